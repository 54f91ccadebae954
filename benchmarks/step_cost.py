"""What a vLLM worker's step costs around its forward: capture, a steer at every layer and a readout,
each against plain decode, through the library (issue 52).

    PYTHONPATH=. .venv/bin/python -m benchmarks.step_cost [--backend vllm-static|vllm] [--model NAME]
        [--size tiny|real] [--streams 1,8] [--new-tokens 32] [--prompt 32] [--rounds 9] [--base DIR] [--relaunch N]
        [--json PATH] [--md PATH]

Each side (this tree, and with --base the engine in another checkout, e.g. `git archive` of an older commit
with the worker's counter and timer: `interp_ops`, `interp_timing`) runs in a process of its own with the
model loaded once. Every round runs, on each side in turn (the order alternates by round), one untimed plain
call (the lead-in), then for each stream count every arm once, the arms rotated by one place a round
(`--relaunch N`: both sides started afresh every N rounds, each time the other first: on this machine the side
started first reads slower, docs/performance.md):

  plain     generation, nothing asked (no plan: the worker does nothing around the forward)
  capture   resid_post of every layer captured, its rows returned to the caller
  steer     a vector added to resid_post at every layer
  readout   the mean of the last layer's resid_post

For each arm and round: milliseconds a token through the library (wall time of `generate_batch` of 32 new
tokens per stream, divided by them: each step makes one token of every stream) and the worker's host
microseconds a step inside its windows around the forward (`interp_timing`: before and after it; on the
hooked backend also inside its hooks), and the same call cut short at 1 and at 2 new tokens, so the host time
splits by step: the prefill step, the first decode step (the two that build what later steps carry) and each
decode step after them (`phases`). "Added" is the arm less plain within the round; each figure is the
median over rounds with its 95% distribution-free interval (benchmarks/ci.py). An added figure is
"unresolved" when its interval spans more than the goal it is held to (0.3 ms a token for the steer, 0.15
ms for capture, issue 52) or, without a goal, more than a tenth of the plain step. Op counts a step are
counted once per arm at the end (`interp_ops`: deterministic). Prefix caching is off, so every run computes
its prompt; the steered tokens are checked to differ from plain ones (a steer that changes nothing times a
no-op). The worker's host us a step are its step windows; what a call costs it outside them, registering the
request (the scheduler hook, which runs for plain calls too) and collecting its results, is timed in two more
windows, and "host us / token, whole call" adds them up over the call's tokens: the figure the goals count,
free of the forward's own noise (the wall-time figures include it all, the forward too). A base from before
those windows has no whole-call figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.child import Child
from benchmarks.ci import median_ci
from benchmarks.env import load1
from benchmarks.stats import fmt_interval, sig
from engine.backends.vllm.worker import meters

ROOT = Path(__file__).resolve().parents[1]
MARK = "STEPCOST "
ARMS = ("plain", "capture", "steer", "readout")
GOALS_MS = {"steer": 0.3, "capture": 0.15}  # added per token at 30 layers, 32 new tokens (issue 52)
SHORT = (1, 2)  # new tokens of the short calls: the prefill step alone, then with the first decode step


# -- the measuring process ----------------------------------------------------------------------------
def child(a: argparse.Namespace) -> int:
    """Load the model, answer commands (JSON lines on stdin) with MARK + JSON lines on stdout."""
    import torch

    from benchmarks.spec import prompt_ids, steer_vector
    from engine import load_model
    from engine.core.readouts import Mean, Readout
    from engine.core.results import Request
    from engine.core.steering import Steer

    torch.set_num_threads(1)
    room = -(-(a.prompt + a.new_tokens) // 16) * 16
    kw = {"static_points": "auto"} if a.backend == "vllm-static" else {}
    m = load_model(a.model, backend=a.backend, source="zoo", enable_prefix_caching=False, max_model_len=room, **kw)
    n, d = m.n_layers, m.d_model
    v = steer_vector(d, 4.0)
    what = {"plain": {}, "capture": {"points": [f"resid_post.{i}" for i in range(n)]},
            "steer": {"steer": [Steer(f"resid_post.{i}", "add", v) for i in range(n)]},
            "readout": {"readouts": [Readout(f"resid_post.{n - 1}", Mean())]}}

    def reqs(arm: str, streams: int, new: int) -> list:
        ids = prompt_ids(m.tokenizer, a.prompt, streams).tolist()
        return [Request(ids[i], new, **what[arm]) for i in range(streams)]

    def say(obj: dict) -> None:
        print(MARK + json.dumps(obj), flush=True)

    say({"ready": True, "layers": n, "d_model": d})
    for line in sys.stdin:  # until the parent closes it (benchmarks/child.py)
        cmd = json.loads(line)
        arm, streams = cmd["arm"], cmd["streams"]
        batch = reqs(arm, streams, cmd.get("new", a.new_tokens))
        timed = hasattr(m, "worker_timing")  # a base from before issue 52 has neither timer nor counter: wall only
        if cmd.get("ops"):
            if not timed:
                say({"steps": 0, "per_step": [], "labels": {}})
                continue
            m.worker_ops(True)
            m.generate_batch(batch, return_logits=False)
            ranks = m.worker_ops(False)
            say({"steps": ranks[0]["steps"], "per_step": ranks[0]["per_step"], "labels": ranks[0]["labels"]})
            continue
        if timed:
            m.worker_timing(True)
        t = time.perf_counter()
        out = m.generate_batch(batch, return_logits=False)
        wall = time.perf_counter() - t
        (rank,) = m.worker_timing(False) if timed else ({"steps": 0, "seconds": {}},)
        tokens = [r.new_tokens.tolist() for r in out]
        if arm == "capture" and "new" not in cmd and any(r.cache[f"resid_post.{n - 1}"].shape[0] < a.prompt + a.new_tokens - 1 for r in out):
            raise RuntimeError("a capture came back short")
        say({"wall": wall, "steps": rank["steps"], "seconds": rank["seconds"], "tokens": tokens})
    m.close()
    return 0


# -- the parent ---------------------------------------------------------------------------------------
def start_side(name: str, tree: Path, a: argparse.Namespace) -> Child:
    """One measuring process: the engine of `tree` (this file runs in the side's tree: its engine, and its
    benchmarks.spec for the prompts); its `ready` answer is {"ready", "layers", "d_model"}."""
    env = {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "INTERP_ZOO_SIZE": a.size, "INTERP_ZOO_HOME": str((ROOT / ".zoo-cache").resolve())}
    args = [sys.executable, str(Path(__file__).resolve()), "--child", "--backend", a.backend, "--model", a.model,
            "--size", a.size, "--new-tokens", str(a.new_tokens), "--prompt", str(a.prompt)]
    return Child(name, args, MARK, env, cwd=tree)


def start_order(names: list[str], r: int, relaunch: int) -> list[str]:
    """Which side starts first when the sides start afresh before round `r` (every `relaunch` rounds): each
    relaunch the other order, so no side is always the first started."""
    return names[::-1] if relaunch and (r // relaunch) % 2 else names


def one_round(sides: list, r: int, streams: list[int], samples: dict) -> None:
    """Round `r` on each side in turn: one untimed plain call first (the side's process takes over from the
    other's: benchmarks/rounds.py says why its first call reads slower), then for each stream count every arm,
    rotated by `r` places, and each arm's call cut short after its prefill step and after the first decode
    step (what the steps that build cost, apart from the decode steps carried after them: `phases`)."""
    for s in sides:
        s.ask(arm="plain", streams=streams[0])  # the lead-in, untimed
        for k in streams:
            for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                got = s.ask(arm=arm, streams=k)
                got["short"] = {str(t): {key: v for key, v in s.ask(arm=arm, streams=k, new=t).items()
                                         if key != "tokens"} for t in SHORT}
                samples[s.name][k][arm].append(got)


def measure(a: argparse.Namespace) -> dict:
    streams = [int(s) for s in a.streams.split(",")]
    trees = {"after": ROOT, **({"before": Path(a.base).resolve()} if a.base else {})}
    sides = [start_side(n, t, a) for n, t in trees.items()]
    samples: dict = {n: {k: {arm: [] for arm in ARMS} for k in streams} for n in trees}
    moved: dict = {}

    def warm(s: Child) -> None:  # every arm once (first calls allocate, compile); the steer must change the tokens
        for k in streams:
            got = {arm: s.ask(arm=arm, streams=k)["tokens"] for arm in ARMS}
            moved[f"{s.name} {k}"] = moved.get(f"{s.name} {k}", True) and got["steer"] != got["plain"]
    try:
        for s in sides:
            warm(s)
        loads = [load1()]
        for r in range(a.rounds):
            if a.relaunch and r and r % a.relaunch == 0:  # fresh processes, started in the other order
                for s in sides:
                    s.close()
                started = {n: start_side(n, trees[n], a) for n in start_order(list(trees), r, a.relaunch)}
                sides = [started[n] for n in trees]
                for s in sides:
                    warm(s)
            one_round(sides if r % 2 == 0 else sides[::-1], r, streams, samples)
            loads.append(load1())
            print(f"round {r + 1}/{a.rounds} done, load {loads[-1]:.1f}", file=sys.stderr, flush=True)
        ops = {s.name: {k: {arm: s.ask(arm=arm, streams=k, ops=True) for arm in ARMS} for k in streams} for s in sides}
        layers = sides[0].ready["layers"]
    finally:
        for s in sides:
            s.close()
    return {"backend": a.backend, "model": a.model, "size": a.size, "layers": layers, "streams": streams,
            "new_tokens": a.new_tokens, "prompt": a.prompt, "rounds": a.rounds, "relaunch": a.relaunch,
            "load": [min(loads), max(loads)],
            "steer_moved_tokens": moved, "samples": samples, "ops": ops}


def figures(out: dict) -> list[dict]:
    """Per side, streams and arm: ms a token, added ms a token, worker host us a step (and added), ops a step."""
    rows = []
    for side, by_k in out["samples"].items():
        for k, by_arm in by_k.items():
            plain = by_arm["plain"]
            per_tok = [s["wall"] / out["new_tokens"] * 1e3 for s in plain]
            plain_call = [call_us(s) / out["new_tokens"] for s in plain]
            timed = any(s["steps"] for ss in by_arm.values() for s in ss)  # False: a base without the worker's timer
            whole = timed and windowed([s for ss in by_arm.values() for s in ss])
            for arm in ARMS:
                ss = by_arm[arm]
                ms = [s["wall"] / out["new_tokens"] * 1e3 for s in ss]
                host = [host_us(s) / max(s["steps"], 1) for s in ss]
                added = [x - p for x, p in zip(ms, per_tok)]
                call = [call_us(s) / out["new_tokens"] for s in ss]
                op = out["ops"][side][k][arm]
                rows.append({"side": side, "streams": int(k), "arm": arm, "ms": median_ci(ms), "host_us": median_ci(host),
                             **phases(ss),
                             "added_ms": None if arm == "plain" else median_ci(added),
                             "call_us": median_ci(call) if whole else None,
                             "added_call_us": median_ci([x - p for x, p in zip(call, plain_call)])
                             if whole and arm != "plain" else None,
                             "ops": max(op["per_step"], default=0), "ops_step": op["labels"].get("step", 0) / max(op["steps"], 1),
                             "ops_hooks": op["labels"].get("hooks", 0) / max(op["steps"], 1),
                             "plain_ms": median_ci(per_tok).median, "timed": timed})
    return rows


STEP_WINDOWS = (meters.STEP, meters.HOOKS)  # a step's windows
CALL_WINDOWS = (meters.REGISTER, meters.COLLECT)  # a call's, outside its steps


def host_us(answer: dict) -> float:
    """The worker's host microseconds over a call's steps: its step windows ("step", and on `vllm` "hooks")."""
    return 1e6 * sum(v for k, v in answer["seconds"].items() if k in STEP_WINDOWS)


def call_us(answer: dict) -> float:
    """The worker's host microseconds over the whole call: its steps and its call windows (registering the
    request in the scheduler hook, collecting its results)."""
    return 1e6 * sum(v for k, v in answer["seconds"].items() if k in STEP_WINDOWS + CALL_WINDOWS)


def windowed(ss: list[dict]) -> bool:
    """Whether the samples carry the call windows (a base from before them times its steps only)."""
    return any(k in s["seconds"] for s in ss for k in CALL_WINDOWS)


def phases(ss: list[dict]) -> dict:
    """The worker's host us of an arm's call split by step, each the median over rounds with its interval:
    "prefill_us" the prefill (the call cut short at 1 new token: one step, or more where vLLM chunks a long
    batch of prompts), "first_us" the first decode step (cut at 2, less the one at 1), "later_us" each
    decode step after them (the whole call less the one cut at 2, over its extra steps). The first two steps
    build what later ones carry (engine/backends/vllm/worker/stepio.py: fill_of), so "later_us" is what a
    long generation pays a token."""
    if not ss or "short" not in ss[0]:
        return {}
    one, two = ([x["short"][str(t)] for x in ss] for t in SHORT)
    later = [(host_us(x) - host_us(b)) / max(x["steps"] - b["steps"], 1) for x, b in zip(ss, two)]
    return {"prefill_us": median_ci([host_us(x) for x in one]),
            "first_us": median_ci([host_us(b) - host_us(x) for x, b in zip(one, two)]), "later_us": median_ci(later)}


def shown(row: dict, key: str = "added_ms") -> str:
    """An added figure with its interval, against the arm's goal (in its unit: ms, or us for "added_call_us")."""
    iv = row[key]
    if iv is None:
        return ""
    scale = 1e3 if key == "added_call_us" else 1.0
    goal = GOALS_MS[row["arm"]] * scale if row["arm"] in GOALS_MS else None
    bound = goal if goal is not None else 0.1 * row["plain_ms"] * scale
    text = f"{fmt_interval(iv.median, iv.lo, iv.hi)}"
    if iv.hi - iv.lo > bound:
        return f"unresolved ({text})"
    if goal is not None:
        text += " (goal met)" if iv.hi <= goal else " (goal missed)" if iv.lo > goal else ""
    return text


def table(out: dict) -> str:
    lines = [f"\n`{out['backend']}`, {out['model']} ({out['size']} twin, {out['layers']} layers), {out['new_tokens']} new "
             f"tokens after a {out['prompt']}-token prompt, {out['rounds']} interleaved rounds"
             + (f" (both sides started afresh every {out['relaunch']}, in turn first)" if out.get("relaunch") else "")
             + ", 1-minute load "
             f"{out['load'][0]:.1f}-{out['load'][1]:.1f}; median [95% interval] over rounds\n",
             "| side | streams | arm | ms / token | added ms / token | worker host us / step | ops / step |",
             "|---|---:|---|---:|---:|---:|---:|"]
    rows = figures(out)
    for row in rows:
        ops = f"{sig(row['ops_step'], 3)}" + (f" (+{sig(row['ops_hooks'], 3)} in hooks)" if row["ops_hooks"] else "")
        host = fmt_interval(row["host_us"].median, row["host_us"].lo, row["host_us"].hi)
        if not row["timed"]:
            host, ops = "n/a", "n/a"  # a base without the worker's timer and counter (before issue 52)
        lines.append(f"| {row['side']} | {row['streams']} | {row['arm']} | "
                     f"{fmt_interval(row['ms'].median, row['ms'].lo, row['ms'].hi)} | {shown(row)} | {host} | {ops} |")
    whole = [row for row in rows if row["call_us"] is not None]
    if whole:
        lines += [f"\nThe worker's host us a token over the whole call: its steps, and what the call costs outside "
                  f"them (registering the request, collecting its results), divided by the {out['new_tokens']} new "
                  f"tokens; added over plain within the round, against the goal (issue 52: "
                  + ", ".join(f"{arm} {1e3 * g:g} us" for arm, g in GOALS_MS.items())
                  + "); median [95% interval] over rounds\n",
                  "| side | streams | arm | host us / token, whole call | added us / token |", "|---|---:|---|---:|---:|"]
        for row in whole:
            iv = row["call_us"]
            lines.append(f"| {row['side']} | {row['streams']} | {row['arm']} | {fmt_interval(iv.median, iv.lo, iv.hi)} | "
                         f"{shown(row, 'added_call_us')} |")
    split = [row for row in rows if row["timed"] and row["arm"] != "plain" and "later_us" in row]
    if split:
        lines += [f"\nWhere the worker's host us go, by step: the prefill (all its steps: vLLM may chunk a batch of "
                  f"prompts), the first decode step (these build), each decode step after them (carried: what a long "
                  f"generation pays a token), and the mean a step over the {out['new_tokens']}-token call; median "
                  f"[95% interval] over rounds\n",
                  "| side | streams | arm | prefill | first decode step | each later step | mean a step |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for row in split:
            cells = [fmt_interval(iv.median, iv.lo, iv.hi) for iv in
                     (row["prefill_us"], row["first_us"], row["later_us"], row["host_us"])]
            lines.append(f"| {row['side']} | {row['streams']} | {row['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="vllm-static", choices=["vllm-static", "vllm"])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--size", default="tiny", choices=["tiny", "real"])
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--base", help="another checkout whose engine runs as the 'before' side")
    ap.add_argument("--relaunch", type=int, default=0,
                    help="start both sides afresh every N rounds, in the other order (0: never); on this machine "
                         "the side started first reads slower (docs/performance.md)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    if a.rounds < 6:
        ap.error("--rounds must be at least 6 (a 95% interval for a median needs them)")
    if a.new_tokens <= max(SHORT):
        ap.error(f"--new-tokens must be more than {max(SHORT)}, got {a.new_tokens} (each call is also timed cut short "
                 f"at {' and '.join(map(str, SHORT))} new tokens: the steps after those are what it splits off)")
    out = measure(a)
    text = table(out)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
