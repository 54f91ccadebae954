"""The sweep: every variant in its own long-lived worker, every workload timed in interleaved rounds.

    load every worker -> warm up and size every cell -> rounds: for each workload, every variant
    once, in an order rotated per round -> check every cell's last output -> write the cells

A ratio of two cells then pairs samples taken seconds apart in the same round, so whatever else the
machine is doing shifts both sides of it alike; a sweep that ran cells one after another over
twenty minutes would have measured the machine instead. Cells a variant cannot run are "n/a" (with
the table's reason) and unavailable variants "skipped", without starting a process; a worker that
fails or hangs leaves "error" cells naming what happened, and the sweep goes on without it."""
from __future__ import annotations

import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import cells, env, rounds
from benchmarks.ci import median_ci
from benchmarks.pool import WorkerDied, WorkerProc
from benchmarks.spec import Params
from benchmarks.variants import VARIANTS
from benchmarks.variants import get as get_variant
from benchmarks.workloads import DEFAULT as DEFAULT_WORKLOADS
from benchmarks.workloads import get as get_workload

SAMPLE_FIELDS = ("seconds", "cpu_s", "min_seconds", "min_cpu_s", "k", "load1", "t")


# generated outputs, not what a sweep runs: a second sweep in one session (benchmarks/cpu.sh) finds the
# first one's cells there, which must not mark it '+dirty'
OUTPUTS = (":(exclude)reports", ":(exclude)visualizer-data", ":(exclude)README.md")


def git_commit() -> str | None:
    """The commit the sweep ran at ('+dirty' when code had uncommitted changes), or None outside a
    checkout."""
    import subprocess
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cells.ROOT, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *OUTPUTS],
                               cwd=cells.ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def default_sweep_name(p: Params) -> str:
    """cpu-smollm2-135m-real: device, checkpoint, and which weights (tiny / real-size twin, real)."""
    model = p.model.split("/")[-1].lower()
    which = p.size if p.source == "zoo" else "weights"
    return cells.check_sweep_name(f"{p.device.split(':')[0]}-{model}-{which}")


def plan(variants=None, workloads=None) -> tuple[list[str], list[str]]:
    vs = [get_variant(v).name for v in variants] if variants else [v.name for v in VARIANTS]
    ws = [get_workload(w).name for w in workloads] if workloads else list(DEFAULT_WORKLOADS)
    return vs, ws


def summarize(samples: list[dict], tokens: int, p: Params) -> dict:
    """tok/s on the sweep's clock over rounds (median and its interval), CPU time per wall second,
    machine load."""
    from benchmarks.table import CLOCK_FIELD
    tok = median_ci([tokens / s[CLOCK_FIELD[p.clock]] for s in samples], p.ci_level)
    cpu = [s["cpu_s"] / s["seconds"] for s in samples if s.get("cpu_s") is not None]
    loads = [s["load1"] for s in samples if s.get("load1") is not None]
    return {"rounds": len(samples), "tokens_per_run": tokens, "tok_s": tok.to_dict(),
            "cpu_per_wall": statistics.median(cpu) if cpu else None,
            "load1": [min(loads), max(loads)] if loads else None}


class Sweep:
    def __init__(self, params: Params, name: str, variants: list[str], workloads: list[str], log_dir: Path,
                 log=print):
        self.p, self.name, self.log = params, name, log
        self.variants, self.workloads, self.log_dir = variants, workloads, Path(log_dir)
        self.run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.commit = git_commit()
        self.cells: dict[tuple[str, str], dict] = {}
        self.workers: dict[str, WorkerProc] = {}
        self.loaded: dict[str, dict] = {}

    def _base(self, v: str) -> dict:
        var = get_variant(v)
        out = {"run_id": self.run_id, "commit": self.commit, "params": self.p.to_dict(), "title": var.title,
               "kind": var.kind}
        if v in self.loaded:
            out.update(env=self.loaded[v]["env"], load_s=self.loaded[v]["load_s"],
                       model_info=self.loaded[v]["model_info"])
        return out

    def _finish(self, v: str, w: str, status: str, reason: str = "", **fields) -> None:
        self.cells[(v, w)] = cells.make_cell(self.name, v, w, status, reason, **self._base(v), **fields)

    # -- phases ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Static n/a and skipped cells; a worker (loaded) for every variant with something to run. Workers
        load at once (imports and weights are most of a sweep's start on a GPU machine), except the vLLM
        ones, which busy-wait and start engine processes: those load one after another, after the rest."""
        todo = {}
        for v in self.variants:
            var = get_variant(v)
            runnable = [w for w in self.workloads if not var.supports(w)]
            for w in set(self.workloads) - set(runnable):
                self._finish(v, w, "n/a", var.supports(w))
            why = var.unavailable()
            if why:
                for w in runnable:
                    self._finish(v, w, "skipped", f"{v} unavailable: {why}")
                continue
            if runnable:
                todo[v] = runnable
        together = [v for v in todo if not get_variant(v).busy_waits]
        t0 = time.perf_counter()
        sent = {v: self._send_load(v) for v in together}
        for v in together:
            self._loaded(v, todo[v], sent[v], t0)
        for v in [v for v in todo if v not in together]:
            t0 = time.perf_counter()
            self._loaded(v, todo[v], self._send_load(v), t0)

    def _send_load(self, v: str) -> tuple[WorkerProc, dict | None]:
        wp = WorkerProc(v, self.p, self.log_dir)
        try:
            wp.send({"op": "load", "variant": v, "params": self.p.to_dict()})
        except WorkerDied as e:
            return wp, {"ok": False, "reason": str(e)}
        return wp, None

    def _loaded(self, v: str, runnable: list[str], sent: tuple[WorkerProc, dict | None], t0: float) -> None:
        wp, reply = sent
        if reply is None:
            try:
                reply = wp.receive({"op": "load"})
            except WorkerDied as e:
                reply = {"ok": False, "reason": str(e)}
        if not reply.get("ok"):
            wp.close()
            for w in runnable:
                self._finish(v, w, "error", f"loading {v} failed: {reply.get('reason')}",
                             traceback=reply.get("traceback"))
            self.log(f"{v:>15}: load failed: {str(reply.get('reason'))[:200]}")
            return
        self.workers[v], self.loaded[v] = wp, reply
        self.log(f"{v:>15}: loaded {time.perf_counter() - t0:.0f} s after the start (RSS {wp.rss_gib()} GiB)")

    def _ask(self, v: str, w: str, req: dict) -> dict | None:
        """A worker request; on failure the cell becomes an error and None comes back. A worker that
        died takes the rest of its cells with it."""
        wp = self.workers.get(v)
        if wp is None:
            return None
        try:
            reply = wp.request(req)
        except WorkerDied as e:
            self.workers.pop(v)
            for ww in self.workloads:
                if (v, ww) not in self.cells:
                    self._finish(v, ww, "error", str(e))
            self.log(f"{v:>15}: worker lost: {str(e)[:200]}")
            return None
        if not reply.get("ok"):
            self._finish(v, w, reply.get("status", "error"), reply.get("reason", "?"),
                         traceback=reply.get("traceback"))
            return None
        return reply

    def prepare(self) -> list[tuple[str, str]]:
        """Warm up and size every runnable cell; the cells each round will run, in table order."""
        self.prepared: dict[tuple[str, str], dict] = {}
        ready = []
        for v in self.variants:
            for w in self.workloads:
                if (v, w) in self.cells or v not in self.workers:
                    continue
                reply = self._ask(v, w, {"op": "prepare", "workload": w})
                if reply:
                    self.prepared[(v, w)] = {"k": reply["k"], "est_s": reply["est_s"], "notes": reply["notes"],
                                             "samples": []}
                    ready.append((v, w))
        return ready

    def run_rounds(self, ready: list[tuple[str, str]], deadline: float | None = None) -> None:
        """Every round; with a `deadline` (perf_counter), only those that the last round's duration says will
        end before it (the rounds left out are logged)."""
        last = 0.0
        for r in range(self.p.rounds):
            if deadline is not None and time.perf_counter() + last > deadline:
                self.log(f"round {r + 1}/{self.p.rounds} and later: not started, the sweep's time is up "
                         f"(--max-seconds); {r} rounds ran")
                break
            t0, load0 = time.perf_counter(), env.load1()
            order = rounds.schedule(ready, r, lambda w: get_workload(w).baseline)
            for pos, (v, w) in enumerate(order):
                if (v, w) in self.cells:  # failed earlier in this sweep
                    continue
                lead_in = rounds.switches_in(order, pos)
                reply = self._ask(v, w, {"op": "sample", "workload": w, "lead_in": lead_in})
                if reply:
                    self.prepared[(v, w)]["samples"].append(
                        {"round": r, "position": pos, "lead_in": lead_in, **{k: reply[k] for k in SAMPLE_FIELDS}})
            last = time.perf_counter() - t0
            self.log(f"round {r + 1}/{self.p.rounds}: {last:.0f} s, machine load {load0} -> {env.load1()}")

    def check(self) -> None:
        for (v, w), prep in self.prepared.items():
            if (v, w) in self.cells:
                continue
            reply = self._ask(v, w, {"op": "check", "workload": w})
            if reply is None:
                continue
            wl = get_workload(w)
            tokens = wl.tokens(self.p)
            status, reason, check = "ok", "", reply["check"]
            if check is not None and not check.get("passed"):
                status, reason = "invalid", f"check failed: {check.get('detail')}"
            made = reply["generated"]
            if wl.generates and made != tokens:  # a run that stopped early would inflate tok/s
                status, reason = "invalid", (f"the last timed run generated {made} tokens, not the {tokens} the "
                                             f"figure counts ({wl.batch} x {self.p.new_tokens})")
            samples = prep["samples"]
            self._finish(v, w, status, reason, samples=samples, warmup={"k": prep["k"], "est_s": prep["est_s"]},
                         summary=summarize(samples, tokens, self.p), check=check,
                         generated_tokens_checked=made, notes=prep["notes"])

    def close(self) -> None:
        for wp in self.workers.values():
            wp.close()
        self.workers.clear()


def run_sweep(params: Params, variants=None, workloads=None, root: Path = cells.CELLS_DIR, name: str | None = None,
              log=print, max_s: float | None = None) -> list[dict]:
    """Run one sweep and write its cells to `root/<name>/` (replacing that sweep's old cells); with `max_s`,
    no round starts that would end more than `max_s` seconds after the sweep started."""
    vs, ws = plan(variants, workloads)
    params = params.for_variants([v for v in vs if get_variant(v).busy_waits])
    name = cells.check_sweep_name(name or default_sweep_name(params))
    root = Path(root)
    t0 = time.perf_counter()
    logs = Path(tempfile.gettempdir()) / "interp-benchmarks" / name  # each worker's stderr
    log(f"sweep {name}: worker logs in {logs}; timed on the {params.clock} clock")
    busy = env.others_running()
    if params.clock == "wall" and params.device == "cpu" and busy is not None and busy > 0.5:
        log(f"warning: {busy:.1f} other tasks are running as the sweep starts; wall-clock figures include time "
            f"other jobs take from the cores (the cells record the load of every sample)")
    s = Sweep(params, name, vs, ws, logs, log)
    try:
        s.start()
        ready = s.prepare()
        log(f"{len(ready)} cells ready; {params.rounds} rounds")
        s.run_rounds(ready, None if max_s is None else t0 + max_s)
        s.check()
    finally:
        s.close()
    wall = time.perf_counter() - t0
    cells.clear_sweep(root, name)
    out = []
    for (v, w) in sorted(s.cells, key=lambda k: (vs.index(k[0]), ws.index(k[1]))):
        cell = dict(s.cells[(v, w)], sweep_wall_s=wall)
        cells.write_cell(cell, root)
        out.append(cell)
        med = (cell.get("summary") or {}).get("tok_s", {}).get("median")
        log(f"{v:>15} x {w:<13} {cell['status']:<8} " + (f"{med:.4g} tok/s" if med else cell["reason"][:110]))
    log(f"sweep {name}: {len(out)} cells in {wall / 60:.1f} min -> {root / name}")
    return out
