"""The engine at two commits on the same machine, side by side in interleaved rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/versus.py --base d65b860 [--head .] [--rounds 9] [--reps 5]
        [--backend eager|vllm|vllm-static] [--model meta-llama/Llama-3.2-1B] [--size tiny] [--new-tokens 16]
        [--clock wall|cpu] [--json PATH]

A published ratio such as "steer every layer / no steer" has the engine on both sides: when a change makes
the plain forward faster, the ratio can fall while steering itself got faster too. This answers the
question the ratio cannot: did each workload get faster or slower in tokens per second, measured on one
machine in one run. `--base` and `--head` are git revisions checked out into temporary worktrees (`.`:
this working tree, uncommitted changes included). Every round runs one process per side, in an order
that alternates by round, each loading the model from the same zoo home and timing every workload
`--reps` times after a warm-up (its median is the round's figure); the ratios head / base are taken
within each round, and the table gives their median with the 95% distribution-free interval
(benchmarks/ci.py), "unresolved" when it spans more than 25% of it. The workloads use only the public
API both commits share (load_model, generate with points / steer / readouts, run_with_cache). On the vLLM
backends (`--backend`) the generation workloads run (vLLM has no bare forward), with prefix caching off
so every run computes its prompt, and no logits returned: the benchmark sweep's own settings.
`--clock cpu` (eager only) times each run in CPU seconds of the measuring process (one torch thread), so
time spent waiting for a core that other work holds does not count: on a shared 2-core machine the wall
clock leaves small differences unresolved. vLLM runs its forward in other processes: wall clock only.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "VERSUS "  # the measuring process's answer line (libraries print to stdout too)
# workload -> what it runs (one sequence of the model's zoo twin; generation is greedy)
WORKLOADS = {
    "forward": "one forward of the prompt, nothing asked",
    "capture": "one forward capturing resid_post at every layer",
    "generate": "generation, nothing asked",
    "capture_gen": "generation capturing resid_post at every layer",
    "steer_gen": "generation with a vector added to resid_post at every layer",
    "readout_gen": "generation reading an SAE's top-32 latents (8x d_model wide, random) at resid_post of every layer",
}
FORWARDS = ("forward", "capture")  # the HF runtime only (vLLM has no bare forward)
# (label, numerator workload, denominator workload): within-commit ratios, reported for both sides
OWN = (("steer every layer / no steer", "steer_gen", "generate"),
       ("capture during generation / no capture", "capture_gen", "generate"),
       ("SAE top-k readout / raw capture, during generation", "readout_gen", "capture_gen"))


def _on_vllm(backend: str) -> bool:
    from engine.core.backends import VLLM_BACKENDS
    return backend in VLLM_BACKENDS


def _load(model: str, backend: str, prompt: int, new_tokens: int):
    """The model on `backend`; the vLLM backends with the benchmark sweep's settings (prefix caching off,
    room for the prompt and its new tokens, one step holding the prompt)."""
    from engine import load_model
    if not _on_vllm(backend):
        return load_model(model, backend=backend, source="zoo"), {}
    room = -(-(prompt + new_tokens) // 16) * 16
    m = load_model(model, backend=backend, source="zoo", enable_prefix_caching=False, max_model_len=room,
                   max_num_batched_tokens=max(room, 256))
    return m, {"return_logits": False}


def measure(model: str, size: str, prompt: int, new_tokens: int, reps: int, backend: str = "eager",
            clock: str = "wall") -> dict:
    """Seconds per workload (median of `reps` after a warm-up) for the engine importable here, on the wall
    clock or in CPU seconds of this process (`clock` "cpu")."""
    import statistics
    import time

    import torch

    from engine.core.readouts import Readout, SAEFeatures
    from engine.core.sae_files import write_random_sae
    from engine.core.steering import Steer
    torch.set_num_threads(1)
    now = time.process_time if clock == "cpu" else time.perf_counter
    os.environ["INTERP_ZOO_SIZE"] = size  # the zoo reads the twin's size from the environment
    m, gen = _load(model, backend, prompt, new_tokens)
    ids = torch.randint(0, 500, (1, prompt), generator=torch.Generator().manual_seed(0))
    v = torch.randn(m.d_model, generator=torch.Generator().manual_seed(1)) * 0.1
    sae = tempfile.mkdtemp(prefix="versus-sae-")
    write_random_sae(sae, "standard", d_in=m.d_model, d_sae=8 * m.d_model, dtype=m.dtype)
    every = [f"resid_post.{i}" for i in range(m.n_layers)]
    jobs = {
        "forward": lambda: m.run_with_cache(ids, []),
        "capture": lambda: m.run_with_cache(ids, ["resid_post"]),
        "generate": lambda: m.generate(ids, max_new_tokens=new_tokens, **gen),
        "capture_gen": lambda: m.generate(ids, max_new_tokens=new_tokens, points=["resid_post"], **gen),
        "steer_gen": lambda: m.generate(ids, max_new_tokens=new_tokens, steer=[Steer(a, "add", v) for a in every],
                                        **gen),
        "readout_gen": lambda: m.generate(ids, max_new_tokens=new_tokens, readouts=[
            Readout(a, SAEFeatures(sae, k=32), name=f"sae.{i}") for i, a in enumerate(every)], **gen),
    }
    if _on_vllm(backend):
        jobs = {k: f for k, f in jobs.items() if k not in FORWARDS}
    out = {}
    try:
        for name, job in jobs.items():
            job()
            times = []
            for _ in range(reps):
                t = now()
                job()
                times.append(now() - t)
            out[name] = statistics.median(times)
    finally:
        shutil.rmtree(sae, ignore_errors=True)
        if hasattr(m, "close"):
            m.close()
    return out


def _checkout(rev: str, into: Path) -> Path:
    """A detached worktree of `rev` (`.`: this working tree itself)."""
    if rev == ".":
        return ROOT
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def caption(args, trees: dict) -> str:
    """What a table was measured on: each side's commit (the working tree marked +dirty when it has changes),
    the model, the rounds and the machine, so a published table says how to reproduce it."""
    import platform

    def commit(tree: Path) -> str:
        sha = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "engine"], capture_output=True,
                               text=True).stdout.strip()
        return sha + ("+dirty (engine/)" if dirty else "")
    return (f"base {args.base} = {commit(trees['base'])}, head {args.head} = {commit(trees['head'])}; "
            f"backend {args.backend}; {args.model} ({args.size} twin), prompt {args.prompt}, {args.new_tokens} new tokens; {args.rounds} rounds "
            f"x {args.reps} reps; {args.clock} clock; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"one torch thread")


def _run_side(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "INTERP_ZOO_HOME": os.environ.get("INTERP_ZOO_HOME", str(ROOT / ".zoo-cache"))}
    cmd = [sys.executable, str(Path(__file__).resolve()), "_measure", "--model", args.model, "--size", args.size,
           "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
           "--backend", args.backend, "--clock", args.clock]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"versus: the measuring process at {tree} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


def _interval(xs: list[float]) -> tuple[str, dict]:
    from benchmarks.ci import median_ci, ratio_shown
    iv = median_ci(xs)
    return ratio_shown(iv), iv.to_dict()


def report(rounds: list[dict], base: str, head: str, prompt: int, new_tokens: int) -> tuple[str, dict]:
    """The markdown table and its data: per workload tok/s of each side (median over rounds) and head / base
    with its interval; then each side's own ratios."""
    import statistics
    tokens = {w: prompt if w in ("forward", "capture") else new_tokens for w in WORKLOADS}
    lines = [f"| workload | {base} tok/s | {head} tok/s | {head} / {base} |", "|---|---:|---:|---:|"]
    data: dict = {"workloads": {}, "own": {}}
    for w, what in WORKLOADS.items():
        if any(w not in r["base"] or w not in r["head"] for r in rounds):
            continue  # not run on this backend
        b = [tokens[w] / r["base"][w] for r in rounds]
        h = [tokens[w] / r["head"][w] for r in rounds]
        text, iv = _interval([y / x for x, y in zip(b, h)])
        lines.append(f"| {what} | {statistics.median(b):.0f} | {statistics.median(h):.0f} | {text} |")
        data["workloads"][w] = {"base_tok_s": b, "head_tok_s": h, "head_over_base": iv}
    lines += ["", f"| own ratio | {base} | {head} |", "|---|---:|---:|"]
    for label, num, den in OWN:  # tok/s ratio num / den = time den / time num
        cells = []
        for side in ("base", "head"):
            text, iv = _interval([r[side][den] / r[side][num] for r in rounds])
            cells.append(text)
            data["own"].setdefault(label, {})[side] = iv
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines), data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_measure"]:
        ap = argparse.ArgumentParser()
        for flag in ("--model", "--size", "--backend", "--clock"):
            ap.add_argument(flag, required=True)
        for flag in ("--prompt", "--new-tokens", "--reps"):
            ap.add_argument(flag, type=int, required=True)
        a = ap.parse_args(argv[1:])
        print(MARK + json.dumps(measure(a.model, a.size, a.prompt, a.new_tokens, a.reps, a.backend, a.clock)),
              flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--head", default=".", help="the revision measured against it ('.': this working tree)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per workload per round")
    from engine.core.backends import CAPTURE_BACKENDS
    ap.add_argument("--backend", default="eager", choices=CAPTURE_BACKENDS,
                    help="the backend both sides run (vLLM: the generation workloads only)")
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--size", default="tiny", choices=["tiny", "real"])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="time runs on the wall clock or in CPU seconds of the measuring process (eager only)")
    ap.add_argument("--json", type=Path, help="write every round's samples and the intervals here")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and _on_vllm(args.backend):
        ap.error(f"--clock cpu with --backend {args.backend}: vLLM runs the forward in its own processes, whose CPU "
                 f"time this process does not see; use --clock wall (on an otherwise idle machine)")
    if args.rounds < 6:
        ap.error(f"--rounds {args.rounds}: a 95% interval for a median needs at least 6 rounds")
    for flag, value in (("--reps", args.reps), ("--prompt", args.prompt), ("--new-tokens", args.new_tokens)):
        if value < 1:  # a median of no runs, or tok/s of no tokens: refused here, not after a round of loading
            ap.error(f"{flag} {value}: must be at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="versus-"))
    trees = {}
    # a SIGTERM (a killed job) unwinds like Ctrl-C, so the worktrees below are removed, not left registered
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        # SIGTERM waits while git checks out: `git worktree add` runs its checkout in a child process that a
        # kill of git itself would leave writing into the folder the cleanup below removes
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            trees = {"base": _checkout(args.base, tmp), "head": _checkout(args.head, tmp)}
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        rounds = []
        for r in range(args.rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            rounds.append({side: _run_side(trees[side], args) for side in order})
            print(f"versus: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        table, data = report(rounds, args.base, args.head, args.prompt, args.new_tokens)
        text = caption(args, trees)
        print(f"{text}\n\n{table}")
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "caption": text,
                                             "rounds": rounds, **data}, indent=1))
    finally:
        # every worktree under tmp, one interrupted while `git worktree add` ran (still locked) included
        for tree in [*tmp.iterdir()] if tmp.exists() else []:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", "--force", str(tree)],
                           check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
