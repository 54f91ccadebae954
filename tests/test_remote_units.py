"""The pieces of engine.connect that need no server: binary frames (engine/serve/encoding.py), the error
body's engine class both ways (engine/serve/errors.py, engine/remote/errors.py), Retry-After, and the
request bodies read back by the server's own schemas into the same Steer / Readout."""
from __future__ import annotations

import email.utils
import json
import subprocess
import sys
import time

import pytest
import torch

from engine.core.crossing import error_classes, library_class
from engine.core.errors import (
    AddressError,
    EngineError,
    InputError,
    SteeringError,
    UnsupportedPointError,
)
from engine.core.readouts import LensTopK, Mean, Project, Readout, ReadoutError
from engine.core.results import StrictSteerError
from engine.core.steering import Steer
from engine.remote import bodies
from engine.remote.errors import (
    AuthenticationError,
    ServerBusy,
    ServerFailed,
    ServerRefused,
    error_from,
)
from engine.remote.transport import Retry, parse_retry_after
from engine.serve import encoding, errors
from engine.serve.schemas import ReadoutSpec, SteerSpec

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


# -- frames -------------------------------------------------------------------------------------------
def test_a_frame_carries_every_dtype_exactly_and_is_smaller_than_base64():
    ts = {"f32": torch.randn(7, 5), "bf16": torch.randn(4, 3).bfloat16(), "f16": torch.randn(2).half(),
          "i64": torch.arange(-3, 9), "i32": torch.tensor([[1, -2]], dtype=torch.int32), "empty": torch.zeros(0, 4),
          "scalar": torch.tensor(2.5)}
    obj = {"a": [encoding.encode(t, encoding.BINARY) for t in ts.values()], "meta": {"n": 1, "s": "x"}}
    body = encoding.frame_bytes(obj)
    assert body.startswith(encoding.MAGIC)
    back = encoding.unframe(body)
    assert back["meta"] == {"n": 1, "s": "x"}
    for t, o in zip(ts.values(), back["a"]):
        got = encoding.decode(o)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    big = [torch.randn(64, 256), torch.randn(64, 512)]  # a capture's size: the raw bytes plus a small header
    framed = encoding.frame_bytes({"c": [encoding.encode(t, encoding.BINARY) for t in big]})
    raw = sum(t.numel() * t.element_size() for t in big)
    assert raw < len(framed) < raw + 300
    assert len(encoding.json_bytes({"c": [encoding.encode(t) for t in big]})) > raw * 4 / 3  # base64: 4/3 of raw


@pytest.mark.parametrize("cut, fragment", [
    (lambda b: b[:5], "magic"), (lambda b: b"{" + b[1:], "magic"), (lambda b: b[:-1], "truncated frame"),
    (lambda b: b + b"x", "truncated frame"), (lambda b: b[:20], "truncated frame")])
def test_a_broken_frame_is_refused_by_name(cut, fragment):
    body = encoding.frame_bytes({"x": encoding.encode(torch.ones(3), encoding.BINARY)})
    with pytest.raises(ValueError, match=fragment):
        encoding.unframe(cut(body))


def test_a_frame_tensor_of_the_wrong_size_is_refused():
    obj = encoding.unframe(encoding.frame_bytes({"x": encoding.encode(torch.ones(3), encoding.BINARY)}))
    with pytest.raises(ValueError, match="holds 12 bytes but shape \\[4\\] of float32 needs 16"):
        encoding.decode({**obj["x"], "shape": [4]})


# -- the engine's class in an error body ------------------------------------------------------------
def test_the_error_body_names_the_nearest_core_class():
    from engine.interop.mappers import UnmappedError

    class Local(UnsupportedPointError):  # a class defined outside engine/core: named by its core base
        pass
    assert errors.kind_of(Local("x")) == "UnsupportedPointError"
    assert errors.kind_of(UnmappedError("x")) == "UnmappedError"  # every engine class lives in core.errors
    assert errors.kind_of(UnsupportedPointError("x")) == "UnsupportedPointError"
    assert errors.kind_of(ValueError("x")) == "ValueError" and errors.kind_of(TypeError("x")) == "TypeError"
    body = errors.payload(400, "m", "p", "SteeringError")["error"]
    assert body["engine_error"] == "SteeringError" and body["type"] == "BadRequestError"
    assert errors.from_engine(InputError("too long"), "prompt").kind == "InputError"
    assert errors.from_engine(EngineError("broke")).kind is None  # a failure, not a refusal: a 500


@pytest.mark.parametrize("body, kind", [
    ({"prompt": "hi", "interp": {"capture": ["resid_psot.0"]}}, "AddressError"),
    ({"prompt": "hi", "interp": {"steer": [{"address": "resid_post.0", "op": "nope"}]}}, "SteeringError"),
    ({"prompt": "hi", "interp": {"steer": [{"address": "resid_post.0", "positions": {"at": []}}]}}, "SteeringError"),
    ({"prompt": "hi", "interp": {"capture": {"readouts": [{"address": "attn_probs.0", "kind": "Mean"}]}}},
     "ReadoutError"),
    ({"prompt": 5, "interp": {"capture": ["resid_post.0"]}}, None),  # the server's own schema: no engine class
])
def test_a_refusal_while_parsing_carries_the_engines_class(body, kind):
    from engine.serve.schemas import CaptureRequest
    from engine.serve.schemas import parse_body as parse
    with pytest.raises(errors.ServeError) as e:
        parse(json.dumps(body).encode(), CaptureRequest)
    assert e.value.status == 400 and e.value.kind == kind, e.value.message


def test_an_error_answer_becomes_the_librarys_exception():
    def body(kind, msg="m", code=400, param=None):
        return {"error": {"message": msg, "type": "x", "param": param, "code": code, "engine_error": kind}}
    for name, cls in [("AddressError", AddressError), ("UnsupportedPointError", UnsupportedPointError),
                      ("SteeringError", SteeringError), ("ReadoutError", ReadoutError), ("ValueError", ValueError),
                      ("TypeError", TypeError)]:
        e = error_from(400, body(name, "the message", param="interp.x"))
        # the library's class (`except ReadoutError` works remotely) and a ServerRefused (the server said no)
        assert isinstance(e, cls) and isinstance(e, ServerRefused) and type(e).__name__ == name, type(e).__mro__
        assert library_class(e) is cls and str(e) == "the message" and (e.status, e.param) == (400, "interp.x")
    strict = error_from(400, body("StrictSteerError"))  # needs its receipt: raised as its base class
    assert library_class(strict) is SteeringError and isinstance(strict, ServerRefused)
    assert type(error_from(400, body("NoSuchClass"))) is ServerRefused
    assert type(error_from(413, body(None))) is ServerRefused and error_from(400, body(None, param="x")).param == "x"
    assert type(error_from(401, body(None))) is AuthenticationError
    assert type(error_from(503, body(None))) is ServerBusy and type(error_from(429, body(None))) is ServerBusy
    assert type(error_from(500, body("AddressError"))) is ServerFailed  # a 5xx is never the input's fault
    assert type(error_from(502, "<html>bad gateway</html>")) is ServerFailed
    names = error_classes()
    assert names["StrictSteerError"] is StrictSteerError and "RemoteError" not in names


def test_every_core_exception_class_has_its_own_name():
    seen: dict = {}
    todo = [EngineError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("engine.core."):
            assert seen.setdefault(cls.__name__, cls) is cls, f"two core classes named {cls.__name__}"
        todo += cls.__subclasses__()


# -- retries ---------------------------------------------------------------------------------------------
def test_retry_after_reads_seconds_and_dates():
    assert parse_retry_after("3") == 3.0 and parse_retry_after("0.5") == 0.5 and parse_retry_after("-4") == 0.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 20 < parse_retry_after(later) <= 31
    assert Retry().wait_s(0, "2") == 2.0
    waits = [Retry(backoff_s=1.0).wait_s(k, None) for k in range(4)]
    assert all(2 ** k * 0.5 <= w <= 2 ** k for k, w in enumerate(waits))  # doubling, with jitter
    for bad in ({"attempts": 0}, {"attempts": 1.5}, {"backoff_s": -1}, {"max_wait_s": "x"}):
        with pytest.raises(EngineError, match="Retry"):
            Retry(**bad)


# -- bodies read back by the server's schemas --------------------------------------------------------
STEERS = [
    Steer("resid_post.1", "add", torch.randn(8), "last"),
    Steer("z.0.head-1", "set", torch.randn(5, 4), (1, None)),
    Steer("resid_post.0", "scale", 0.5, slice(None, 3)),
    Steer("resid_post.0", "ablate", positions=[0, 2, 5], exclude="special"),
    Steer("mlp_out.1", "project_out", torch.randn(8), "generated", exclude=[0]),
    Steer("resid_post.0", "projection_cap", torch.randn(8), -1, bounds=(None, 2.0)),
    Steer("resid_post.0", "rescale", torch.randn(8), torch.tensor([True, False, True]), coeff=1.5),
    Steer("resid_post.0", "add", torch.randn(8, dtype=torch.float64), 3),
]


@pytest.mark.parametrize("st", STEERS, ids=[f"{s.op}-{i}" for i, s in enumerate(STEERS)])
def test_a_steer_body_reads_back_as_the_same_steer(st):
    back = SteerSpec.model_validate(json.loads(encoding.json_bytes(bodies.steer(st)))).steer
    for f in bodies.STEER_FIELDS:
        a, b = getattr(back, f), getattr(st, f)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f
        else:
            assert a == b, (f, a, b)


def test_a_readout_body_reads_back_as_the_same_readout():
    W = torch.randn(3, 8)
    for r in [Readout("resid_post.1", Mean()), Readout("resid_post.0", LensTopK(4), name="lens"),
              Readout("mlp_out.0", Project(W, b=torch.randn(3), act="sigmoid"))]:
        back = ReadoutSpec.model_validate(json.loads(encoding.json_bytes(bodies.readout(r)))).readout
        assert (str(back.address), back.name, type(back.kind)) == (str(r.address), r.name, type(r.kind))
        if isinstance(r.kind, Project):
            assert torch.equal(back.kind.W, r.kind.W) and torch.equal(back.kind.b, r.kind.b) and back.kind.act == "sigmoid"


def test_what_cannot_be_sent_is_refused_by_name():
    class LoadedSAE:
        d_sae = 4

        def encode(self, x):
            return x
    with pytest.raises(SteeringError, match="a loaded SAE \\(LoadedSAE\\) cannot be sent"):
        bodies.steer(Steer("resid_post.0", "feature_add", sae=LoadedSAE(), feature=0, coeff=1.0))


def test_importing_the_client_imports_no_model_library_and_no_server():
    code = ("import sys, engine.remote; bad = [m for m in ('transformers', 'vllm', 'fastapi', 'starlette', 'pydantic', "
            "'uvicorn') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
