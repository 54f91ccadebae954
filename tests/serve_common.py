"""Shared helpers of the server tests (no tests here): the server in a subprocess on 127.0.0.1, as a
user starts it, and what a test asserts about its answers."""
from __future__ import annotations

import base64
import contextlib
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

    def __init__(self, model: str, *args: str, sigchld_ignored: bool = False):
        """sigchld_ignored: started with SIGCHLD ignored, as a supervisor or a Ray driver (the subreaper
        option) may start it; the disposition is inherited across exec."""
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        pre = (lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN)) if sigchld_ignored else None
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.serve", model, "--port", "0", *args], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=pre)
        self.lines: list[str] = []
        self.url: str | None = None
        self._seen = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

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
        """SIGTERM, as a supervisor stops it; then its output is read to the end (self.lines)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(150)  # uvicorn's 5 s grace, then up to 60 s for vLLM's processes (stop_engine)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.reader.join(30)

    def assert_clean_exit(self) -> None:
        """After close(): exit status 0, vLLM's engine core not killed (a killed one leaves its shared
        memory behind), no leaked shared memory reported."""
        assert self.proc.returncode == 0, self.log()
        bad = [ln for ln in self.lines if "force killing" in ln or "leaked shared_memory" in ln]
        assert not bad, bad


async def read_body(receive) -> bytes:
    """An ASGI request's whole body, read message by message (the test apps that stand in for a server)."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


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


# -- hostile requests (tests/test_serve_abuse.py): each must be a 4xx naming the field, and leave the
# server healthy. (name, path, body: dict or raw bytes, status, fragment of the message, param)
D_MODEL = 256  # the Llama-3.2-1B zoo twin's hidden size
ONE = "AACAPw=="  # base64 of one float32 1.0


def _raw(text: str) -> bytes:
    return text.replace("M", LLAMA).encode()


HOSTILE = [
    ("temperature Infinity", "/v1/completions", _raw('{"model":"M","prompt":"hi","temperature":Infinity}'), 400,
     "finite number", "temperature"),
    ("temperature NaN", "/v1/completions", _raw('{"model":"M","prompt":"hi","temperature":NaN}'), 400,
     "finite number", "temperature"),
    ("temperature 1e308", "/v1/completions", {"prompt": "hi", "temperature": 1e308}, 400, "temperature",
     "temperature"),
    ("repetition_penalty Infinity", "/v1/completions",
     _raw('{"model":"M","prompt":"hi","repetition_penalty":Infinity}'), 400, "finite number", "repetition_penalty"),
    ("stop_token_ids -1", "/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "not a token id",
     "stop_token_ids"),
    ("stop_token_ids past the vocabulary", "/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 9]}, 400,
     "not a token id", "stop_token_ids"),
    ("seed 2**70", "/v1/completions", {"prompt": "hi", "seed": 2 ** 70}, 400, "less than or equal", "seed"),
    ("top_k 2**70", "/v1/completions", {"prompt": "hi", "top_k": 2 ** 70}, 400, "less than or equal", "top_k"),
    ("min_tokens 2**70", "/v1/completions", {"prompt": "hi", "min_tokens": 2 ** 70}, 400, "less than or equal",
     "min_tokens"),
    ("steer scale by 10**400", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.0", "op": "scale", "value": 10 ** 400}]}}, 400, "does not fit a float",
     "interp.steer[0].value"),
    ("steer coeff 10**400", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.0", "op": "rescale", "value": [1.0] * D_MODEL, "coeff": 10 ** 400}]}}, 400,
     "give a finite number", "interp.steer[0]"),
    ("JSON nested 10000 deep", "/v1/completions",
     _raw('{"model":"M","prompt":"hi","user":' + "[" * 10000 + "]" * 10000 + "}"), 400, "too deep", None),
    ("steer value of 10**6 dims", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "interp": {"steer": [
        {"address": "resid_post.0", "value": {"dtype": "float32", "shape": [1] * 10 ** 6, "data": ONE}}]}}, 400,
     "at most 8", "interp.steer[0].value"),
    ("steer value of 65 dims", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "interp": {"steer": [
        {"address": "resid_post.0", "value": {"dtype": "float32", "shape": [1] * 65, "data": ONE}}]}}, 400,
     "at most 8", "interp.steer[0].value"),
    ("steer value of 2**40 elements", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "interp": {"steer": [
        {"address": "resid_post.0", "value": {"dtype": "float32", "shape": [1 << 20, 1 << 20], "data": ONE}}]}},
     400, "holds at most", "interp.steer[0].value"),
    ("steer lists 100 deep", "/v1/completions", _raw(
        '{"model":"M","prompt":"hi","interp":{"steer":[{"address":"resid_post.0","value":' + "[" * 100 + "1.0"
        + "]" * 100 + "}]}}"), 400, "more than 8 deep", "interp.steer[0].value"),
    ("steer number too big for int64", "/v1/completions", _raw(
        '{"model":"M","prompt":"hi","interp":{"steer":[{"address":"resid_post.0","op":"add","value":[' + "9" * 400
        + "]}]}}"), 400, "does not fit", "interp.steer[0].value"),
    ("steer whose result overflows", "/v1/completions", {"prompt": "Zebra crossing Zebra crossing", "max_tokens": 8,
     "temperature": 0, "interp": {"steer": [{"address": "value.0", "op": "scale", "value": 3e38}]}}, 400,
     "inf or NaN", "interp.steer[0]"),
    ("steer float64 value that overflows float32", "/v1/capture", {"prompt": "hi", "interp": {
        "capture": ["resid_post.1"], "steer": [{"address": "resid_post.0", "op": "add", "value": {
            "dtype": "float64", "shape": [D_MODEL], "data": base64.b64encode(
                torch.full((D_MODEL,), 1e300, dtype=torch.float64).numpy().tobytes()).decode()}}]}}, 400,
     "float32", "interp.steer[0]"),
    ("steer coeff NaN", "/v1/completions", _raw(
        '{"model":"M","prompt":"hi","interp":{"steer":[{"address":"resid_post.0","op":"norm_scaled_add",'
        '"value":[' + ",".join(["1.0"] * D_MODEL) + '],"coeff":NaN}]}}'), 400, "finite number", "interp.steer[0]"),
    ("steer bounds Infinity", "/v1/completions", _raw(
        '{"model":"M","prompt":"hi","interp":{"steer":[{"address":"resid_post.0","op":"projection_cap",'
        '"value":[' + ",".join(["1.0"] * D_MODEL) + '],"bounds":[null,Infinity]}]}}'), 400, "finite numbers",
     "interp.steer[0]"),
    ("steer positional value too short", "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 2,
     "interp": {"steer": [{"address": "resid_post.0", "value": [[0.5] * D_MODEL] * 2}]}}, 400,
     "covers positions 0..1", "interp.steer[0]"),
    ("steer engine field", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.0", "op": "ablate", "lead": 1}]}}, 400, "unknown field", "interp.steer[0].lead"),
    # issue 34: every one of these was a 500 or silently accepted
    ("max_tokens of 5000 digits", "/v1/completions", _raw('{"model":"M","prompt":"hi","max_tokens":' + "9" * 5000
                                                          + "}"), 400, "valid integer", "max_tokens"),
    ("steer value of 5000 digits", "/v1/completions", _raw(
        '{"model":"M","prompt":"hi","interp":{"steer":[{"address":"resid_post.0","op":"add","value":[' + "9" * 5000
        + "]}]}}"), 400, "a number of 5000 digits", "interp.steer[0].value"),
    ("max_tokens as a string", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "valid integer",
     "max_tokens"),
    ("max_tokens true", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "valid integer", "max_tokens"),
    ("strict 'yes'", "/v1/completions", {"prompt": "hi", "interp": {"strict": "yes", "steer": [
        {"address": "resid_post.0", "op": "ablate"}]}}, 400, "valid boolean", "interp.strict"),
    ("temperature as a string", "/v1/completions", {"prompt": "hi", "temperature": "0.5"}, 400, "valid number",
     "temperature"),
    ("layer in Arabic-Indic digits", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.\u0661", "op": "ablate"}]}}, 400, "ASCII", "interp.steer[0]"),
    ("capture layer in Arabic-Indic digits", "/v1/capture", {"prompt": "hi", "interp": {
        "capture": ["resid_post.\u0661"]}}, 400, "ASCII", "interp.capture.points[0]"),
    ("300 steers", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.0", "op": "scale", "value": 1.0}] * 300}}, 400, "at most 256", "interp.steer"),
    ("LensTopK k=10**9", "/v1/completions", {"prompt": "hi", "interp": {"capture": {"readouts": [
        {"address": "resid_post.0", "kind": "LensTopK", "k": 10 ** 9}]}}}, 400, "exceeds the vocabulary",
     "interp.capture.readouts[0]"),
    ("3000-row steer on a 256- or 512-position model", "/v1/completions", {"prompt": "hi", "max_tokens": 2,
     "interp": {"steer": [{"address": "resid_post.0", "op": "add", "value": {"dtype": "float32", "shape": [
         3000, D_MODEL], "data": base64.b64encode(bytes(3000 * D_MODEL * 4)).decode()}}]}}, 400,
     "3000 rows of per-position values, more than the", "interp.steer[0].value"),
    ("stop index outside a lens readout", "/v1/completions", {"prompt": "hi", "stream": True, "interp": {
        "capture": {"readouts": [{"address": "resid_post.1", "kind": "LensTopK", "k": 3, "name": "l"}]},
        "stop": {"readout": "l", "above": 0.0, "index": 10 ** 6}}}, 400, "give index 0..", "interp.stop.index"),
    # each steer's own result is finite, together they overflow a later layer: the request fails alone
    # (the layer guard, engine.core.site.guard), naming its steers, before any capture is encoded
    ("capture list encoding of inf", "/v1/capture", {"prompt": "hi there", "interp": {
        "capture": {"points": ["resid_mid.1"], "encoding": "list"}, "steer": [
            {"address": "resid_post.0", "op": "add", "value": [3e38] * D_MODEL},
            {"address": "attn_out.1", "op": "add", "value": [3e38] * D_MODEL}]}}, 400,
     "downstream of its steers ('add' at resid_post.0; 'add' at attn_out.1)", "interp.steer[0]"),
]


def assert_refused(url: str, case: tuple, headers: dict | None = None) -> None:
    """One hostile request: the status, the message fragment and the field; then /health is ok."""
    import json
    name, path, body, status, fragment, param = case
    if isinstance(body, dict):
        body = json.dumps({"model": LLAMA, **body}).encode()
    r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json", **(headers or {})},
                   timeout=120)
    assert r.status_code == status, f"{name}: {r.status_code} {r.text[:400]}"
    err = r.json()["error"]
    assert fragment in err["message"], f"{name}: {err['message']}"
    assert err["param"] == param, f"{name}: param {err['param']!r} ({err['message']})"
    healthy(url)


@contextlib.contextmanager
def eager_server(*extra: str):
    """A real eager server subprocess on the Llama twin (the library's own twin loads meanwhile: it is
    the reference the responses are compared with); yields its URL."""
    from test_vllm_common import eager_model
    srv = ServerProcess(LLAMA, "--backend", "eager", "--source", "zoo", "--max-pending", "8", *extra)
    try:
        eager_model(LLAMA)
        yield srv.wait().url
    finally:
        srv.close()


def probe_stop_matches_library(client, em, U: torch.Tensor, prompt: str = "The quick brown fox jumps over the lazy dog",
                               n: int = 10) -> None:
    """A streamed completion with a probe stop (interp.stop on a Project readout of resid_post.1) ends at
    the first token whose score crosses the threshold, as the library model `em` computes that probe;
    each token's chunk carries its forward's probe rows."""
    from engine import Project, Readout
    ref = em.generate(prompt, n, readouts=[Readout("resid_post.1", Project(U), name="probe")])
    p = ref.requests[0].prompt_ids.shape[0]
    scores = ref.cache.readouts["probe"][0, p - 1:p - 1 + n]  # token i is predicted from position p - 1 + i
    j = int(scores.argmax())
    side = "above"
    if j == 0:
        j, side = int(scores.argmin()), "below"
    earlier = scores[:j]
    edge = (earlier.max() if side == "above" else earlier.min()) if j else scores[j] - (1 if side == "above" else -1)
    threshold = float((edge + scores[j]) / 2)
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "interp": {"capture": {"readouts": [{"address": "resid_post.1", "kind": "Project", "W": encoding.encode(U),
                                                 "name": "probe"}]},
                       "stop": {"readout": "probe", side: threshold}}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = stream_lines(r)
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "interp.stop"
    assert last["interp"]["token_ids"] == ref.new_tokens[0, :j + 1].tolist()
    assert last["interp"]["stopped"]["token"] == j
    assert abs(last["interp"]["stopped"]["score"] - float(scores[j])) < 1e-4
    # every token's chunk carried its forward's probe rows as computed: the prompt's, then one per token
    rows = [encoding.decode(c["choices"][0]["interp"]["readouts"]["probe"]) for c in chunks
            if "interp" in c["choices"][0] and "readouts" in c["choices"][0]["interp"]]
    assert len(rows) == j + 1 and rows[0].shape[0] == p and all(r.shape[0] == 1 for r in rows[1:])
    close(torch.cat(rows), ref.cache.readouts["probe"][0, :p + j], "probe rows", atol=1e-5)
    text = em.tokenizer.decode(ref.new_tokens[0, :j + 1], skip_special_tokens=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text.rstrip("\ufffd")  # whole characters only
