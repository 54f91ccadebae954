"""vllm-static's taps as a CUDA graph needs them (engine/backends/vllm/worker/static.py): every buffer keeps
its storage for the engine's life (a captured graph reads and writes fixed addresses), the per-row
steer coefficients are written into it in place before a forward, and the forward applies them and
leaves its rows in `cap`. The replay itself needs a GPU; everything around it runs here on a Linear."""
from __future__ import annotations

import torch

from engine.backends.vllm.worker.static import Tap
from engine.backends.vllm.worker.tree import VSite
from engine.core.steering import Steer

ROWS, WIDTH = 8, 4


def _tap():
    torch.manual_seed(0)
    lin = torch.nn.Linear(WIDTH, WIDTH)
    site = VSite(lin, "post", "out", get=lambda out: out, put=lambda out, new: new)
    return lin, Tap("resid_post.0", site, WIDTH, ROWS, True, "cpu", torch.float32, 0)


def _ptrs(tap):
    return {k: tap.buf(k).data_ptr() for k in ("cap", "u", "mul", "add")}


def test_steer_coefficients_are_written_in_place_and_applied_per_row():
    lin, tap = _tap()
    before = _ptrs(tap)
    x = torch.randn(3, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)  # the reference, without the tap
    v = torch.tensor([1.0, -2.0, 3.0, 0.5])
    tap.fill(torch.tensor([1]), Steer("resid_post.0", "add", v), None)
    tap.fill(torch.tensor([2]), Steer("resid_post.0", "scale", torch.tensor(2.0)), None)
    assert _ptrs(tap) == before  # same storage: a captured graph sees the new coefficients
    out = lin(x)
    torch.testing.assert_close(out[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], plain[1] + v)
    torch.testing.assert_close(out[2], plain[2] * 2)
    torch.testing.assert_close(tap.buf("cap")[:3], out)  # the capture rows a step reads after the forward
    tap.reset()
    assert _ptrs(tap) == before
    torch.testing.assert_close(lin(x), plain, rtol=0, atol=0)  # identity again on every row


def test_project_out_and_set_rows_keep_the_storage():
    lin, tap = _tap()
    before = _ptrs(tap)
    x = torch.randn(2, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    d = torch.tensor([0.0, 1.0, 0.0, 0.0])
    tap.fill(torch.tensor([0]), Steer("resid_post.0", "project_out", d), None)
    tap.fill(torch.tensor([1]), Steer("resid_post.0", "set", torch.full((WIDTH,), 7.0)), None)
    assert _ptrs(tap) == before
    out = lin(x)
    want0 = plain[0].clone()
    want0[1] = 0.0
    torch.testing.assert_close(out[0], want0)
    torch.testing.assert_close(out[1], torch.full((WIDTH,), 7.0))


def test_a_step_fills_only_its_rows_and_the_next_step_undoes_them():
    """StaticTaps.before: a steer at every position fills its span's rows (a slice), one at some
    positions only those rows; the next step without steers leaves every row the identity again."""
    from engine.backends.vllm.worker.static import StaticTaps
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step
    lin, tap = _tap()
    taps = StaticTaps()
    taps.taps["resid_post.0"], taps.head_dim["resid_post.0"] = tap, None
    v, w = torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([0.0, 5.0, 0.0, 1.0])
    a = Plan(4, steers=[Steer("resid_post.0", "add", v)])
    b = Plan(4, steers=[Steer("resid_post.0", "add", w, positions=slice(5, 6))])
    x = torch.randn(5, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    # rows 0-1: plan a at positions 3, 4; rows 2-4: plan b at positions 4, 5, 6 (only position 5 touched)
    taps.before(Step([Span(a, 0, 2, 3), Span(b, 2, 5, 4)], 5), site_work([a, b], str))
    out = lin(x)
    want = plain.clone()
    want[0:2] += v
    want[3] += w
    torch.testing.assert_close(out, want)
    taps.before(Step([Span(a, 0, 1, 5)], 1), site_work([], str))  # plan a finished steering: nothing registered
    torch.testing.assert_close(lin(x), plain, rtol=0, atol=0)
    assert tap.dirty is None
