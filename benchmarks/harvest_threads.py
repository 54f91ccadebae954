"""The same shards whatever number of intra-op threads an eager CPU harvest runs on.

    PYTHONPATH=. .venv/bin/python benchmarks/harvest_threads.py [--model NAME] [--tokens 16000] [--json PATH]

Whether an eager CPU harvest's rows depend on how many intra-op threads its forward runs on
(spare_threads leaves some to the reader and writer; a resumed harvest may run on another machine):
this harvests one corpus with the forward on every thread, on one fewer, on half and on one, and
compares the shards' sha256. Exit 0 when they are all identical, 1 when some differ. On the 16-core
device machine 16, 8 and 1 threads agreed and 15 did not (docs/harvest.md), which is why
spare_threads is part of a harvest's identity and never chosen on the fly.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--tokens", type=int, default=16000)
    ap.add_argument("--points", default="resid_post,attn_out,mlp_out")
    ap.add_argument("--json", help="write the digests here")
    a = ap.parse_args(argv)
    if a.tokens < 1:
        ap.error(f"--tokens must be at least 1, got {a.tokens}")
    import torch

    from benchmarks.harvest_bench import corpus
    from engine import load_model
    from engine.harvest import harvest, read_manifest
    m = load_model(a.model)
    threads = torch.get_num_threads()
    spares = sorted({0, 1, threads // 2, threads - 1} - {threads}) if threads > 1 else [0]
    digests: dict[int, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="harvest-threads-") as tmp:
        data = Path(tmp) / "corpus.txt"
        corpus(data, m.tokenizer, a.tokens)
        for spare in spares:
            out = Path(tmp) / f"spare-{spare}"
            s = harvest(m, a.points, data, out, shard_tokens=4096, progress=False, spare_threads=spare)
            assert s.spared_threads == spare, (s.spared_threads, spare)
            digests[threads - spare] = [sh["sha256"] for sh in read_manifest(out)["shards"]]
    same = all(d == digests[threads] for d in digests.values())
    res = {"model": a.model, "source": m.source, "points": a.points, "threads": sorted(digests), "same": same,
           "digests": {str(k): v for k, v in digests.items()}}
    print(f"{a.model} ({m.source}), {a.points}: shards at {sorted(digests)} threads are "
          + ("byte-identical" if same else "DIFFERENT"), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
