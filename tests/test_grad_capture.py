"""run_with_cache(grad=True) captures the same tensors as the default no-grad capture, on every zoo
twin and every point it serves at every layer (one short prompt). The no-grad capture is the one the
family tests check against HF's own tensors, so this pins the gradient path to that reference.
Capture-only points (a q split out of a fused qkv, Falcon-H1's resid_mid) have no write path: with
gradients they are differentiable copies, never routed through a write that crashes or drops part of
the tensor; every other capture is the tensor the logits are computed from."""
import pytest
import torch

from engine import zoo
from engine.loading import load_model

PROMPT = "The cat sat on the mat"
TOL = 1e-5  # fp32: norm of the difference over the norm of the no-grad capture


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error over the finite entries; infinite ones (masked scores) must match exactly."""
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin) or not torch.equal(a[~fin], b[~fin]):
        return float("inf")
    a, b = a[fin].double(), b[fin].double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The twins are tiny: one intra-op thread beats the pool (measured on a loaded 2-core machine: all
    96 twins in 22 s with one thread, 247 s with the default pool)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_grad_capture_equals_no_grad_capture(name):
    m = load_model(name, source="zoo")
    try:
        points = m.points()
        logits, ref = m.run_with_cache(PROMPT, points)
        glogits, got = m.run_with_cache(PROMPT, points, grad=True)
        assert sorted(got.keys()) == sorted(ref.keys())
        assert _rel(glogits.detach(), logits) < TOL
        floats = []
        for key in ref.keys():
            want, have = ref[key], got[key]
            assert have.shape == want.shape, key
            if want.dtype.is_floating_point:
                assert have.requires_grad, f"{key} left the autograd graph"
                assert _rel(have.detach(), want) < TOL, key
                floats.append(key)
            else:
                assert torch.equal(have, want), key
        grads = torch.autograd.grad(glogits.sum(), [got[k] for k in floats], allow_unused=True)
        for key, g in zip(floats, grads):  # the forward's own tensor, or (capture-only) a copy it never reads
            assert (g is None) == bool(m.verdict(key).capture_only), key
    finally:
        m.close()
