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

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core import positions as engine_positions
from engine.core.address import parse
from engine.core.points import INTEGER_POINTS, KEY_AXIS_POINTS
from engine.core.readouts import LensTopK, Project, SAEFeatures, TopK
from engine.core.sae_files import sae_widths
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
        check_features(s.steer, where)  # before the backend's own check: the same answer on every backend
        try:
            addresses.append(str(runner.check_steer(s.steer).address))
            for n, new in set(calls):
                engine_positions.check(s.steer.positions, n, new, f"{s.steer.op} at {s.steer.address}")
        except Exception as e:
            raise from_engine(e, where) from None
        check_rows(s.steer, runner.max_model_len, where)
        steers.append(s.steer)
    readouts = []
    for i, r in enumerate(spec.readouts if spec else []):
        try:
            readouts.append(runner.check_readout(r.readout))
        except Exception as e:
            raise from_engine(e, f"interp.capture.readouts[{i}]") from None
        outputs(runner, readouts[-1].kind, f"interp.capture.readouts[{i}]")  # k within what the readout has
    stop = interp.stop
    if stop is not None:
        kind = next(r.kind for r in readouts if r.name == stop.readout)
        outs = outputs(runner, kind, "interp.stop.readout")
        if (stop.index is None and outs > 1 and not kind.sparse) or (stop.index or 0) >= outs:
            what = "token ids" if isinstance(kind, LensTopK) else "features" if kind.sparse else "value(s) per token"
            raise ServeError(400, f"interp.stop.index: readout {stop.readout!r} gives {outs} {what}; give index "
                                  f"0..{outs - 1}", "interp.stop.index")
    return Asked(points, steers, spec, strict=interp.strict, steer_addresses=addresses, readouts=readouts, stop=stop,
                 binary=binary, logits=interp.logits)


@functools.lru_cache(maxsize=64)
def sae_latents(path: str) -> int:
    """d_sae of an SAE folder (its cfg.json alone, read once per path)."""
    return sae_widths(path)[1]


def outputs(runner: Runner, kind: object, where: str) -> int:
    """How many outputs a readout kind has per token (a Project's rows, an SAE's latents, the
    vocabulary for a lens), its top k checked against them: a k above that is a 400 naming `where`
    (the engine would fail inside the forward, or compute a top-k it cannot fill)."""
    if isinstance(kind, Project):
        return kind.W.shape[0] if kind.W.dim() == 2 else 1
    n = None
    if isinstance(kind, SAEFeatures) and isinstance(kind.sae, str):
        try:
            n = sae_latents(kind.sae)
        except Exception as e:
            raise from_engine(e, where) from None
    elif isinstance(kind, LensTopK):
        n = runner.limits.vocab_size
    k = getattr(kind, "k", None)
    if n is not None and k is not None and k > n:
        of = "latents of its SAE" if isinstance(kind, SAEFeatures) else "tokens of the vocabulary"
        raise ServeError(400, f"{where}: k={k} is more than the {n} {of}; give k of at most {n}", where,
                         kind="ReadoutError")  # the library's class for it (engine/core/readouts.py)
    return n if n is not None else 1


def check_features(st: object, where: str) -> None:
    """A feature op's feature indices within its SAE (read from its cfg.json: the engine would load the
    SAE and fail inside the forward on vLLM)."""
    if getattr(st, "sae", None) is not None and getattr(st, "feature", None) is not None:
        try:
            n = sae_latents(st.sae)  # type: ignore[attr-defined]
        except Exception as e:  # a folder without a readable cfg.json: the engine's own words
            raise from_engine(e, where) from None
        feats = st.feature if isinstance(st.feature, list) else [st.feature]  # type: ignore[attr-defined]
        bad = [f for f in feats if not 0 <= f < n]
        if bad:
            raise ServeError(400, f"{where}.feature: feature {bad[0]} is out of range; its SAE has {n} features "
                                  f"(0..{n - 1})", f"{where}.feature", kind="SteeringError")


def check_rows(st: object, most: int | None, where: str) -> None:
    """A per-position value with no more rows than the model has positions (`most`: max_model_len).
    Rows past a request's own positions are left unused, as the library does (a client may pad one
    value for prompts of several lengths); rows past every position are refused (3000 rows for a
    512-position model were accepted, checked and carried on every step)."""
    v = getattr(st, "value", None)
    lead = st.bound().lead if isinstance(v, torch.Tensor) else 0  # type: ignore[attr-defined]
    if lead and most is not None and v.shape[lead - 1] > most:
        raise ServeError(400, f"{where}.value: {v.shape[lead - 1]} rows of per-position values, more than the "
                              f"{most} positions this server's model takes (max_model_len); give one row per "
                              f"position", f"{where}.value")


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
            enc[k] = encoding.deferred(t, how)
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
        self.wire_used += self.wire_of(rows.nelement(), n, how)
        if self.raw is not None and self.raw_used > self.raw:
            raise ServeError(400, f"interp.capture: the captures of this request are over this server's limit of "
                                  f"{self.raw} bytes (--max-capture-bytes); capture fewer points or positions, or "
                                  f"use reduction 'last' or 'mean'", "interp.capture")
        if self.wire is not None and self.wire_used > self.wire:
            raise too_large(self.wire, how)
        return n

    @classmethod
    def wire_of(cls, numbers: int, raw: int, how: str) -> int:
        """Bytes a tensor of `numbers` numbers (`raw` bytes) takes in an answer, encoded `how`."""
        return numbers * cls.LIST_BYTES if how == "list" else raw if how == encoding.BINARY else 4 * -(-raw // 3)


def largest(runner: Runner, spec: CaptureSpec, keys: list[str], calls: list[tuple[int, int]],
            how: str | None = None) -> tuple[int, int]:
    """(raw bytes, encoded bytes) of a request's captures at their largest, counted as Budget.take
    counts them: each call (prompt length, new tokens; 0: a forward) over every position its spec
    selects, every capture key whose per-token shape the model knows (attention patterns, sized by
    the run, are left to Budget as they are written); `how`: the answer's encoding (default the spec's)."""
    how = how or spec.encoding
    raw = wire = 0
    for n, new in calls:
        end = n + max(new - 1, 0)  # positions a call runs the model on: the prompt, then each token fed back
        m = int(engine_positions.mask(spec.positions, 0, end, n).sum())
        rows = m if spec.reduction == "none" else min(m, 1)
        for key in keys:
            addr = parse(key)
            shape = None if addr.point in KEY_AXIS_POINTS else runner.point_shape(addr.base)
            if shape is None or not rows:
                continue
            numbers = rows * math.prod(shape[len(addr.coords):])
            size = 4 if spec.reduction == "mean" else 8 if addr.point in INTEGER_POINTS else runner.itemsize
            raw += numbers * size
            wire += Budget.wire_of(numbers, numbers * size, how)
    return raw, wire


def check_largest(runner: Runner, spec: CaptureSpec, keys: list[str], calls: list[tuple[int, int]],
                  budget: Budget, how: str | None = None) -> None:
    """Refuse, before anything runs, captures that cannot fit the budget even at their largest (see
    `largest`). For a forward the largest is the answer; for a stream it is what would be sent before
    a cut (old code sent 1.1 MB of a stream, then an in-band 413)."""
    raw, wire = largest(runner, spec, keys, calls, how)
    if budget.raw is not None and raw > budget.raw:
        raise ServeError(400, f"interp.capture: the captures of this request, at their largest, are over this "
                              f"server's limit of {budget.raw} bytes (--max-capture-bytes); capture fewer points or "
                              f"positions, or use reduction 'last' or 'mean'", "interp.capture")
    if budget.wire is not None and wire > budget.wire:
        raise too_large(budget.wire, how or spec.encoding, largest=True)


def too_large(limit: int, how: str, largest: bool = False) -> ServeError:
    """The 413 of captures over --max-response-bytes, with the fixes that apply to this request."""
    fixes = "capture fewer points or positions, or use reduction 'last' or 'mean'"
    fixes += ", or encoding 'base64' instead of 'list' (6x smaller)" if how == "list" else ""
    what = "at their largest (every token up to max_tokens), " if largest else ""
    return ServeError(413, f"interp.capture: the encoded captures, {what}would make this response larger than this "
                           f"server's limit of {limit} bytes (--max-response-bytes); {fixes}", "interp.capture")


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
        out[key] = None if rows is None else encoding.deferred(rows, spec.encoding)
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
                 "captures": {k: encoding.deferred(t, self.spec.encoding) for k, t in cut.items()}}, nbytes)


def canonical(runner: Runner, points: list[str]) -> list[str]:
    """The cache keys a capture list produces (expanded, absolute layers), in order."""
    out = []
    for p in points:
        out += [str(a) for a in runner.check_point(p)]
    return list(dict.fromkeys(out))


def receipts(res: list[Receipt]) -> list[dict]:
    """A result's receipts as JSON, one per interp.steer entry (in order)."""
    return [r.as_json() for r in res]
