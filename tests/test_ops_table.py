"""The op table (engine/core/ops.py): each row's eager maths against its vllm-static affine form as the
worker's Tap applies it, rows without a form refused by name with the row's reason, and the parameter
checks Steer derives from the rows."""
from __future__ import annotations

import math
import tempfile

import pytest
import torch

from engine.backends.vllm.modes import MODES
from engine.backends.vllm.worker.static import Tap, lone_tap
from engine.backends.vllm.worker.tree import VSite
from engine.core.errors import SteeringError
from engine.core.ops import OPS, AffineRows, Op
from engine.core.sae_files import write_random_sae
from engine.core.site import apply_steer
from engine.core.steering import Steer, finite_number

WIDTH, ROWS = 6, 5
STATIC = MODES["vllm-static"]
_SAE = str(write_random_sae(tempfile.mkdtemp(prefix="ops-table-sae-"), "standard", WIDTH, 8, seed=0))
PARAMS = {"rescale": {"coeff": 0.0}, "norm_scaled_add": {"coeff": 0.5}, "projection_cap": {"bounds": (-0.2, 0.3)},
          **{f"feature_{k}": {"coeff": 1.5, "sae": _SAE, "feature": [1, 5]} for k in ("clamp", "scale", "add")}}


class _Id(torch.nn.Module):
    def forward(self, x):
        return x


def _tap() -> Tap:
    site = VSite(_Id(), "post", "out", lambda o: o, lambda o, n: n)
    return lone_tap("resid_post.0", site, WIDTH, rows=ROWS, writable=True, device="cpu", dtype=torch.float32)


def _value(op: Op, g: torch.Generator, per_row: bool):
    shape = (ROWS, WIDTH) if per_row or op.value == "activation" else (WIDTH,)
    if op.value == "none":
        return None
    if op.value == "scale" and not per_row:
        return float(torch.rand((), generator=g)) * 3 - 1.5
    return torch.randn(shape, generator=g)


def _static_ops():
    return [n for n, o in OPS.items() if o.affine is not None]



def values_at(steer: Steer, rows: torch.Tensor, shape: tuple):
    """The steer's value for the rows at positions `rows`, as a step gathers it (engine/core/step.py)."""
    st = steer.bound()
    st.check_shape(shape)
    return None if st.value is None else (st.value[rows] if st.lead else st.value)

@pytest.mark.parametrize("per_row", [False, True], ids=["one value", "a value per position"])
@pytest.mark.parametrize("name", _static_ops())
def test_each_rows_affine_form_as_the_worker_applies_it_equals_its_eager_maths(name, per_row):
    """Every row with a static form: the worker's Tap.fill composes the row's affine form into the
    tap buffers and the tap's forward applies it; that equals the row's eager maths (apply_steer)."""
    op, g = OPS[name], torch.Generator().manual_seed(hash((name, per_row)) % 2**31)
    steer = Steer("resid_post.0", name, _value(op, g, per_row), **PARAMS.get(name, {}))
    assert op.static_refusal(steer) is None
    x = torch.randn(ROWS, WIDTH, generator=g) * 2
    rows = torch.tensor([0, 2, 3])
    mask = torch.zeros(ROWS, dtype=torch.bool)
    mask[rows] = True
    tap = _tap()
    v = values_at(steer, rows, (WIDTH,))
    tap.fill(rows, steer, None, v)
    got = tap.site.module(x)
    want = apply_steer(steer, x, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = ~mask
    assert torch.equal(got[untouched], x[untouched])  # identity on the other rows
    # composed with coefficients already there (another steer at the tap): the row's form maps rows the
    # way its maths does after them (or, for a `first` row that sets u, before them)
    prior = AffineRows(torch.zeros(3, WIDTH), torch.randn(3, WIDTH, generator=g), torch.randn(3, WIDTH, generator=g))
    a = op.affine(prior, None if v is None else v.float(), steer)
    xs = x[rows]
    want = prior(op.apply(xs, v, steer)) if op.first else op.apply(prior(xs), v, steer)
    torch.testing.assert_close(a(xs), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", _static_ops())
def test_each_rows_affine_form_composes_with_another_steer_on_the_worker(name):
    """Two steers at one tap (an add before, or after a `first` row): the tap applies both as
    apply_steer does one after the other."""
    op, g = OPS[name], torch.Generator().manual_seed(7)
    steer = Steer("resid_post.0", name, _value(op, g, False), **PARAMS.get(name, {}))
    other = Steer("resid_post.0", "add", torch.randn(WIDTH, generator=g))
    steers = [steer, other] if op.first else [other, steer]
    x, rows = torch.randn(ROWS, WIDTH, generator=g), torch.tensor([1, 4])
    mask = torch.zeros(ROWS, dtype=torch.bool)
    mask[rows] = True
    tap, want = _tap(), x
    for st in steers:
        tap.fill(rows, st, None, values_at(st, rows, (WIDTH,)))
        want = apply_steer(st, want, mask)
    torch.testing.assert_close(tap.site.module(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", _static_ops())
def test_each_rows_affine_form_is_a_scale_and_a_shift_of_the_coefficients(name):
    """What vllm-static's host table rests on (engine/backends/vllm/worker/table.py): every static row maps
    the coefficients already at a row as mul * a, add * a + b (u kept, or its own for a `first` row), with
    (a, b, u) its affine form of the identity; composing by that rule equals its affine form on any prior."""
    import numpy as np

    from engine.backends.vllm.worker.table import form_of
    op, g = OPS[name], torch.Generator().manual_seed(11)
    steer = Steer("resid_post.0", name, _value(op, g, False), **PARAMS.get(name, {}))
    form = form_of(steer, WIDTH, None, torch.device("cpu"))
    n = form.a.shape[0] if form.lead else 3  # a value by position: one row of its form per position
    prior = AffineRows(torch.zeros(n, WIDTH), torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
    v = steer.value
    want = op.affine(prior, None if v is None else v.float(), steer)
    a, b = torch.from_numpy(form.a), torch.from_numpy(form.b)
    assert torch.equal(prior.mul * a, want.mul) and torch.equal(prior.add * a + b, want.add)
    assert torch.equal(want.u, prior.u if form.u is None else torch.from_numpy(np.broadcast_to(form.u, (n, WIDTH))))


@pytest.mark.parametrize("name", [n for n, o in OPS.items() if o.affine is None])
def test_a_row_without_an_affine_form_is_refused_with_its_reason(name):
    op = OPS[name]
    steer = Steer("resid_post.0", name, None if op.value == "none" else torch.ones(WIDTH), **PARAMS.get(name, {}))
    assert op.static and op.static_refusal(steer) == op.static
    with pytest.raises(SteeringError, match=f"'{name}' at resid_post.0 cannot run on vllm-static") as e:
        STATIC.check_steer_op(steer)
    assert op.static in str(e.value)
    with pytest.raises(SteeringError, match=f"vllm-static cannot apply '{name}'"):
        _tap().fill(torch.tensor([0]), steer, None)


def test_a_conditional_row_is_static_only_where_its_condition_holds():
    """rescale is project_out at coeff 0 (static), anything else refused with the row's reason."""
    d = torch.randn(WIDTH)
    STATIC.check_steer_op(Steer("resid_post.0", "rescale", d, coeff=0.0))
    with pytest.raises(SteeringError, match="a rescale by a coefficient other than 0"):
        STATIC.check_steer_op(Steer("resid_post.0", "rescale", d, coeff=2.0))
    with pytest.raises(SteeringError, match="vllm-static cannot apply 'rescale'"):
        _tap().fill(torch.tensor([0]), Steer("resid_post.0", "rescale", d, coeff=2.0), None)


def test_first_rows_order_at_a_tap_comes_from_the_row():
    firsts = [n for n, o in OPS.items() if o.first]
    assert set(firsts) == {"project_out", "rescale"}
    d = torch.randn(WIDTH)
    with pytest.raises(SteeringError, match="rescale at resid_post.0 before any other op"):
        STATIC.check_steers([Steer("resid_post.0", "add", d), Steer("resid_post.0", "rescale", d, coeff=0.0)])


def test_a_row_must_say_why_it_has_no_static_form():
    with pytest.raises(ValueError, match="op 'x' has no affine form: give static="):
        Op("x", "vector", "doc", lambda x, v, p: x)
    with pytest.raises(ValueError, match="value kind 'vec' is not one of"):
        Op("x", "vec", "doc", lambda x, v, p: x, static="no")
    with pytest.raises(ValueError, match="static only under a condition"):
        Op("x", "vector", "doc", lambda x, v, p: x, lambda a, v, p: a, static_if=lambda p: True)


@pytest.mark.parametrize("param", ["coeff", "bounds", "sae", "feature"])
def test_parameter_checks_derive_from_the_rows(param):
    takers = [n for n, o in OPS.items() if param in o.params]
    given = {"coeff": 1.0, "bounds": (0.0, 1.0), "sae": _SAE, "feature": 1}[param]
    for name, op in OPS.items():
        value = _value(op, torch.Generator().manual_seed(0), False)
        if param in op.params:
            with pytest.raises(SteeringError, match=f"needs {param}="):
                Steer("resid_post.0", name, value, **{k: v for k, v in PARAMS[name].items() if k != param})
        else:
            with pytest.raises(SteeringError, match=f"op '{name}' takes no {param}") as e:
                Steer("resid_post.0", name, value, **{param: given})
            assert all(t in str(e.value) for t in takers)


@pytest.mark.parametrize("x,fragment", [
    (True, "is a number, got bool"), ("1", "is a number, got str"), (None, "is a number, got NoneType"),
    (math.inf, "is inf; give a finite number"), (math.nan, "is nan; give a finite number"),
    (10 ** 400, "is inf; give a finite number"),
])
def test_finite_number_refuses_with_the_fields_name(x, fragment):
    with pytest.raises(SteeringError, match=f"coeff of 'rescale'.*{fragment}"):
        finite_number(x, "coeff of 'rescale'", "at resid_post.0")
    assert finite_number(3, "c") == 3.0 and isinstance(finite_number(3, "c"), float)


def test_every_number_field_of_a_steer_goes_through_the_one_check():
    d = torch.ones(WIDTH)
    with pytest.raises(SteeringError, match="coeff of 'norm_scaled_add' at resid_post.0 is inf"):
        Steer("resid_post.0", "norm_scaled_add", d, coeff=10 ** 400)
    with pytest.raises(SteeringError, match=r"bounds=\(None, inf\) at resid_post.0 is inf; give finite numbers"):
        Steer("resid_post.0", "projection_cap", d, bounds=(None, math.inf))
    with pytest.raises(SteeringError, match="the scale of 'scale' at resid_post.0 is inf"):
        Steer("resid_post.0", "scale", 10 ** 400)
    with pytest.raises(SteeringError, match="coeff of 'rescale' is a number, got bool"):
        Steer("resid_post.0", "rescale", d, coeff=True)


@pytest.mark.parametrize("first,lead,cols", [(f, ld, c) for f in (False, True) for ld in (False, True)
                                              for c in (slice(0, 2 * WIDTH), slice(WIDTH, 2 * WIDTH))])
def test_a_lone_forms_table_is_the_composed_tables_bit_for_bit(first, lead, cols):
    """Form.table_alone builds a step's table at a tap with one steer group directly (a prefill at 30 taps
    made 30 of them through the general composition's masks). The same bits as that composition from
    identity rows, signed zeros and non-finite values included (0 * inf: NaN either way)."""
    import numpy as np

    from engine.backends.vllm.worker.table import Form, _table
    rng = np.random.default_rng(0)
    p, c = (4 if lead else 1), cols.stop - cols.start
    a, b = (rng.standard_normal((p, c)).astype(np.float32) for _ in range(2))
    a[0, :3], b[0, :3] = [-2.0, np.inf, 0.0], [-0.0, 1.0, -0.0]  # -2 * 0 + -0.0 and 0 * inf: the edge bits
    u = rng.standard_normal((p, c)).astype(np.float32) if first else None
    form = Form(first, cols, a, b, u, lead)
    with np.errstate(invalid="ignore"):
        want = _table([(form, np.arange(p))], p, 2 * WIDTH)
        got = form.table_alone(2 * WIDTH)
    assert got.shape == want.shape == (p, 3, 2 * WIDTH) and got.tobytes() == want.tobytes()
    assert not got.flags.writeable and form.table_alone(2 * WIDTH) is got  # made once, shared read-only
