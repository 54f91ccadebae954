"""Helpers of the API conformance tests (no tests here): one table of bad calls, and how a case runs on a
model's sync side or its async side, so that the same table runs on every backend (tests/test_api_errors.py)
and through a server (tests/test_remote_vllm.py).

A case is (name, call(env), expected): expected is (class, phrase) for every target, or a dict keyed by
target (eager, vllm, vllm-static, remote-eager, remote-vllm, remote-vllm-static) or by the family it falls
back to (FALLBACK): (class, phrase), or None when the call succeeds there. The class must be the library's
class of what was raised (engine.core.errors.library_class: a server's refusal is also a ServerRefused)
and the phrase in its message.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine import LensTopK, Readout, Request, SAEFeatures, Steer
from engine.core.crossing import library_class
from engine.core.errors import AddressError, InputError, OptionError, ReadoutError, SAEError, SteeringError
from test_inputs import CALLS
from test_vllm_common import STATIC_TAPS

LLAMA = "meta-llama/Llama-3.2-1B"
DECLARED = STATIC_TAPS  # the session's one shared vllm-static engine (tests/test_vllm_common.py): one start, not two
FALLBACK = {"eager": ["eager"], "vllm": ["vllm"], "vllm-static": ["vllm-static", "vllm"],
            "remote-eager": ["remote-eager", "remote", "eager"], "remote-vllm": ["remote-vllm", "remote", "vllm"],
            "remote-vllm-static": ["remote-vllm-static", "remote", "vllm-static", "vllm"]}
SAE_LATENTS = 64  # the random SAE the cases name (written by write_sae)


class Awaited:
    """A model's async side (m.aio) called as the sync side is: a coroutine is awaited on a loop of the
    caller's (asyncio.run, as a user's script runs it); a stream and a steering() block are returned as
    made (what the call checks is checked when it is made)."""

    def __init__(self, aio: Any) -> None:
        self.aio = aio

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.aio, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            out = attr(*args, **kw)
            return asyncio.run(out) if inspect.iscoroutine(out) else out
        return call


@dataclass
class Env:
    """What a case reads: the model (either side), its positions, and how it names the test SAE (a path
    on a local backend, a folder name inside --sae-dir on a server)."""
    m: Any
    positions: int
    sae: str


def _d(n: int) -> torch.Tensor:
    return torch.ones(n)


# the issue's drifts (each raised three classes, or failed on one backend only), beside test_inputs' calls
ISSUE = [
    ("SAE feature out of range",
     lambda e: e.m.run_with_cache("hi", steer=[Steer("resid_post.1", "feature_add", sae=e.sae, feature=SAE_LATENTS,
                                                     coeff=1.0)]),
     (SteeringError, f"feature {SAE_LATENTS} is out of range")),
    ("SAEFeatures k above the SAE's latents",
     lambda e: e.m.run_with_cache("hi", readouts=[Readout("resid_post.1", SAEFeatures(e.sae, k=SAE_LATENTS + 1))]),
     (ReadoutError, f"k={SAE_LATENTS + 1}")),
    ("LensTopK k above the vocabulary", lambda e: e.m.run_with_cache("hi", readouts=[Readout("resid_post.1",
                                                                                                LensTopK(10_000))]),
     (ReadoutError, "k=10000")),
    ("an SAE the model side lacks",
     lambda e: e.m.run_with_cache("hi", readouts=[Readout("resid_post.1", SAEFeatures(e.sae + "-missing", k=2))]),
     (SAEError, "-missing")),
    ("point_layers of an unknown point", lambda e: e.m.point_layers("nope"), (AddressError, "unknown point 'nope'")),
    ("logit_lens at an unknown point", lambda e: e.m.logit_lens(torch.zeros(2, 256), point="nope"),
     (AddressError, "unknown point 'nope'")),
    ("grad=True", lambda e: e.m.run_with_cache("hi", ["resid_post.0"], grad=True),
     {"eager": None, "vllm": (OptionError, "grad=True"), "remote": (OptionError, "gradients")}),
    ("stop_at_layer", lambda e: e.m.run_with_cache("hi", stop_at_layer=1),
     {"eager": None, "vllm": (OptionError, "stop_at_layer=1"), "remote": (OptionError, "stop_at_layer")}),
    ("generate return_logits=False", lambda e: e.m.generate("hi", 2, return_logits=False), None),
    ("run_with_cache return_logits=False", lambda e: e.m.run_with_cache("hi", ["resid_post.0"], return_logits=False),
     None),
    ("generate_batch with a progress bar", lambda e: e.m.generate_batch([Request("hi", 2)], progress=True), None),
    ("generate_batch of strings", lambda e: e.m.generate_batch(["hi"]), (InputError, "Request")),
    ("steering() opens with a steer of the wrong width",
     lambda e: e.m.steering(Steer("resid_post.0", "add", _d(7))).__enter__(), (SteeringError, "(7,)")),
    ("steering() opens with a steer at a bad layer",
     lambda e: e.m.steering(Steer("resid_post.9", "add", _d(256))).__enter__(), (AddressError, "layer 9")),
    ("a steer of the wrong width, generating", lambda e: e.m.generate("hi", 2, steer=[Steer("mlp_out.1", "add", _d(9))]),
     (SteeringError, "(9,)")),
    ("stream with a steer of the wrong width (checked when made)",
     lambda e: e.m.stream("hi", 2, steer=[Steer("resid_post.0", "add", _d(5))]), (SteeringError, "(5,)")),
]
CASES = [(name, call, exp) for name, call, exp in CALLS] + ISSUE
# where a server names the field its own way (the request's field, e.g. prompt[1]), the phrase it names it with;
# the class is the case's own
SERVER_WORDS = {
    "empty id list in a batch": "prompt[1]",
    "batch with an empty string (capture)": "prompt[1]: the prompt is empty",
    "batch with an empty string (generate)": "prompt[1]: the prompt is empty",
    "prompt + max_new_tokens past the positions": "max_tokens: 3 new tokens after a",
    "max_new_tokens 10**9": "max_tokens: 1000000000 new tokens",
    "a position past one row of a batch": "position 4 matches no token",
    # the server checks a capture's room as a generation's (engine/serve/context.tokenize): the class and the
    # limit are the library's, its advice on a vLLM server one token off
    "one token past the positions (capture)": "tokens, longer than the",
    "a prompt of exactly the positions (capture)": "tokens fill all 256 positions",
}


def expected(exp: Any, target: str) -> Any:
    """The expectation of a case on one target (FALLBACK order), or the case's one expectation."""
    if not isinstance(exp, dict):
        return exp
    for key in FALLBACK[target]:
        if key in exp:
            return exp[key]
    raise KeyError(f"no expectation for {target} in {sorted(exp)}")


def check(name: str, call: Any, exp: Any, env: Env, target: str) -> None:
    """Run one case on one target: the library's class and the phrase, or a result."""
    want = expected(exp, target)
    if want is None:
        out = call(env)
        assert out is not None, f"{name} on {target} returned nothing"
        return
    cls, phrase = want
    phrase = SERVER_WORDS.get(name, phrase) if target.startswith("remote") else phrase
    with pytest.raises(Exception) as info:
        call(env)
    got = library_class(info.value)
    assert got is cls, f"{name} on {target}: {type(info.value).__name__} ({info.value}), not {cls.__name__}"
    assert phrase in str(info.value), f"{name} on {target}: {info.value!r} does not name {phrase!r}"


def write_sae(folder: Any, d_model: int = 256) -> str:
    from engine.core.sae_files import write_random_sae
    return str(write_random_sae(folder, "topk", d_in=d_model, d_sae=SAE_LATENTS, k=4, seed=0))


@contextlib.contextmanager
def targets(sae_dir: str | None = None) -> Iterator[Callable[[str], Any]]:
    """get(target) -> the model of a target, made once: the session's shared engines (eager, vllm,
    vllm-static), or engine.connect to an eager server in this process around the session's eager model
    (remote-eager; SAEs named inside `sae_dir`). The servers stop, and the clients close, on exit."""
    from engine import connect
    from engine.serve.app import build_app
    from engine.serve.runner import EagerRunner
    from engine.serve.settings import ServeSettings
    from remote_common import InProcess
    from test_vllm_common import eager_model, vllm_model
    made: dict = {}
    servers = []

    def get(target: str) -> Any:
        if target not in made:
            if target == "eager":
                made[target] = eager_model(LLAMA)
            elif target == "vllm":
                made[target] = vllm_model(LLAMA)
            elif target == "vllm-static":
                made[target] = vllm_model(LLAMA, "vllm-static", static_points=DECLARED)
            else:  # not runner.close() afterwards: the model is the session's shared one
                runner = EagerRunner(eager_model(LLAMA))
                srv = InProcess(build_app(runner, ServeSettings(sae_dir=sae_dir)))
                servers.append((srv, runner))
                made[target] = connect(srv.url, timeout=300)
        return made[target]
    try:
        yield get
    finally:
        for target, m in made.items():
            if target.startswith("remote"):
                m.close()
        for srv, runner in servers:
            srv.stop()
            runner.pool.shutdown(wait=True)
