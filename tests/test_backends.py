"""One backend registry (issue 36): engine/core/backends.py maps each backend name to its object (its
runtime's dtypes, devices and knobs, what it captures, what it declares, its load keywords); nothing
else in engine/ compares backend names; load_model refuses a keyword a backend does not take, by
name, on every backend, before anything loads."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from engine.core import backends as B
from engine.core.errors import OptionError

ENGINE = pathlib.Path(__file__).resolve().parents[1] / "engine"
NAMES = ("eager", "vllm", "vllm-static", "vllm-generate")
# where a backend name may key a dict: the point catalogue's per-backend statuses (a point's facts)
NAME_KEYS_ALLOWED = {"core/points.py"}
# where the same word names something else, each with what it names there
NOT_A_BACKEND = {"backends/hf/attention.py": "'eager' is HF's attention implementation (attn_implementation)"}


def test_the_registry_holds_every_backend_once():
    assert B.BACKENDS == NAMES and tuple(B.REGISTRY) == NAMES
    assert B.VLLM_BACKENDS == ("vllm", "vllm-static", "vllm-generate")
    assert B.CAPTURE_BACKENDS == ("eager", "vllm", "vllm-static") and B.STOCK_BACKEND == "vllm-generate"
    assert [b.runtime for b in B.REGISTRY.values()] == [B.HF, B.VLLM, B.VLLM, B.VLLM]
    assert [b.declares for b in B.REGISTRY.values()] == [False, False, True, False]
    assert B.backend_for("vllm-static").static_points == "auto"
    import engine
    assert engine.BACKENDS is B.BACKENDS


@pytest.mark.parametrize("bad,hint", [("vllm-statc", "Did you mean 'vllm-static'"), ("egaer", "Did you mean 'eager'"),
                                      ("hf", ""), (None, "")])
def test_an_unknown_backend_is_refused_with_the_accepted_ones(bad, hint):
    with pytest.raises(OptionError, match=rf"unknown backend {bad!r}\.") as e:
        B.backend_for(bad)
    assert hint in str(e.value) and "Backends: eager, vllm, vllm-static, vllm-generate." in str(e.value)


def test_each_runtime_says_its_dtypes_devices_and_knobs():
    assert (B.HF.default_dtype, B.HF.platform_device, B.HF.own_processes, B.HF.sampling_extras) == (
        "float32", False, False, False)
    assert (B.VLLM.default_dtype, B.VLLM.platform_device, B.VLLM.own_processes, B.VLLM.sampling_extras) == (
        None, True, True, True)
    assert "float64" in B.HF.dtypes and "float64" not in B.VLLM.dtypes
    assert (B.HF.batch_tokens, B.VLLM.batch_tokens) == (1024, 8192)


def test_load_kw_keeps_what_each_backend_takes():
    sizes = dict(max_model_len=257, max_num_seqs=4, static_points=["resid_post.1"])
    assert B.backend_for("eager").load_kw(**sizes) == {}
    assert B.backend_for("vllm").load_kw(**sizes) == {"max_model_len": 257, "max_num_seqs": 4}
    assert B.backend_for("vllm-generate").load_kw(**sizes) == {"max_model_len": 257, "max_num_seqs": 4}
    assert B.backend_for("vllm-static").load_kw(**sizes) == {**sizes}
    assert B.backend_for("vllm-static").load_kw(max_model_len=None) == {}  # None: the backend's own default


def test_policies_read_from_the_registry():
    from engine.model import options
    from engine.model.sampling import Sampling
    assert options.parse_dtype("fp64", "eager") is torch.float64
    with pytest.raises(OptionError, match=r"dtype float64 is not served by vLLM \(backend 'vllm-static'\); use one "
                                          r"of float32, float16, bfloat16 .*or backend='eager' for float64"):
        options.parse_dtype("fp64", "vllm-static")
    with pytest.raises(OptionError, match=r"unknown sampling option \['n'\] for backend 'eager'"):
        Sampling.parse({"n": 1}, "eager")
    with pytest.raises(OptionError, match="the vLLM backends run one sample per request"):
        Sampling.parse({"n": 2}, "vllm-generate")
    with pytest.raises(OptionError, match="unknown backend 'vllm2'"):
        options.parse_device(None, "vllm2")


# -- no backend name compared outside the registry ------------------------------------------------
def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _names_in(node: ast.AST) -> bool:
    return _is_name(node) or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(_is_name, node.elts)))


def comparisons(source: str, path: str) -> list[str]:
    """Places in `source` that decide on a backend's name: a comparison with (or membership in) names,
    a startswith / endswith on a name's prefix, a dict keyed by names."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(_names_in, [node.left, *node.comparators])):
            out.append(f"{path}:{node.lineno}: compares a backend name")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and any(n.startswith(node.args[0].value) or n.endswith(node.args[0].value) for n in NAMES)):
            out.append(f"{path}:{node.lineno}: tests a backend name's {node.func.attr}")
        elif isinstance(node, ast.Dict) and any(k is not None and _is_name(k) for k in node.keys) \
                and path not in NAME_KEYS_ALLOWED:
            out.append(f"{path}:{node.lineno}: keys a dict by backend name")
    return out


def test_no_module_outside_the_registry_decides_on_a_backend_name():
    bad = []
    for p in sorted(ENGINE.rglob("*.py")):
        rel = str(p.relative_to(ENGINE))
        if rel != "core/backends.py" and rel not in NOT_A_BACKEND:
            bad += comparisons(p.read_text(), rel)
    assert bad == [], "ask the backend object (engine/core/backends.py: backend_for(name)) instead:\n" + "\n".join(bad)


def test_the_scan_finds_each_form():
    planted = '''
if backend == "eager": pass
if "vllm-static" != model.backend: pass
if backend in ("vllm", "vllm-static"): pass
if name.startswith("vllm"): pass
DEFAULTS = {"eager": 1024}
ok = backend_status(point, "vllm")  # passing a name is not deciding on it
doc = "backend='vllm': hooks"
'''
    assert [line.split(": ", 1)[1] for line in comparisons(planted, "x.py")] == [
        "compares a backend name", "compares a backend name", "compares a backend name",
        "tests a backend name's startswith", "keys a dict by backend name"]


# -- load_model refuses a keyword its backend does not take -----------------------------------------
@pytest.mark.parametrize("backend", NAMES)
def test_load_model_refuses_an_unknown_keyword_by_name_on_every_backend(backend, monkeypatch):
    """Nothing loads: the refusal comes before the model name is even resolved (`no/such-model`)."""
    from engine.loading import load_model
    from engine.model import sources
    monkeypatch.setattr(sources, "resolve", lambda *a, **k: pytest.fail("resolved the model before the check"))
    if backend == "eager":  # eager takes no load option at all: max_num_seqs used to be dropped silently
        with pytest.raises(OptionError, match=r"unknown keyword 'max_num_seqs' for backend 'eager': it takes source, "
                                              r"dtype, device and attention only .*vllm, vllm-static, vllm-generate"):
            load_model("no/such-model", backend=backend, max_num_seqs=4)
        return
    with pytest.raises(OptionError, match=rf"unknown keyword 'max_num_seq' for backend '{backend}'\. Did you mean "
                                          r"'max_num_seqs'.*and vLLM's engine arguments"):
        load_model("no/such-model", backend=backend, max_num_seq=4)
    with pytest.raises(OptionError, match=r"unknown keywords 'bogus', 'zzz_option'"):
        load_model("no/such-model", backend=backend, zzz_option=1, bogus=True)


def test_vllm_load_options_are_checked_once_where_they_enter():
    from engine.backends.vllm.load_options import LoadOptions
    o = LoadOptions.parse("vllm-static", {"max_model_len": 64, "enable_prefix_caching": False})
    assert (o.static_points, o.max_model_len, o.engine_kw) == ("auto", 64, {"enable_prefix_caching": False})
    assert LoadOptions.parse("vllm", {}).static_points is None  # a backend that declares no taps holds none
    with pytest.raises(OptionError, match="static_points is for backend='vllm-static', not 'vllm'"):
        LoadOptions.parse("vllm", {"static_points": ["resid_post"]})
    for bad, msg in [({"max_model_len": 0}, "max_model_len must be a whole number >= 1"),
                     ({"max_num_seqs": 2.5}, "max_num_seqs must be a whole number >= 1"),
                     ({"tensor_parallel_size": None}, "tensor_parallel_size must be a whole number >= 1, got None"),
                     ({"compile": "no"}, "compile must be True or False"),
                     ({"seed": True}, "seed must be a whole number >= 0")]:
        with pytest.raises(OptionError, match=msg):
            LoadOptions.parse("vllm", bad)
