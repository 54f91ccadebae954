"""Where an eager harvest's time goes beside its own forward, measured in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/harvest_costs.py [--model NAME] [--device cpu|cuda]
        [--tokens 64000] [--rounds 6] [--variants V,...] [--out DIR] [--json PATH] [--md PATH]

benchmarks/harvest_bench.py runs every cell in its own process, so its ratios also carry the spread
between processes (on a 16-core machine the same HF forward read 64k to 130k tokens/s from one process
to the next). Here one process loads the model once, plus a stock HF copy as the ceiling, and runs
the variants below in interleaved rounds whose order rotates every round, over one synthetic corpus
(harvest_bench.corpus) cut into the eager harvest's own batches. Each variant changes one thing, so
the differences between their rates say what each part of a harvest costs. For every harvest it also
records the CPU seconds of each thread: the forward's (main), the reader's and the writer's.

Variants:
  hf           a stock HF forward (its own copy of the model) over the harvest's batches: the ceiling
  fwd          the harvest's own forward calls (capture.forward), nothing read ahead, nothing stored
  harvest      engine.harvest with its defaults: reader thread, forward on every thread, writer thread
  no-write     the writer records each shard in the manifest but neither hashes nor writes it
  read-inline  the batches are tokenized on the forward's thread as it needs them, not ahead
  write-inline each shard is hashed and written on the forward's thread, between two forwards
  serial       both: no helper thread at all, every part of the harvest one after another
  spare-1      the harvest with one intra-op thread left to the reader and writer (spare_threads=1)
  spare-2      the same with two (spare_threads=2)
  fwd-spare-1  the forward alone with one thread fewer (what a spare thread costs the forward)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock


@dataclass(frozen=True)
class Variant:
    """One row of the table above: what runs (`kind`) and the one thing it changes."""
    kind: str  # "hf", "fwd" or "harvest"
    write: bool = True  # shards hashed and written (False: only recorded)
    read_ahead: bool = True  # the reader thread tokenizes ahead (False: inline, on the forward's thread)
    write_behind: bool = True  # the writer thread writes (False: inline, on the forward's thread)
    spare: int = 0  # intra-op threads left to the helpers (fwd: taken away from the forward)


VARIANTS = {
    "hf": Variant("hf"),
    "fwd": Variant("fwd"),
    "harvest": Variant("harvest"),
    "no-write": Variant("harvest", write=False),
    "read-inline": Variant("harvest", read_ahead=False),
    "write-inline": Variant("harvest", write_behind=False),
    "serial": Variant("harvest", read_ahead=False, write_behind=False),
    "spare-1": Variant("harvest", spare=1),
    "spare-2": Variant("harvest", spare=2),
    "fwd-spare-1": Variant("fwd", spare=1),
}
DEFAULT = "hf,fwd,harvest,no-write,read-inline,spare-1"


def _unwritten(path, tensors, metadata) -> tuple[str, int]:
    """The no-write variant's stand-in for shards.write_shard: nothing hashed, nothing written."""
    return "0" * 64, 0


def _written_now(self, item) -> None:
    """The write-inline variant's stand-in for ShardWriter.submit: the shard written on the caller's thread."""
    self.check()
    self.write(item)


@contextlib.contextmanager
def thread_cpu(spent: dict[str, float]):
    """Record, per helper thread name, the CPU seconds of every thread that ends inside the block."""
    run = threading.Thread.run

    def timed(self):
        try:
            run(self)
        finally:
            spent[self.name] = spent.get(self.name, 0.0) + time.thread_time()

    with mock.patch.object(threading.Thread, "run", timed):
        yield


@contextlib.contextmanager
def applied(v: Variant):
    """The variant's one change, undone on exit."""
    import engine.harvest.batches as batches
    import engine.harvest.shards as shards
    from engine.harvest.priority import forward_threads
    with contextlib.ExitStack() as stack:
        if not v.write:
            stack.enter_context(mock.patch.object(shards, "write_shard", _unwritten))
        if not v.read_ahead:
            stack.enter_context(mock.patch.object(batches, "prefetch", lambda items, depth=2, nice=0, cpu=None: iter(items)))
        if not v.write_behind:
            stack.enter_context(mock.patch.object(shards.ShardWriter, "submit", _written_now))
        if v.kind == "fwd":  # a harvest spares its threads itself (spare_threads)
            stack.enter_context(forward_threads(v.spare))
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--shard-tokens", type=int, default=8192)
    ap.add_argument("--variants", default=DEFAULT, help=f"any of {', '.join(VARIANTS)}; the first is the "
                                                         f"baseline of the rate table")
    ap.add_argument("--out", help="where the harvests write (default: a temp folder; it decides the disk costs)")
    ap.add_argument("--json", help="write the samples and ratios here")
    ap.add_argument("--md", help="write the tables here")
    a = ap.parse_args(argv)
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        ap.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    check_sizes(ap, a)
    with tempfile.TemporaryDirectory(prefix="harvest-costs-", dir=a.out) as tmp:
        res = measure(a, names, Path(tmp))
    emit(table(res, names), res, a.md, a.json)
    return 0


def check_sizes(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--rounds and --tokens as the intervals need them (argparse's error, naming both, otherwise)."""
    if a.rounds < 6 or a.tokens < 1:
        ap.error(f"--rounds must be at least 6 (fewer cannot give a 95% interval) and --tokens at least 1, "
                 f"got {a.rounds} and {a.tokens}")


def emit(text: str, res: dict, md: str | None, json_path: str | None) -> None:
    """The table printed, and written with the samples where asked."""
    print("\n" + text)
    if md:
        Path(md).write_text(text)
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1))


def measure(a, names: list[str], tmp: Path) -> dict:
    """Load once, warm every variant up, then run the rounds; the samples and their summary."""
    import torch

    from benchmarks.harvest_bench import corpus, hf_forward
    from benchmarks.rounds import rotated
    from engine import load_model
    from engine.harvest import batches, capture, harvest, inputs
    from engine.loading import load_hf
    m = load_model(a.model, device=a.device)
    hf = load_hf(a.model, device=a.device)[0] if "hf" in names else None
    data = tmp / "corpus.txt"
    corpus(data, m.tokenizer, a.tokens)
    keys = capture.addresses(m, f"resid_post.{m.n_layers // 2}")
    groups = list(batches.pack(batches.windows(inputs.documents(inputs.open_source(data)), m.tokenizer, 256), 1024))
    tokens = sum(len(w.ids) for g in groups for w in g.windows)
    sync = torch.cuda.synchronize if m.device.type == "cuda" else (lambda: None)

    def run(name: str) -> dict:
        v = VARIANTS[name]
        spent: dict[str, float] = {}
        with applied(v), thread_cpu(spent):
            cpu0, main0, t = time.process_time(), time.thread_time(), time.perf_counter()
            if v.kind == "harvest":
                s = harvest(m, keys[0], data, tmp / "out", shard_tokens=a.shard_tokens, progress=False,
                            spare_threads=v.spare)
                assert s.tokens == tokens, (s.tokens, tokens)
                seconds, spared = s.seconds, s.spared_threads
            else:
                for g in groups:
                    if v.kind == "fwd":
                        capture.forward(m, [w.ids for w in g.windows], keys)
                    else:
                        hf_forward(hf, g.windows, m.device)
                sync()
                seconds, spared = time.perf_counter() - t, v.spare
            cpu = {"process": time.process_time() - cpu0, "main": time.thread_time() - main0}
        for thread, sec in spent.items():
            helper = thread.split("-")[1] if thread.startswith("harvest-") else "other"
            cpu[helper] = cpu.get(helper, 0.0) + sec
        if v.kind == "harvest":
            shutil.rmtree(tmp / "out")
            os.sync()  # the deletion's disk work happens now, not in the next sample
        return {"tok_s": tokens / seconds, "seconds": seconds, "cpu_s": cpu, "spared": spared}

    for name in names:  # warm-up: first-call allocations, the tokenizer's thread pool
        run(name)
    rounds = []
    for r in range(a.rounds):
        sample = {}
        for name in rotated(names, r):
            time.sleep(0.3)
            sample[name] = run(name)
        rounds.append(sample)
        print(f"round {r + 1}: " + ", ".join(f"{n} {sample[n]['tok_s']:.0f}" for n in names), file=sys.stderr,
              flush=True)
    return {"args": vars(a), "model": a.model, "source": m.source, "device": str(m.device),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "tokens": tokens, "batches": len(groups), "rounds": rounds, **summarize(rounds, names)}


def summarize(rounds: list[dict], names: list[str]) -> dict:
    """Per variant: median tokens/s, its ratio to the first variant and to `fwd` (median over rounds,
    95% interval), and the median CPU seconds of each thread."""
    from benchmarks.ci import BOUND, median_ci
    out: dict = {"tok_s": {}, "ratios": {}, "cpu_s": {}, "spared": {}}
    bases = list(dict.fromkeys([names[0]] + (["fwd"] if "fwd" in names else [])))
    for n in names:
        out["tok_s"][n] = statistics.median(r[n]["tok_s"] for r in rounds)
        out["spared"][n] = sorted({r[n]["spared"] for r in rounds})
        parts = {k for r in rounds for k in r[n]["cpu_s"]}
        out["cpu_s"][n] = {k: statistics.median(r[n]["cpu_s"].get(k, 0.0) for r in rounds) for k in sorted(parts)}
        for b in bases:
            if b != n:
                iv = median_ci([r[n]["tok_s"] / r[b]["tok_s"] for r in rounds])
                out["ratios"][f"{n} / {b}"] = dict(iv.to_dict(), resolved=iv.resolved(BOUND))
    return out


def table(res: dict, names: list[str]) -> str:
    from benchmarks.stats import fmt_interval, sig
    head = (f"{res['tokens']} tokens in {res['batches']} batches, {res['model']} ({res['source']}) on {res['device']}, "
            f"{res['threads']} intra-op threads on {res['cpus']} CPUs ({res['machine']}), {len(res['rounds'])} "
            f"interleaved rounds in one process.")
    parts = ["main", "reader", "writer"]
    lines = [head, "", "| variant | threads spared | tokens/s | CPU s: process | " + " | ".join(parts) + " |",
             "|---|---|---:|---:|" + "---:|" * len(parts)]
    for n in names:
        cpu = res["cpu_s"][n]
        spared = "/".join(str(x) for x in res["spared"][n])
        lines.append(f"| {n} | {spared} | {sig(res['tok_s'][n])} | {cpu['process']:.3f} | "
                     + " | ".join(f"{cpu[p]:.3f}" if p in cpu else "-" for p in parts) + " |")
    lines += ["", "| ratio | median [95% interval] | verdict |", "|---|---|---|"]
    for k, r in res["ratios"].items():
        verdict = "-" if r["resolved"] else f"unresolved (interval spans {r['width']:.0%})"
        lines.append(f"| {k} | {fmt_interval(r['median'], r['lo'], r['hi'], unit='x')} | {verdict} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
