"""A benchmark's measuring process: started once with its model loaded, asked one line at a time on stdin,
answering with JSON lines behind a MARK prefix on stdout (the libraries it loads print there too).

benchmarks/step_cost.py asks JSON commands of its sides, benchmarks/harvest_bench.py asks cell names of its
engine processes; both read answers the same way and stop a child by closing its stdin."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


class Child:
    """One measuring process: `argv` run in `cwd` with `env` added to this process's environment. It
    answers once when its model is loaded: that first answer is `ready`."""

    def __init__(self, name: str, argv: list[str], mark: str, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name, self.mark = name, mark
        self.p = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})}, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.ready: dict = self.answer()

    def answer(self) -> dict:
        """The next answer line's JSON; a child that ends first is an error naming it and its exit code."""
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(self.mark):
                return json.loads(line[len(self.mark):])
        raise RuntimeError(f"{self.name} ended without answering (exit {self.p.wait()}; its stderr is above)")

    def ask_line(self, text: str) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()
        return self.answer()

    def ask(self, **cmd) -> dict:
        """A command as one JSON line."""
        return self.ask_line(json.dumps(cmd))

    def close(self, timeout: float = 120) -> int:
        """Close its stdin (it finishes its loop and exits) and wait; killed after `timeout` s. Its exit code."""
        try:
            if self.p.stdin is not None:
                self.p.stdin.close()
        except BrokenPipeError:
            pass
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()
