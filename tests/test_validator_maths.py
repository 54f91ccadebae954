"""The validator's own maths (validator/maths.py), against closed forms written here, and against what the
engine documents (a check built on a wrong reading of an op would pass a wrong engine). Also the
comparisons of greedy tokens and top-k lists, whose ties are not failures."""
import math

import pytest
import torch

from validator import maths
from validator.checks import Pair, score
from validator.subject import Generation
from validator.tolerances import tier_for

G = torch.Generator().manual_seed(0)
X = torch.randn(5, 8, generator=G)
V = torch.randn(8, generator=G)
U = V / V.norm()


@pytest.mark.parametrize("spec,prompt_len,n,want", [
    ("all", 4, 6, [0, 1, 2, 3, 4, 5]),
    ("last", 4, 6, [3, 4, 5]),  # the last prompt token, then every fed-back one
    ("generated", 4, 6, [4, 5]),
    (2, 4, 6, [2]),
    (-1, 4, 6, [3]),  # negative: from the end of the prompt, not of the call
    ([0, -1, 5], 4, 6, [0, 3, 5]),
    ((1, 3), 4, 6, [1, 2]),
    ((-2, None), 4, 6, [2, 3, 4, 5]),
])
def test_touched_positions(spec, prompt_len, n, want):
    assert torch.nonzero(maths.touched(spec, prompt_len, n)).flatten().tolist() == want


def test_ops_against_their_closed_forms():
    ap = maths.apply_op
    torch.testing.assert_close(ap("add", X, V), X + V)
    torch.testing.assert_close(ap("set", X, V), V.expand_as(X))
    torch.testing.assert_close(ap("scale", X, torch.tensor(0.5)), X * 0.5)
    torch.testing.assert_close(ap("ablate", X), torch.zeros_like(X))
    out = ap("project_out", X, V * 3)  # the value's norm does not matter
    assert float((out @ U).abs().max()) < 1e-6 and torch.allclose(X - out, (X @ U)[:, None] * U, atol=1e-6)
    out = ap("rescale", X, V, coeff=3.0)
    torch.testing.assert_close(out @ U, 3.0 * (X @ U))
    torch.testing.assert_close(out - (out @ U)[:, None] * U, X - (X @ U)[:, None] * U)
    cap = float((X @ U).median())
    out = ap("projection_cap", X, V, bounds=(None, cap))
    torch.testing.assert_close(out @ U, (X @ U).clamp(max=cap))
    out = ap("norm_scaled_add", X, V, coeff=0.5)
    torch.testing.assert_close(out, X + 0.5 * X.norm(dim=1, keepdim=True) * U)
    other = torch.randn(7, 8, generator=G)
    torch.testing.assert_close(ap("swap", X, other, positions=torch.tensor([6, 0, 1, 2, 3])), other[[6, 0, 1, 2, 3]])


def test_an_ops_value_is_cast_to_the_activation_dtype_first():
    """The engine casts a steer's value where it applies it: the sum rounds from the cast value."""
    x = X.to(torch.bfloat16)
    got = maths.apply_op("add", x, V)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, (x.double() + V.to(torch.bfloat16).double()).to(torch.bfloat16), rtol=0, atol=0)


def test_feature_ops_keep_the_reconstruction_error():
    sae = maths.SAEWeights.random(8, 16, seed=3, scale=2.0)
    f = sae.encode(X)
    i = int(f.sum(0).argmax())
    out = maths.apply_op("feature_clamp", X, coeff=5.0, sae=sae, feature=i)
    assert not torch.allclose(out, X)
    # x' - decode(f') == x - decode(f): the error term is kept
    dec = lambda feats: feats @ sae.W_dec.double() + sae.b_dec.double()  # noqa: E731
    f2 = f.clone()
    f2[:, i] = 5.0
    torch.testing.assert_close(out.double() - dec(f2), X.double() - dec(f), rtol=1e-5, atol=1e-5)
    add = maths.apply_op("feature_add", X, coeff=2.0, sae=sae, feature=i)
    torch.testing.assert_close(add, X + 2.0 * sae.W_dec[i])


def test_the_sae_file_is_what_the_engine_reads(tmp_path):
    """The validator writes its SAE in SAELens's format itself; the engine must read the same numbers."""
    from engine.core.sae_files import load_sae
    sae = maths.SAEWeights.random(8, 16, seed=4)
    loaded = load_sae(str(sae.write(tmp_path / "sae", "blocks.0.hook_resid_post")))
    torch.testing.assert_close(loaded.encode(X).double(), sae.encode(X), rtol=1e-5, atol=1e-5)


def test_readout_reductions():
    x = torch.randn(4, 3, 2, generator=G)
    torch.testing.assert_close(maths.reduce("mean", x), x.double().mean(0))
    torch.testing.assert_close(maths.reduce("max", x), x.double().amax(0))
    torch.testing.assert_close(maths.reduce("norm", x), torch.linalg.vector_norm(x.double().reshape(4, -1), dim=1))
    W, b = torch.randn(2, 6, generator=G), torch.tensor([0.1, -0.1])
    want = torch.sigmoid(x.double().reshape(4, -1) @ W.double().T + b.double())
    torch.testing.assert_close(maths.reduce("project", x, W, b, "sigmoid"), want)
    i, v = maths.top_k(torch.tensor([[0.1, 0.9, 0.5]], dtype=torch.float64), 2)
    assert i.tolist() == [[1, 2]] and v.tolist() == [[0.9, 0.5]]
    lp = maths.log_softmax(torch.tensor([[1.0, 2.0, 3.0]]))
    assert math.isclose(float(lp.exp().sum()), 1.0, rel_tol=1e-12)


# -- tokens and top-k: ties are not failures ----------------------------------------------------------
def _gen(tokens, logits):
    return Generation(torch.tensor([tokens]), torch.tensor([logits], dtype=torch.float32), {})


def _row(ours, ref, how):
    p = Pair({"case": "generate", "point": "generate", "layer": None}, ours, ref, tier_for("hf", "float32", "generate"),
             how=how)
    return score("hf", "llama", "m", [p])[0]


def test_greedy_tokens_must_match_except_on_a_tie():
    ref = _gen([1, 2, 3, 4], [[0.0, 0.0, 0.0, 9.0, 1.0], [0.0, 0.0, 0.0, 1.0, 9.0]])
    assert _row(_gen([1, 2, 3, 4], [[0] * 5, [0] * 5]), ref, "tokens")["verdict"] == "pass"
    bad = _row(_gen([1, 2, 3, 1], [[0] * 5, [0] * 5]), ref, "tokens")
    assert bad["verdict"] == "fail" and bad["mismatch"] == "tokens"
    assert "tokens differ at generated step 1 (position 3): ours 1, the reference's 4" in bad["reason"]
    tie = _gen([1, 2, 3, 4], [[0.0, 0.0, 0.0, 9.0, 1.0], [0.0, 0.0, 0.0, 9.0, 9.0 + 1e-9]])
    assert _row(_gen([1, 2, 3, 3], [[0] * 5, [0] * 5]), tie, "tokens")["verdict"] == "pass"  # within the noise band


def test_topk_indices_must_match_except_between_tied_values():
    ref = (torch.tensor([[4, 2, 7]]), torch.tensor([[3.0, 2.0, 1.0]]))
    assert _row(ref, ref, "topk")["verdict"] == "pass"
    swapped = (torch.tensor([[2, 4, 7]]), torch.tensor([[3.0, 2.0, 1.0]]))
    bad = _row(swapped, ref, "topk")
    assert bad["verdict"] == "fail" and bad["mismatch"] == "indices"
    tied = (torch.tensor([[4, 2, 7]]), torch.tensor([[3.0, 2.0, 2.0 - 1e-12]]))
    assert _row((torch.tensor([[4, 7, 2]]), tied[1]), tied, "topk")["verdict"] == "pass"
