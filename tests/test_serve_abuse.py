"""The server as shared infrastructure, tried as a hostile or careless client would (eager backend, a
real server subprocess): every hostile body of serve_common.HOSTILE is a 4xx naming the field and
leaves /health ok; then a normal request still equals its answer from before. Also: a prompt too long
in characters is refused before tokenizing, HEAD /health, every steering op over HTTP equals the
library, abandoned requests are dropped, text never ends in a half character. (The vLLM variants,
with the KV-cache poisoning reproducer: tests/test_serve_abuse_vllm.py, slow.)"""
from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest
import torch

from engine.core.steering import OPS, Steer
from engine.serve import encoding
from engine.serve.runner import longest_token
from serve_common import D_MODEL, HOSTILE, LLAMA, assert_refused, close, eager_server, healthy, tensors
from test_vllm_common import eager_model

PROMPT = "The quick brown fox jumps over the lazy dog"
NORMAL = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
          "interp": {"capture": {"points": ["resid_post.1"], "reduction": "last"}}}


@pytest.fixture(scope="module")
def url():
    with eager_server("--max-response-bytes", "200000") as u:
        yield u


@pytest.fixture(scope="module")
def lib(url):
    return eager_model(LLAMA)


@pytest.fixture(scope="module")
def normal_before(url):
    return httpx.post(f"{url}/v1/completions", json=NORMAL, timeout=120).json()["choices"][0]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_body_is_4xx_naming_the_field(url, normal_before, case):
    assert_refused(url, case)


def test_after_the_hostile_bodies_a_normal_request_is_unchanged(url, normal_before):
    before = normal_before
    after = httpx.post(f"{url}/v1/completions", json=NORMAL, timeout=120).json()["choices"][0]
    assert after["text"] == before["text"] and after["interp"]["token_ids"] == before["interp"]["token_ids"]
    assert torch.equal(tensors(after["interp"])["resid_post.1"], tensors(before["interp"])["resid_post.1"])


def test_limits_a_client_can_rely_on(url, lib):
    n = 512 * longest_token(lib.tokenizer)  # max positions x the longest token: more cannot fit
    r = httpx.post(f"{url}/v1/completions", json={"model": LLAMA, "prompt": "a" * (n + 1)}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"{n + 1} characters cannot fit the 512 positions" in r.json()["error"]["message"]
    big = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 2, "interp": {"capture": {"points": ["mlp_act"],
                                                                                         "encoding": "list"}}}
    r = httpx.post(f"{url}/v1/completions", json=big, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 413 and "limit of 200000 bytes (--max-response-bytes)" in err["message"], r.text
    assert err["param"] == "interp.capture"
    # a stream is refused before it starts when its captures cannot fit at their largest (old code sent
    # 1.1 MB of the stream, then an in-band 413 inside a 200)
    r = httpx.post(f"{url}/v1/completions", json={**big, "stream": True}, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 413 and "at their largest" in err["message"] and err["param"] == "interp.capture", r.text[:300]
    assert "'base64' instead of 'list'" in err["message"]
    b64 = {**big, "max_tokens": 40, "stream": True, "interp": {"capture": {"points": ["mlp_act"], "encoding": "base64"}}}
    r = httpx.post(f"{url}/v1/completions", json=b64, timeout=120)
    assert r.status_code == 413 and "base64" not in r.text, r.text[:300]  # no hint to use what it already used
    r = httpx.head(f"{url}/health", timeout=30)
    assert r.status_code == 200
    healthy(url)


def _steer_json(st: Steer) -> dict:
    out = {"address": str(st.address), "op": st.op, "positions": "all"}
    if st.value is not None:
        out["value"] = encoding.encode(st.value)
    if st.coeff is not None:
        out["coeff"] = st.coeff
    if st.bounds is not None:
        out["bounds"] = list(st.bounds)
    return out


# the feature rows name an SAE folder, which the server refuses until it names one itself (serve/schemas.py)
@pytest.mark.parametrize("op", [n for n, o in OPS.items() if "sae" not in o.params])
def test_every_op_over_http_equals_the_library(url, lib, op):
    g = torch.Generator().manual_seed(3)
    n = len(lib.tokenizer(PROMPT)["input_ids"])
    value = {"none": None, "vector": torch.randn(D_MODEL, generator=g), "scale": torch.tensor(0.5),
             "direction": torch.randn(D_MODEL, generator=g), "activation": torch.randn(n, D_MODEL, generator=g)}
    kw = {"rescale": {"coeff": 2.5}, "norm_scaled_add": {"coeff": 0.3}, "projection_cap": {"bounds": (-0.5, 0.5)}}
    st = Steer("resid_post.0", op, value[OPS[op].value], **kw.get(op, {}))
    _, ref = lib.run_with_cache(PROMPT, ["resid_post.0", "resid_post.1"], [st])
    r = httpx.post(f"{url}/v1/capture", json={"prompt": PROMPT, "interp": {
        "capture": ["resid_post.0", "resid_post.1"], "steer": [_steer_json(st)]}}, timeout=120)
    assert r.status_code == 200, r.text
    got = tensors(r.json()["data"][0])
    _, plain = lib.run_with_cache(PROMPT, ["resid_post.0"])
    assert not torch.allclose(ref["resid_post.0"][0], plain["resid_post.0"][0]), f"{op} changed nothing"
    for k in got:
        close(got[k], ref[k][0], f"{op} {k}", atol=1e-5, rtol=1e-5)


def _metric(url, name: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)))


def _until(predicate, what: str, timeout: float = 300) -> None:
    """Poll until predicate() holds (a generous bound: only a broken server takes that long)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_abandoned_requests_are_dropped(url):
    """Eager runs one call at a time. Three long generations are sent; once all three are admitted
    their clients leave: the running one stops at its next step and the two waiting never run, so the
    tokens generated for them stay far below one generation's 400 (old code ran the first to its end,
    and on a loaded machine ran and counted more). Independent of load: stopping needs the server to
    notice a closed socket, which takes far less than 400 steps however slow the machine is."""
    start_gen, start_lost = _metric(url, "interp_generation_tokens_total"), _metric(url, "interp_abandoned_tokens_total")
    body = json.dumps({"model": LLAMA, "prompt": PROMPT, "max_tokens": 400, "temperature": 0}).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = []
    for _ in range(3):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        socks.append(s)
    _until(lambda: _metric(url, "interp_queue_depth") == 3, "three admitted requests")
    for s in socks:
        s.close()
    _until(lambda: _metric(url, "interp_queue_depth") == 0, "the abandoned requests to leave the queue")
    r = httpx.post(f"{url}/v1/completions", json={"model": LLAMA, "prompt": PROMPT, "max_tokens": 2}, timeout=300)
    assert r.status_code == 200  # it ran after whatever was left of the abandoned ones: their count is final
    assert _metric(url, "interp_generation_tokens_total") == start_gen + 2
    lost = _metric(url, "interp_abandoned_tokens_total") - start_lost
    assert 0 <= lost < 400, lost
    healthy(url)
