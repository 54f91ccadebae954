"""One vLLM request streamed: a StreamStep per new token, with the rows and per-position readouts of
the forward that produced it, read from the workers while the request runs.

vLLM hands back each output as it is made (RequestOutputKind.DELTA). A step waits until the next
one is seen, so that one peek at the workers (`peek`) serves every step seen so far; the last step
goes out with the request's result, its rows cut from the result's cache. The request's plan stays
registered in the workers until its final output was seen (`hold`), then is collected as any
other's. Attention patterns are recomputed after the request on vLLM: only the result holds them.
The client (engine/backends/vllm/client.py) says how to start the request and how to peek.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import torch

from engine.backends.vllm.replies import rekey
from engine.backends.vllm.worker import attn as vllm_attn
from engine.core.plan import Plan
from engine.core.readouts import as_value, parts_of
from engine.core.results import RequestResult, StreamStep, StrictSteerError, check_strict

# start(on_output, key, hold) runs the request under `key`, calling on_output with each of vLLM's
# outputs and keeping its plan registered until `hold` is set; it returns the request's result
Start = Callable[[Callable[[Any], None], str, asyncio.Event], Awaitable[list[RequestResult]]]
# peek(key, since, since_r): the request's capture rows and readout parts from those positions on
Peek = Callable[[str, dict, dict], Awaitable[tuple[dict, dict]]]


def token_logprobs(entry: Any, token: int, n: int) -> tuple:
    """(the sampled token's log-probability, {id: log-probability} of the n most likely) from vLLM's
    per-token logprobs dict ({id: Logprob(logprob, rank)})."""
    if not entry:
        return None, {}
    top = {int(i): float(v.logprob) for i, v in entry.items() if v.rank is not None and v.rank <= n}
    chosen = entry.get(token)
    return (None if chosen is None else float(chosen.logprob)), top


def _span(prompt_len: int, index: int) -> tuple[int, int]:
    """The positions of the forward that produced new token `index`: the prompt for the first, then
    the token fed back."""
    return (0, prompt_len) if index == 0 else (prompt_len + index - 1, prompt_len + index)


def step_readouts(parts: dict, kinds: dict, prompt_len: int, index: int) -> dict | None:
    """The per-position readouts of the forward that produced new token `index` ({name: value}), cut
    from parts read from position 0 (as step_rows cuts captures)."""
    lo, hi = _span(prompt_len, index)
    out = {n: as_value(kinds[n], tuple(t[lo:hi] for t in p)) for n, p in parts.items() if p[0].shape[0] >= hi}
    return out or None


def step_rows(rows: dict, prompt_len: int, index: int) -> dict:
    """The rows of the forward that produced new token `index` ({address: [n, ...]}); addresses not
    read that far are left out."""
    lo, hi = _span(prompt_len, index)
    return {k: t[lo:hi] for k, t in rows.items() if t.shape[0] >= hi}


async def stream_steps(plan: Plan, start: Start, peek: Peek, decode: Callable[[int], str], logprobs: int,
                       rows: bool, strict: bool, keys: dict | None = None) -> AsyncGenerator[StreamStep, None]:
    """The request's StreamSteps (token, text, logprob and the top `logprobs`; with rows=True its
    captured rows; its per-position readouts), the last carrying the RequestResult; strict=True raises
    instead of yielding the last when a steer touched no row. Closing the generator cancels the request."""
    key = uuid.uuid4().hex
    queue: asyncio.Queue = asyncio.Queue()
    hold = asyncio.Event()  # the plan stays registered until the final output was seen
    task = asyncio.ensure_future(start(queue.put_nowait, key, hold))
    live = [str(a) for a in plan.captures if a.point not in vllm_attn.ATTN_POINTS] if rows else []
    since = {k: 0 for k in live}  # read from the workers up to here
    got: dict = {}  # {address: rows from position 0}, as read so far
    live_r = {r.name: r.kind for r in plan.readouts if r.kind.per_position}
    since_r = {n: 0 for n in live_r}
    got_r: dict = {}  # {readout name: parts from position 0}, as read so far
    pending: list[StreamStep] = []  # seen, not yielded (the newest goes out last, with the result)
    seen: list[int] = []
    try:
        finished = False
        while not finished:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:  # the request ended without a final output: raise its error
                getter.cancel()
                task.result()
                break
            ro = getter.result()
            finished = bool(getattr(ro, "finished", False))
            out = ro.outputs[0]
            for j, tok in enumerate(out.token_ids):
                lp, top = token_logprobs(out.logprobs[j] if out.logprobs else None, tok, logprobs)
                pending.append(StreamStep(len(seen), tok, decode(tok), lp, top))
                seen.append(tok)
            if finished:
                hold.set()
            if len(pending) < 2 or finished:
                continue
            if since or since_r:
                caps, reads = await peek(key, since, since_r)
                for k, t in caps.items():
                    got[k] = torch.cat([got[k], t]) if k in got else t
                for k, parts in reads.items():
                    got_r[k] = tuple(torch.cat(z) for z in zip(got_r[k], parts)) if k in got_r else parts
            while len(pending) > 1:
                step = pending.pop(0)
                step.rows = rekey(step_rows(got, plan.prompt_len, step.index), keys or {}) if live else None
                step.readouts = step_readouts(got_r, live_r, plan.prompt_len, step.index)
                yield step
        hold.set()
        (result,) = await task  # built from every DELTA output's tokens (the client's _submit)
        cache = {a: result.cache[a] for k in live for a in (keys or {}).get(k, (k,))}  # its keys as asked
        final_r = {n: parts_of(result.cache.readouts[n]) for n in live_r}
        for step in pending:
            step.rows = step_rows(cache, plan.prompt_len, step.index) if live else None
            step.readouts = step_readouts(final_r, live_r, plan.prompt_len, step.index)
        if pending:
            pending[-1].result = result
        failure = None
        if strict:
            try:
                check_strict(result.receipts, "generation")
            except StrictSteerError as e:
                failure, pending = e, pending[:-1]
        for step in pending:
            yield step
        if failure is not None:
            raise failure
    finally:
        hold.set()
        if not task.done():
            task.cancel()
