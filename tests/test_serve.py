"""The server on vLLM, started as a user starts it (`python -m engine.serve`, a subprocess on
127.0.0.1) and called over real HTTP: completions, chat, streams and /v1/capture equal the library's
own results on the same backend (tokens exactly, tensors within float32 noise); 32 concurrent mixed
requests equal their solo runs; the prefix-cache rule holds across requests; every malformed request
gets the right 4xx naming the field, and the server stays healthy; a full queue answers 429.

One server for the module (Llama-3.2-1B zoo twin, max_model_len 256); the library model comes from
test_vllm_common's session cache (test_vllm.py reuses it)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from engine.core.errors import UnsupportedPointError
from engine.core.points import POINTS
from engine.core.results import Receipt, Request
from engine.core.steering import Steer
from engine.serve import encoding
from engine.serve.text import whole_chars  # the server drops a half character at the end, as vLLM does
from serve_common import (
    AUTH,
    CHAT_TEMPLATE,
    KEY,
    LLAMA,
    ServerProcess,
    assert_receipts,
    close,
    healthy,
    joined_rows,
    probe_stop_matches_library,
    stream_lines,
    tensors,
)
from test_vllm_common import MAX_LEN, eager_model, vllm_model

pytestmark = pytest.mark.vllm

PROMPT = "The quick brown fox jumps over the lazy dog"
PROMPTS = [PROMPT, "Hello world, this is a test", "Once upon a time", "def add(a, b):"]
MAX_BODY = 64 << 10
MAX_PENDING = 40


@pytest.fixture(scope="module")
def url():
    srv = ServerProcess(LLAMA, "--backend", "vllm", "--source", "zoo", "--max-model-len", str(MAX_LEN),
                        "--max-num-seqs", "16", "--max-pending", str(MAX_PENDING), "--api-key", KEY,
                        "--max-body-bytes", str(MAX_BODY), "--chat-template", CHAT_TEMPLATE, sigchld_ignored=True)
    try:
        vllm_model(LLAMA)  # the library's engine loads while the server starts
        yield srv.wait().url
    finally:
        srv.close()
    # started with SIGCHLD ignored, old code's vLLM shutdown could not see its children exit (they were
    # reaped unseen) and force-killed its engine core
    srv.assert_clean_exit()


@pytest.fixture(scope="module")
def lib(url):
    return vllm_model(LLAMA)


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=300) as c:
        yield c


def vec(n: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def library(lib, prompt, n: int, points=(), steer=(), **sampling):
    """The library's answer to the same request (greedy unless sampling says otherwise)."""
    req = Request(prompt, n, points, steer, {"temperature": 0.0, "min_tokens": 0, **sampling})
    return lib.generate_batch([req], return_logits=False)[0]


def complete(client, prompt, max_tokens: int = 6, interp=None, path="/v1/completions", **kw) -> dict:
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    if interp is not None:
        body["interp"] = interp
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_matches(choice: dict, ref, what: str = "") -> None:
    """A choice equals a library RequestResult: text, tokens, every capture."""
    blk = choice["interp"]
    assert blk["prompt_token_ids"] == ref.prompt_ids.tolist(), what
    assert blk["token_ids"] == ref.new_tokens.tolist(), what
    assert choice.get("text", choice.get("message", {}).get("content")) == whole_chars(ref.text), what
    got = tensors(blk) if "captures" in blk else {}
    assert set(got) == set(ref.cache), what
    for k in got:
        close(got[k], ref.cache[k], f"{what} {k}")


def test_completion_matches_library(client, lib):
    plain = complete(client, PROMPT, interp={})["choices"][0]
    assert_matches(plain, library(lib, PROMPT, 6), "plain")
    assert plain["finish_reason"] in ("length", "stop")
    assert plain["interp"].keys() == {"prompt_token_ids", "token_ids", "receipts", "text", "cached_tokens", "recomputed"}
    assert plain["interp"]["receipts"] == [] and whole_chars(plain["interp"]["text"]) == plain["text"]  # the library's text
    points = ["resid_post.-1", "z.0.head-1", "attn_probs.0", "mlp_act.1", "embeddings"]
    steer = [Steer("resid_post.0", "add", vec(256, 1)), Steer("z.1.head-2", "scale", 0.0, "generated"),
             Steer("mlp_out.0", "ablate", None, (2, 5))]
    wire = [{"address": "resid_post.0", "op": "add", "value": encoding.encode(vec(256, 1))},
            {"address": "z.1.head-2", "op": "scale", "value": 0.0, "positions": "generated"},
            {"address": "mlp_out.0", "op": "ablate", "positions": [2, 5]}]
    body = complete(client, PROMPT, interp={"capture": {"points": points}, "steer": wire})
    ref = library(lib, PROMPT, 6, points, steer)
    ch = body["choices"][0]
    assert_matches(ch, ref, "steered")
    assert_receipts(ch["interp"]["receipts"], ref.receipts)
    n = len(ref.prompt_ids) + len(ref.new_tokens) - 1
    assert ch["interp"]["positions"] == list(range(n)) and ch["interp"]["reduction"] == "none"
    unsteered = library(lib, PROMPT, 6, ["resid_post.-1"])
    assert not torch.allclose(tensors(ch["interp"])["resid_post.1"], unsteered.cache["resid_post.1"])  # it acted
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_ids), "completion_tokens": 6, "total_tokens":
                             len(ref.prompt_ids) + 6}


def test_receipts_and_strict_by_default(client):
    """Receipts equal eager's on the same weights; a steer at a generated position that a stop token
    keeps generation from reaching fails the request with a 400 naming it (strict is the default),
    comes back with 0 rows with interp.strict false, and ends a stream on the same error."""
    em = eager_model(LLAMA)
    n = len(em.to_tokens(PROMPT)["input_ids"][0])
    steer = [Steer("resid_post.0", "scale", 2.0), Steer("resid_post.1", "add", vec(256, 3), [n + 3])]
    wire = [{"address": "resid_post.0", "op": "scale", "value": 2.0},
            {"address": "resid_post.1", "value": encoding.encode(vec(256, 3)), "positions": [n + 3, n + 4]}]
    full = complete(client, PROMPT, 6, interp={"steer": wire})["choices"][0]["interp"]
    ref = em.generate(PROMPT, 6, steer=steer)
    assert full["token_ids"] == ref.new_tokens[0].tolist()
    assert_receipts(full["receipts"], ref.receipts, rel=1e-3)
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "stop_token_ids": full["token_ids"][:1], "interp": {"steer": wire}}
    r = client.post("/v1/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "interp.steer[1]", r.text
    assert "steer 1 ('add' at resid_post.1) touched no row of this request" in err["message"]
    got = client.post("/v1/completions", json={**body, "interp": {"steer": wire, "strict": False}}).json()
    blk = got["choices"][0]["interp"]
    assert blk["token_ids"] == full["token_ids"][:1]  # stopped: only the prompt ran
    assert_receipts(blk["receipts"], em.run_with_cache(PROMPT, (), steer[:1])[1].receipts + [
        Receipt(1, "resid_post.1", "add", 0, 0.0)], rel=1e-3)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        chunks = stream_lines(resp)
    assert chunks[-1]["error"]["param"] == "interp.steer[1]"
    item = client.post("/v1/capture", json={"prompt": PROMPT,
                                            "interp": {"steer": wire[:1], "capture": ["resid_post.0"]}})
    assert_receipts(item.json()["data"][0]["receipts"], em.run_with_cache(PROMPT, (), steer[:1])[1].receipts, rel=1e-3)
    healthy(str(client.base_url).rstrip("/"))


def test_positions_and_reductions(client, lib):
    ref = library(lib, PROMPT, 5, ["resid_post.1", "z.0"])
    p = len(ref.prompt_ids)
    for positions, reduction, rows in (("last", "none", slice(p - 1, None)), ("generated", "mean", slice(p, None)),
                                       ([1, -1], "last", p - 2), (3, "none", slice(3, 4))):
        cap = {"points": ["resid_post.1", "z.0"], "positions": positions, "reduction": reduction, "encoding": "list"}
        blk = complete(client, PROMPT, 5, {"capture": cap})["choices"][0]["interp"]
        for k, t in tensors(blk).items():
            want = ref.cache[k][rows]
            close(t, want.mean(0) if reduction == "mean" else want, f"{positions}/{reduction} {k}")
        assert blk["reduction"] == reduction and blk["captures"]["z.0"]["data"] and isinstance(
            blk["captures"]["z.0"]["data"], list)


def test_stream_matches_non_stream(client):
    cap = {"capture": {"points": ["resid_post.-1", "z.0"]}, "steer": [{"address": "resid_post.0", "op": "add",
                                                                        "value": vec(256, 2).tolist()}]}
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "interp": cap}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = stream_lines(r)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["text"]
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert last["finish_reason"] == whole["finish_reason"]
    assert last["interp"]["token_ids"] == whole["interp"]["token_ids"]
    pos, rows, carried = joined_rows(chunks)
    assert pos == whole["interp"]["positions"]
    assert carried >= 2, "capture rows came only with the last chunk: not streamed per step"
    for k, t in tensors(whole["interp"]).items():
        close(rows[k], t, k)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_library_stream_rows_and_early_stop(lib):
    """The engine addition the server streams with: AsyncVLLMModel.stream(rows=True) hands out each
    step's capture rows (the forward that produced its token) while generating, all of them once and
    in order; attention patterns (recomputed after the request) only in the result; a sequence that
    stops early still ends with its result."""
    async def collect(**kw):
        return [ev async for ev in lib.aio.stream(PROMPT, 6, **kw)]
    evs = lib._run(collect(points=["resid_post.-1", "z.0", "attn_probs.0"], rows=True))
    res = evs[-1].result
    assert [e.token for e in evs] == res.new_tokens.tolist() and len(evs) == 6
    assert [e.index for e in evs] == list(range(6))
    for k, t in res.cache.items():
        if k.startswith("attn_probs"):
            assert not any(e.rows and k in e.rows for e in evs), k
            continue
        parts = [e.rows[k] for e in evs]
        assert [len(x) for x in parts] == [res.prompt_ids.shape[0]] + [1] * 5, k
        assert torch.equal(torch.cat(parts), t), k
    first = res.new_tokens[0].item()
    early = lib._run(collect(stop_token_ids=[first], min_tokens=0, temperature=0.0))
    assert [e.token for e in early] == [first] and early[-1].result.new_tokens.tolist() == [first]


def test_capture_endpoint_matches_library(client, lib):
    points = ["resid_post", "attn_scores.1.head-0", "q.0", "final_norm"]
    steer = [Steer("mlp_out.0", "ablate", None, (1, 4))]
    r = client.post("/v1/capture", json={"prompt": PROMPTS[:2], "return_logits": True, "interp": {
        "capture": {"points": points}, "steer": [{"address": "mlp_out.0", "op": "ablate", "positions": [1, 4]}]}})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    for i, prompt in enumerate(PROMPTS[:2]):
        logits, cache = lib.run_with_cache(prompt, points, steer)
        got = tensors(data[i])
        assert set(got) == set(cache) and data[i]["positions"] == list(range(cache["q.0"].shape[1]))
        for k in got:
            close(got[k], cache[k][0], f"prompt {i} {k}")
        close(encoding.decode(data[i]["logits"]), logits[0], "logits")


def test_chat_and_openai_client(url, lib):
    from openai import AuthenticationError, OpenAI
    oc = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert LLAMA in [m.id for m in oc.models.list().data]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]
    r = oc.chat.completions.create(model=LLAMA, messages=messages, max_tokens=5, temperature=0,
                                   extra_body={"interp": {"capture": ["resid_post.-1"]}})
    tok = lib.tokenizer
    rendered = tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
                                       tokenize=False)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    ref = library(lib, ids, 5, ["resid_post.-1"])
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == whole_chars(ref.text)
    blk = choice.model_extra["interp"]
    assert blk["prompt_token_ids"] == ids and blk["token_ids"] == ref.new_tokens.tolist()
    close(tensors(blk)["resid_post.1"], ref.cache["resid_post.1"], "chat capture")
    plain = library(lib, PROMPT, 6)
    plain_text = oc.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    assert plain_text == whole_chars(plain.text)
    streamed = oc.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole_chars(plain.text)
    chat_stream = oc.chat.completions.create(model=LLAMA, messages=messages, max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == whole_chars(ref.text)
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(model=LLAMA, prompt="x")


def test_prefix_cache_rule(client, lib):
    """A steered request never reuses an unsteered prefix, and never leaves its own for others."""
    prompt = "Steering vectors are added to the residual stream of the model"
    base = complete(client, prompt, 6, {})["choices"][0]["interp"]["token_ids"]  # now in the prefix cache
    steer = [{"address": "resid_post.0", "op": "add", "value": vec(256, 3, 50.0).tolist()}]
    steered = complete(client, prompt, 6, {"steer": steer, "capture": ["resid_post.0"]})["choices"][0]["interp"]
    assert steered["token_ids"] != base, "the steer had no effect on a prompt already in the prefix cache"
    ref = library(lib, prompt, 6, ["resid_post.0"], [Steer("resid_post.0", "add", vec(256, 3, 50.0))])
    close(tensors(steered)["resid_post.0"], ref.cache["resid_post.0"], "steered rows")
    assert complete(client, prompt, 6, {})["choices"][0]["interp"]["token_ids"] == base


def test_client_leaving_a_stream_frees_its_slot(client):
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 100, "min_tokens": 100, "temperature": 0, "stream": True,
            "interp": {"capture": ["resid_post.-1"]}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    deadline = time.monotonic() + 60
    while client.get("/health").json()["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.get("/health").json()["queue_depth"] == 0
    assert complete(client, PROMPT, 3, {})["choices"][0]["interp"]["token_ids"]  # and it serves on


def _mixed(i: int) -> dict:
    """Request i of the concurrent mix: plain, capturing, steering, sampled; some streamed."""
    prompt = PROMPTS[i % len(PROMPTS)]
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": 3 + i % 4, "temperature": 0, "interp": {}}
    kind = i % 4
    if kind in (1, 2):
        body["interp"]["capture"] = {"points": [["resid_post.-1"], ["z.0.head-1", "mlp_out.1"], ["attn_probs.1"],
                                                ["resid_mid.0", "q.1"]][i // 4 % 4]}
    if kind == 2:
        op = ["add", "scale", "ablate", "project_out"][i // 4 % 4]
        s = {"address": f"resid_post.{i % 2}", "op": op, "positions": ["all", "last", [1, 3], "generated"][i // 8 % 4]}
        if op in ("add", "project_out"):
            s["value"] = vec(256, i, 10.0).tolist()
        elif op == "scale":
            s["value"] = 0.5
        body["interp"]["steer"] = [s]
    if kind == 3:
        body.update(temperature=0.9, seed=1000 + i, top_p=0.95)
    if i % 5 == 0:
        body["stream"] = True
    return body


async def _send(client: httpx.AsyncClient, body: dict) -> dict:
    """The answer as (status, text, token ids, captures) whether streamed or not."""
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.json()["error"]}
        ch = r.json()["choices"][0]
        return {"status": 200, "text": ch["text"], "tokens": ch["interp"]["token_ids"],
                "captures": tensors(ch["interp"]) if "captures" in ch["interp"] else {}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    _, rows, _ = joined_rows(chunks)
    return {"status": r.status_code, "text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
            "tokens": last["interp"]["token_ids"], "captures": rows}


def test_32_concurrent_mixed_requests_equal_solo(url):
    bodies = [_mixed(i) for i in range(32)]
    bad = [{"model": LLAMA, "prompt": PROMPT, "interp": {"steer": [{"address": "resid_post.0", "value": [1.0]}]}},
           {"model": LLAMA, "prompt": PROMPT, "interp": {"capture": ["mlp_pre.1"]}}]

    async def run(items, together: bool):
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300) as c:
            if together:
                return await asyncio.gather(*(_send(c, b) for b in items))
            return [await _send(c, b) for b in items]
    together = asyncio.run(run(bodies + bad, True))
    solo = asyncio.run(run(bodies, False))
    assert [t["status"] for t in together[32:]] == [400, 400]
    for i, (a, b) in enumerate(zip(together, solo)):
        assert a["status"] == b["status"] == 200, (i, a, b)
        assert a["tokens"] == b["tokens"] and a["text"] == b["text"], (i, bodies[i])
        assert set(a["captures"]) == set(b["captures"]), i
        for k in a["captures"]:
            close(a["captures"][k], b["captures"][k], f"request {i} {k}")
    healthy(url)


BIG = {"model": LLAMA, "prompt": "x" * (MAX_BODY + 10)}
CASES = [
    # (name, method, path, body, headers, status, message fragment, param)
    ("malformed json", "POST", "/v1/completions", b'{"model": "x", "prompt": ', AUTH, 400, "not valid JSON", None),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", AUTH, 400, "must be a JSON object", None),
    ("empty body", "POST", "/v1/completions", b"", AUTH, 400, "request body is empty", None),
    ("unknown field", "POST", "/v1/completions", {"prompt": "hi", "max_tokns": 3}, AUTH, 400, "unknown field",
     "max_tokns"),
    ("missing model", "POST", "/v1/completions", {"prompt": "hi", "model": None}, AUTH, 400, "model", "model"),
    ("unknown point", "POST", "/v1/completions", {"prompt": "hi", "interp": {"capture": ["resid_pots.0"]}}, AUTH,
     400, "unknown point 'resid_pots'. Did you mean 'resid_post'", "interp.capture.points[0]"),
    ("layer out of range", "POST", "/v1/completions", {"prompt": "hi", "interp": {"capture": ["z.0", "resid_post.7"]}},
     AUTH, 400, "out of range", "interp.capture.points[1]"),
    ("point vLLM cannot serve", "POST", "/v1/completions", {"prompt": "hi", "interp": {"capture": ["mlp_pre.0"]}}, AUTH,
     400, "fuses gate and up", "interp.capture.points[0]"),
    ("steer width", "POST", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.0", "value": [1.0, 2.0]}]}}, AUTH, 400, "per-position shape is (256,)",
     "interp.steer[0]"),
    ("steer width (base64)", "POST", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "z.0.head-1", "value": encoding.encode(torch.ones(256))}]}}, AUTH, 400,
     "per-position shape is (64,)", "interp.steer[0]"),
    ("steer op", "POST", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.0", "op": "nudge", "value": [1.0]}]}}, AUTH, 400, "unknown steering op 'nudge'",
     "interp.steer[0]"),
    ("steer without value", "POST", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.0"}]}}, AUTH, 400, "needs a value", "interp.steer[0]"),
    ("ragged steer value", "POST", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "z.0", "value": [[1.0], [1.0, 2.0]]}]}}, AUTH, 400, "rectangular", "interp.steer[0].value"),
    ("bad base64", "POST", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "resid_post.0", "value": {"dtype": "float32", "shape": [256], "data": "!!"}}]}}, AUTH, 400,
     "not valid base64", "interp.steer[0].value"),
    ("steer position", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "interp": {"steer": [
        {"address": "resid_post.0", "op": "ablate", "positions": 500}]}}, AUTH, 400, "position 500 matches no token",
     "interp.steer[0]"),
    ("steer a capture-only point", "POST", "/v1/completions", {"prompt": "hi", "interp": {"steer": [
        {"address": "attn_probs.0", "op": "ablate"}]}}, AUTH, 400, "capture only", "interp.steer[0]"),
    ("capture positions", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "interp": {"capture": {
        "points": ["z.0"], "positions": "generated"}}}, AUTH, 400, "matches no token", "interp.capture.positions"),
    ("reduction", "POST", "/v1/completions", {"prompt": "hi", "interp": {"capture": {
        "points": ["z.0"], "reduction": "max"}}}, AUTH, 400, "'none', 'last' or 'mean'", "interp.capture.reduction"),
    ("prompt too long", "POST", "/v1/completions", {"prompt": [5] * 300}, AUTH, 400, "longer than the 256 positions",
     "prompt"),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, AUTH, 400, "is empty", "prompt"),
    ("token out of vocab", "POST", "/v1/completions", {"prompt": [[1, 2], [1, 99999]]}, AUTH, 400,
     "token id 99999 at position 1", "prompt[1]"),
    ("max_tokens over the context", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1000}, AUTH, 400,
     "exceed the 256 positions", "max_tokens"),
    ("n", "POST", "/v1/completions", {"prompt": "hi", "n": 2}, AUTH, 400, "only n=1", "n"),
    ("negative temperature", "POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, AUTH, 400,
     "greater than or equal to 0", "temperature"),
    ("logprobs", "POST", "/v1/completions", {"prompt": "hi", "logprobs": 2}, AUTH, 400, "not supported", "logprobs"),
    ("wrong model", "POST", "/v1/completions", {"prompt": "hi", "model": "gpt-4"}, AUTH, 404, "not served here",
     "model"),
    ("chat role", "POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, AUTH, 400,
     "'system', 'developer', 'user' or 'assistant'", "messages[0].role"),
    ("capture nothing", "POST", "/v1/capture", {"prompt": "hi", "interp": {}}, AUTH, 400, "nothing to return",
     "interp.capture"),
    ("oversize body", "POST", "/v1/completions", BIG, AUTH, 413, "over this server's limit of 65536 bytes", None),
    ("no key", "POST", "/v1/completions", {"prompt": "hi"}, {}, 401, "missing API key", None),
    ("wrong key", "POST", "/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer nope"}, 401,
     "invalid API key", None),
    ("metrics need the key", "GET", "/metrics", None, {}, 401, "missing API key", None),
    ("GET on a POST route", "GET", "/v1/completions", None, AUTH, 405, "GET is not allowed", None),
    ("no such route", "POST", "/v1/embeddings", {"input": "hi"}, AUTH, 404, "no endpoint /v1/embeddings", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_its_4xx(url, case):
    name, method, path, body, headers, status, fragment, param = case
    if isinstance(body, dict):
        body = json.dumps({"model": LLAMA, **body} if "model" not in body else
                          {k: v for k, v in body.items() if v is not None}).encode()
    r = httpx.request(method, f"{url}{path}", content=body, headers={"content-type": "application/json", **headers},
                      timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"], err["message"]
    assert err["param"] == param and err["code"] == status
    healthy(url)


def test_full_queue_answers_429(url):
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 32, "min_tokens": 32, "temperature": 0}

    async def flood():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300,
                                     limits=httpx.Limits(max_connections=200)) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(2 * MAX_PENDING + 20)))
    rs = asyncio.run(flood())
    codes = [r.status_code for r in rs]
    assert set(codes) == {200, 429}, codes
    refused = next(r for r in rs if r.status_code == 429)
    assert "queue is full" in refused.json()["error"]["message"] and refused.headers["retry-after"] == "1"
    healthy(url)
    metrics = httpx.get(f"{url}/metrics", headers=AUTH).text
    assert "interp_queue_depth 0\n" in metrics
    assert f"interp_rejected_total {codes.count(429)}\n" in metrics


def test_points_table_and_metrics(client, lib):
    table = client.get("/v1/points").json()
    assert (table["model"], table["backend"], table["n_layers"], table["d_model"]) == (LLAMA, "vllm", 2, 256)
    assert [p["name"] for p in table["points"]] == [p.name for p in POINTS]
    by = {p["name"]: p for p in table["points"]}
    assert by["resid_post"]["served"] and by["resid_post"]["layers"] == [0, 1] and by["resid_post"]["steerable"]
    assert by["resid_post"]["per_token_shape"] == [256] and by["z"]["per_token_shape"] == [4, 64]
    assert by["attn_probs"]["how"] == "recompute" and not by["attn_probs"]["steerable"]
    with pytest.raises(UnsupportedPointError) as e:
        lib.address("mlp_pre.0")
    assert not by["mlp_pre"]["served"] and by["mlp_pre"]["refused"] == str(e.value)
    text = client.get("/metrics").text
    for line in ('interp_requests_total{route="/v1/completions",status="200"}', "interp_generation_tokens_total",
                 "interp_prompt_tokens_total", "interp_capture_bytes_total", "interp_queue_depth 0"):
        assert line in text, line
    served = float(next(ln.split()[-1] for ln in text.splitlines()
                        if ln.startswith('interp_requests_total{route="/v1/completions",status="200"}')))
    assert served >= 1 and client.get("/health").json()["queue_depth"] == 0


def test_readme_openai_example_runs(url, capsys, monkeypatch):
    """The README's `openai` example (block serve-openai), as written, against this server: the reader's variables
    point it there."""
    from scripts import readme_blocks
    code = readme_blocks.get("serve-openai").code()
    monkeypatch.setenv("INTERP_URL", url)
    monkeypatch.setenv("INTERP_API_KEY", KEY)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    # positions "last": the last prompt token, then the 7 generated tokens fed back
    assert "resid_post.1 (8, 256)" in out and "z.0.head-1 (8, 64)" in out
    assert out.count("[") >= 3


def test_a_streamed_completion_stops_at_the_first_token_whose_probe_crosses(client, lib):
    """interp.stop on vLLM: the probe is computed in the worker and read per token while the request
    runs; the stream ends (the request is aborted) at the first crossing, as the library computes it."""
    probe_stop_matches_library(client, lib, vec(256, 11, 1.0))
