"""Streaming generation on the eager backend: HF generate runs on a worker thread with a streamer
that, at each new token, reads what the step's forward left in the plan (the raw logits of the
engine's own lm_head read, the captured rows) and hands a StreamStep to the caller's iterator."""
from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from engine.backends.hf import generation
from engine.core.address import Address
from engine.core.errors import InputError
from engine.core.inputs import limits_of, top_logprobs
from engine.core.plan import Plan
from engine.core.results import StreamStep

if TYPE_CHECKING:
    from engine.backends.hf.grid import Call

_LOGITS = Address("lm_head")
_HEADS = ("lm_head", "lm_head_raw")  # HF's prefill computes every column; the stream gives the last
# `model` below is the EagerModel: typed Any because engine/backends/hf/eager.py imports this module and an
# import back, even for type checking only, would be a cycle (tests/test_imports.py)


def step_logprobs(logits_row: torch.Tensor, token: int, n: int) -> tuple[float, dict]:
    """(log-probability of `token`, {id: log-probability} of the n most likely) from raw logits."""
    lp = torch.log_softmax(logits_row.float(), dim=-1)
    top = {}
    if n:
        vals, ids = lp.topk(n)
        top = {int(i): float(v) for i, v in zip(ids, vals)}
    return float(lp[token]), top


class _Stop(StoppingCriteria):
    def __init__(self) -> None:
        self.flag = False

    def __call__(self, input_ids, scores, **kw):
        return torch.full((input_ids.shape[0],), self.flag, dtype=torch.bool, device=input_ids.device)


class _Streamer(BaseStreamer):
    """Gets the prompt, then each new token, from HF generate (on the worker thread)."""

    def __init__(self, model: Any, n_logprobs: int, out: queue.Queue, rows: bool = True) -> None:
        self.model, self.n, self.out, self.want_rows = model, n_logprobs, out, rows
        self.plan: Plan | None = None
        self.call: Call | None = None  # the call's captured chunks ([1, columns, ...] per forward)
        self.seen_prompt = False
        self.index = 0
        self.sent: dict = {}  # capture key -> chunks already handed out

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        token = int(value.reshape(-1)[0])
        plan, call = self.plan, self.call
        assert plan is not None and call is not None, "generate hands the plan over before the first token"
        chunks = call.store.get(str(_LOGITS)) or []
        logprob, top = step_logprobs(chunks[-1][1][0, -1], token, self.n) if chunks else (None, {})
        rows = None
        if plan.captures and self.want_rows:
            rows = {}
            for addr in plan.captures:
                key = str(addr)
                got = call.store.get(key) or []
                new = got[self.sent.get(key, 0):]
                self.sent[key] = len(got)
                if new:
                    rows[key] = torch.cat([c[0, -1:] if key in _HEADS else c[0] for _, c in new])
        text = self.model.tokenizer.decode([token], skip_special_tokens=True)
        self.out.put(("step", StreamStep(self.index, token, text, logprob, top, rows, self._readouts(plan))))
        self.index += 1

    def _readouts(self, plan) -> dict | None:
        """The per-position readouts of the forward that produced this token (the rows not handed out yet)."""
        from engine.core.readouts import as_value
        out = {}
        for name, acc in plan.accumulators.items():
            if not acc.readout.kind.per_position:
                continue
            start = self.sent.get(("readout", name), 0)
            parts = acc.rows_from(start)
            if parts is not None:
                out[name] = as_value(acc.readout.kind, parts)
                self.sent[("readout", name)] = start + parts[0].shape[0]
        return out or None

    def end(self) -> None:
        pass


def stream(model: Any, prompt: Any, max_new_tokens: int, points: Any, steer: Any, logprobs: int,
           sampling: dict[str, Any], return_logits: bool = True, rows: bool = True, strict: bool = False,
           readouts: Any = ()) -> Generator[StreamStep, None, None]:
    logprobs = top_logprobs(logprobs, limits_of(model).vocab_size)
    model._live()
    # everything a bad call fails on is checked here, before the thread starts (errors raise here), and the
    # steering() blocks around the call are bound here
    prep = generation.prepare(model, prompt, max_new_tokens, points, steer, sampling, readouts, strict,
                              internal=(_LOGITS,))
    if prep.batch.mask.shape[0] != 1:
        raise InputError(f"stream takes one prompt, got {prep.batch.mask.shape[0]}; stream each, or use generate "
                         f"for a batch.")
    out: queue.Queue = queue.Queue()
    streamer, stop = _Streamer(model, logprobs, out, rows), _Stop()

    def on_plans(plans, call):
        streamer.plan, streamer.call = plans[0], call

    def run():
        try:
            res = generation.run(model, prep, streamer, StoppingCriteriaList([stop]), on_plans, strict)
            req = res.requests[0]
            if not return_logits:
                req.logits = None
            out.put(("done", req))
        except BaseException as e:  # noqa: BLE001  (handed to the caller's thread)
            out.put(("error", e))
    # the caller's context goes with the thread as well (what it reads at run time)
    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), name="interp-eager-stream",
                              daemon=True)
    thread.start()
    return _iterate(out, stop, thread)


def _iterate(out, stop, thread):
    held = None
    try:
        while True:
            kind, item = out.get()
            if kind == "error":
                raise item
            if kind == "done":
                if held is not None:
                    held.result = item
                    yield held
                return
            if held is not None:
                yield held
            held = item
    finally:
        stop.flag = True
        thread.join()
