"""Issue 34's reproduction on the vLLM servers (slow): no request, whatever it steers, changes another
request's output, and /health tells the truth.

Ten unrelated prompts are answered before; then each attack is a 4xx naming its steers, and the ten
answer exactly as before, alone and while attacks run beside them:
- two finite adds (attn_out.0 and mlp_out.0, 3e38 each) whose sum overflows resid_post.0: before the
  fix layer 1 wrote NaN into a KV block that the next requests were handed (vllm: 10 of 10 prompts
  changed; zeroing the non-finite KV entries restored all 10);
- one add of 3.4e38 at resid_post.0: finite, but no norm after it is defined; on vllm-static its
  coefficients also stayed in the tap buffers and were applied to the next plain requests;
- one add of 3e38 at attn_in.1: finite where it is added, inf in layer 1's q / k / v, which reach its
  KV block before the layer's output is guarded (zeroing the block's inf restored 10 of 10 prompts);
- a benign add at resid_post.0 (vllm-static: the same leak without any overflow).
Both vLLM backends: the layer guard fails a row whose float32 norm overflows, and the KV blocks a
steering request wrote are zeroed before a schedule hands them to another request
(engine/backends/vllm/worker/kv.py)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from serve_common import LLAMA, ServerProcess, healthy
from test_vllm_common import MAX_LEN

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORDS = ["Zebra", "Hello world", "Once upon a time", "def add(a, b):", "The quick brown fox", "A B C D E F",
         "import torch", "In the beginning", "1 2 3 4 5", "Dear Sir or Madam"]
D = 256  # the Llama-3.2-1B twin's hidden size
PAIR = [{"address": "attn_out.0", "op": "add", "value": [3e38] * D},
        {"address": "mlp_out.0", "op": "add", "value": [3e38] * D}]
SINGLE = [{"address": "resid_post.0", "op": "add", "value": [3.4e38] * D}]
INLAYER = [{"address": "attn_in.1", "op": "add", "value": [3e38] * D}]  # finite; layer 1's q / k / v are not
BENIGN = [{"address": "resid_post.0", "op": "add", "value": [50.0] * D}]


def _body(prompt: str, steer: list | None = None, n: int = 8) -> dict:
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": n, "temperature": 0}
    if steer:
        body["interp"] = {"steer": steer}
    return body


async def _answers(c: httpx.AsyncClient) -> list[list[int]]:
    """The ten prompts, concurrently; each answer's token ids (plain requests: no plan, no salt)."""
    rs = await asyncio.gather(*(c.post("/v1/completions", json=_body(p)) for p in WORDS))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    return [r.json()["choices"][0]["text"] for r in rs]


async def _attacked(c: httpx.AsyncClient, steer: list) -> httpx.Response:
    return await c.post("/v1/completions", json=_body("Zebra crossing Zebra crossing", steer, 16))


def _refused(r: httpx.Response) -> None:
    assert r.status_code in (400, 422), f"{r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    assert err["param"].startswith("interp.steer") and "inf or NaN" in err["message"], err


async def _scenario(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        solo = [(await c.post("/v1/completions", json=_body(p))).json()["choices"][0]["text"] for p in WORDS]
        assert await _answers(c) == solo  # batched together they answer as alone (the comparison below)
        for steer in (PAIR, SINGLE, INLAYER):
            _refused(await _attacked(c, steer))
            assert await _answers(c) == solo, steer[0]["address"]
            healthy(url)
        r = await _attacked(c, BENIGN)
        assert r.status_code == 200, r.text
        assert [(await c.post("/v1/completions", json=_body(p))).json()["choices"][0]["text"] for p in WORDS] == solo
        # attacks and unrelated requests in the same steps
        together = await asyncio.gather(_answers(c), *(_attacked(c, s) for s in (PAIR, SINGLE, INLAYER)))
        for r in together[1:]:
            _refused(r)
        assert together[0] == solo
        assert await _answers(c) == solo
    healthy(url)


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_no_attack_changes_another_request(backend):
    taps = ("--static-points", "resid_post,attn_out,mlp_out,attn_in") if backend == "vllm-static" else ()
    srv = ServerProcess(LLAMA, "--backend", backend, "--source", "zoo", "--max-model-len", str(MAX_LEN),
                        "--max-num-seqs", "8", *taps)
    try:
        asyncio.run(_scenario(srv.wait().url))
    finally:
        srv.close()
    srv.assert_clean_exit()  # SIGTERM: old code killed vLLM's engine core after 5 s (leaking its shared memory)
