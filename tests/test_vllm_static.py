"""backend="vllm-static": declared taps as fixed buffers inside the torch.compile'd forward (CPU) or
CUDA graphs (GPU), against eager on the same zoo weights; the startup proof; refusals."""
from __future__ import annotations

import pytest
import torch

from engine.backends.vllm.backend import Request, _declared, load
from engine.backends.vllm.proof import PROBE, TapProofError, prove_taps
from engine.backends.vllm.runtime import LoadReport
from engine.core.address import Address
from engine.core.errors import AddressError, SteeringError, UnsupportedPointError
from engine.core.points import backend_status
from engine.core.steering import Steer
from test_vllm_common import (
    MAX_LEN,
    PROMPT,
    STATIC_TAPS,
    assert_steer_acts,
    check,
    decode_failures,
    eager_model,
    prefill_failures,
    random_vector,
    vllm_model,
)

LLAMA, GPT2 = "meta-llama/Llama-3.2-1B", "openai-community/gpt2"
DECLARED = STATIC_TAPS  # "auto" (resid_post everywhere) plus one tap of every other site kind


@pytest.fixture(scope="module")
def static():
    return vllm_model(LLAMA, "vllm-static", static_points=DECLARED)  # compiled (torch.compile, inductor); shared


def test_declared_sets():
    assert _declared("auto", 4) == [Address("resid_post", i) for i in range(4)]
    assert _declared(["resid_post.-1", "z"], 2) == [Address("resid_post", 1), Address("z", 0), Address("z", 1)]
    with pytest.raises(AddressError, match="declare z.1 rather than z.1.head-2"):
        _declared(["z.1.head-2"], 2)
    with pytest.raises(UnsupportedPointError, match=backend_status("attn_probs", "vllm")[1][:40]):
        _declared(["attn_probs.0"], 2)
    with pytest.raises(ValueError, match="static_points is empty"):
        _declared([], 2)
    with pytest.raises(ValueError, match="static_points is for backend='vllm-static'"):
        load(LLAMA, backend="vllm", static_points=["resid_post"])


@pytest.mark.vllm
def test_startup_proof_and_report(static):
    r = static.load_report
    assert r.compiled and "compiled" in r.line()
    proof = r.proof
    assert r.extra == {"proof": proof, "cudagraph_mode": r.cudagraph_mode}  # the earlier dict, read-only
    assert proof["steer_logit_change"] > 1e-3 and proof["reset_drift"] < 1e-4
    # the proof ran under the engine's own CUDA-graph mode (vLLM's default; NONE on CPU), no PIECEWISE override
    assert proof["cudagraph_mode"] == r.cudagraph_mode == static.aio.engine.vllm_config.compilation_config.cudagraph_mode.name
    assert r.runner.startswith("model runner: V1")
    assert proof["receipt_rows"] == len(static._prompt_ids(PROBE)) + 1
    assert proof["lens_max_abs"] is not None and proof["lens_max_abs"] < 1e-3
    assert len(static.declared) == len(_declared(DECLARED, static.n_layers)) + 1  # + internal final_norm
    rows = static.aio.engine.vllm_config.scheduler_config.max_num_batched_tokens  # one row per step token
    want = 0
    for a in static.declared:  # float32 buffers: cap, and pre / u / mul / add on write taps (+ float64 receipts
        info = static.catalogue.info(a)  # and flags, one a row)
        want += rows * int(torch.tensor(info["shape"]).prod()) * 4 * (5 if info["writable"] else 1)
        want += 2 * rows * 8 if info["writable"] else 0
    # the layer guard's row marks (float32) and each layer's flags (float64): engine/backends/vllm/worker/guard.py
    want += rows * 4 + static.n_layers * rows * 8
    assert static.tap_buffer_bytes == want > 0
    assert static.points() == ["embeddings", "attn_in", "z", "attn_out", "resid_mid", "mlp_act", "mlp_out",
                               "resid_post", "final_norm"]


@pytest.mark.vllm
def test_every_declared_point_matches_eager(static):
    em = eager_model(LLAMA)
    declared = [str(a) for a in static.declared]
    assert prefill_failures(static, em, points=declared, engine="vllm-static") == {}
    assert decode_failures(static, em, declared, engine="vllm-static") == {}


def _steers(m):
    d, (heads, hd), mw = m.d_model, m.point_shape(m.address("z.1")), m.point_shape(m.address("mlp_act.0"))
    v = random_vector((d,), 1)
    return [
        [Steer("resid_post.1", "add", v)],
        [Steer("resid_post.0", "scale", 0.5, "generated")],
        [Steer("z.1.head-2", "set", random_vector((hd,), 2), "last")],
        [Steer("z.1", "add", random_vector((heads, hd), 3), slice(2, None))],
        [Steer("attn_out.0", "ablate", None, (1, 4))],
        [Steer("resid_mid.1", "mean_ablate", random_vector((d,), 4, 1.0), slice(3, None))],
        [Steer("resid_post.0", "project_out", v)],
        [Steer("mlp_act.0", "add", random_vector(mw, 5), "last")],
        [Steer("embeddings", "add", v)],
        [Steer("attn_in.1", "scale", 3.0)],
        # several ops composed at one tap, in order
        [Steer("resid_post.1", "project_out", v), Steer("resid_post.1", "add", v, "generated"),
         Steer("resid_post.1", "scale", 0.5, slice(0, 4))],
    ]


@pytest.mark.vllm
@pytest.mark.parametrize("i", range(11))
def test_steering_matches_eager(static, i):
    em = eager_model(LLAMA)
    steer = _steers(static)[i]
    reads = ["final_norm", str(steer[0].address.base)]
    assert decode_failures(static, em, reads, steer=steer, engine="vllm-static") == {}
    assert_steer_acts(static, PROMPT, steer)


@pytest.mark.vllm
def test_eight_concurrent_requests_match_their_solo_runs(static):
    d = static.d_model
    words = PROMPT.split()
    reqs = [Request(" ".join(words[: 2 + i]), 2 + i % 5, points=[["resid_post.1"], ["z.1.head-0", "mlp_out.1"], [],
                    ["resid_post"], ["attn_out.0"], ["final_norm"], ["mlp_act.0", "resid_mid.1"], ["embeddings"]][i],
                    steer=[] if i % 3 == 2 else [Steer(f"resid_post.{i % 3}", "add", random_vector((d,), i))])
            for i in range(8)]
    together = static.generate_batch(reqs)
    for req, got in zip(reqs, together):
        solo = static.generate_batch([req])[0]
        assert torch.equal(got.new_tokens, solo.new_tokens), req
        check(got.logits[None], solo.logits[None], "lm_head", "vllm-static")
        for k in solo.cache:
            check(got.cache[k][None], solo.cache[k][None], k.split(".")[0], "vllm-static", what=k)


@pytest.mark.vllm
def test_refusals_name_the_declared_set(static):
    with pytest.raises(UnsupportedPointError, match="declared at load: resid_post.0"):
        static.run_with_cache(PROMPT, ["mlp_in.0"])
    with pytest.raises(UnsupportedPointError, match="declared at load"):
        static.generate(PROMPT, 2, steer=[Steer("attn_in.0", "add", torch.ones(static.d_model))])
    with pytest.raises(UnsupportedPointError, match="serves only the taps declared at load"):
        static.address("attn_probs.0")
    with pytest.raises(UnsupportedPointError, match=backend_status("lm_head", "vllm")[1][:40]):
        static.address("lm_head")
    with pytest.raises(UnsupportedPointError, match="read-only tap"):
        static.generate(PROMPT, 2, steer=[Steer("final_norm", "add", torch.ones(static.d_model))])
    v = torch.ones(static.d_model)
    with pytest.raises(SteeringError, match="project_out"):
        static.generate(PROMPT, 2, steer=[Steer("resid_post.0", "add", v), Steer("resid_post.0", "project_out", v)])
    assert static.generate(PROMPT, 2).new_tokens.shape == (1, 2)


class _DeadTaps:
    """A model whose taps never run (what a forward that skipped them would give): captures all zero,
    a steer that changes nothing."""
    name, n_layers, d_model = "dead", 2, 4
    declared = [Address("resid_post", 0), Address("resid_post", 1), Address("final_norm")]
    load_report = LoadReport("vllm-static", 0.0, 0, 0, cudagraph_mode="FULL_AND_PIECEWISE")

    class catalogue:
        @staticmethod
        def info(a):
            return {"writable": a.point == "resid_post"}

    def _prompt_ids(self, text):
        return [1, 2, 3]

    def generate_batch(self, reqs):
        from engine.core.results import ActivationCache, RequestResult
        cache = ActivationCache(self.n_layers)
        for p in reqs[0].points:
            cache[p] = torch.zeros(4, self.d_model)
        return [RequestResult(torch.tensor([1, 2, 3]), torch.tensor([0, 0]), "", cache, torch.zeros(2, 8))]


def test_proof_refuses_taps_that_do_not_run():
    with pytest.raises(TapProofError, match="refuses to serve dead under cudagraph_mode=FULL_AND_PIECEWISE: tap "
                                            "resid_post.0 captured shape") as e:
        prove_taps(_DeadTaps())
    assert "compilation_config={'cudagraph_mode': 'PIECEWISE'}" in str(e.value)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA-graph path of vllm-static)")
def test_cuda_graph_taps_capture_and_steer():
    """On a GPU the default compile mode captures CUDA graphs: the taps must survive replay."""
    m = load(LLAMA, backend="vllm-static", source="zoo", device="cuda", max_model_len=MAX_LEN,
             static_points=["resid_post", "attn_out.0"])
    try:
        assert m.load_report.compiled and m.load_report.proof["steer_logit_change"] > 1e-3
        em = eager_model(LLAMA)
        em.hf.to("cuda")
        em.device = torch.device("cuda")
        v = random_vector((m.d_model,)).cuda()
        for steer in ([], [Steer("resid_post.1", "add", v)], [Steer("attn_out.0", "scale", 0.0, "generated")]):
            gm = m.generate([PROMPT] * 3, 6, points=["resid_post", "attn_out.0"], steer=steer)
            ge = em.generate(PROMPT, 6, points=["resid_post", "attn_out.0"], steer=steer)
            for r in gm.requests:
                assert torch.equal(r.new_tokens, ge.new_tokens[0].cpu())
                for k in ge.cache:
                    check(r.cache[k][None], ge.cache[k].cpu(), k.split(".")[0], "vllm-static", "decode")
    finally:
        m.close()


@pytest.mark.vllm
def test_a_request_leaves_nothing_behind_for_later_ones(static):
    """Issue 34 on the compiled forward. A benign steer stayed in the tap buffers and was applied to
    the next plain requests (the worker starts no step of ours for requests without a plan); two
    finite adds that overflow a later layer wrote NaN into KV blocks later requests were handed; one
    add of 3.4e38 (finite) left every norm after it dividing by inf. Each now fails alone (the
    overflowing ones with NonFiniteSteer naming their steers) and later requests answer as before."""
    from engine.core.steering import NonFiniteSteer
    d = static.d_model
    prompts = ["Zebra", "Hello world", "Once upon a time", "def add(a, b):", "1 2 3 4 5"]

    def answers():
        return [static.generate([p], 6, return_logits=False).new_tokens[0].tolist() for p in prompts]
    solo = answers()
    static.generate(["Zebra crossing"], 4, steer=[Steer("resid_post.0", "add", torch.full((d,), 50.0))],
                    return_logits=False)
    assert answers() == solo
    pair = [Steer("attn_out.0", "add", torch.full((d,), 1e18)), Steer("attn_out.1", "add", torch.full((d,), 1e18))]
    with pytest.raises(NonFiniteSteer, match=r"downstream of its steers \('add' at attn_out.0; 'add' at attn_out.1\)"):
        static.generate(["Zebra crossing Zebra crossing"], 4, steer=pair, return_logits=False)
    assert answers() == solo
    with pytest.raises(NonFiniteSteer, match=r"inf or NaN .* of its steers \('add' at resid_post.0\)"):
        static.generate(["Zebra crossing"], 4, steer=[Steer("resid_post.0", "add", torch.full((d,), 3.4e38))],
                        return_logits=False)
    assert answers() == solo
