"""The `interp` field against the loaded model, and each result cut to what was asked.

Before anything runs, every capture point and steer is checked against the model one by one (the
engine's own checks: `expand` for points, the backend's steer validation for ops, widths and
capture-only points, engine.core.positions for position specs), so a 400 names the exact entry
(`interp.steer[1]`). After the run, a request's captures ([positions, ...], the prompt then every
generated token fed back, exactly the library's RequestResult.cache) are cut to the asked
positions, reduced (none / last / mean over them) and encoded. Each response's `receipts` say what
every steer did (engine.core.results.Receipt: rows touched, norm of its change); with `strict` (the
default) a steer that touched no row fails the request with a 400 naming `interp.steer[i]`.

Capture keys are the engine's canonical addresses (absolute layer: `resid_post.-1` on a 4-layer
model comes back as `resid_post.3`), as in the library's ActivationCache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core import positions as engine_positions
from engine.core.points import INTEGER_POINTS
from engine.core.readouts import Project, TopK
from engine.serve import encoding
from engine.serve.errors import ServeError, from_engine
from engine.serve.schemas import CaptureSpec, Interp, StopSpec

if TYPE_CHECKING:
    from engine.core.results import Receipt
    from engine.serve.runner import Runner


@dataclass
class Asked:
    """What one request asks of the engine: points to capture, steers, and how to return captures."""
    points: list[str] = field(default_factory=list)
    steers: list = field(default_factory=list)
    spec: CaptureSpec | None = None
    strict: bool = True  # a steer that touched no row fails the request (engine.core.results.check_strict)
    steer_addresses: list[str] = field(default_factory=list)  # each steer's resolved address (errors name it)
    readouts: list = field(default_factory=list)  # engine.core.readouts.Readout, checked against the model
    stop: StopSpec | None = None
    binary: bool = False  # the answer is a frame: tensors asked as base64 travel as raw bytes (encoding.BINARY)
    logits: bool = False  # a generation returns each new token's logits

    @property
    def encoding(self) -> str:
        return self.spec.encoding if self.spec is not None else (encoding.BINARY if self.binary else "base64")

    @property
    def wants_rows(self) -> bool:
        return self.spec is not None and self.spec.reduction == "none" and bool(self.points)


def check(runner: Runner, interp: Interp | None, calls: list[tuple[int, int]], binary: bool = False) -> Asked:
    """Validate `interp` for calls of (prompt length, new tokens) (0 new tokens: a forward). `binary`:
    the answer is a frame, so base64 tensors are sent as raw bytes instead."""
    if interp is None:
        return Asked(binary=binary)
    spec = interp.capture
    if binary and spec is not None and spec.encoding == "base64":
        spec = spec.model_copy(update={"encoding": encoding.BINARY})
    points = list(spec.points) if spec else []
    for i, p in enumerate(points):
        try:
            addrs = runner.check_point(p)
        except Exception as e:
            raise from_engine(e, f"interp.capture.points[{i}]") from None
        if spec.reduction == "mean" and any(a.point in INTEGER_POINTS for a in addrs):
            raise ServeError(400, f"interp.capture.reduction: 'mean' of {p} (integer expert indices) is not "
                                  f"defined; use 'none' or 'last'", "interp.capture.reduction")
    if spec:
        for n, new in set(calls):
            try:
                engine_positions.check(spec.positions, n, new, "the capture")
            except Exception as e:
                raise from_engine(e, "interp.capture.positions") from None
    steers, addresses = [], []
    for i, s in enumerate(interp.steer):
        where = f"interp.steer[{i}]"
        try:
            addresses.append(str(runner.check_steer(s.steer).address))
            for n, new in set(calls):
                engine_positions.check(s.steer.positions, n, new, f"{s.steer.op} at {s.steer.address}")
        except Exception as e:
            raise from_engine(e, where) from None
        steers.append(s.steer)
    readouts = []
    for i, r in enumerate(spec.readouts if spec else []):
        try:
            readouts.append(runner.check_readout(r.readout))
        except Exception as e:
            raise from_engine(e, f"interp.capture.readouts[{i}]") from None
    stop = interp.stop
    if stop is not None:
        kind = next(r.kind for r in readouts if r.name == stop.readout)
        outs = (kind.W.shape[0] if kind.W.dim() == 2 else 1) if isinstance(kind, Project) else 1
        if not kind.sparse and ((stop.index is None and outs > 1) or (stop.index or 0) >= outs):
            raise ServeError(400, f"interp.stop.index: readout {stop.readout!r} gives {outs} value(s) per token; give "
                                  f"index 0..{outs - 1}", "interp.stop.index")
    return Asked(points, steers, spec, strict=interp.strict, steer_addresses=addresses, readouts=readouts, stop=stop,
                 binary=binary, logits=interp.logits)


def stop_score(stop: StopSpec, value: torch.Tensor | TopK) -> float:
    """The score a stop reads from a step's readout (rows of the forward that produced a token): its
    last row; a sparse readout scores `index` by its value when among the top k (else -inf), or its
    top value."""
    if isinstance(value, TopK):
        ids, vals = value.indices[-1], value.values[-1]
        if stop.index is None:
            return float(vals[0])
        hit = vals[ids == stop.index]
        return float(hit[0]) if hit.numel() else float("-inf")
    row = value[-1].reshape(-1)
    return float(row[stop.index or 0])


def crossed(stop: StopSpec, score: float) -> bool:
    return score > stop.above if stop.above is not None else score < stop.below  # type: ignore[operator]


def readouts_payload(values: dict, how: str, budget: "Budget") -> tuple[dict, int]:
    """{name: encoded} for readout values (a TopK as {indices, values}), each taken from `budget`."""
    out, n = {}, 0
    for name, v in values.items():
        parts = {"indices": v.indices, "values": v.values} if isinstance(v, TopK) else {"value": v}
        enc = {}
        for k, t in parts.items():
            n += budget.take(t, how)
            enc[k] = encoding.encode(t, how)
        out[name] = enc if isinstance(v, TopK) else enc["value"]
    return out, n


@dataclass
class Budget:
    """What one request's captures may take: raw tensor bytes (`raw`, --max-capture-bytes) and bytes
    in the response body once encoded (`wire`, --max-response-bytes; base64 is 4/3 of raw, a `list`
    number counts LIST_BYTES, binary is the raw bytes). Checked before a tensor is encoded, so an oversize
    answer costs nothing."""
    raw: int | None = None
    wire: int | None = None
    raw_used: int = 0
    wire_used: int = 0
    LIST_BYTES = 25  # the longest a float's JSON text and its separator can be ('-1.1754943508222875e-38, ')

    def take(self, rows: torch.Tensor, how: str) -> int:
        n = rows.nelement() * rows.element_size()
        if how == "list" and rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
            raise ServeError(400, "interp.capture.encoding: these captures hold inf or NaN, which JSON numbers "
                                  "cannot carry; use encoding 'base64'", "interp.capture.encoding")
        self.raw_used += n
        self.wire_used += (rows.nelement() * self.LIST_BYTES if how == "list" else n if how == encoding.BINARY
                           else 4 * -(-n // 3))
        if self.raw is not None and self.raw_used > self.raw:
            raise ServeError(400, f"interp.capture: the captures of this request are over this server's limit of "
                                  f"{self.raw} bytes (--max-capture-bytes); capture fewer points or positions, or "
                                  f"use reduction 'last' or 'mean'", "interp.capture")
        if self.wire is not None and self.wire_used > self.wire:
            raise ServeError(413, f"interp.capture: the encoded captures would make this response larger than this "
                                  f"server's limit of {self.wire} bytes (--max-response-bytes); capture fewer points "
                                  f"or positions, use reduction 'last' or 'mean', or encoding 'base64' instead of "
                                  f"'list'", "interp.capture")
        return n


def selected(spec: CaptureSpec, start: int, stop: int, prompt_len: int) -> torch.Tensor:
    """Absolute positions in [start, stop) that the capture's position spec selects."""
    if stop <= start:
        return torch.zeros(0, dtype=torch.long)
    m = engine_positions.mask(spec.positions, start, stop - start, prompt_len)
    return torch.nonzero(m, as_tuple=True)[0] + start


def payload(spec: CaptureSpec, cache: dict, prompt_len: int, end: int, start: int = 0,
            budget: Budget | None = None) -> tuple[dict, int]:
    """({positions, reduction, captures}, raw bytes) for a result's cache over positions [start, end)
    (`end`: prompt plus fed-back tokens; a stream sends earlier rows as they come). Every capture ends
    at `end`; one that starts later (eager's lm_head while generating: the logits of each new token,
    from the last prompt position on) carries its own `positions`. A reduction over none gives null.
    Each tensor is taken from `budget` before it is encoded."""
    pos = selected(spec, start, end, prompt_len)
    out, nbytes = {}, 0
    budget = budget or Budget()
    for key, t in cache.items():
        off = end - t.shape[0]
        mine = pos[pos >= off] if off > 0 else pos
        rows = t[mine - off]
        if spec.reduction == "last":
            rows = rows[-1] if len(mine) else None
        elif spec.reduction == "mean":
            rows = rows.float().mean(0) if len(mine) else None
        if rows is not None:
            nbytes += budget.take(rows, spec.encoding)
        out[key] = None if rows is None else encoding.encode(rows, spec.encoding)
        if out[key] is not None and len(mine) != len(pos):
            out[key]["positions"] = mine.tolist()
    return {"positions": pos.tolist(), "reduction": spec.reduction, "captures": out}, nbytes


class StreamRows:
    """Capture rows of a stream as they arrive ({address: (first position, rows)}), sent once every
    expected address has them (attention patterns, recomputed at the end, hold every row back to
    the final chunk), cut to the asked positions; the rest goes out with the final result."""

    def __init__(self, spec: CaptureSpec, keys: list[str], prompt_len: int, budget: Budget) -> None:
        self.spec, self.keys, self.prompt_len, self.budget = spec, set(keys), prompt_len, budget
        self.next = 0  # first position not sent yet (every address)
        self.pending: dict = {}  # address -> rows from self.next on

    def add(self, rows: dict | None) -> tuple[dict | None, int]:
        if not rows:
            return None, 0
        for k, (p, t) in rows.items():
            have = self.pending.get(k)
            end = self.next + (0 if have is None else have.shape[0])
            if p > end:  # a gap cannot be filled from here: wait for the final result
                continue
            t = t[end - p:]
            self.pending[k] = t if have is None else torch.cat([have, t])
        keys = self.keys
        ready = min((self.pending[k].shape[0] if k in self.pending else 0) for k in keys) if keys else 0
        if ready == 0:
            return None, 0
        part = {k: self.pending[k][:ready] for k in keys}
        self.pending = {k: v[ready:] for k, v in self.pending.items()}
        start, self.next = self.next, self.next + ready
        pos = selected(self.spec, start, self.next, self.prompt_len)
        if len(pos) == 0:
            return None, 0
        cut = {k: t[pos - start] for k, t in part.items()}
        return self._encoded(pos, cut)

    def final(self, cache: dict, end: int) -> tuple[dict, int]:
        """The rows not sent yet, from the finished request's cache (positions up to `end`)."""
        return payload(self.spec, cache, self.prompt_len, end, self.next, self.budget)

    def _encoded(self, pos, cut: dict) -> tuple[dict, int]:
        nbytes = sum(self.budget.take(t, self.spec.encoding) for t in cut.values())
        return ({"positions": pos.tolist(), "reduction": "none",
                 "captures": {k: encoding.encode(t, self.spec.encoding) for k, t in cut.items()}}, nbytes)


def canonical(runner: Runner, points: list[str]) -> list[str]:
    """The cache keys a capture list produces (expanded, absolute layers), in order."""
    out = []
    for p in points:
        out += [str(a) for a in runner.check_point(p)]
    return list(dict.fromkeys(out))


def receipts(res: list[Receipt]) -> list[dict]:
    """A result's receipts as JSON, one per interp.steer entry (in order)."""
    return [r.as_json() for r in res]
