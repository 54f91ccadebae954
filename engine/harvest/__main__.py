"""Command line.

    python -m engine.harvest MODEL --points resid_post.6,mlp_out.6 --data FILE_OR_DIR --out DIR
        [--backend vllm|vllm-static|eager] [--positions all|last] [--shard-tokens N]
        [--dtype bf16|fp16|fp32] [--workers N | --part I/N] [--context N] [--batch-tokens N]
        [--text-field NAME] [--model-dtype float32|bfloat16|float16] [--engine-arg KEY=VALUE ...]
        [--ray [ADDRESS]] [--saelens DIR]
    python -m engine.harvest merge OUT      # merge part manifests (the last part does it by itself)
    python -m engine.harvest verify OUT     # re-hash every shard against the manifest
    python -m engine.harvest saelens OUT DEST [POINT] [CONTEXT_SIZE]   # SAELens's cached-activations layout
    python -m engine.harvest                # offline demo: zoo twin, bundled sample text, ./harvest-demo
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from engine.core.backends import CAPTURE_BACKENDS
from engine.core.errors import EngineError

if TYPE_CHECKING:
    from engine.harvest.runner import Summary

DEMO = dict(model="meta-llama/Llama-3.2-1B", points="resid_post.1,mlp_out.1", out="harvest-demo", shard_tokens=512)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.harvest", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="model name (real if in the HF cache, else its zoo twin) or a local "
                                            "model directory; omit everything for the offline demo")
    p.add_argument("--points", help="comma-separated addresses; a bare name means every layer (resid_post)")
    p.add_argument("--data", help=".txt (one document per line), .jsonl, .parquet, .arrow, or a directory of them")
    p.add_argument("--out", help="output directory (resumable: rerun the same command after a crash)")
    p.add_argument("--backend", default="vllm", choices=CAPTURE_BACKENDS)
    p.add_argument("--positions", default="all", choices=["all", "last"])
    p.add_argument("--shard-tokens", type=int, default=65536, help="rows per shard (the last one may be shorter)")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"], help="storage dtype")
    p.add_argument("--workers", type=int, default=1, help="run the N parts as N local processes (with --ray: "
                                                              "N Ray actors, one engine each)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the parts on Ray actors: a running cluster's ADDRESS (e.g. auto or ray://host:10001) "
                        "or none to start a local one; OUT must be a directory every node sees")
    p.add_argument("--saelens", metavar="DIR", help="when the harvest is complete, also write it to DIR in SAELens's "
                                                     "cached-activations layout (one point)")
    p.add_argument("--part", help="run only part I of N (I/N, 0-based), e.g. from a cluster array job")
    p.add_argument("--context", type=int, default=256, help="tokens per forward window")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per forward batch")
    p.add_argument("--text-field", default="text", help="column holding the text (JSONL / parquet / Arrow)")
    p.add_argument("--model-dtype", default="float32")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to load_model / vllm.LLM, e.g. tensor_parallel_size=2 (JSON values)")
    p.add_argument("--spare-threads", type=int, default=0, metavar="N",
                   help="eager on CPU: leave N of torch's threads to the reader and writer (pays on many cores "
                        "with a small model; the summary line says when; part of the harvest's identity)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _engine_args(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--engine-arg takes KEY=VALUE, got {item!r}.")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _part(spec: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--part takes I/N (e.g. 0/4), got {spec!r}.") from None
    return i, n


def _saelens_line(ex) -> str:
    return (f"{ex.path}: {ex.sequences} sequences of {ex.context_size} rows of {ex.hook_name} (d_in {ex.d_in}) "
            f"in SAELens's cached-activations layout ({ex.dropped_rows} tail rows dropped); train with "
            f"cached_activations_path={str(ex.path)!r}, use_cached_activations=True, hook_name={ex.hook_name!r}, "
            f"context_size={ex.context_size}, d_in={ex.d_in}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from engine.harvest import SAMPLE, dataset, harvest, merge
    try:
        if argv[:1] == ["merge"] and len(argv) == 2:
            m = merge(argv[1])
            print(f"{argv[1]}: merged, {m['rows']} rows in {len(m['shards'])} shards" if m else
                  f"{argv[1]}: not every part is complete yet; nothing merged")
            return 0 if m else 1
        if argv[:1] == ["saelens"] and 3 <= len(argv) <= 5:
            from engine.harvest.saelens import to_saelens
            ex = to_saelens(argv[1], argv[2], argv[3] if len(argv) > 3 else None,
                            int(argv[4]) if len(argv) > 4 else None)
            print(_saelens_line(ex))
            return 0
        if argv[:1] == ["verify"] and len(argv) == 2:
            bad = dataset.verify(argv[1])
            print("\n".join(bad) or f"{argv[1]}: every shard matches its manifest hash")
            return 1 if bad else 0
        a = parser().parse_args(argv)
        demo = a.model is None
        if demo:
            a.model, a.points, a.data = DEMO["model"], a.points or DEMO["points"], a.data or str(SAMPLE)
            a.out = a.out or DEMO["out"]
            if a.shard_tokens == 65536:
                a.shard_tokens = DEMO["shard_tokens"]
            print(f"demo: {a.model} (zoo twin offline), {a.points}, bundled sample -> {a.out}")
        missing = [f"--{k}" for k in ("points", "data", "out") if not getattr(a, k)]
        if missing:
            raise ValueError(f"{', '.join(missing)} required (or give no arguments at all for the demo).")
        if a.part and a.workers != 1:
            raise ValueError("give --part I/N (run one part here) or --workers N (run all parts), not both.")
        if a.part and a.ray is not None:
            raise ValueError("--ray runs every part; give --workers N (actors) instead of --part I/N.")
        kw = dict(backend=a.backend, positions=a.positions, shard_tokens=a.shard_tokens, dtype=a.dtype,
                  context=a.context, batch_tokens=a.batch_tokens, text_field=a.text_field,
                  model_dtype=a.model_dtype, progress=not a.no_progress, load_kw=_engine_args(a.engine_arg),
                  spare_threads=a.spare_threads)
        res: Summary | list[Summary] | list[dict]
        if a.ray is not None:
            from engine.harvest.cluster import run_on_ray
            res = run_on_ray(dict(kw, model=a.model, points=a.points, data=a.data, out=a.out, progress=False),
                             actors=a.workers, address=a.ray or None, progress=kw["progress"])
        else:
            res = harvest(a.model, a.points, a.data, a.out, workers=a.workers,
                          part=_part(a.part) if a.part else None, **kw)
        if a.saelens:
            from engine.harvest import read_manifest
            from engine.harvest.saelens import to_saelens
            read_manifest(a.out)  # complete: every part (a --part run leaves the export to the last one)
            saelens_line = _saelens_line(to_saelens(a.out, a.saelens))
    except (EngineError, ValueError, FileNotFoundError, FileExistsError, KeyError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s in res if isinstance(res, list) else [res]:
        if isinstance(s, dict):
            print(json.dumps(s))
        elif s.status == "complete":
            print(f"{a.out}: part {s.part[0]}/{s.part[1]} already complete; nothing written")
        else:
            print(f"{a.out}: part {s.part[0]}/{s.part[1]}: {s.rows} rows in {s.shards} shards, "
                  f"{s.tokens_per_s:.0f} tokens/s, writer stalled the forward {s.writer.stall_s:.2f} s"
                  f"{'; manifest merged' if s.merged else ''}{'; ' + s.spare_advice if s.spare_advice else ''}")
    if a.saelens:
        print(saelens_line)
    if demo:
        print(f"load it: from engine.harvest import HarvestDataset; ds = HarvestDataset({a.out!r}); ds[0]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
