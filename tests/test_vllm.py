"""backend="vllm" (hooks in vLLM's workers, engine core in its own process) and "vllm-generate", against eager on the
same zoo weights. One engine per model for the module; three families in the default run (Llama,
GPT-2 with chunked prefill and a tiny KV cache, Gemma-2 sandwich norms); more in
tests/test_vllm_families.py (slow)."""
from __future__ import annotations

import os

import pytest
import torch

from engine.backends.vllm.backend import Request
from engine.core.errors import AddressError, SteeringError, UnsupportedPointError
from engine.core.points import backend_status
from engine.core.steering import Steer
from test_vllm_common import (
    MAX_LEN,
    PROMPT,
    PROMPTS,
    assert_steer_acts,
    check,
    decode_failures,
    drop,
    eager_model,
    prefill_failures,
    random_vector,
    shared_points,
    vllm_model,
)

pytestmark = pytest.mark.vllm

LLAMA, GPT2, GEMMA2 = "meta-llama/Llama-3.2-1B", "openai-community/gpt2", "google/gemma-2-2b"
# GPT-2 runs with a 48-token step budget (prompts are prefilled in chunks) and a KV cache of three
# 128-token blocks (requests that outgrow one block get preempted and recomputed).
GPT2_KW = dict(max_num_batched_tokens=48, kv_cache_memory_bytes=3 * 128 * 2048)
KW = {LLAMA: {}, GPT2: GPT2_KW, GEMMA2: {}}
# Gemma-2 (sliding windows, soft-capped scores) starts a third engine: the slow step (CI) runs it, and the
# default run keeps under 10 minutes; the published vllm column covers every zoo family's prefill and decode
TWIN_GEMMA2 = pytest.param(GEMMA2, marks=pytest.mark.slow, id=GEMMA2)
LONG = " ".join(["the quick brown fox jumps over the lazy dog and"] * 8)  # ~136 tokens: > one KV block


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(name):
        if name not in made:
            made[name] = vllm_model(name, **KW[name])
        return made[name]
    yield get
    for m in made.values():
        if m.name != LLAMA:  # the default Llama engine is shared with other modules for the session
            drop(m)


@pytest.mark.parametrize("name", [LLAMA, GPT2, TWIN_GEMMA2])
def test_prefill_every_point_matches_eager(engines, name):
    vm, em = engines(name), eager_model(name)
    points = shared_points(vm, em)
    assert {"resid_post", "attn_out", "mlp_out", "z", "mlp_act", "resid_mid", "final_norm", "q", "k", "value",
            "attn_scores", "attn_probs"} <= set(points)
    assert prefill_failures(vm, em, points=points) == {}
    assert prefill_failures(vm, em, points=["attn_scores.0.head-1", "attn_probs.-1", "q.0.head-0"]) == {}
    # past the zoo twins' sliding windows (16 tokens): the recomputed scores carry the window mask
    assert prefill_failures(vm, em, prompt=LONG, points=["resid_post", "attn_scores", "attn_probs", "z"]) == {}


@pytest.mark.parametrize("name", [LLAMA, GPT2, TWIN_GEMMA2])
def test_decode_capture_and_steer_match_eager(engines, name):
    vm, em = engines(name), eager_model(name)
    points = shared_points(vm, em)
    assert decode_failures(vm, em, points) == {}
    steer = [Steer("resid_post.0", "add", random_vector((vm.d_model,)))]
    assert decode_failures(vm, em, ["resid_post.-1"], steer=steer) == {}
    assert_steer_acts(vm, PROMPT, steer)


def _steers(vm):
    """One steer per op and per kind of position, at points of every site kind."""
    d, (heads, hd), m = vm.d_model, vm.point_shape(vm.address("z.0")), vm.point_shape(vm.address("mlp_act.1"))
    v = random_vector((d,), 1)
    return [
        Steer("resid_post.1", "add", v),
        Steer("mlp_out.0", "scale", 0.0, "generated"),
        Steer("z.1.head-2", "set", random_vector((hd,), 2), "last"),
        Steer("z.0", "add", random_vector((heads, hd), 3), slice(2, 5)),
        Steer("attn_out.0", "ablate", None, (1, 4)),
        Steer("resid_mid.0", "mean_ablate", random_vector((d,), 4, 1.0), 3),
        Steer("resid_post.0", "project_out", v),
        Steer("mlp_act.1", "add", random_vector(m, 5), "last"),
        Steer("embeddings", "add", v, "all"),
        Steer("attn_in.1", "scale", 3.0),
    ]


@pytest.mark.parametrize("i", range(10))
def test_each_op_and_position_matches_eager(engines, i):
    vm, em = engines(LLAMA), eager_model(LLAMA)
    st = _steers(vm)[i]
    assert decode_failures(vm, em, ["final_norm", str(st.address.base)], steer=[st]) == {}
    assert_steer_acts(vm, PROMPT, [st])


def _batch(vm):
    """Eight requests with different prompts, lengths, captures and steers."""
    d = vm.d_model
    words = PROMPT.split()
    return [
        Request(" ".join(words[: 3 + i]), 3 + i % 4,
                points=[["resid_post.1"], ["z.0.head-1", "mlp_out.1"], [], ["resid_post"], ["attn_out.0"],
                        ["final_norm"], ["mlp_act.0", "resid_mid.1"], ["embeddings"]][i],
                steer=[[], [Steer("resid_post.0", "add", random_vector((d,), i))], [Steer("mlp_out.1", "scale", 2.0)],
                       [], [Steer("z.1.head-0", "ablate", None, "generated")], [Steer("resid_post.1", "add",
                       random_vector((d,), 9), "last")], [], [Steer("attn_out.1", "add", random_vector((d,), 7))]][i])
        for i in range(8)]


@pytest.mark.parametrize("name", [LLAMA, GPT2])
def test_eight_concurrent_requests_match_their_solo_runs(engines, name):
    vm = engines(name)
    reqs = _batch(vm)
    together = vm.generate_batch(reqs)
    for req, got in zip(reqs, together):
        solo = vm.generate_batch([req])[0]
        assert torch.equal(got.new_tokens, solo.new_tokens), req
        check(got.logits[None], solo.logits[None], "lm_head", what=f"logits of {req.prompt!r}")
        assert set(got.cache) == set(solo.cache)
        for k in solo.cache:
            check(got.cache[k][None], solo.cache[k][None], k.split(".")[0], what=f"{k} of {req.prompt!r}")


def test_chunked_prefill_and_preemption_keep_captures_exact(engines):
    """GPT-2 engine: 48-token steps split a long prompt over several forwards, and three requests
    that outgrow their KV block force the scheduler to preempt and recompute one."""
    vm, em = engines(GPT2), eager_model(GPT2)
    ids = vm._prompt_ids(LONG)[:118]
    assert decode_failures(vm, em, ["resid_post", "z.1"], prompt=LONG, n=3) == {}
    le, ce = em.run_with_cache(torch.tensor([ids]), ["resid_post.1", "attn_out.0"])
    lv, cv = vm.run_with_cache([ids], ["resid_post.1", "attn_out.0"])
    check(cv["resid_post.1"], ce["resid_post.1"], "resid_post")
    check(cv["attn_out.0"], ce["attn_out.0"], "attn_out")
    reqs = [Request(ids[:116 + i], 24, points=["resid_post.1"]) for i in range(3)]
    res = vm.generate_batch(reqs)
    assert sum(r.recomputed for r in res) > 0, "no request was preempted: the scenario did not trigger"
    for req, r in zip(reqs, res):
        ref = em.generate(torch.tensor([req.prompt]), 24, points=["resid_post.1"])
        assert torch.equal(r.new_tokens, ref.new_tokens[0])
        check(r.cache["resid_post.1"][None], ref.cache["resid_post.1"], "resid_post", case="decode")


def test_prefix_cache_never_serves_a_steered_prefix(engines):
    vm, em = engines(LLAMA), eager_model(LLAMA)
    prompt = "A unique long prompt for the cache test: " + LONG
    steer = [Steer("resid_post.0", "add", random_vector((vm.d_model,), 11))]
    steered = vm.generate(prompt, 4, points=["resid_post.0"], steer=steer)
    assert steered.requests[0].cached_tokens == 0
    plain = vm.generate(prompt, 4)
    ref = em.generate(prompt, 4)
    assert torch.equal(plain.new_tokens, ref.new_tokens)
    check(plain.logits, ref.logits, "lm_head", case="decode")
    assert not torch.equal(steered.new_tokens, plain.new_tokens) or \
        float((steered.logits - plain.logits).abs().max()) > 1e-2
    again = vm.generate(prompt, 4)
    assert again.requests[0].cached_tokens >= 128, "prefix caching is off: the test proves nothing"
    assert torch.equal(again.new_tokens, ref.new_tokens)
    # the prefix the plain requests share is cached now: a steered request still computes every position
    resteered = vm.generate(prompt, 4, steer=steer)
    assert resteered.requests[0].cached_tokens == 0
    assert torch.equal(resteered.new_tokens, steered.new_tokens)
    check(resteered.logits, steered.logits, "lm_head", case="decode")
    captured = vm.generate(prompt, 2, points=["resid_post.0"])  # a capture after cached runs: full length
    n = len(vm._prompt_ids(prompt))
    assert captured.cache["resid_post.0"].shape[1] == n + 1


def test_run_with_cache_pads_like_eager(engines):
    """Prompts of different lengths come back as one left-padded batch, as eager's: each row's real
    positions equal the prompt run alone, padded positions hold 0."""
    vm, em = engines(LLAMA), eager_model(LLAMA)
    lv, cv = vm.run_with_cache(PROMPTS, ["resid_post.1", "attn_probs.0"])
    le, ce = em.run_with_cache(PROMPTS, ["resid_post.1", "attn_probs.0"])
    lengths = [len(vm._prompt_ids(p)) for p in PROMPTS]
    width = max(lengths)
    assert lv.shape == le.shape == (2, width, lv.shape[-1]) and cv["resid_post.1"].shape[:2] == (2, width)
    for key in ("resid_post.1", "attn_probs.0"):
        check(cv[key], ce[key], key.split(".")[0])
    check(lv, le, "lm_head")
    for i, p in enumerate(PROMPTS):
        ls, cs = vm.run_with_cache(p, ["resid_post.1"])
        real = slice(width - lengths[i], width)
        check(cv["resid_post.1"][i:i + 1, real], cs["resid_post.1"], "resid_post")
        check(lv[i:i + 1, real], ls, "lm_head")
        assert cv["resid_post.1"][i, :width - lengths[i]].abs().max() == 0 if lengths[i] < width else True


def test_generate_pads_tokens_like_eager_when_the_tokenizer_has_no_pad(engines):
    """A tokenizer with no pad token pads with its EOS on every backend (engine/core/tokens.pad_id, which the
    server hands the remote client too). The vLLM client padded with 0 until 2026-12-05, or with EOS once
    some earlier call had set the pad: the same request's tokens depended on the calls before it."""
    vm, em = engines(LLAMA), eager_model(LLAMA)
    saved = vm.tokenizer.pad_token, em.tokenizer.pad_token
    try:
        vm.tokenizer.pad_token = em.tokenizer.pad_token = None
        gv, ge = vm.generate(PROMPTS, 3), em.generate(PROMPTS, 3)
    finally:
        vm.tokenizer.pad_token, em.tokenizer.pad_token = saved
    eos = em.tokenizer.eos_token_id
    assert eos not in (None, 0) and torch.equal(gv.attention_mask, ge.attention_mask)
    pads = gv.attention_mask == 0
    assert pads.any() and (gv.tokens[pads] == eos).all(), gv.tokens
    assert torch.equal(gv.tokens, ge.tokens)


def test_logit_lens_and_steering_context_match_eager(engines):
    vm, em = engines(LLAMA), eager_model(LLAMA)
    _, cv = vm.run_with_cache(PROMPT, ["resid_post.1", "final_norm"])
    _, ce = em.run_with_cache(PROMPT, ["resid_post.1", "final_norm"])
    check(vm.logit_lens((cv, "resid_post.1")), em.logit_lens((ce, "resid_post.1")), "lm_head")
    check(vm.logit_lens(cv["final_norm"], "final_norm"), em.logit_lens(ce["final_norm"], "final_norm"), "lm_head")
    st = Steer("resid_post.1", "add", random_vector((vm.d_model,), 5))
    with vm.steering(st), em.steering(st):
        gv, ge = vm.generate(PROMPT, 4), em.generate(PROMPT, 4)
    assert torch.equal(gv.new_tokens, ge.new_tokens)
    check(gv.logits, ge.logits, "lm_head", case="decode")
    assert vm._context_steers() == ()


def test_a_coordinate_counted_from_the_end_is_read_as_asked(engines):
    """Issue 48's validator found it: 'q.0.head--4' on vLLM was captured as head 0 and stored as 'q.0.head-0',
    so the cache raised KeyError for the key asked; eager kept the asked key. Every call keys it as asked."""
    vm, em = engines(LLAMA), eager_model(LLAMA)
    n = vm.config.num_attention_heads
    asked = [f"q.-2.head--{n}", "z.0.head--1", f"z.0.head-{n - 1}"]
    _, cv = vm.run_with_cache(PROMPT, asked)
    _, ce = em.run_with_cache(PROMPT, asked)
    assert sorted(cv) == sorted(ce) == sorted(["q.0.head--4", "z.0.head--1", "z.0.head-3"])
    for a in asked:
        check(cv[a], ce[a], a.split(".")[0])
    torch.testing.assert_close(cv["z.0.head--1"], cv[f"z.0.head-{n - 1}"], rtol=0, atol=0)
    gv, ge = vm.generate(PROMPT, 3, points=asked[:2]), em.generate(PROMPT, 3, points=asked[:2])
    for a in asked[:2]:
        check(gv.cache[a], ge.cache[a], a.split(".")[0], case="decode")
    steps = list(vm.stream(PROMPT, 3, points=["z.0.head--1"]))
    assert all("z.0.head--1" in s.rows for s in steps) and "z.0.head--1" in steps[-1].result.cache


def test_load_report(engines):
    vm = engines(LLAMA)
    r = vm.load_report
    assert vm.startup_s > 0 and vm.kv_cache_bytes > 0 and r.kv_cache_tokens >= 256
    assert vm.tap_buffer_bytes == 0 and not r.compiled
    assert "KV cache" in r.line() and "startup" in r.line()
    # CPU defaults as they always were (max_model_len as the fixture set it), each with its reason
    s = r.sizing
    assert (s.device_type, s.dtype, s.max_model_len, s.max_num_seqs) == ("cpu", "float32", MAX_LEN, 8)
    assert s.why["dtype"] == "the CPU default" and s.why["max_model_len"] == "set by the caller"
    assert vm.aio.engine.vllm_config.model_config.dtype == torch.float32
    assert r.runner.startswith("model runner: V1 (VLLM_USE_V2_MODEL_RUNNER=0") and r.runner in r.line()
    assert "max_num_seqs 8 (the CPU default)" in r.line()


def test_refusals_name_the_reason(engines):
    vm = engines(LLAMA)
    for point in ("lm_head", "mlp_pre", "q_norm_in", "router_logits", "attn_gate", "resid_streams"):
        reason = backend_status(point, "vllm")[1]
        with pytest.raises(UnsupportedPointError, match="cannot be served by backend 'vllm'") as e:
            vm.run_with_cache(PROMPT, [f"{point}.0" if point not in ("lm_head",) else point])
        assert reason in str(e.value)
    with pytest.raises(SteeringError, match="recomputed from q and k after the forward"):
        vm.generate(PROMPT, 2, steer=[Steer("attn_probs.0", "scale", 2.0)])
    with pytest.raises(UnsupportedPointError, match="no post-attention sandwich norm"):
        vm.address("attn_out_post.0")
    with pytest.raises(AddressError, match="out of range"):
        vm.address("resid_post.99")
    with pytest.raises(AddressError, match="head 99 is out of range"):
        vm.address("z.0.head-99")
    with pytest.raises(AddressError, match="unknown point"):
        vm.address("resid_psot.0")
    with pytest.raises(SteeringError, match=r"shape \(5,\)"):
        vm.generate(PROMPT, 2, steer=[Steer("resid_post.0", "add", torch.ones(5))])
    with pytest.raises(SteeringError, match="Steer objects"):
        vm.generate(PROMPT, 2, steer=["resid_post.0"])
    with pytest.raises(TypeError, match="inputs must be"):
        vm.run_with_cache(3.5, ["resid_post.0"])
    assert vm.generate(PROMPT, 2).new_tokens.shape == (1, 2)  # the engine still serves after refusals


def test_vllm_generate_is_stock_and_refuses_capture(engines):
    vm = engines(LLAMA)
    gen = vllm_model(LLAMA, "vllm-generate", enforce_eager=True)  # eager forward: keeps the suite fast
    try:
        out = gen.generate(PROMPTS, 5)
        assert out.logits is None
        hooked = vm.generate(PROMPTS, 5)
        for a, b in zip(out.requests, hooked.requests):
            assert torch.equal(a.new_tokens, b.new_tokens)
        assert gen.points() == []
        with pytest.raises(UnsupportedPointError, match="vllm-generate is stock vLLM"):
            gen.generate(PROMPT, 2, points=["resid_post.0"])
        with pytest.raises(SteeringError, match="vllm-generate is stock vLLM"):
            gen.generate(PROMPT, 2, steer=[Steer("resid_post.0", "add", torch.ones(vm.d_model))])
        with pytest.raises(UnsupportedPointError, match="vllm-generate is stock vLLM"):
            gen.run_with_cache(PROMPT)
        with pytest.raises(UnsupportedPointError, match="vllm-generate is stock vLLM"):
            gen.logit_lens(torch.zeros(2, vm.d_model))
        with pytest.raises(UnsupportedPointError, match="no capture, no steering"):
            gen.address("resid_post.0")
    finally:
        drop(gen)


def test_a_failing_request_fails_alone(engines):
    """A plan that fails inside the worker's forward (here: a steer whose value has the wrong width,
    sent past the client's checks straight to the workers) fails its own request with the reason;
    a request running beside it and the engine itself are unaffected."""
    import asyncio

    from engine.backends.vllm.client import Submission
    from engine.backends.vllm.worker import wire
    from engine.core.plan import Plan
    vm, em = engines(LLAMA), eager_model(LLAMA)
    aio = vm.aio
    prompt = vm._prompt_ids(PROMPT)
    bad = Plan(len(prompt), [], [Steer("resid_post.0", "add", torch.ones(7))])
    sub = Submission(bad, dict(temperature=0.0, max_tokens=3, min_tokens=3), prompt, salted=True)

    async def scenario():  # the bad plan rides with its request, as every plan does
        good = asyncio.ensure_future(aio.generate(PROMPTS[1], 3, points=["resid_post.0"]))
        await aio._submit(sub, "bad-plan")
        (rank0,) = await aio._rpc("interp_collect", ["bad-plan"], [False])
        return rank0[0], await good
    res, good = vm._loop.run(scenario())
    failed = wire.CollectReply.read(res).failed  # the declared reply: its failure's class and message
    assert failed is not None and failed.kind == "SteeringError" and "shape (7,)" in failed.message
    ref = em.generate(PROMPTS[1], 3, points=["resid_post.0"])
    assert torch.equal(good.new_tokens, ref.new_tokens)
    check(good.cache["resid_post.0"], ref.cache["resid_post.0"], "resid_post", case="decode")
    out = vm.generate(PROMPTS, 3, points=["resid_post.0"])
    assert len(out.requests) == 2 and all(r.new_tokens.shape == (3,) for r in out.requests)


def test_cancelled_requests_leave_no_plan_in_the_workers(engines):
    """A request cancelled at any await point of its run (before it starts, while vLLM generates it, while
    its collect RPC is in flight) leaves no plan registered in the workers (its plan rides with the
    request and is registered when it is first scheduled; older code registered it by an RPC of its own,
    and a request cancelled during that RPC was never collected)."""
    import asyncio
    vm = engines(LLAMA)
    aio = vm.aio
    real_rpc, real_generate = aio._rpc, aio.engine.generate

    async def scenario(point: str) -> list:
        task = None

        async def rpc(method, *args):
            if method.startswith(point):  # interp_collect, or interp_collect_to (rows back through /dev/shm)
                task.cancel()  # lands at the RPC's first suspension: in flight
            return await real_rpc(method, *args)

        async def generate(*args, **kw):
            async for out in real_generate(*args, **kw):
                if point == "generate":
                    task.cancel()
                yield out
        aio._rpc, aio.engine.generate = rpc, generate
        try:
            task = asyncio.ensure_future(aio.generate(PROMPT, 4, points=["resid_post.0"],
                                                      steer=[Steer("resid_post.0", "scale", 0.5)]))
            if point == "start":
                task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            aio._rpc, aio.engine.generate = real_rpc, real_generate
        await asyncio.sleep(0.5)
        return await aio._rpc("interp_plans")

    for point in ("start", "generate", "interp_collect"):
        assert vm._loop.run(scenario(point)) == [[]], point
    assert vm.generate(PROMPT, 2, points=["resid_post.0"]).requests[0].new_tokens.shape == (2,)


def test_captures_with_logits_leave_no_file_in_shared_memory(engines):
    """A call's captured rows come back as files in the client's /dev/shm directory, each unlinked when the
    client maps it. final_norm, read for the logits the worker makes, was written too and never mapped: one
    file left per call until the model closed (a server's /dev/shm filled)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm: every hand-off is inline")
    vm = engines(LLAMA)
    aio = vm.aio

    def files() -> set:  # what the client's directory holds (a request cancelled mid-collect, in another test,
        return set(os.listdir(aio._shm)) if aio._shm else set()  # may have left its files there before)
    calls = [lambda: vm.generate(PROMPT, 3, points=["resid_post.0"]).logits,
             lambda: vm.generate(PROMPT, 3, points=["resid_post", "final_norm"]).logits,
             lambda: vm.run_with_cache(PROMPT, ["resid_post.1"])[0]]
    for call in calls:
        before = files()
        assert call() is not None and aio._shm is not None
        assert files() <= before, call
    # final_norm asked for itself still comes back: every row the generation computed (prompt, 2 fed back)
    before = files()
    rows = vm.generate(PROMPT, 3, points=["final_norm"]).cache["final_norm"]
    assert rows.shape[-2:] == (len(vm._prompt_ids(PROMPT)) + 2, vm.d_model) and files() <= before


def test_a_request_makes_one_call_to_the_workers_and_its_plan_rides_with_it(engines):
    """A capturing or steering call makes one RPC to the workers (its collect): each plan is registered
    by the workers from the request itself when it is first scheduled (older code made a register RPC
    first, which stalls the engine core for every request it serves)."""
    vm, em = engines(LLAMA), eager_model(LLAMA)
    aio = vm.aio
    real = aio._rpc
    calls = []

    async def rpc(method, *args):
        calls.append(method)
        return await real(method, *args)
    aio._rpc = rpc
    try:
        out = vm.generate(PROMPT, 3, points=["resid_post.0"], steer=[Steer("resid_post.1", "scale", 0.5)])
    finally:
        aio._rpc = real
    # its collect: captured rows come back through files in /dev/shm where there is one (worker/sink.py)
    assert calls == ["interp_collect_to" if os.path.isdir("/dev/shm") else "interp_collect"]
    ref = em.generate(PROMPT, 3, points=["resid_post.0"], steer=[Steer("resid_post.1", "scale", 0.5)])
    assert torch.equal(out.new_tokens, ref.new_tokens)  # the plan was registered before its first step
    assert [r.rows for r in out.receipts] == [r.rows for r in ref.receipts] == [len(vm._prompt_ids(PROMPT)) + 2]
    check(out.cache["resid_post.0"], ref.cache["resid_post.0"], "resid_post", case="decode")
    assert vm._loop.run(aio._rpc("interp_plans")) == [[]]


def test_a_plan_the_workers_cannot_register_fails_its_request_alone(engines):
    """A plan that does not decode in the worker (here: a steer with no address) fails its own request at
    collect, naming why; registering it never raises into vLLM's step, so a request beside it and the
    engine itself go on."""
    import asyncio

    from vllm import SamplingParams

    from engine.backends.vllm.worker.rows import EXTRA_KEY, PLAN_ARG
    vm, em = engines(LLAMA), eager_model(LLAMA)
    aio = vm.aio
    prompt = vm._prompt_ids(PROMPT)
    wire = {"key": "broken", "prompt_len": len(prompt), "captures": [], "internal": [], "start_at": {},
            "steers": [{"op": "add"}], "readouts": []}

    async def scenario():
        good = asyncio.ensure_future(aio.generate(PROMPTS[1], 3, points=["resid_post.0"]))
        sp = SamplingParams(max_tokens=3, temperature=0.0, extra_args={EXTRA_KEY: "broken", PLAN_ARG: wire})
        (rendered,) = await aio.engine.renderer.render_cmpl_async([{"prompt_token_ids": prompt}],
                                                                  prompt_extras={"cache_salt": "interp-broken"})
        async for _ in aio.engine.generate(rendered, sp, request_id="broken"):
            pass
        (rank0,) = await aio._rpc("interp_collect", ["broken"], [False])
        return rank0[0], await good
    res, good = vm._loop.run(scenario())
    from engine.backends.vllm.worker.wire import CollectReply
    failed = CollectReply.read(res).failed  # the declared reply: the class the worker raised, its message
    assert failed is not None and failed.kind == "TypeError" and "address" in failed.message, res
    ref = em.generate(PROMPTS[1], 3, points=["resid_post.0"])
    assert torch.equal(good.new_tokens, ref.new_tokens)
    assert vm.generate(PROMPT, 2, points=["resid_post.0"]).requests[0].new_tokens.shape == (2,)


def test_a_steer_whose_result_is_not_finite_fails_alone(engines):
    """scale 3e38 of a value row overflows float32: that request fails with the steer named, its rows
    never reach the rest of the forward (nor the KV cache), and a later request equals eager."""
    from engine.core.steering import NonFiniteSteer
    vm, em = engines(LLAMA), eager_model(LLAMA)
    with pytest.raises(NonFiniteSteer, match=r"'scale' at value\.0 produced inf or NaN"):
        vm.generate("Zebra crossing Zebra crossing", 6, steer=[Steer("value.0", "scale", 3e38)])
    with pytest.raises(SteeringError, match="coeff of 'rescale' at resid_post.0 is nan"):
        Steer("resid_post.0", "rescale", torch.ones(vm.d_model), coeff=float("nan"))
    got = vm.generate(PROMPTS[1], 4, points=["resid_post.1"])
    ref = em.generate(PROMPTS[1], 4, points=["resid_post.1"])
    assert torch.equal(got.new_tokens, ref.new_tokens)
    check(got.cache["resid_post.1"], ref.cache["resid_post.1"], "resid_post", case="decode")
