"""Shared helpers of the server tests (no tests here): the server in a subprocess on 127.0.0.1, as a
user starts it, and what a test asserts about its answers."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine.serve import encoding

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "meta-llama/Llama-3.2-1B"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ServerProcess:
    """`python -m engine.serve MODEL ...` in a subprocess; `url` once it printed where it listens."""

    def __init__(self, model: str, *args: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.serve", model, "--port", "0", *args], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self._seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self._seen.set()
        self._seen.set()

    def log(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    def wait(self, timeout: float = 600) -> "ServerProcess":
        """Block until /health answers 200 (or fail with the server's output)."""
        deadline = time.monotonic() + timeout
        self._seen.wait(timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log()}")
            if self.url:
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def healthy(url: str) -> None:
    r = httpx.get(f"{url}/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def tensors(block: dict) -> dict[str, torch.Tensor]:
    """The captures of an `interp` block as tensors."""
    return {k: encoding.decode(v) for k, v in block["captures"].items()}


def close(a: torch.Tensor, b: torch.Tensor, what: str = "", atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """Equal within float32 noise (vLLM's CPU kernels vary with the batch a request rides in)."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol), \
        f"{what}: max abs diff {(a.float() - b.float()).abs().max().item():.3g}"


def stream_lines(resp) -> list:
    """The JSON objects of an SSE body (after 'data: '), [DONE] checked and dropped."""
    import json
    events = [ln[len("data: "):] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def joined_rows(chunks: list, index: int = 0) -> tuple[list[int], dict[str, torch.Tensor], int]:
    """(positions, captures concatenated over the stream, chunks that carried rows) of one choice."""
    pos, parts, n = [], {}, 0
    for c in chunks:
        for ch in c["choices"]:
            blk = ch.get("interp")
            if ch["index"] != index or not blk or "captures" not in blk:
                continue
            n += 1
            pos += blk["positions"]
            for k, v in blk["captures"].items():
                parts.setdefault(k, []).append(encoding.decode(v))
    return pos, {k: torch.cat(v) for k, v in parts.items()}, n


def assert_receipts(got: list, ref: list, rel: float = 1e-4) -> None:
    """A response's receipts equal the library's (engine.core.results.Receipt): every field, norms within
    float noise."""
    assert [{**r, "change_norm": None} for r in got] == [{**r.as_json(), "change_norm": None} for r in ref], got
    for g, r in zip(got, ref):
        assert g["change_norm"] == pytest.approx(r.change_norm, rel=rel, abs=1e-6), (g, r)
