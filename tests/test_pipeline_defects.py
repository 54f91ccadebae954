"""Regression tests for the defects the shared pipeline fixed, on eager and vLLM: nested steering by
identity, no callbacks left behind, positions in each row's own tokens on padded batches, read-only
captures that leave the forward bit-identical, calls from several threads and tasks, the model's
life cycle (context manager, close, use after close), and the engine core in its own process."""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.core.errors import EngineError, SteeringError
from engine.core.results import ActivationCache
from engine.core.steering import Steer
from test_vllm_common import (
    PROMPT,
    PROMPTS,
    check,
    children_left_running,
    eager_model,
    random_vector,
    stream_under_steering,
    vllm_model,
)

LLAMA = "meta-llama/Llama-3.2-1B"
REPO = Path(__file__).resolve().parents[1]
LEFT = ["The quick brown fox jumps over the lazy dog", "Hi there"]  # different lengths: row 1 is padded


@pytest.fixture(scope="module")
def em():
    return eager_model(LLAMA)


@pytest.fixture(scope="module")
def vm():
    return vllm_model(LLAMA)


def _tier(backend):
    return "hf" if backend == "eager" else backend  # eager against eager: the float32 identity tier


def _callbacks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(getattr(m, "_interp_callbacks", {}))
               for m in model.hf.modules())


# -- nested steering ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "vllm"])
def test_nested_steering_exits_by_identity(em, vm, backend):
    m = em if backend == "eager" else vm
    a, b = random_vector((m.d_model,), 1), random_vector((m.d_model,), 2)
    outer, inner = Steer("resid_post.0", "add", a), Steer("resid_post.0", "add", a.clone())  # equal values
    _, base = m.run_with_cache(PROMPT, ["resid_post.0"])
    with m.steering(outer):
        with m.steering(inner, Steer("resid_post.0", "add", b)):
            _, both = m.run_with_cache(PROMPT, ["resid_post.0"])
        _, only_outer = m.run_with_cache(PROMPT, ["resid_post.0"])
    _, after = m.run_with_cache(PROMPT, ["resid_post.0"])
    check(both["resid_post.0"], base["resid_post.0"] + 2 * a + b, "resid_post")
    check(only_outer["resid_post.0"], base["resid_post.0"] + a, "resid_post")
    assert torch.equal(after["resid_post.0"], base["resid_post.0"]) and m._context_steers() == ()


def test_nested_steer_calls_at_attention_points_leave_nothing_behind(em):
    q_shape = (em.config.num_attention_heads, em.config.head_dim)
    steer = Steer("q.1", "scale", 1.5)
    before = _callbacks(em)
    with em.steering(Steer("attn_probs.0", "scale", 1.0)):
        for i in range(200):
            em.run_with_cache(PROMPT, ["attn_probs.1", "z.0"], steer=[steer, Steer("z.1", "add", torch.zeros(q_shape))])
    assert _callbacks(em) == before  # HF's own output-recording hooks (installed on its first
    # output_attentions=True call by any module sharing this model) may be there, ours never


# -- positions on padded batches -----------------------------------------------------------------------
@pytest.mark.parametrize("positions", [2, slice(1, 3), (0, 2), -1])
@pytest.mark.parametrize("backend", ["eager", "vllm"])
def test_int_and_slice_positions_are_each_rows_own(em, vm, backend, positions):
    m = em if backend == "eager" else vm
    v = random_vector((m.d_model,), 3)
    st = Steer("resid_post.0", "add", v, positions)
    _, batch = m.run_with_cache(LEFT, ["resid_post.1"], steer=[st])
    for row, text in enumerate(LEFT):
        _, solo = em.run_with_cache(text, ["resid_post.1"], steer=[st])
        n = solo["resid_post.1"].shape[1]
        check(batch["resid_post.1"][row:row + 1, -n:], solo["resid_post.1"], "resid_post", _tier(backend))


@pytest.mark.parametrize("backend", ["eager", "vllm"])
@pytest.mark.parametrize("positions,fragment", [(999, "position 999 matches no token"),
                                                ((100, 200), "matches no token"),
                                                ((3, 1), "matches no token"),
                                                ("generated", "a plain forward has no generated tokens")])
def test_positions_matching_no_token_are_errors(em, vm, backend, positions, fragment):
    m = em if backend == "eager" else vm
    with pytest.raises(SteeringError, match=fragment):
        m.run_with_cache(PROMPT, [], steer=[Steer("resid_post.0", "add", torch.ones(m.d_model), positions)])
    with pytest.raises(SteeringError, match="positions=True is not a position spec"):
        Steer("resid_post.0", "add", torch.ones(m.d_model), True)


# -- read-only captures -------------------------------------------------------------------------------
def test_every_read_only_capture_leaves_logits_bit_identical(em):
    enc = em.to_tokens(LEFT)
    base = em.run_with_cache(enc)[0]
    for point in em.points():
        logits, _ = em.run_with_cache(enc, [point])
        assert torch.equal(logits, base), f"capturing {point} changed the forward"


# -- threads and tasks --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "vllm"])
def test_calls_from_several_threads_equal_their_solo_runs(em, vm, backend):
    m = em if backend == "eager" else vm
    vectors = [random_vector((m.d_model,), 10 + i) for i in range(4)]
    texts = [PROMPT, PROMPTS[1], "Water boils at a hundred degrees", "One two three"]
    solo = [m.run_with_cache(t, ["resid_post.1"], steer=[Steer("resid_post.0", "add", v)])[1]["resid_post.1"]
            for t, v in zip(texts, vectors)]
    got: dict = {}

    def work(i):
        with m.steering(Steer("resid_post.0", "add", vectors[i])):  # per thread: never seen by the others
            for _ in range(3):
                got[i] = m.run_with_cache(texts[i], ["resid_post.1"])[1]["resid_post.1"]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        check(got[i], solo[i], "resid_post", _tier(backend))


def test_sixteen_concurrent_async_captures_equal_their_solo_results(vm):
    texts = [" ".join(PROMPT.split()[: 2 + i % 8]) for i in range(16)]
    steers = [[Steer(f"resid_post.{i % 2}", "add", random_vector((vm.d_model,), i))] if i % 3 else [] for i in range(16)]
    points = [["resid_post.1", "z.0.head-1"], ["attn_probs.1"], ["mlp_act.0", "resid_mid.1"], ["final_norm"]]

    async def all_at_once():
        return await asyncio.gather(*(vm.aio.run_with_cache(t, points[i % 4], steers[i]) for i, t in enumerate(texts)))
    together = vm._loop.run(all_at_once())
    for i, (logits, cache) in enumerate(together):
        solo_logits, solo = vm.run_with_cache(texts[i], points[i % 4], steers[i])
        check(logits, solo_logits, "lm_head")
        for k in solo:
            check(cache[k], solo[k], k.split(".")[0], what=k)


# -- life cycle ----------------------------------------------------------------------------------------
def _within(seconds: float, fn):
    """fn() on a daemon thread: its result or its error, or a test failure when it has not returned
    within `seconds` (a hang fails the test instead of stalling the run)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised on the test's thread)
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{fn} did not return within {seconds} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")



def test_engine_core_runs_in_its_own_process(vm):
    assert vm.catalogue.worker_pids and os.getpid() not in vm.catalogue.worker_pids


def test_eager_close_and_context_manager():
    from engine.loading import load_model
    with load_model(LLAMA, source="zoo") as m:
        assert m.run_with_cache(PROMPT)[0].shape[0] == 1
    m.close()  # idempotent
    with pytest.raises(EngineError, match="was closed; load it again"):
        m.run_with_cache(PROMPT)
    with pytest.raises(EngineError, match="was closed"):
        m.address("resid_post.0")


def _calls_after_close(m, run_coroutine=None) -> dict:
    """Every public method and property of a model, each called on it (placeholders for required
    arguments: a closed model must refuse before it reads them; a coroutine is run by run_coroutine),
    mapped to what it raised."""
    import inspect
    cls = type(m)
    out = {}
    # the engine's own names only: nnsight mounts a `save` on `object` itself once a trace has run
    own = {n for c in cls.__mro__ if c is not object for n in vars(c)}
    for name in sorted(n for n in own if not n.startswith("_") and n not in ("close", "aclose")):
        attr = inspect.getattr_static(cls, name)
        try:
            if isinstance(attr, property):
                getattr(m, name)
            elif callable(attr):
                fn = getattr(m, name)
                args = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty
                        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
                result = fn(*["resid_post.0"] * len(args))
                if inspect.iscoroutine(result):
                    run_coroutine(result)
                if hasattr(result, "__enter__"):  # steering(): refuses when the block opens
                    with result:
                        pass
            else:
                continue  # plain class attributes: backend, prepend_bos
            out[name] = None
        except Exception as e:  # noqa: BLE001 - what each raised is the assertion
            out[name] = e
    return out


def test_every_public_method_of_a_closed_eager_model_says_it_was_closed():
    """points() and capture_attention() raised AttributeError ('NoneType' object has no attribute
    'config') after close(); to_tokens() still worked. A closed model refuses every call by name (its
    tokenizer stays reachable as m.tokenizer)."""
    from engine import capture_attention
    from engine.loading import load_model
    m = load_model(LLAMA, source="zoo")
    m.points()  # fills the catalogue's cache: a cached answer is refused all the same
    m.close()
    raised = _calls_after_close(m)
    assert {"points", "to_tokens", "run_with_cache", "W_U", "describe"} <= set(raised)
    wrong = {n: repr(e) for n, e in raised.items() if not (isinstance(e, EngineError) and "was closed" in str(e))}
    assert not wrong, f"after close() these did not refuse with the closed-model error: {wrong}"
    with pytest.raises(EngineError, match="was closed; load it again"):
        capture_attention(m, PROMPT)
    assert m.tokenizer(PROMPT)["input_ids"]


@pytest.mark.vllm
@pytest.mark.slow  # two engines of its own (~55 s): CI's slow step, keeping the default run under 10 min
def test_vllm_close_frees_the_engine_and_use_after_close_says_so():
    import multiprocessing

    from engine.backends.vllm.backend import load
    before = {p.pid for p in multiprocessing.active_children()}
    with load("openai-community/gpt2", source="zoo", max_model_len=128) as m:
        assert m.generate(PROMPT, 2).new_tokens.shape == (1, 2)
        half = m.stream(PROMPT, 20)  # read one step, then dropped after close
        next(half)
    m.close()
    with pytest.raises(EngineError, match="was closed; load it again"):
        m.generate(PROMPT, 2)
    # every method says so at once: a stream when it is made (it hung on its first step), async calls
    # from any loop, and a half-read stream closed or dropped afterwards returns (it waited forever on
    # the stopped loop, also at interpreter exit)
    with pytest.raises(EngineError, match=r"openai-community/gpt2 \(vllm\) was closed; load it again"):
        m.stream(PROMPT, 2)
    with pytest.raises(EngineError, match="was closed; load it again"):
        _within(60, lambda: asyncio.run(m.aio.run_with_cache(PROMPT)))
    # the sync model's catalogue calls are the async model's; its coroutines awaited from another loop
    raised = _calls_after_close(m.aio, lambda c: _within(60, lambda: asyncio.run(c)))
    wrong = {n: repr(e) for n, e in raised.items() if not (isinstance(e, EngineError) and "was closed" in str(e))}
    assert not wrong, f"after close() these did not refuse with the closed-model error: {wrong}"
    for call in (m.points, lambda: m.to_tokens(PROMPT), lambda: m.point_layers("resid_post")):
        with pytest.raises(EngineError, match="was closed; load it again"):
            call()
    _within(60, half.close)
    assert children_left_running(before) == {}
    dropped = load("openai-community/gpt2", source="zoo", max_model_len=128)  # never closed: freed when dropped
    assert {p.pid for p in multiprocessing.active_children()} - before
    del dropped
    gc.collect()
    assert children_left_running(before) == {}


def test_cache_get_resolves_negative_layers(em):
    _, cache = em.run_with_cache(PROMPT, ["resid_post.-1"])
    assert isinstance(cache, ActivationCache) and "resid_post.-1" in cache
    assert cache.get("resid_post.-1") is cache[f"resid_post.{em.n_layers - 1}"]
    assert cache.get("resid_post.0") is None and cache.get("resid_post.0", 7) == 7


# -- async generation stream --------------------------------------------------------------------------
def test_stream_yields_each_token_then_the_full_result(vm):
    v = random_vector((vm.d_model,), 21)
    steer = [Steer("resid_post.0", "add", v)]
    ref = vm.generate(PROMPT, 5, points=["resid_post.1"], steer=steer)

    async def collect(stop_after=None):
        events = []
        async for ev in vm.aio.stream(PROMPT, 5, points=["resid_post.1"], steer=steer):
            events.append(ev)
            if stop_after is not None and len(events) == stop_after:
                break
        return events
    events = vm._loop.run(collect())
    assert [e.token for e in events] == ref.new_tokens[0].tolist()
    assert all(e.result is None for e in events[:-1]) and events[-1].result is not None
    check(events[-1].result.cache["resid_post.1"][None], ref.cache["resid_post.1"], "resid_post", case="decode")
    assert "".join(e.text for e in events).strip() == ref.text[0].strip()
    assert len(vm._loop.run(collect(stop_after=2))) == 2  # leaving early aborts the request...
    assert torch.equal(vm.generate(PROMPT, 5, steer=steer).new_tokens, ref.new_tokens)  # ...and the engine serves on


def test_sync_vllm_model_hands_out_no_coroutine(vm):
    """The sync facade never hands out a coroutine: `capture` (the async side's earlier name of
    run_with_cache) is a deprecated alias on both sides that warns and gives run_with_cache's result, and an
    async-only method of the async model is refused by name."""
    with pytest.warns(DeprecationWarning, match=r"call run_with_cache\(\)"):
        logits, cache = vm.capture("hello", ["resid_post.0"])
    ref_logits, ref = vm.run_with_cache("hello", ["resid_post.0"])
    assert torch.equal(logits, ref_logits) and torch.equal(cache["resid_post.0"], ref["resid_post.0"])
    with pytest.raises(AttributeError, match=r"is async only: call `await model\.aio\._rpc"):
        vm.__getattr__("_rpc")


@pytest.mark.parametrize("backend", ["eager", "vllm"])
def test_stream_equals_generate_under_a_steering_block(em, backend, request):
    """A stream made in a `steering()` block is steered like generate there (eager ran the stream on a
    thread that lost the block; vLLM read the block when first iterated, so a stream iterated after
    the block ran unsteered). vllm-static: tests/test_vllm_interventions.py."""
    stream_under_steering(em if backend == "eager" else request.getfixturevalue("vm"), _tier(backend))


def test_async_api_from_the_callers_own_loop(vm):
    """m.aio awaited from a loop of the caller's (asyncio.run): results as the sync API gives them, the
    caller's steering block applied, and a call the caller cancels is cancelled on the engine."""
    st = Steer("resid_post.0", "add", random_vector((vm.d_model,), 32, 8.0))
    with vm.steering(st):
        steered = vm.generate(PROMPT, 4)
    plain = vm.generate(PROMPT, 4)

    async def main():
        with vm.steering(st):
            a = await vm.aio.generate(PROMPT, 4)
        b = await vm.aio.generate(PROMPT, 4)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(vm.aio.generate(PROMPT, 200), 0.05)
        steps = [s.token async for s in vm.aio.stream(PROMPT, 4)]
        return a, b, steps
    a, b, steps = _within(300, lambda: asyncio.run(main()))
    assert torch.equal(a.new_tokens, steered.new_tokens) and torch.equal(b.new_tokens, plain.new_tokens)
    assert not torch.equal(steered.new_tokens, plain.new_tokens) or not torch.equal(steered.logits, plain.logits)
    assert steps == plain.new_tokens[0].tolist()
    assert torch.equal(vm.generate(PROMPT, 4).new_tokens, plain.new_tokens)  # the engine serves on


@pytest.mark.slow
@pytest.mark.vllm
def test_ctrl_c_during_a_sync_vllm_stream_is_a_keyboard_interrupt(tmp_path):
    """SIGINT while a sync stream waits for its next step raises KeyboardInterrupt (it surfaced as
    "RuntimeError: aclose(): asynchronous generator is already running"); the request is aborted and
    the engine serves on. Run as a user runs it: a script of its own, on a fresh engine; the same
    in the shared session engine after calls from another loop: the next test."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(
        "import os, signal, threading\n"
        "from engine.backends.vllm.backend import load\n"
        "if __name__ == '__main__':\n"
        "    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even when started in the background\n"
        "    m = load('meta-llama/Llama-3.2-1B', source='zoo', max_model_len=256)\n"
        "    steps = m.stream('The quick brown fox jumps over the lazy dog', 200, points=['resid_post.1'])\n"
        "    next(steps)\n"
        "    threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()\n"
        "    try:\n"
        "        for _ in steps:\n"
        "            pass\n"
        "        print('no interrupt', flush=True)\n"
        "    except KeyboardInterrupt:\n"
        "        print('KeyboardInterrupt', flush=True)\n"
        "    steps.close()\n"
        "    print('after', m.generate('Hi there', 3).new_tokens.shape[1], flush=True)\n"
        "    m.close()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stdout.splitlines() if line in ("KeyboardInterrupt", "no interrupt", "after 3")]
    assert said == ["KeyboardInterrupt", "after 3"], (done.stdout[-2000:], done.stderr[-2000:])


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="SIGINT goes to the main thread")
def test_ctrl_c_during_a_sync_vllm_stream_after_calls_from_another_loop(vm, ctrl_c):
    """In the session engine, after it served calls (one cancelled) from a caller's own event loop, as
    the old in-session test did: SIGINT during a sync stream is a KeyboardInterrupt (it surfaced as
    "aclose(): asynchronous generator is already running"), returned promptly (the unwind wait sat
    out a 30 s timeout), and the engine serves on. The loop mechanics: tests/test_loop_streams.py."""
    async def elsewhere():
        await vm.aio.generate(PROMPT, 2)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(vm.aio.generate(PROMPT, 200), 0.05)
    _within(300, lambda: asyncio.run(elsewhere()))
    plain = vm.generate(PROMPT, 3)
    steps = vm.stream("The quick brown fox jumps over the lazy dog", 200, points=["resid_post.1"])
    next(steps)
    timer = threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in steps:
            pass
    steps.close()
    assert time.monotonic() - t0 < 20, f"Ctrl-C took {time.monotonic() - t0:.0f} s"
    assert torch.equal(vm.generate(PROMPT, 3).new_tokens, plain.new_tokens)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_stream_left_half_read_after_close_lets_the_interpreter_exit(tmp_path):
    """At exit the half-read stream's cleanup ran on the stopped loop and the process never ended."""
    script = tmp_path / "half_read.py"
    script.write_text(
        "from engine.backends.vllm.backend import load\n"
        "if __name__ == '__main__':\n"
        "    m = load('openai-community/gpt2', source='zoo', max_model_len=128)\n"
        "    s = m.stream('The quick brown fox', 20)\n"
        "    next(s)\n"
        "    m.close()\n"
        "    print('closed', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit after close(): {e.stdout!r:.300}")
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr[-2000:]
