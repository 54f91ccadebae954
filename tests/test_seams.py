"""The typed seams of issue 20: vLLM modes as objects, one steer validation with the mode's rules,
fields declared (never attached after construction), and HEADED as a Point trait. No engine starts:
the mode objects and dataclasses are checked directly."""
from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

from engine.backends.vllm.client import Submission
from engine.backends.vllm.modes import MODES, NO_CAPTURE, HooksMode, StaticTapsMode, StockMode, mode_for
from engine.backends.vllm.runtime import LoadReport
from engine.core.address import Address
from engine.core.backends import VLLM_BACKENDS
from engine.core.errors import SteeringError, UnsupportedPointError
from engine.core.ledger import Ledger
from engine.core.ops import OPS, AffineRows
from engine.core.plan import Plan, SiteWork, Span
from engine.core.points import HEADED_POINTS, POINTS, get_point
from engine.core.steer_checks import check_steers
from engine.core.steering import CacheEntry, Steer
from engine.core.step import Step

ENGINE = pathlib.Path(__file__).resolve().parents[1] / "engine"
D = 8


def test_one_mode_per_vllm_backend_and_a_clear_error_for_others():
    assert tuple(MODES) == VLLM_BACKENDS
    assert [type(m) for m in MODES.values()] == [HooksMode, StaticTapsMode, StockMode]
    assert mode_for("vllm-static") is MODES["vllm-static"]
    with pytest.raises(ValueError, match=r"unknown vLLM backend 'vllm-statc'\. Did you mean 'vllm-static'"):
        mode_for("vllm-statc")


def test_each_mode_says_what_the_engine_starts_with():
    hooks = MODES["vllm"].setup(None, compile=True)
    assert hooks.kw["enforce_eager"] is True and hooks.kw["worker_extension_cls"].endswith("InterpWorker")
    # nothing compiles in the hooked workers: vLLM's compiled logprob-rank helper cost the first stream 25 s
    assert hooks.declared is None and hooks.env == {"TORCH_COMPILE_DISABLE": "1"}
    declared = [Address("resid_post", 0), Address("attn_out", 1)]
    static = MODES["vllm-static"].setup(declared, compile=True)
    assert static.kw["enforce_eager"] is False and static.kw["load_format"] == "interp_static"
    assert static.kw["model_loader_extra_config"]["interp_static"] == [
        ["resid_post.0", True], ["attn_out.1", True], ["final_norm", False]]  # the engine's own logits read
    assert static.declared == [*declared, Address("final_norm")] and static.env == {"VLLM_DISABLE_COMPILE_CACHE": "1"}
    assert MODES["vllm-static"].setup([Address("final_norm")], compile=False).kw["enforce_eager"] is True
    stock = MODES["vllm-generate"].setup(None, compile=True)
    assert stock.kw == {} and stock.env == {} and not MODES["vllm-generate"].worker
    assert [m.declares for m in MODES.values()] == [False, True, False]
    assert MODES["vllm-generate"].unserved == NO_CAPTURE and MODES["vllm"].unserved is None


def test_what_each_mode_serves():
    declared = [Address("resid_post", 0), Address("final_norm")]
    assert MODES["vllm-static"].check_served(Address("resid_post", 0), declared) is True
    with pytest.raises(UnsupportedPointError, match=r"resid_post\.1 cannot be served by backend 'vllm-static'.*"
                                                     r"declared at load: resid_post\.0, final_norm"):
        MODES["vllm-static"].check_served(Address("resid_post", 1), declared)
    assert MODES["vllm"].check_served(Address("resid_post", 1), None) is False  # the engine's table decides
    with pytest.raises(UnsupportedPointError, match=r"mlp_pre\.0 cannot be served by backend 'vllm': vLLM fuses"):
        MODES["vllm"].check_served(Address("mlp_pre", 0), None)
    with pytest.raises(UnsupportedPointError, match="vllm-generate is stock vLLM"):
        MODES["vllm-generate"].check_served(Address("resid_post", 0), None)
    assert MODES["vllm-static"].capture_only({"writable": False}) == StaticTapsMode.READ_ONLY
    assert MODES["vllm-static"].capture_only({"writable": True}) is None
    assert MODES["vllm"].capture_only({}) is None


def _sae_dir() -> str:
    import tempfile

    from engine.core.sae_files import write_random_sae
    return str(write_random_sae(tempfile.mkdtemp(prefix="seams-sae-"), "standard", D, 4, seed=0))


GIVEN = {"coeff": 2.0, "bounds": (-1.0, 1.0), "feature": 1}


@pytest.mark.parametrize("name", [n for n, o in OPS.items() if o.params and (o.affine is None or o.static_if)])
def test_a_steer_refused_by_a_mode_names_the_mode_and_the_field(name):
    """Every op that vllm-static refuses for its parameters: the message names the op, the address, the
    mode, the row's reason and each parameter given."""
    op = OPS[name]
    given = {k: (_sae_dir() if k == "sae" else GIVEN[k]) for k in op.params}
    st = Steer("resid_post.0", name, None if op.value == "none" else torch.ones(D), **given)
    with pytest.raises(SteeringError) as e:
        MODES["vllm-static"].check_steer(st, {"writable": True})
    msg = str(e.value)
    assert f"'{name}' at resid_post.0 cannot run on vllm-static" in msg and op.static in msg
    assert all(f"({k}={getattr(st, k)!r})" in msg for k in op.params), msg
    assert "use backend='vllm' or 'eager'" in msg
    MODES["vllm"].check_steer(st, {"writable": False})  # hooks take every op, at any served point
    with pytest.raises(SteeringError, match="vllm-generate is stock vLLM"):
        MODES["vllm-generate"].check_steer(st, {})


def test_static_refuses_a_read_only_tap_by_address():
    st = Steer("resid_post.3", "add", torch.ones(D))
    with pytest.raises(UnsupportedPointError, match=r"steer address resid_post\.3 is a read-only tap of this "
                                                     r"vllm-static engine; declare it in static_points"):
        MODES["vllm-static"].check_steer(st, {"writable": False})


def test_check_steers_is_the_one_pass_form_then_model_then_together():
    """The argument's form is refused before the model sees anything; each steer (the blocks' first)
    goes through the model's rule; the mode's rule for the set sees them all, resolved."""
    seen, together = [], []

    def model(st):
        seen.append(st)
        return st.at(Address("resid_post", 1))

    ctx = Steer("resid_post.-1", "add", torch.ones(D))
    arg = Steer("resid_post.0", "scale", 2.0)
    out = check_steers([arg], (ctx,), model, together.append)
    assert seen == [ctx, arg] and together == [out]
    assert [s.address for s in out] == [Address("resid_post", 1)] * 2 and out[1].op == "scale"
    with pytest.raises(SteeringError, match="steer entry 1 is str 'x', not a Steer"):
        check_steers([arg, "x"], (), model)
    assert len(seen) == 2  # the model never saw the bad call
    with pytest.raises(SteeringError, match="project_out at resid_post.0 before any other op"):
        check_steers([Steer("resid_post.0", "add", torch.ones(D)), Steer("resid_post.0", "project_out", torch.ones(D))],
                     together=MODES["vllm-static"].check_steers)


def _instances():
    plan = Plan(3)
    return [plan, Span(plan, 0, 3, 0), Step([], 0), Ledger(), SiteWork(), Steer("resid_post.0", "ablate"),
            CacheEntry("resid_post.0", [torch.zeros(2, D)]), Submission(plan, {}, [1, 2, 3]),
            LoadReport("vllm", 1.0, 0, 0), OPS["add"], AffineRows.identity(1, D)]


@pytest.mark.parametrize("obj", _instances(), ids=lambda o: type(o).__name__)
def test_no_attribute_is_attached_after_construction(obj):
    """Plans, steers, submissions, reports and op rows declare every field: an undeclared attribute is
    refused (slots or frozen), so no code can hang data on them later and read it back with getattr."""
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError)):
        obj.attached_later = [Address("attn_probs", 0)]
    assert not hasattr(obj, "attached_later")


def test_frozen_records_are_copied_with_replace():
    r = LoadReport("vllm-static", 1.0, 0, 0, cudagraph_mode="NONE")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.proof = {"taps": 1}
    proven = dataclasses.replace(r, proof={"taps": 1})
    assert proven.proof == {"taps": 1} and r.proof is None
    assert proven.extra == {"cudagraph_mode": "NONE", "proof": {"taps": 1}}  # the earlier dict, as a view
    sub = Submission(Plan(2), {"max_tokens": 1}, [5, 6], (Address("attn_probs", 0),), True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sub.salted = False


def test_headed_is_a_point_trait_read_from_its_shape():
    by_shape = [p.name for p in POINTS if p.shape.replace(" ", "").endswith(",hd]")]
    assert list(HEADED_POINTS) == by_shape and {"q", "k", "value", "z"} <= set(by_shape)
    assert get_point("z").headed and not get_point("resid_post").headed and not get_point("attn_probs").headed


def _engine_sources():
    return {p: p.read_text() for p in ENGINE.rglob("*.py")}


def test_no_module_relists_a_point_trait_or_compares_vllm_backend_names():
    # the four headed points vLLM serves, in any order (a fused q/k/value split of three is another fact)
    relisted = re.compile(r"""\(\s*["'](z|q|k|value)["'](\s*,\s*["'](z|q|k|value)["']){3}\s*\)""")
    compares = re.compile(r"""backend\s*(==|!=)\s*["']vllm""")
    vllm_client = {"client.py", "backend.py", "catalogue.py", "modes.py"}
    bad = []
    for path, text in _engine_sources().items():
        if relisted.search(text):
            bad.append(f"{path}: lists the headed points (use Point.headed / HEADED_POINTS)")
        if path.name == "extension.py" and re.search(r"self\.taps\b", text):
            bad.append(f"{path}: asks whether the engine has static taps (ask self.mode: HookSites | StaticTaps)")
        if path.parent.name == "vllm" and path.name in vllm_client and compares.search(text):
            bad.append(f"{path}: compares a vLLM backend name (ask the mode, engine/backends/vllm/modes.py)")
        for m in re.finditer(r"getattr\((plan|sub|site|report)\b[^)]*,\s*None\)", text):
            bad.append(f"{path}: {m.group(0)} reads back an attribute attached after construction")
    assert bad == []
