"""Per-request plans and the demultiplexing of vLLM's flattened continuous batch.

Every forward step sees one flat `[tokens, ...]` tensor holding the scheduled tokens of all running
requests back to back. `Step.of(runner)` says which rows belong to which of *our* requests (found
through the key we put in SamplingParams.extra_args, never by vLLM's request id) and at which
absolute position each chunk starts (the scheduler's computed-token count). Captured rows are
accumulated per request by absolute position: a chunk that starts before what is held (the
scheduler preempted and recomputed the request) truncates the accumulator first; a chunk that
starts after it (positions served from a prefix cache, never computed here) is an error at
assembly, never a silently short tensor.
"""
from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field

import torch

from engine.address import Address
from engine.steering import Steer

EXTRA_KEY = "interp_request"
_keys = itertools.count(1)


def position_mask(positions, pos0: int, n: int, prompt_len: int, device=None) -> torch.Tensor:
    """Which of the n tokens at absolute positions pos0.. a steer touches: the absolute-position
    form of engine.steering.position_mask ("last" = the last prompt token and every generated
    token fed back; "generated" = fed-back tokens only)."""
    idx = torch.arange(pos0, pos0 + n, device=device)
    if positions == "all":
        return torch.ones(n, dtype=torch.bool, device=device)
    if positions == "generated":
        return idx >= prompt_len
    if positions == "last":
        return idx >= prompt_len - 1
    if isinstance(positions, int):
        return idx == positions
    start = positions.start or 0
    stop = positions.stop if positions.stop is not None else 1 << 62
    return (idx >= start) & (idx < stop)


@dataclass
class Plan:
    """One request's prompt, what it captures and steers, and what it has captured so far."""
    prompt: list[int]
    captures: list[Address] = field(default_factory=list)  # resolved (absolute layer), with coords
    steers: list[Steer] = field(default_factory=list)  # resolved addresses
    internal: list[Address] = field(default_factory=list)  # read for the engine itself (logits, q/k)
    derived: list[Address] = field(default_factory=list)  # computed after the request (attn_scores/probs)
    start_at: dict = field(default_factory=dict)  # address str -> first position worth keeping
    force_salt: bool = False  # every position must be computed (e.g. prefill logits)
    key: int = field(default_factory=lambda: next(_keys))
    recomputed: int = 0  # chunks that restarted below what was held (preemption + recompute)
    store: dict = field(default_factory=dict)  # address str -> list[(pos0, cpu tensor)]

    def reads(self) -> list[Address]:
        return list(dict.fromkeys(self.captures + self.internal))

    @property
    def salt(self) -> str | None:
        """A private prefix-cache key for requests that capture or steer (see pitfalls.md)."""
        if self.captures or self.steers or self.force_salt:
            if not hasattr(self, "_salt"):
                self._salt = f"interp-{uuid.uuid4().hex}"
            return self._salt
        return None

    def wanted(self, key: str, pos0: int, n: int) -> int | None:
        """How many leading rows of a chunk to skip for `key` (None: skip the whole chunk)."""
        lo = self.start_at.get(key, 0)
        return None if pos0 + n <= lo else max(0, lo - pos0)

    def add(self, key: str, pos0: int, rows: torch.Tensor) -> None:
        chunks = self.store.setdefault(key, [])
        end = chunks[-1][0] + chunks[-1][1].shape[0] if chunks else None
        if end is not None and pos0 < end:  # recomputed after preemption: drop what is being recomputed
            self.recomputed += 1
            chunks[:] = [(p, c[: pos0 - p]) for p, c in chunks if p < pos0]
        chunks.append((pos0, rows))

    def tail(self, key: str) -> tuple[int, torch.Tensor]:
        """(first position, rows) of a capture that may start after 0 (its prefix was cached)."""
        chunks = self.store.get(key) or []
        if not chunks:
            raise RuntimeError(f"{key} was never computed for this request.")
        p0 = chunks[0][0]
        self.store[key] = [(p - p0, c) for p, c in chunks]
        try:
            return p0, self.tensor(key)
        finally:
            self.store[key] = chunks

    def tensor(self, key: str) -> torch.Tensor:
        """The [pos, ...] capture for an address key, checked contiguous from position 0."""
        chunks = self.store.get(key)
        if not chunks:
            raise RuntimeError(f"{key} was never computed for this request: vLLM served all of it "
                               f"from a cache or the request was aborted.")
        at = 0
        for p, c in chunks:
            if p != at:
                raise RuntimeError(f"{key}: positions {at}..{p - 1} were never computed in this request "
                                   f"(served from vLLM's prefix cache); capturing requests need their own "
                                   f"cache salt, which the engine sets: report this as a bug.")
            at += c.shape[0]
        return torch.cat([c for _, c in chunks], dim=0)


@dataclass
class Row:
    plan: Plan
    a: int  # first row of this request in the flat batch
    b: int  # one past its last row
    pos0: int  # absolute position of row a

    def mask(self, positions, device=None) -> torch.Tensor:
        return position_mask(positions, self.pos0, self.b - self.a, len(self.plan.prompt), device)


@dataclass
class Step:
    rows: list[Row]
    n_tokens: int

    @staticmethod
    def of(runner, plans: dict[int, Plan], n_tokens: int) -> "Step":
        """Rows of our requests in the step the runner is about to execute."""
        req_ids = runner.input_batch.req_ids
        qsl = runner.query_start_loc.cpu[: len(req_ids) + 1].tolist()
        rows = []
        for i, rid in enumerate(req_ids):
            state = runner.requests.get(rid)
            extra = (state.sampling_params.extra_args or {}) if state and state.sampling_params else {}
            plan = plans.get(extra.get(EXTRA_KEY))
            if plan is not None and qsl[i + 1] > qsl[i]:
                rows.append(Row(plan, qsl[i], qsl[i + 1], state.num_computed_tokens))
        return Step(rows, n_tokens)


class StepTracker:
    """Wraps the runner's `_model_forward` (the one call per step, made inside vLLM's forward
    context) so that the active backend learns the step's rows before the forward and can
    collect after it, also when the forward itself is a replayed graph."""

    def __init__(self, runner):
        self.runner = runner
        self.plans: dict[int, Plan] = {}
        self.step: Step | None = None
        self.before = self.after = None  # callbacks(step) set by the backend
        orig = runner._model_forward

        def _model_forward(*args, **kwargs):
            if not self.plans:
                return orig(*args, **kwargs)
            ids = kwargs.get("input_ids")
            emb = kwargs.get("inputs_embeds")
            n = (ids if ids is not None else emb).shape[0]
            self.step = Step.of(runner, self.plans, n)
            try:
                if self.before:
                    self.before(self.step)
                out = orig(*args, **kwargs)
                if self.after:
                    self.after(self.step)
                return out
            finally:
                self.step = None

        runner._model_forward = _model_forward
