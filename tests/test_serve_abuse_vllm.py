"""The abuse suite on the vLLM backends (slow: a server per backend). The KV-cache poisoning
reproducer (a valid steer whose result overflows float32) is a 400 naming the steer, and 20 unrelated
requests afterwards equal their solo answers from before it; then every hostile body of
serve_common.HOSTILE (plus the vLLM-only ones) is a 4xx naming the field, and the server is healthy."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from serve_common import HOSTILE, LLAMA, ServerProcess, assert_refused, healthy, tensors
from test_vllm_common import MAX_LEN

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORDS = ["Zebra", "Hello world", "Once upon a time", "def add(a, b):", "The quick brown fox", "A B C D E F",
         "import torch", "In the beginning", "1 2 3 4 5", "Dear Sir or Madam"]
PROMPTS = [f"{w} {i}" for i in range(2) for w in WORDS]  # 20 unrelated prompts
POISON = {"model": LLAMA, "prompt": "Zebra crossing Zebra crossing Zebra crossing", "max_tokens": 40,
          "temperature": 0, "interp": {"steer": [{"address": "value.0", "op": "scale", "value": 3e38}]}}
VLLM_ONLY = [
    ("capture of a prompt that fills max_model_len", "/v1/capture", {"prompt": [5] * MAX_LEN, "interp": {
        "capture": ["resid_post.0"]}}, 400, f"at most {MAX_LEN - 1} tokens", "prompt"),
]
# the list-encoding case needs an overflow downstream of the steered sites, which vLLM would cache
UNSAFE_HERE = ("capture list encoding of inf",)


def _ask(url: str, prompt: str) -> dict:
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "interp": {"capture": {"points": ["resid_post.1"], "reduction": "last"}}}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def _all(url: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        body = lambda p: {"model": LLAMA, "prompt": p, "max_tokens": 8, "temperature": 0,  # noqa: E731
                          "interp": {"capture": {"points": ["resid_post.1"], "reduction": "last"}}}
        rs = await asyncio.gather(*(c.post("/v1/completions", json=body(p)) for p in PROMPTS))
    return [r.json()["choices"][0] for r in rs]


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_poisoning_steer_fails_alone_and_hostile_bodies_are_4xx(backend):
    taps = ("--static-points", "resid_post,value.0,attn_out.1,resid_mid.1") if backend == "vllm-static" else ()
    srv = ServerProcess(LLAMA, "--backend", backend, "--source", "zoo", "--max-model-len", str(MAX_LEN),
                        "--max-num-seqs", "8", *taps)
    try:
        url = srv.wait().url
        assert sum("startup" in ln for ln in srv.lines) == 1, srv.log()  # the load report once (was twice)
        solo = [_ask(url, p) for p in PROMPTS]
        r = httpx.post(f"{url}/v1/completions", json=POISON, timeout=300)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "interp.steer[0]" and "inf or NaN" in err["message"], err
        for got, ref, p in zip(asyncio.run(_all(url)), solo, PROMPTS):
            assert got["text"] == ref["text"] and got["interp"]["token_ids"] == ref["interp"]["token_ids"], p
            a, b = tensors(got["interp"])["resid_post.1"], tensors(ref["interp"])["resid_post.1"]
            assert bool(torch.isfinite(a).all()) and torch.allclose(a, b, atol=1e-4, rtol=1e-4), p
        healthy(url)
        for case in HOSTILE + VLLM_ONLY:
            if case[0] not in UNSAFE_HERE:
                assert_refused(url, case)
        for got, ref in zip(asyncio.run(_all(url)), solo):
            assert got["interp"]["token_ids"] == ref["interp"]["token_ids"]
    finally:
        srv.close()
