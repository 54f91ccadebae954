"""The sweep's side of a worker: start `python -m benchmarks.worker` for one variant, send it requests,
read its replies with a timeout, and stop it. A worker that hangs past the timeout is killed; one
that dies is reported with the tail of its log (its stderr, kept in a file so a chatty library can
never fill a pipe and stall it)."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cells
from benchmarks.spec import Params


class WorkerDied(RuntimeError):
    """The worker process exited, hung past its timeout, or answered something that is not a reply."""


def worker_env(params: Params) -> dict:
    """The worker's environment: twins of the sweep's size load by repo id offline; vLLM keeps its
    default engine-core layout unless the caller set one; every library gets the same thread count."""
    e = dict(os.environ)
    if params.source == "zoo":
        from engine import zoo
        e.update(zoo.offline_env(params.size))
    if params.threads:
        e["OMP_NUM_THREADS"] = str(params.threads)
        if params.device == "cpu":
            e["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    e["PYTHONPATH"] = os.pathsep.join([str(cells.ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e.setdefault("TOKENIZERS_PARALLELISM", "false")
    e.setdefault("PYTHONUNBUFFERED", "1")
    return e


class WorkerProc:
    def __init__(self, variant: str, params: Params, log_dir: Path, argv: list[str] | None = None):
        self.variant, self.params = variant, params
        self.log_path = Path(log_dir) / f"{variant}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        cmd = argv or [sys.executable, "-m", "benchmarks.worker"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=worker_env(params), cwd=cells.ROOT, text=True, bufsize=1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 800) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip()
        except OSError:
            return "(no log)"
        return text[-n:] if text else "(empty log)"

    def request(self, req: dict, timeout_s: float | None = None) -> dict:
        """Send one request and wait for its reply; WorkerDied when none comes in time."""
        self.send(req)
        return self.receive(req, timeout_s)

    def send(self, req: dict) -> None:
        """Send one request without waiting (several workers can then load at once); `receive` its reply."""
        if self.proc.poll() is not None:
            raise WorkerDied(f"{self.variant} worker exited with code {self.proc.returncode}: {self.log_tail()}")
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerDied(f"{self.variant} worker is gone: {self.log_tail()}") from None

    def receive(self, req: dict, timeout_s: float | None = None) -> dict:
        """The reply to `req`, sent before; WorkerDied when none comes within `timeout_s` of now."""
        timeout_s = timeout_s or self.params.timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerDied(f"{self.variant} worker gave no reply to {req.get('op')} "
                                 f"{req.get('workload', '')} within {timeout_s:.0f} s (raise --timeout); killed it. "
                                 f"Log: {self.log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    self.proc.wait(timeout=30)
                    raise WorkerDied(f"{self.variant} worker exited with code {self.proc.returncode} during "
                                     f"{req.get('op')}: {self.log_tail()}")
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    raise WorkerDied(f"{self.variant} worker answered {line[:200]!r}, not a JSON reply") from None

    def close(self, timeout_s: float = 120) -> None:
        """Ask the worker to free its model and exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.request({"op": "close"}, timeout_s)
                self.proc.wait(timeout=timeout_s)
            except (WorkerDied, subprocess.TimeoutExpired):
                self.kill()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def rss_gib(self) -> float | None:
        try:
            import psutil
            return round(psutil.Process(self.pid).memory_info().rss / 2 ** 30, 2)
        except Exception:  # noqa: BLE001 (a worker that exited has no RSS)
            return None
