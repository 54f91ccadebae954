"""The steering ops table (engine/core/steering.py OPS) and position masks on eager: each op against its
formula applied by hand to the unsteered capture, exclusions (listed positions, the tokenizer's
special tokens), and every bad input by message. Cross-backend equality: tests/test_vllm_interventions.py."""
from __future__ import annotations

import pytest
import torch

from engine.core.errors import SteeringError
from engine.core.site import apply_steer
from engine.core.steering import OPS, CacheEntry, Steer
from test_vllm_common import eager_model

LLAMA, GEMMA2 = "meta-llama/Llama-3.2-1B", "google/gemma-2-2b"
KINDS = ["openai-community/gpt2", LLAMA, GEMMA2, "mistralai/Mixtral-8x7B-v0.1", "LiquidAI/LFM2-350M"]
TEXT = "The quick brown fox jumps over the lazy dog"
def model(name=LLAMA):  # eager models are shared across the session's test modules
    return eager_model(name)


def _u(v):
    return v / v.norm()


def _expected(op, x, v, **kw):
    """Each op written out on [.., d] rows (the reference the engine is held to)."""
    if op == "rescale":
        return x + (kw["coeff"] - 1) * (x @ _u(v))[..., None] * _u(v)
    if op == "projection_cap":
        d = x @ _u(v)
        lo, hi = kw["bounds"]
        return x + (d.clamp(lo, hi) - d)[..., None] * _u(v)
    if op == "norm_scaled_add":
        return x + kw["coeff"] * x.norm(dim=-1, keepdim=True) * _u(v)
    raise AssertionError(op)


@pytest.mark.parametrize("op,kw", [("rescale", {"coeff": 3.0}), ("rescale", {"coeff": -1.0}),
                                   ("projection_cap", {"bounds": (-0.5, 0.5)}), ("projection_cap", {"bounds": (None, 0.0)}),
                                   ("norm_scaled_add", {"coeff": 0.25})])
@pytest.mark.parametrize("name", KINDS)
def test_direction_ops_follow_their_formula(name, op, kw):
    m = model(name)
    v = torch.randn(m.d_model, generator=torch.Generator().manual_seed(3))
    _, base = m.run_with_cache(TEXT, ["mlp_out.1"])
    _, got = m.run_with_cache(TEXT, ["mlp_out.1"], [Steer("mlp_out.1", op, v, positions=slice(2, 6), **kw)])
    x, y = base["mlp_out.1"][0], got["mlp_out.1"][0]
    torch.testing.assert_close(y[2:6], _expected(op, x[2:6], v, **kw), rtol=1e-4, atol=1e-5)
    assert torch.equal(y[:2], x[:2]) and torch.equal(y[6:], x[6:])


def test_rescale_zero_is_project_out_and_one_is_identity():
    m = model()
    v = torch.randn(m.d_model)
    a = m.run_with_cache(TEXT, ["resid_post.0"], [Steer("resid_post.0", "rescale", v, coeff=0.0)])[1]
    b = m.run_with_cache(TEXT, ["resid_post.0"], [Steer("resid_post.0", "project_out", v)])[1]
    torch.testing.assert_close(a["resid_post.0"], b["resid_post.0"])
    c = m.run_with_cache(TEXT, ["resid_post.0"], [Steer("resid_post.0", "rescale", v, coeff=1.0)])[1]
    base = m.run_with_cache(TEXT, ["resid_post.0"])[1]
    torch.testing.assert_close(c["resid_post.0"], base["resid_post.0"])


def test_projection_cap_leaves_rows_inside_the_bounds_alone():
    x = torch.randn(5, 8)
    v = torch.randn(8)
    d = x @ _u(v)
    st = Steer("resid_post.0", "projection_cap", v, bounds=(float(d.min()) - 1, float(d.max()) + 1))
    assert torch.equal(apply_steer(st, x, torch.ones(5, dtype=torch.bool)), x)


def test_swap_and_resample_take_other_prompts_rows():
    m = model()
    rows = [m.tokenizer(t)["input_ids"][:8] for t in ("The quick brown fox jumps over", "Water boils at 100 degrees")]
    enc = {"input_ids": torch.tensor(rows), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    _, cache = m.run_with_cache(enc, ["resid_pre.1"])
    donor = m.run_with_cache("The capital of France is Paris", ["resid_pre.1"])[1]
    n = min(enc["input_ids"].shape[1], donor["resid_pre.1"].shape[1])
    # swap from a one-sequence cache: the same donor rows for every sequence
    _, got = m.run_with_cache(enc, ["resid_pre.1"], [Steer("resid_pre.1", "swap", donor.entry("resid_pre.1"),
                                                           positions=slice(0, n))])
    for r in range(2):
        torch.testing.assert_close(got["resid_pre.1"][r, :n], donor["resid_pre.1"][0, :n])
    # resample: each sequence takes the other's rows
    res = cache.entry("resid_pre.1").resampled(seed=0)
    _, got = m.run_with_cache(enc, ["resid_pre.1"], [Steer("resid_pre.1", "swap", res)])
    torch.testing.assert_close(got["resid_pre.1"][0], cache["resid_pre.1"][1])
    torch.testing.assert_close(got["resid_pre.1"][1], cache["resid_pre.1"][0])
    with pytest.raises(SteeringError, match="two or more sequences"):
        donor.entry("resid_pre.1").resampled()
    with pytest.raises(SteeringError, match="need equal lengths"):
        CacheEntry("x", [torch.zeros(3, 2), torch.zeros(4, 2)]).resampled()


def test_exclude_listed_positions_and_special_tokens():
    m = model()
    tok = m.tokenizer
    body = tok(TEXT, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[tok.bos_token_id, *body, tok.eos_token_id]])
    v = torch.randn(m.d_model)
    _, base = m.run_with_cache(ids, ["resid_pre.1"])
    _, got = m.run_with_cache(ids, ["resid_pre.1"], [Steer("resid_pre.1", "add", v, exclude="special")])
    diff = (got["resid_pre.1"] - base["resid_pre.1"])[0]
    n = ids.shape[1]
    assert diff[0].abs().max() == 0  # BOS untouched
    torch.testing.assert_close(diff[1], v)
    _, got = m.run_with_cache(ids, ["resid_pre.1"], [Steer("resid_pre.1", "add", v, exclude=[1, -1])])
    diff = (got["resid_pre.1"] - base["resid_pre.1"])[0]
    touched = [p for p in range(n) if diff[p].abs().max() > 0]
    assert touched == [p for p in range(n) if p not in (1, n - 1)]


@pytest.mark.parametrize("make,fragment", [
    (lambda v: Steer("resid_post.0", "rescale", v), r"op 'rescale' needs coeff="),
    (lambda v: Steer("resid_post.0", "add", v, coeff=2.0), "op 'add' takes no coeff"),
    (lambda v: Steer("resid_post.0", "projection_cap", v), r"needs bounds=\(min, max\)"),
    (lambda v: Steer("resid_post.0", "projection_cap", v, bounds=(None, None)), "at least one of them"),
    (lambda v: Steer("resid_post.0", "projection_cap", v, bounds=(2, 1)), "min is above max"),
    (lambda v: Steer("resid_post.0", "scale", v, bounds=(0, 1)), "op 'scale' takes no bounds"),
    (lambda v: Steer("resid_post.0", "norm_scaled_add", torch.zeros_like(v), coeff=1.0), "needs a direction"),
    (lambda v: Steer("resid_post.0", "add", v, exclude="bos"), "exclude is a list of positions or 'special'"),
    (lambda v: Steer("resid_post.0", "add", v, positions=2, exclude=[2]), "every position it selects is excluded"),
    (lambda v: Steer("resid_post.0", "add", v, positions=[1, 99]), r"positions \[99\] match no token"),
    (lambda v: Steer("resid_post.0", "scale", "2"), "needs a torch.Tensor value, got str"),
    (lambda v: Steer("resid_post.0", "set", (v, "resid_post.0")), "needs a torch.Tensor value, got tuple"),
])
def test_bad_op_input(make, fragment):
    m = model()
    with pytest.raises(SteeringError, match=fragment):
        m.run_with_cache(TEXT, (), [make(torch.randn(m.d_model))])


def test_ops_table_is_complete():
    assert set(OPS) == {"add", "set", "scale", "ablate", "mean_ablate", "project_out", "rescale", "projection_cap",
                        "norm_scaled_add", "swap", "feature_clamp", "feature_scale", "feature_add"}
    assert {o for o, op in OPS.items() if op.static} == {"rescale", "projection_cap", "norm_scaled_add",
                                                         "feature_clamp", "feature_scale"}
    assert all(OPS[o].whole for o in ("project_out", "rescale", "projection_cap", "norm_scaled_add"))


def test_a_value_of_another_dtype_is_cast_where_it_is_applied():
    """A float64 or bfloat16 value on a float32 model is accepted and cast at its site: the same logits as
    the value cast by hand (issue 35: values come from any device or dtype, moved once per call)."""
    em = eager_model("meta-llama/Llama-3.2-1B")
    v = torch.randn(em.d_model, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ids = torch.tensor([[5, 6, 7, 8]])
    for given in (v, v.bfloat16()):
        want = em.forward(ids, steer=[Steer("resid_post.0", "add", given.float())])
        assert torch.equal(em.forward(ids, steer=[Steer("resid_post.0", "add", given)]), want)


@pytest.mark.gpu
def test_a_value_on_the_cpu_steers_a_cuda_model():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine import load_model
    m = load_model("meta-llama/Llama-3.2-1B", source="zoo", device="cuda")
    v = torch.randn(m.d_model)
    ids = torch.tensor([[5, 6, 7, 8]])
    got = m.forward(ids, steer=[Steer("resid_post.0", "add", v)])
    assert torch.equal(got, m.forward(ids, steer=[Steer("resid_post.0", "add", v.cuda())]))
