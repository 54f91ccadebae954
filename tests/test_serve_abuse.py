"""The server as shared infrastructure, tried as a hostile or careless client would (eager backend, a
real server subprocess): every hostile body of serve_common.HOSTILE is a 4xx naming the field and
leaves /health ok; then a normal request still equals its answer from before. Also: a prompt too long
in characters is refused before tokenizing, HEAD /health, every steering op over HTTP equals the
library, abandoned requests are dropped, text never ends in a half character. (The vLLM variants,
with the KV-cache poisoning reproducer: tests/test_serve_abuse_vllm.py, slow.)"""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch

from engine.serve import encoding
from engine.serve.runner import longest_token
from engine.core.steering import OPS, Steer
from serve_common import (D_MODEL, HOSTILE, LLAMA, assert_refused, close, eager_server, healthy,
                          tensors)
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


def _generated(url) -> int:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(re.search(r"^interp_generation_tokens_total (\d+)$", text, re.M).group(1))


def test_abandoned_requests_are_dropped(url):
    """Eager runs one call at a time: requests whose clients left before their turn never run, and no
    abandoned request is counted as served (old code: each ran to its end and was counted)."""
    start = _generated(url)
    long = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 200, "temperature": 0}

    async def abandon():
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as c:
            await asyncio.gather(*(c.post("/v1/completions", json=long) for _ in range(3)), return_exceptions=True)
    asyncio.run(abandon())
    r = httpx.post(f"{url}/v1/completions", json={**long, "max_tokens": 2}, timeout=300)
    assert r.status_code == 200
    assert _generated(url) == start + 2
    healthy(url)
