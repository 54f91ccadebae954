"""Feature steering (ops feature_clamp / feature_scale / feature_add, engine/core/ops.py) through an
SAE written to disk: checked against the SAE's own encode/decode on plain captures (the edited
feature and nothing else on re-encode, the reconstruction error unchanged, the decoder direction
added at exactly the steered positions), refused by name where malformed, and equal to eager on
vllm and vllm-static under concurrent requests."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from engine import Readout, SAEFeatures, Steer
from engine.core.errors import SAEError, SteeringError
from engine.core.ops import OPS
from engine.core.sae_files import load_sae, random_sae, save_sae, write_random_sae
from test_vllm_common import STATIC_TAPS, check, eager_model, vllm_model

LLAMA = "meta-llama/Llama-3.2-1B"
DECLARED = STATIC_TAPS  # the session's one shared vllm-static engine (tests/test_vllm_common.py): one start, not two
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello world"]
D = 256  # the zoo Llama's width


@pytest.fixture(scope="module")
def em():
    return eager_model(LLAMA)


@pytest.fixture(scope="session")
def saes(tmp_path_factory):
    """{name: directory}: a random standard SAE, and a tied orthonormal one whose features all fire
    (then re-encoding a clamped activation gives back exactly the clamped features)."""
    root = tmp_path_factory.mktemp("feature-saes")
    q, _ = torch.linalg.qr(torch.randn(D, 64, generator=torch.Generator().manual_seed(1)))  # [D, 64] orthonormal
    base = random_sae("standard", D, 64, seed=2)
    tied = dataclasses.replace(base, W_enc=q.contiguous(), W_dec=q.T.contiguous(), b_enc=torch.full((64,), 100.0))
    return {"random": str(write_random_sae(root / "random", "standard", D, 512, seed=3)),
            "tied": str(save_sae(tied, root / "tied"))}


def _rows(m, prompts, steer=()):
    _, cache = m.run_with_cache(prompts, ["resid_post.1"], steer=steer)
    return [cache["resid_post.1"][i, c] for i, c in enumerate(cache.columns)]


def test_a_clamp_changes_exactly_that_feature_on_re_encode_and_keeps_the_error(em, saes):
    sae = load_sae(saes["tied"])
    st = Steer("resid_post.1", "feature_clamp", sae=saes["tied"], feature=3, coeff=5.0)
    for x, y in zip(_rows(em, PROMPTS), _rows(em, PROMPTS, [st])):  # y: the steered activation itself
        f, g = sae.encode(x), sae.encode(y)
        assert bool((f > 0).all())  # every feature fires, so the re-encode is exact
        assert torch.allclose(g[:, 3], torch.full_like(g[:, 3], 5.0), atol=1e-4)
        others = torch.arange(64) != 3
        assert torch.allclose(g[:, others], f[:, others], atol=1e-4)
        assert torch.allclose(y - sae.decode(g), x - sae.decode(f), atol=1e-4)


@pytest.mark.parametrize("op, edit", [("feature_clamp", lambda f: f.index_fill(-1, torch.tensor([7, 9]), 2.5)),
                                      ("feature_scale", lambda f: f * torch.where(
                                          torch.isin(torch.arange(f.shape[-1]), torch.tensor([7, 9])), 2.5, 1.0))])
def test_feature_edits_keep_the_reconstruction_error(em, saes, op, edit):
    """x' = x + decode(f') - decode(f): x' - decode(f') equals x - decode(f), f' = f edited."""
    sae = load_sae(saes["random"])
    st = Steer("resid_post.1", op, sae=saes["random"], feature=[7, 9], coeff=2.5)
    for x, y in zip(_rows(em, PROMPTS), _rows(em, PROMPTS, [st])):
        f = sae.encode(x)
        assert torch.allclose(y - sae.decode(edit(f)), x - sae.decode(f), atol=1e-4)
        assert not torch.allclose(y, x)


def test_feature_add_adds_the_decoder_direction_at_the_steered_positions_only(em, saes):
    sae = load_sae(saes["random"])
    st = Steer("resid_post.1", "feature_add", sae=saes["random"], feature=11, coeff=-3.0, positions="last")
    for x, y in zip(_rows(em, PROMPTS), _rows(em, PROMPTS, [st])):
        assert torch.allclose(y[-1] - x[-1], -3.0 * sae.W_dec[11], atol=1e-5)
        assert torch.equal(y[:-1], x[:-1])
    _, cache = em.run_with_cache(PROMPTS, steer=[st])
    assert cache.receipts[0].rows == 2 and cache.receipts[0].op == "feature_add"
    assert abs(cache.receipts[0].change_norm - (2 * 9 * float(sae.W_dec[11].norm()) ** 2) ** 0.5) < 1e-3


@pytest.mark.parametrize("kw, match", [
    (dict(op="feature_clamp", coeff=1.0, feature=1), "needs sae="),
    (dict(op="feature_clamp", coeff=1.0, sae=""), "sae is empty"),
    (dict(op="feature_clamp", sae="SAE", feature=1), "needs coeff="),
    (dict(op="feature_clamp", sae="SAE", coeff=1.0), "needs feature="),
    (dict(op="feature_clamp", sae="SAE", coeff=1.0, feature=True), "needs feature=.*got bool True, not an integer"),
    (dict(op="feature_clamp", sae="SAE", coeff=1.0, feature=[]), "needs feature=.*got an empty list"),
    (dict(op="feature_clamp", sae="SAE", coeff=1.0, feature=-2), "needs feature=.*got -2, a negative index"),
    (dict(op="feature_clamp", sae="SAE", coeff=1.0, feature=[1, np.int64(-2)]), "got -2, a negative index"),
    (dict(op="feature_clamp", sae="SAE", coeff=1.0, feature=3.0), r"got float 3.0, not an integer"),
    (dict(op="feature_clamp", sae="SAE", coeff=1.0, feature=torch.tensor([3])), r"got Tensor tensor\(\[3\]\), not an"),
    (dict(op="feature_add", sae="SAE", coeff=float("nan"), feature=1), "finite"),
    (dict(op="feature_add", sae="SAE", coeff=1.0, feature=1, value=torch.ones(D)), "takes no value"),
    (dict(op="add", value=torch.ones(D), sae="SAE"), "takes no sae"),
    (dict(op="add", value=torch.ones(D), feature=3), "takes no feature"),
])
def test_malformed_feature_steers_are_refused_when_made(saes, kw, match):
    if kw.get("sae") == "SAE":
        kw = {**kw, "sae": saes["random"]}
    with pytest.raises(SteeringError, match=match):
        Steer("resid_post.1", **kw)


@pytest.mark.parametrize("feature", [np.int64(11), torch.tensor(11), np.array(11), [np.int32(11), torch.tensor(7)]])
def test_integer_scalars_are_feature_indices(em, saes, feature):
    """np.int64(3) or torch.tensor(3) was refused with "needs feature= (a feature index >= 0 ...)"; any
    integer scalar is the index it holds, and the steer equals the one made with Python ints."""
    plain = [11, 7] if isinstance(feature, list) else 11
    st = Steer("resid_post.1", "feature_clamp", sae=saes["random"], feature=feature, coeff=4.0, positions="last")
    assert st.feature == plain and all(type(i) is int for i in (st.feature if isinstance(plain, list) else [plain]))
    ref = Steer("resid_post.1", "feature_clamp", sae=saes["random"], feature=plain, coeff=4.0, positions="last")
    got, want = _rows(em, PROMPTS, [st]), _rows(em, PROMPTS, [ref])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.allclose(got[0], _rows(em, PROMPTS)[0])


def test_feature_steers_checked_against_the_sae_before_running(em, saes, tmp_path):
    # an SAE named by a path that is not a folder here is refused by the call, not when the Steer is made
    # (on a model server the same string names a folder inside its --sae-dir)
    st = Steer("resid_post.1", "feature_clamp", sae="/nonexistent", feature=1, coeff=1.0)
    with pytest.raises(SAEError, match="feature_clamp at resid_post.1: '/nonexistent' is not a directory"):
        em.run_with_cache("hi", steer=[st])
    with pytest.raises(SteeringError, match="feature 512 is out of range; .* has 512 features"):
        em.run_with_cache("hi", steer=[Steer("resid_post.1", "feature_clamp", sae=saes["random"], feature=512,
                                             coeff=1.0)])
    tc = str(write_random_sae(tmp_path / "tc", "transcoder", D, 32, seed=4))
    # the ops that encode x with the SAE (the op table's `encodes`) are refused with a transcoder, which
    # encodes another point; feature_add only decodes and runs
    feature_ops = [o for o in OPS.values() if "sae" in o.params]
    assert {o.name for o in feature_ops if o.encodes} == {"feature_clamp", "feature_scale"}
    for op in feature_ops:
        st = Steer("resid_post.1", op.name, sae=tc, feature=1, coeff=2.0)
        if op.encodes:
            with pytest.raises(SteeringError, match=f"{op.name} at resid_post.1: .* is a transcoder"):
                em.run_with_cache("hi", steer=[st])
        else:
            em.run_with_cache("hi", steer=[st])


# -- vllm and vllm-static against eager ----------------------------------------------------------------
def _engine(backend: str):
    return vllm_model(LLAMA, backend, **({"static_points": DECLARED} if backend == "vllm-static" else {}))


@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_feature_steers_match_eager_under_concurrent_requests(backend, saes):
    vm, em = _engine(backend), eager_model(LLAMA)
    ops = ["feature_add"] if backend == "vllm-static" else ["feature_clamp", "feature_scale", "feature_add"]
    reqs = []
    for i in range(4):
        op = ops[i % len(ops)]
        st = [Steer(f"resid_post.{i % 2}", op, sae=saes["random"], feature=[5 + i, 40], coeff=[4.0, 0.5, 3.0][i % 3],
                    positions=["all", "last", "all", (0, 3)][i])]
        rs = [Readout("resid_post.1", SAEFeatures(saes["random"], k=5), name="sae")]
        reqs.append((PROMPTS[i % 2], st if i != 3 else [], rs))

    async def run():
        return await asyncio.gather(*(vm.aio.generate(p, 3, steer=s, readouts=r) for p, s, r in reqs))
    got = asyncio.run(run())
    for i, ((p, s, r), g) in enumerate(zip(reqs, got)):
        ref = em.generate(p, 3, steer=s, readouts=r)
        assert torch.equal(g.new_tokens, ref.new_tokens), f"request {i}"
        want, have = ref.cache.readouts["sae"], g.cache.readouts["sae"]
        check(have.values[None], want.values[None], "readout", backend, "decode", f"request {i}")
        for a, b in zip(g.receipts, ref.receipts):
            assert a.rows == b.rows and abs(a.change_norm - b.change_norm) <= 1e-3 * max(1.0, b.change_norm)


@pytest.mark.vllm
def test_vllm_static_refuses_feature_edits_its_taps_cannot_express(saes):
    vm = _engine("vllm-static")
    with pytest.raises(Exception, match="feature_clamp.*SAE encode and decode|SAE encode and decode.*feature_clamp"):
        vm.run_with_cache("hi", steer=[Steer("resid_post.1", "feature_clamp", sae=saes["random"], feature=1,
                                             coeff=1.0)])
