"""The server on the eager backend (a subprocess, real HTTP): generation, streams and /v1/capture
equal the library's EagerModel on the same zoo weights; eager's own refusals (stop strings, a steer's
width, checked before the call) are 400s naming the field; seeded sampling repeats."""
from __future__ import annotations

import httpx
import pytest
import torch

from engine.core.steering import Steer
from engine.serve import encoding
from serve_common import LLAMA, assert_receipts, close, eager_server, healthy, joined_rows, stream_lines, tensors
from test_vllm_common import eager_model

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def url():
    with eager_server() as u:
        yield u


@pytest.fixture(scope="module")
def lib(url):
    return eager_model(LLAMA)


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


def test_generation_matches_library(client, lib):
    m = lib.config.intermediate_size
    v = torch.randn(m, generator=torch.Generator().manual_seed(0)) * 3
    points = ["resid_post.-1", "mlp_pre.0", "attn_probs.1", "lm_head"]
    ref = lib.generate(PROMPT, 5, points, [Steer("mlp_pre.0", "add", v, "last")]).requests[0]
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "interp": {
        "capture": {"points": points}, "steer": [{"address": "mlp_pre.0", "value": encoding.encode(v),
                                                  "positions": "last"}]}}
    ch = client.post("/v1/completions", json=body).json()["choices"][0]
    assert ch["text"] == ref.text and ch["interp"]["token_ids"] == ref.new_tokens.tolist()
    assert ch["finish_reason"] == "length"
    got = tensors(ch["interp"])
    assert set(got) == set(ref.cache)
    for k in got:
        close(got[k], ref.cache[k], k, atol=1e-5, rtol=1e-5)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = stream_lines(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    # one chunk per token, as vLLM's own server sends, also where a token adds no text (old code dropped those)
    assert len(chunks) == 5 and [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    pos, rows, _ = joined_rows(chunks)
    assert pos == ch["interp"]["positions"]
    for k in got:
        close(rows[k], got[k], f"stream {k}", atol=1e-5, rtol=1e-5)


def test_capture_matches_library(client, lib):
    points = ["z.1.head-0", "resid_mid.0", "attn_scores.0"]
    logits, cache = lib.run_with_cache(PROMPT, points, [Steer("resid_post.0", "scale", 0.5)])
    r = client.post("/v1/capture", json={"prompt": PROMPT, "return_logits": True, "interp": {
        "capture": {"points": points, "positions": "last", "reduction": "last"},
        "steer": [{"address": "resid_post.0", "op": "scale", "value": 0.5}]}})
    item = r.json()["data"][0]
    assert item["positions"] == [cache["z.1.head-0"].shape[1] - 1]
    for k, t in tensors(item).items():
        close(t, cache[k][0, -1], k, atol=1e-5, rtol=1e-5)
    close(encoding.decode(item["logits"]), logits[0, -1], "logits", atol=1e-5, rtol=1e-5)


def test_eager_refusals_and_seeded_sampling(client, lib):
    r = client.post("/v1/completions", json={"model": LLAMA, "prompt": "hi", "interp": {"steer": [
        {"address": "mlp_act.1", "value": [1.0, 2.0]}]}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "interp.steer[0]"
    assert f"per-position shape is ({lib.config.intermediate_size},)" in err["message"]
    r = client.post("/v1/completions", json={"model": LLAMA, "prompt": "hi", "stop": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and "backend 'eager'" in r.text
    r = client.post("/v1/completions", json={"model": LLAMA, "prompt": "hi", "min_p": 0.1})  # not an engine knob
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p" and "backend 'eager'" in r.text
    greedy = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "top_p": 0.5, "top_k": -1}
    assert client.post("/v1/completions", json=greedy).status_code == 200  # greedy ignores top_p / top_k
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 7, "interp": {}}
    a, b = (client.post("/v1/completions", json=body).json()["choices"][0]["interp"]["token_ids"] for _ in range(2))
    assert a == b
    table = client.get("/v1/points").json()
    by = {p["name"]: p for p in table["points"]}
    assert by["mlp_pre"]["served"] and by["mlp_pre"]["per_token_shape"] == [lib.config.intermediate_size]
    healthy(client.base_url.__str__().rstrip("/"))


def test_receipts_and_strict_by_default(client, lib):
    """Each response says what every steer did (the library's receipts); a steer that touched no row
    (HF computes only the last prompt token's logits while generating) fails the request with a 400
    naming it, unless interp.strict is false; a stream ends on the same error."""
    v = torch.randn(lib.config.vocab_size, generator=torch.Generator().manual_seed(1))
    steer = [Steer("resid_post.0", "scale", 2.0, "last"), Steer("lm_head", "add", v, 0)]
    wire = [{"address": "resid_post.0", "op": "scale", "value": 2.0, "positions": "last"},
            {"address": "lm_head", "value": encoding.encode(v), "positions": 0}]
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "interp": {"steer": wire[:1]}}
    ch = client.post("/v1/completions", json=body).json()["choices"][0]
    assert_receipts(ch["interp"]["receipts"], lib.generate(PROMPT, 4, steer=steer[:1]).receipts)
    assert ch["interp"]["receipts"][0]["rows"] == 4
    r = client.post("/v1/completions", json={**body, "interp": {"steer": wire}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "interp.steer[1]", r.text
    assert "steer 1 ('add' at lm_head) touched no row" in err["message"]
    ch = client.post("/v1/completions", json={**body, "interp": {"steer": wire, "strict": False}}).json()["choices"][0]
    assert_receipts(ch["interp"]["receipts"], lib.generate(PROMPT, 4, steer=steer).receipts)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "interp": {"steer": wire}}) as resp:
        chunks = stream_lines(resp)
    assert chunks[-1]["error"]["param"] == "interp.steer[1]"
    item = client.post("/v1/capture", json={"prompt": PROMPT, "return_logits": True,
                                            "interp": {"steer": wire}}).json()["data"][0]
    assert_receipts(item["receipts"], lib.run_with_cache(PROMPT, (), steer)[1].receipts)  # a forward reaches 0
