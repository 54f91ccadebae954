"""The new interventions on every backend: the ops of engine.core.steering.OPS, values with position /
batch axes, cache entries, position masks and exclusions, and patch_sweep, on vllm and
vllm-static against eager on the same zoo weights (the validator's vLLM tolerances). vllm-static
serves what its per-row affine taps express and refuses the rest by name."""
from __future__ import annotations

import pytest
import torch

from engine.core.errors import SteeringError
from engine.core.results import Request, StrictSteerError
from engine.core.steering import Steer
from engine.workflows.patching import patch_sweep
from test_receipts import CASES, check_receipt, steered_cases
from test_vllm_common import (
    PROMPT,
    PROMPTS,
    STATIC_TAPS,
    check,
    decode_failures,
    eager_model,
    random_vector,
    stream_under_steering,
    vllm_model,
)

pytestmark = pytest.mark.vllm
LLAMA = "meta-llama/Llama-3.2-1B"
DECLARED = STATIC_TAPS  # the session's one shared vllm-static engine (tests/test_vllm_common.py): one start, not two
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(backend):
        if backend not in made:
            kw = {"static_points": DECLARED} if backend == "vllm-static" else {}
            made[backend] = vllm_model(LLAMA, backend, **kw)
        return made[backend]
    return get  # both are the session's shared engines (tests/test_vllm_syncs.py, the last module of the static
    # one, drops it)


def _steers(d, n_prompt):
    v = random_vector((d,), 1)
    pos_v = random_vector((n_prompt, d), 2, 1.0)
    return {
        "rescale": Steer("resid_post.0", "rescale", v, coeff=3.0),
        "projection_cap": Steer("resid_post.1", "projection_cap", v, bounds=(-0.2, 0.2)),
        "norm_scaled_add": Steer("mlp_out.1", "norm_scaled_add", v, coeff=0.5, positions="last"),
        "set_pos": Steer("resid_post.0", "set", pos_v, positions=slice(1, 5)),
        "add_pos_exclude": Steer("resid_post.1", "add", pos_v, positions=slice(0, n_prompt), exclude=[0, 3]),
        "scale_pos": Steer("mlp_out.1", "scale", pos_v.abs(), positions=[2, 4, -1]),
        "mask": Steer("resid_post.0", "add", v, positions=torch.tensor([False, True, False, True])),
        "head_pos": Steer("z.1.head-2", "set", random_vector((n_prompt, 64), 3), positions=(0, 3)),
    }


AFFINE = ["set_pos", "add_pos_exclude", "scale_pos", "mask", "head_pos"]


@pytest.mark.parametrize("key", list(_steers(4, 8)))
def test_ops_and_value_forms_match_eager_on_vllm(engines, key):
    vm, em = engines("vllm"), eager_model(LLAMA)
    st = _steers(vm.d_model, len(vm._prompt_ids(PROMPT)))[key]
    reads = ["final_norm", str(st.address.base)]
    assert decode_failures(vm, em, reads, steer=[st]) == {}
    lv, cv = vm.run_with_cache(PROMPT, reads, [st])
    le, ce = em.run_with_cache(PROMPT, reads, [st])
    check(lv, le, "lm_head")
    check(cv[reads[1]], ce[reads[1]], reads[1].split(".")[0])


@pytest.mark.parametrize("key", AFFINE)
def test_affine_value_forms_match_eager_on_vllm_static(engines, key):
    sm, em = engines("vllm-static"), eager_model(LLAMA)
    st = _steers(sm.d_model, len(sm._prompt_ids(PROMPT)))[key]
    assert decode_failures(sm, em, ["final_norm", str(st.address.base)], steer=[st], engine="vllm-static") == {}


def test_static_refuses_by_name_what_its_taps_cannot_express(engines):
    sm = engines("vllm-static")
    v = random_vector((sm.d_model,), 4)
    for st, op in [(Steer("resid_post.0", "rescale", v, coeff=2.0), "rescale"),
                   (Steer("resid_post.0", "projection_cap", v, bounds=(0, 1)), "projection_cap"),
                   (Steer("resid_post.0", "norm_scaled_add", v, coeff=0.1), "norm_scaled_add")]:
        with pytest.raises(SteeringError, match=f"'{op}' at resid_post.0 cannot run on vllm-static: vllm-static taps "
                                                f"apply y = "):
            sm.generate(PROMPT, 2, steer=[st])
    a = sm.generate(PROMPT, 3, steer=[Steer("resid_post.0", "rescale", v, coeff=0.0)])
    b = sm.generate(PROMPT, 3, steer=[Steer("resid_post.0", "project_out", v)])
    assert torch.equal(a.new_tokens, b.new_tokens)
    check(a.logits, b.logits, "lm_head", "vllm-static", case="decode")


def test_batch_values_and_cache_entries_per_prompt(engines):
    """A [batch, pos, d] value and a padded cache's entry give each prompt its own rows on vllm, as eager."""
    vm, em = engines("vllm"), eager_model(LLAMA)
    _, cache = em.run_with_cache(PROMPTS, ["resid_post.0"])
    n = min(len(vm._prompt_ids(p)) for p in PROMPTS)
    batch_v = random_vector((2, n, vm.d_model), 5, 1.0)
    for st in (Steer("resid_post.0", "add", batch_v, positions=slice(0, n)),
               Steer("resid_post.1", "set", cache.entry("resid_post.0"), positions=slice(1, n)),
               Steer("resid_post.1", "add", random_vector((vm.d_model,), 6),
                     positions=torch.tensor([[True, False, True], [False, True, False]]))):
        gv, ge = vm.generate(PROMPTS, 3, points=["resid_post.1"], steer=[st]), em.generate(PROMPTS, 3, points=["resid_post.1"], steer=[st])
        assert torch.equal(gv.new_tokens, ge.new_tokens)
        check(gv.logits, ge.logits, "lm_head", case="decode")
        check(gv.cache["resid_post.1"], ge.cache["resid_post.1"], "resid_post", case="decode")


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_patch_sweep_same_numbers_as_eager(engines, backend):
    m, em = engines(backend), eager_model(LLAMA)
    kw = dict(positions=[0, 11, -1], batch_size=4)
    ours = patch_sweep(m, CLEAN, CORRUPT, "resid_post", **kw)
    ref = patch_sweep(em, CLEAN, CORRUPT, "resid_post", **kw)
    assert ours.addresses == ref.addresses and ours.positions == ref.positions
    torch.testing.assert_close(ours.values, ref.values, rtol=0, atol=2e-4)
    assert float(ref.values.max() - ref.values.min()) > 1e-3


# -- capability verdicts, streams and sampling knobs on vLLM -------------------------------------------
@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_every_verdict_matches_the_call(engines, backend):
    from engine.core.errors import AddressError
    m = engines(backend)
    table = m.describe()
    served = [v.address for v in table.served()]
    _, cache = m.run_with_cache(PROMPT, served)
    assert set(cache) == set(served) and served
    for v in table:
        if not v.served:
            with pytest.raises(AddressError) as e:
                m.address(v.address)
            assert v.reason.rstrip(".") in str(e.value)
    if backend == "vllm-static":
        assert {v.address for v in table.served()} == {str(a) for a in m.declared}
        assert m.verdict("resid_post.0").capture_only is None and "declared at load" in m.refuses("mlp_in.0")
    else:
        assert m.verdict("attn_probs.0").how == "recompute" and m.verdict("attn_probs.0").capture_only
        assert "fused" in m.refuses("mlp_pre.0") and m.block_layout().kind == "sequential"


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_stream_matches_eager_stream(engines, backend):
    m, em = engines(backend), eager_model(LLAMA)
    steer = [Steer("resid_post.0", "add", random_vector((m.d_model,), 8), "generated")]
    got = list(m.stream(PROMPT, 4, points=["resid_post.1"], steer=steer, logprobs=3))
    ref = list(em.stream(PROMPT, 4, points=["resid_post.1"], steer=steer, logprobs=3))
    assert [s.token for s in got] == [s.token for s in ref]
    for a, b in zip(got, ref):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert set(a.top_logprobs) == set(b.top_logprobs)
        check(a.rows["resid_post.1"][None], b.rows["resid_post.1"][None], "resid_post", backend, case="decode")
    assert got[-1].result is not None and got[0].rows["resid_post.1"].shape[0] == len(m._prompt_ids(PROMPT))


def test_static_stream_equals_generate_under_a_steering_block(engines):
    """As on eager and vllm (tests/test_pipeline_defects.py): the block's steers are bound when the
    stream is made."""
    stream_under_steering(engines("vllm-static"), "vllm-static")


def test_sampling_knobs_on_vllm(engines):
    from engine.core.errors import OptionError
    vm, em = engines("vllm"), eager_model(LLAMA)
    a = vm.generate(PROMPT, 5, temperature=1.5, seed=3)
    assert torch.equal(a.new_tokens, vm.generate(PROMPT, 5, temperature=1.5, seed=3).new_tokens)
    greedy = em.generate(PROMPT, 5).new_tokens
    assert torch.equal(vm.generate(PROMPT, 5, temperature=1.0, top_k=1, seed=1).new_tokens, greedy)
    with pytest.raises(OptionError, match="sample with temperature > 0"):
        vm.generate(PROMPT, 2, do_sample=True)
    with pytest.raises(OptionError, match=r"unknown sampling option \['temprature'\]"):
        vm.generate(PROMPT, 2, temprature=1.0)


def test_capture_attention_matches_eager(engines):
    from engine.workflows.attention_capture import capture_attention
    vm, em = engines("vllm"), eager_model(LLAMA)
    got, ref = capture_attention(vm, PROMPT), capture_attention(em, PROMPT)
    assert got.layers == ref.layers and not got.missing
    for layer in ref.layers:
        for piece, point in (("scores", "attn_scores"), ("probs", "attn_probs"), ("value", "value"), ("z", "z")):
            check(getattr(got, piece)[layer], getattr(ref, piece)[layer], point)
        check(got.mixed(layer), got.z[layer], "z")


def test_prepend_bos_on_vllm_matches_eager(engines):
    vm, em = engines("vllm"), eager_model(LLAMA)
    assert vm.bos() == em.bos()
    try:
        vm.prepend_bos = em.prepend_bos = True
        lv, _ = vm.run_with_cache(PROMPT)
        le, _ = em.run_with_cache(PROMPT)
        assert vm.to_tokens(PROMPT)["input_ids"][0, 0] == vm.bos().id
    finally:
        vm.prepend_bos = em.prepend_bos = None
    assert lv.shape[1] == len(vm._prompt_ids(PROMPT)) + 1
    check(lv, le, "lm_head")


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_swap_matches_eager(engines, backend):
    """swap: each prompt takes the other prompt's activation at the same positions (from a cache of the
    prompts in reverse order); the captured rows there are the other prompt's, on every backend."""
    m, em = engines(backend), eager_model(LLAMA)
    _, other = em.run_with_cache(PROMPTS[::-1], ["resid_post.1"])
    n = min(len(m._prompt_ids(p)) for p in PROMPTS)
    st = Steer("resid_post.1", "swap", other.entry("resid_post.1"), positions=slice(1, n))
    got, ref = (x.generate(PROMPTS, 3, points=["resid_post.1"], steer=[st]) for x in (m, em))
    for r, req in enumerate(ref.requests):  # the independent part: the other prompt's own rows
        torch.testing.assert_close(req.cache["resid_post.1"][1:n], other.entry("resid_post.1").rows[r][1:n])
    assert torch.equal(got.new_tokens, ref.new_tokens)
    check(got.logits, ref.logits, "lm_head", backend, case="decode")
    check(got.cache["resid_post.1"], ref.cache["resid_post.1"], "resid_post", backend, case="decode")


# -- receipts (tests/test_receipts.py: the routine and eager) ----------------------------------------
@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_receipts_match_an_independent_computation(engines, backend):
    """Every case's receipt (rows, change norm) equals the steered capture minus an unsteered forward
    over the same tokens, on generate, run_with_cache and generate_batch, and agrees with eager's;
    vllm-static's receipts come from its pre-write tap buffer, replayed through the shared routine."""
    m, em = engines(backend), eager_model(LLAMA)
    cases = steered_cases(m, len(m._prompt_ids(PROMPT)))
    for case in CASES:
        st = cases[case]
        key = str(st.address.base)
        g = m.generate(PROMPT, 4, points=[key], steer=[st])
        (r,) = g.receipts
        check_receipt(m, g.cache, g.tokens[:, :-1], st, r, rel=1e-3)
        (ref,) = em.generate(PROMPT, 4, steer=[st]).receipts
        assert r.rows == ref.rows and r.change_norm == pytest.approx(ref.change_norm, rel=1e-3), case
    st = cases["scale_list"]
    _, cache = m.run_with_cache(PROMPT, ["mlp_out.1"], [st])
    check_receipt(m, cache, m.to_tokens(PROMPT)["input_ids"], st, cache.receipts[0], rel=1e-3)
    a, b = m.generate_batch([Request(PROMPT, 3, ["resid_post.0"], [cases["add_last"]]), Request(PROMPT, 3)])
    check_receipt(m, {"resid_post.0": a.cache["resid_post.0"][None]}, a.tokens[None, :-1], cases["add_last"],
                  a.receipts[0], rel=1e-3)
    assert b.receipts == []


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_strict_fails_a_steer_that_generation_never_reached(engines, backend):
    """A steer at a generated position passes the position check, but generation stops (a stop token)
    before it: the receipt says 0 rows, and strict=True fails the call naming the steer."""
    m = engines(backend)
    n = len(m._prompt_ids(PROMPT))
    first = int(m.generate(PROMPT, 1, steer=[Steer("resid_post.0", "scale", 2.0)]).new_tokens[0, 0])
    stop = {"stop_token_ids": [first], "min_tokens": 0}
    st = [Steer("resid_post.0", "scale", 2.0), Steer("resid_post.1", "add", random_vector((m.d_model,), 5), [n + 3])]
    g = m.generate(PROMPT, 6, steer=st, **stop)
    assert g.new_tokens.shape[1] == 1 and [r.rows for r in g.receipts] == [n, 0]
    with pytest.raises(StrictSteerError, match=r"steer 1 \('add' at resid_post.1\) touched no row of this generat"):
        m.generate(PROMPT, 6, steer=st, strict=True, **stop)
    with pytest.raises(StrictSteerError, match=r"steer 1 .* touched no row of this request"):
        m.generate_batch([Request(PROMPT, 6, steer=st, sampling=stop)], strict=True)
    steps = list(m.stream(PROMPT, 6, steer=st, **stop))
    assert steps[-1].result.receipts == g.receipts
    with pytest.raises(StrictSteerError, match=r"steer 1 \('add' at resid_post.1\)"):
        list(m.stream(PROMPT, 6, steer=st, strict=True, **stop))
    assert m.generate(PROMPT, 6, steer=st, strict=True).receipts[1].rows == 1  # reached without the stop
