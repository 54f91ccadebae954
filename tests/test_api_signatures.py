"""The model API is declared once (engine/model/api.py) and every implementation conforms to it (issue 49):
each side of each backend has every declared method, with the declared parameters (names, order, kinds,
defaults), awaitable where the declaration is async; the deprecated names warn and give the one name's
result. Compared with inspect.signature on the classes, so no engine starts; a drifted parameter (eager's
`strict` where vLLM has `return_logits`, an async side without run_with_cache) fails here."""
from __future__ import annotations

import asyncio
import inspect
import warnings

import pytest

from engine.backends.hf.eager import EagerModel
from engine.backends.vllm.backend import VLLMModel
from engine.backends.vllm.client import AsyncVLLMModel
from engine.model import api
from engine.model.facade import InThread, OnLoop
from engine.remote.aio import AsyncRemoteModel
from engine.remote.model import RemoteModel

SYNC = {"eager": EagerModel, "vllm": VLLMModel, "remote": RemoteModel}
ASYNC = {"eager": InThread, "vllm": AsyncVLLMModel, "remote": AsyncRemoteModel}


def _params(fn_or_sig) -> list[tuple]:
    """(name, kind, default) of every parameter but self: what a caller relies on."""
    sig = fn_or_sig if isinstance(fn_or_sig, inspect.Signature) else inspect.signature(fn_or_sig)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]


def _declared(name: str) -> list[tuple]:
    return _params(api.declared(name))


def _method(cls: type, name: str):
    assert hasattr(cls, name), f"{cls.__name__} has no {name}(): the API declares it (engine/model/api.py)"
    return inspect.getattr_static(cls, name)


@pytest.mark.parametrize("backend", list(SYNC))
@pytest.mark.parametrize("name", api.SHARED + api.RUNS + api.STREAMS)
def test_every_sync_side_has_every_declared_method_with_its_parameters(backend, name):
    fn = _method(SYNC[backend], name)
    assert _params(fn) == _declared(name), f"{SYNC[backend].__name__}.{name}{inspect.signature(fn)} differs from " \
                                           f"the declaration {name}{api.declared(name)}"
    assert not inspect.iscoroutinefunction(fn) and not inspect.isasyncgenfunction(fn), f"{backend} {name} is async"


@pytest.mark.parametrize("backend", list(ASYNC))
@pytest.mark.parametrize("name", api.SHARED + api.RUNS + api.STREAMS + ["aclose"])
def test_every_async_side_has_every_declared_method_awaitable_with_its_parameters(backend, name):
    fn = _method(ASYNC[backend], name)
    if name != "aclose":
        assert _params(fn) == _declared(name), f"{ASYNC[backend].__name__}.{name}{inspect.signature(fn)} differs " \
                                               f"from the declaration {name}{api.declared(name)}"
    if name in api.RUNS or name == "aclose":
        assert inspect.iscoroutinefunction(fn), f"{ASYNC[backend].__name__}.{name} is not awaitable"
    else:  # a stream is made (and checked) by the call and iterated with `async for`; the catalogue is sync
        assert not inspect.iscoroutinefunction(fn), f"{ASYNC[backend].__name__}.{name} must not be awaited"


def test_the_twins_are_declared_from_the_sync_declarations_and_the_lists_cover_the_protocols():
    for name in api.RUNS + api.STREAMS:
        assert api.declared(name, api.AsyncModel) == api.declared(name, api.Model)
    assert set(api.RUNS + api.STREAMS) | {"close", "aio"} == {n for n in vars(api.Model) if not n.startswith("_")}
    assert api.SHARED == ["points", "point_layers", "describe", "verdict", "serves", "refuses", "steering"]
    assert api.RUNS == ["run_with_cache", "forward", "generate", "generate_batch", "logit_lens", "to_tokens",
                        "to_string"]


def test_the_generated_sides_run_the_other_side_with_the_callers_arguments():
    """OnLoop runs m.aio's coroutine on the model's loop; InThread runs the sync method on a thread, awaited
    from the caller's loop; both pass the arguments through as given (the implementation's defaults are the
    declared ones, checked above)."""
    from engine.core.loop import Loop
    calls = []

    class Async:
        name, backend, n_layers, d_model, device = "m", "x", 2, 4, "cpu"

        def _live(self):
            pass

        async def generate(self, *a, **kw):
            calls.append(("generate", a, kw))
            return "generated"

        def stream(self, *a, **kw):
            async def steps():
                for i in range(3):
                    yield i
            return steps()

        def points(self):
            return ["resid_post"]

        async def aclose(self):
            calls.append(("aclose",))

    loop = Loop("a test model")
    m = OnLoop(Async(), loop)
    assert m.generate("hi", 3, temperature=0.5) == "generated" and calls[-1] == ("generate", ("hi", 3),
                                                                                  {"temperature": 0.5})
    assert list(m.stream("hi")) == [0, 1, 2] and m.points() == ["resid_post"] and m.n_layers == 2
    m.close()
    assert calls[-1] == ("aclose",) and loop.stopped

    class Sync:
        name, backend, n_layers, d_model, device = "m", "x", 2, 4, "cpu"

        def run_with_cache(self, *a, **kw):
            return ("ran", a, kw)

        def stream(self, *a, **kw):
            return iter([1, 2])

    aio = InThread(Sync())

    async def main():
        steps = [s async for s in aio.stream("p")]
        return await aio.run_with_cache("p", ["resid_post.0"], strict=True), steps
    assert asyncio.run(main()) == (("ran", ("p", ["resid_post.0"]), {"strict": True}), [1, 2])


def test_a_deprecated_name_warns_and_gives_the_one_names_result():
    class M(api.Aliases):
        def run_with_cache(self, **kw):
            return kw
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        # the old positional order (inputs, points, steer, strict, readouts) is passed on by name
        assert M().capture("hi", ["resid_post.0"], (), True) == {"inputs": "hi", "points": ["resid_post.0"],
                                                                  "steer": (), "strict": True}
    assert [x.category for x in w] == [DeprecationWarning] and "call run_with_cache()" in str(w[0].message)
    for cls in (*SYNC.values(), *ASYNC.values()):
        assert hasattr(cls, "capture"), cls


def test_the_readme_shows_the_declared_api_once():
    """README's "The model API" block is the declarations' outline (api.outline), not a list per backend."""
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## The model API", 1)[1].split("\n## ", 1)[0]
    block = section.split("```\n", 1)[1].split("```", 1)[0]
    assert block == api.outline(), "README's API block drifted from engine/model/api.py: paste api.outline() there"
    assert readme.count("  generate_batch(requests, return_logits=True") == 1
