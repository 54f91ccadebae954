"""One error hierarchy (issue 36): every error class of engine/ is defined in engine/core/errors.py,
derives from EngineError and is exported from `engine`; the server tells a client's error from the
engine's own failure by that hierarchy."""
from __future__ import annotations

import ast
import builtins
import pathlib

import pytest

import engine
from engine.core import errors

ENGINE = pathlib.Path(__file__).resolve().parents[1] / "engine"
# error classes defined beside their data for now, each with why
ELSEWHERE = {
    "core/steering.py:NonFiniteSteer": "the hot-path rewrite of core/steering.py is under way; move it when it lands",
    "core/results.py:StrictSteerError": "the hot-path rewrite of core/results.py is under way; move it when it lands",
    "backends/hf/stop.py:_Stopped": "private control flow that ends HF generate early, never seen by a caller",
    "serve/connections.py:_Abandoned": "private control flow: a send on a connection the server aborted stops the "
                                        "app producing for it; never reaches a client",
}
BUILTIN_ERRORS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _error_classes(root: pathlib.Path = ENGINE) -> dict[str, str]:
    """{"path:Class": its module path} for every class of engine/ that derives (by name, through any
    chain of engine classes) from a builtin exception."""
    classes = {}
    for p in root.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))}
                classes[f"{p.relative_to(root)}:{node.name}"] = bases
    known = BUILTIN_ERRORS | {n for n, v in vars(errors).items() if isinstance(v, type)}
    grew = True
    while grew:
        found = {k.split(":")[1] for k, bases in classes.items() if bases & known}
        grew = not found <= known
        known |= found
    return {k: k.split(":")[0] for k, bases in classes.items() if bases & known}


def test_every_error_class_lives_in_the_errors_module():
    found = _error_classes()
    assert "core/errors.py:EngineError" in found and "core/errors.py:ServeError" in found  # the scan sees them
    outside = sorted(k for k, path in found.items() if path != "core/errors.py" and k not in ELSEWHERE)
    assert outside == [], f"define these in engine/core/errors.py (and import them where they are raised): {outside}"
    stale = sorted(k for k in ELSEWHERE if k not in found)
    assert stale == [], f"ELSEWHERE lists classes that moved or went: {stale}"


def test_the_scan_finds_a_planted_error(tmp_path):
    planted = tmp_path / "engine"
    (planted / "harvest").mkdir(parents=True)
    (planted / "harvest" / "x.py").write_text("from engine.core.errors import MixingError\n"
                                              "class A(MixingError):\n    pass\nclass B(A):\n    pass\n"
                                              "class C:\n    pass\nclass D(ValueError):\n    pass\n")
    assert sorted(_error_classes(planted)) == ["harvest/x.py:A", "harvest/x.py:B", "harvest/x.py:D"]


ERRORS = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, BaseException)]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_is_an_engine_error_exported_from_engine(cls):
    assert issubclass(cls, errors.EngineError)
    assert cls.__name__ in engine.__all__ and getattr(engine, cls.__name__) is cls


def test_the_steering_errors_kept_beside_their_data_are_exported_too():
    from engine.core.results import StrictSteerError
    from engine.core.steering import NonFiniteSteer
    assert engine.NonFiniteSteer is NonFiniteSteer and engine.StrictSteerError is StrictSteerError
    assert issubclass(NonFiniteSteer, errors.SteeringError) and issubclass(StrictSteerError, errors.SteeringError)


def test_one_input_error_for_the_model_and_the_harvest(tmp_path):
    """harvest had its own InputError (a ValueError, not an EngineError, under the same name)."""
    import engine.harvest
    from engine.harvest import inputs
    assert engine.harvest.InputError is engine.InputError is inputs.InputError
    with pytest.raises(engine.InputError, match=r"does not exist; give a \.txt, \.jsonl") as e:
        inputs.open_source(tmp_path / "missing.jsonl")
    assert isinstance(e.value, engine.EngineError) and isinstance(e.value, ValueError)


def test_moved_classes_keep_their_old_import_paths_and_bases():
    from engine.backends.vllm.proof import TapProofError
    from engine.backends.vllm.worker.runner import RunnerError
    from engine.core.readouts import ReadoutError
    from engine.harvest.capture import PointError
    from engine.harvest.manifest import MixingError, PartBusyError
    from engine.interop.mappers import UnmappedError
    from engine.serve.errors import ServeError
    from engine.serve.guard import BodyTooLarge
    assert (TapProofError, RunnerError, ReadoutError, PointError, MixingError, PartBusyError, UnmappedError,
            ServeError, BodyTooLarge) == (errors.TapProofError, errors.RunnerError, errors.ReadoutError,
                                          errors.PointError, errors.MixingError, errors.PartBusyError,
                                          errors.UnmappedError, errors.ServeError, errors.BodyTooLarge)
    assert issubclass(TapProofError, RuntimeError) and issubclass(RunnerError, NotImplementedError)
    assert issubclass(MixingError, ValueError) and issubclass(PointError, errors.AddressError)


def test_the_server_tells_a_refusal_from_a_failure():
    from engine.serve.errors import from_engine, is_client_error
    refusal = errors.AddressError("unknown point 'resid_postt'; did you mean 'resid_post'?")
    assert is_client_error(refusal) and from_engine(refusal, "interp.capture.points[0]").status == 400
    failure = errors.TapProofError("tap resid_post.0 captured nothing")
    assert not is_client_error(failure)
    err = from_engine(failure)
    assert (err.status, err.message) == (500, "TapProofError: tap resid_post.0 captured nothing")
    assert not is_client_error(errors.EngineError("closed"))
    served = errors.ServeError(429, "too many requests in flight", None, {"Retry-After": "1"})
    assert not is_client_error(served) and from_engine(served, "prompt") is served  # its own status, untouched
    big = errors.BodyTooLarge("request body over 16 MiB (--max-body-bytes)")
    assert (big.status, big.message, str(big)) == (413, "request body over 16 MiB (--max-body-bytes)",
                                                   "request body over 16 MiB (--max-body-bytes)")
