"""The private event loop's stream stepping (engine/backends/vllm/runtime.py: Loop.relay, Loop.iterate).

A stream step interrupted under the caller (Ctrl-C on the sync side, a cancelled task or a timeout on
the async side) can still be unwinding on the model's loop when the stream is closed. Closing then
ran `aclose()` on a running generator: "RuntimeError: aclose(): asynchronous generator is already
running" (issue 19, item 6), and the generator's cleanup (vLLM's abort) was skipped. These tests drive
the Loop with a plain async generator whose cancellation takes a while to unwind, as an aborted vLLM
request does, so they need no engine."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from engine.backends.vllm.runtime import Loop

UNWIND_S = 0.3  # how long a cancelled step takes to unwind (an abort round trip to the engine core)


class SlowStream:
    """An async generator factory that records what happened to it: steps taken, whether its cleanup
    ran and finished, and any error aclose() raised into it."""

    def __init__(self) -> None:
        self.cleaned = threading.Event()
        self.steps = 0

    async def gen(self, step_s: float):
        try:
            while True:
                await asyncio.sleep(step_s)
                self.steps += 1
                yield self.steps
        finally:
            await asyncio.sleep(UNWIND_S)  # the abort: an await inside cleanup, as vLLM's is
            self.cleaned.set()


@pytest.fixture
def loop():
    lp = Loop("a test loop")
    yield lp
    lp.stop()


def test_async_stream_cancelled_mid_step_closes_after_the_step_unwinds(loop):
    """The caller's own loop cancels a step (wait_for times out) and closes the stream: the close
    waits for the cancelled step to unwind, then the generator's cleanup runs to its end before
    aclose returns. On the old relay the close hit the still-running generator: the RuntimeError was
    swallowed and the cleanup had not run when the stream reported closed."""
    s = SlowStream()
    relayed = loop.relay(s.gen(step_s=5.0))

    async def main():
        errors = []
        try:
            await asyncio.wait_for(relayed.__anext__(), 0.1)
        except asyncio.TimeoutError:
            pass
        try:
            await relayed.aclose()
        except BaseException as e:  # noqa: BLE001  (any error here is the bug)
            errors.append(e)
        return errors, s.cleaned.is_set()

    errors, cleaned_at_close = asyncio.run(main())
    assert errors == []
    assert cleaned_at_close, "the stream reported closed before its generator's cleanup (the abort) ran"
    assert s.steps == 0


def test_async_stream_read_to_the_end_and_closed_early_still_work(loop):
    """The ordinary paths through the same code: a full read, and leaving after two items."""
    async def finite():
        for i in range(3):
            await asyncio.sleep(0)
            yield i

    async def main():
        whole = [x async for x in loop.relay(finite())]
        s = SlowStream()
        early = []
        async for x in loop.relay(s.gen(step_s=0.01)):
            early.append(x)
            if len(early) == 2:
                break
        return whole, early, s

    whole, early, s = asyncio.run(main())
    assert whole == [0, 1, 2] and early == [1, 2]
    assert s.cleaned.wait(5), "leaving an async for did not close the generator"


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="SIGINT goes to the main thread")
def test_ctrl_c_during_a_sync_stream_step_is_a_keyboard_interrupt_and_closes_it(loop, ctrl_c):
    """SIGINT while the sync side waits for a step: KeyboardInterrupt (what a user's `except
    KeyboardInterrupt` catches), the step is cancelled and unwound, and closing the stream runs the
    generator's cleanup to its end without an error; the loop serves the next stream."""
    s = SlowStream()
    steps = loop.iterate(s.gen(step_s=5.0))
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        next(steps)
    assert time.monotonic() - t0 < 4.0, "the interrupt waited for the step instead of cancelling it"
    steps.close()
    assert s.cleaned.is_set() and s.steps == 0

    again = SlowStream()
    assert list(zip(range(3), loop.iterate(again.gen(step_s=0.01)))) == [(0, 1), (1, 2), (2, 3)]


def test_a_sync_stream_closed_after_the_loop_stopped_raises_nothing(loop):
    """Dropping a half-read stream after close() (or at interpreter exit) must not wait on a loop that
    no longer runs."""
    s = SlowStream()
    steps = loop.iterate(s.gen(step_s=0.01))
    assert next(steps) == 1
    loop.stop()
    t0 = time.monotonic()
    steps.close()
    assert time.monotonic() - t0 < 2.0


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="SIGINT goes to the main thread")
def test_ctrl_c_during_a_sync_call_returns_once_the_call_has_unwound(loop, ctrl_c):
    """Loop.run interrupted: the call is cancelled on the loop and KeyboardInterrupt goes on as soon as
    it has unwound. The cancelled future was never marked notified, so the wait for the unwind sat out
    its whole 30 s timeout on every Ctrl-C."""
    unwound = threading.Event()

    async def call():
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(UNWIND_S)
            unwound.set()

    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        loop.run(call())
    assert unwound.is_set(), "KeyboardInterrupt went on before the call had unwound"
    assert time.monotonic() - t0 < 5.0, f"Ctrl-C took {time.monotonic() - t0:.1f} s to return"
