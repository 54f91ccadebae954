"""The same calls give the same results on every backend and through a server (issue 49): capture, a steer at
every position form, greedy and seeded generation, a stream, the logit lens, readouts and a batch of requests,
each on eager's async side, an eager server (sync and async), vllm and vllm-static (sync and async), compared
with eager's sync side at the validator's tolerances (validator/tolerances.py: its float32 tiers, x10 at decode
steps; a verdict of pass, or warn where the validator allows it: vLLM's own kernels); tokens and receipts'
rows exactly. Seeded sampling draws from each runtime's own generator, so a seeded call
is compared within its runtime (vLLM's sides with each other). The vLLM servers run the same calls in
tests/test_remote_vllm.py (slow)."""
from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
import torch

from api_conformance import Awaited
from api_conformance import targets as conformance_targets
from engine import LensTopK, Mean, Norm, Readout, Request, Steer
from engine.core.readouts import TopK
from test_vllm_common import random_vector
from validator.scoring import compare as score
from validator.tolerances import EXACT_ENGINES, tier_for

P = "The quick brown fox jumps over the lazy dog"
V = random_vector((256,), seed=5, scale=2.0)
MASK = torch.tensor([False, True, False, True, True] + [False] * 6)  # 11 positions: the prompt's


def _positions() -> list:
    return ["all", "last", 2, -3, slice(1, 4), [0, 3, 5], MASK]


def _flat(out: Any, prefix: str = "") -> dict:
    """A result as {name: tensor, or a list / number compared exactly}."""
    if isinstance(out, torch.Tensor):
        return {prefix: out}
    if isinstance(out, TopK):
        return {f"{prefix}.values": out.values}
    if isinstance(out, (tuple, list)) and out and all(isinstance(x, int) for x in out):
        return {prefix: list(out)}
    if isinstance(out, (tuple, list)):
        return {k: v for i, x in enumerate(out) for k, v in _flat(x, f"{prefix}[{i}]").items()}
    d: dict = {}
    if isinstance(out, dict):  # an ActivationCache: captures, readouts and receipts' rows
        for k, v in out.items():
            d.update(_flat(v, f"{prefix}.{k}"))
        for k, v in getattr(out, "readouts", {}).items():
            d.update(_flat(v, f"{prefix}.readout.{k}"))
        for r in getattr(out, "receipts", ()):
            d[f"{prefix}.receipt{r.index}.rows"] = r.rows
        return d
    for f in ("new_tokens", "logits", "cache"):  # a GenerationResult or a RequestResult
        if getattr(out, f, None) is not None:
            d.update(_flat(out.new_tokens.tolist() if f == "new_tokens" else getattr(out, f), f"{prefix}.{f}"))
    return d


async def _consume(steps: Any) -> list:
    return [s async for s in steps]


def _stream(m: Any, *args: Any, **kw: Any) -> dict:
    steps = m.stream(*args, **kw)
    steps = asyncio.run(_consume(steps)) if inspect.isasyncgen(steps) or hasattr(steps, "__anext__") else list(steps)
    return {"tokens": [s.token for s in steps], **_flat(steps[-1].result, "result")}


CALLS = {
    "capture": lambda m: m.run_with_cache(P, ["resid_post.1", "mlp_out.1"]),
    "steer at every position form": lambda m: [m.run_with_cache(P, ["resid_post.1"], [Steer("resid_post.0", "add", V, p)])
                                               for p in _positions()],
    "generate greedy": lambda m: m.generate(P, 4, ["resid_post.1"], [Steer("resid_post.0", "add", V, "generated")]),
    "generate seeded": lambda m: m.generate(P, 4, temperature=0.8, top_k=20, seed=3).new_tokens[0].tolist(),
    "stream": lambda m: _stream(m, P, 4, ["resid_post.1"]),
    "logit lens": lambda m: m.logit_lens(torch.stack([V, -V])[None]),
    "readouts": lambda m: m.run_with_cache(P, readouts=[Readout("resid_post.1", Mean(), "mean"),
                                                        Readout("mlp_out.1", Norm(), "norm"),
                                                        Readout("resid_post.1", LensTopK(3), "lens")])[1],
    "batch": lambda m: m.generate_batch([Request(P, 3, ["resid_post.1"]),
                                         Request("Hello there", 2, steer=[Steer("resid_post.0", "scale", 2.0)])]),
}
DECODE = ("generate greedy", "stream", "batch")  # decode steps: the validator's x10 tier


@pytest.fixture(scope="module")
def targets():
    with conformance_targets() as get:
        yield get


@pytest.fixture(scope="module")
def reference(targets):
    """Eager's sync results, each computed once (and vLLM's sync seeded draw, its runtime's reference)."""
    done: dict = {}

    def get(name: str, runtime: str = "eager") -> dict:
        if (name, runtime) not in done:
            done[name, runtime] = _flat(CALLS[name](targets(runtime)))
        return done[name, runtime]
    return get


def compare(got: dict, ref: dict, engine: str, what: str) -> None:
    assert got.keys() == ref.keys(), f"{what}: {sorted(got)} != {sorted(ref)}"
    for k, r in ref.items():
        g = got[k]
        if not isinstance(r, torch.Tensor):
            assert g == r, f"{what} {k}: {g} != {r}"
            continue
        point = next((p for p in ("resid_post", "mlp_out", "lm_head") if p in k), "lm_head")
        t = g.to(r.dtype) if isinstance(g, torch.Tensor) else g
        t, rr = t, r
        while rr.dim() < 3:  # [batch, pos, ...]: a token is a vector (its rows' error), never one scalar
            t, rr = t[None], rr[None]
        s = score(t, rr, tier_for(engine, "float32", "decode" if what.split(" @ ")[0] in DECODE else ""), point)
        # the validator's verdicts: within the tier (half precision alone has a warn band)
        assert s.verdict == "pass" or (s.verdict == "warn" and engine not in EXACT_ENGINES), \
            f"{what} {k}: {s.verdict} {s.to_dict()}"


def _params():
    for target, sides in (("eager", ("async",)), ("remote-eager", ("sync", "async")), ("vllm", ("sync", "async")),
                          ("vllm-static", ("sync", "async"))):
        marks = (pytest.mark.vllm,) if target.startswith("vllm") else ()
        for side in sides:
            for name in CALLS:
                yield pytest.param(target, side, name, id=f"{target}-{side}-{name}", marks=marks)


@pytest.mark.parametrize("target,side,name", list(_params()))
def test_the_same_call_gives_the_same_result_everywhere(targets, reference, target, side, name):
    m = targets(target)
    got = _flat(CALLS[name](m if side == "sync" else Awaited(m.aio)))
    runtime = "vllm" if target.startswith("vllm") and name == "generate seeded" else "eager"
    if runtime == "vllm" and target == "vllm" and side == "sync":
        assert got == reference(name, "vllm")  # the same seed draws the same tokens again
        return
    compare(got, reference(name, runtime), "hf" if target.endswith("eager") else "vllm", f"{name} @ {target} {side}")


@pytest.mark.parametrize("target", ["eager", "remote-eager", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_generate_batch_shows_its_progress_when_asked(targets, capsys, target):
    """progress=True ticks a bar per request (vLLM's was taken and silently ignored); without it, nothing."""
    m = targets(target)
    m.generate_batch([Request(P, 1), Request("Hello", 1)])
    assert "2/2" not in capsys.readouterr().err
    m.generate_batch([Request(P, 1), Request("Hello", 1)], progress=True)
    assert "2/2" in capsys.readouterr().err


def test_a_remote_model_describes_what_its_server_serves(targets):
    """describe / serves / refuses answer remotely, from the server's own table: the same verdict on every
    point and layer as the library's model behind it (served, and steerable or capture-only)."""
    remote, local = targets("remote-eager"), targets("eager")
    got, ref = remote.describe(), local.describe()
    assert [(v.address, v.served, v.capture_only is None) for v in got] == \
        [(v.address, v.served, v.capture_only is None) for v in ref]
    assert got.readouts.keys() == ref.readouts.keys()
    assert remote.serves("resid_post.1") and remote.refuses("q_norm_in.0") and not remote.serves("q_norm_in.0")
    assert remote.verdict("z.0.head-1").served and not remote.verdict("z.0.head-99").served
