"""The messages between the engine's client and vLLM's workers (another process), each declared once
here with its encoding: the plan a request carries (plan_out / plan_in), a rank's reply to a collect
(CollectReply) and to a peek (PeekReply), and a failure (Failure: re-raised on the client as the
class the worker raised).

collective_rpc carries msgpack-able data: tensors travel as {dtype, shape, raw bytes}, plans as
dicts of address strings, ops and position specs, replies as dicts of their declared fields. Nothing
callable ever crosses the boundary.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.backends.vllm.worker.sink import FILE, from_file
from engine.core.address import parse
from engine.core.crossing import error_classes, library_class, nearest
from engine.core.errors import EngineFailure
from engine.core.plan import Plan
from engine.core.readouts import Readout, kind_fields, kind_from
from engine.core.results import Receipt
from engine.core.steering import Steer

_TENSOR = "__tensor__"
STACK = "__stack__"  # a capture sent inside one of its reply's stacks: {STACK: which, "index": its row}


def tensor_out(t: torch.Tensor) -> dict:
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dtype == torch.bfloat16 else t
    return {_TENSOR: True, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "data": raw.numpy().tobytes()}


def tensor_in(d: "dict | torch.Tensor") -> torch.Tensor:
    if isinstance(d, torch.Tensor):  # already decoded (a capture taken from its reply's stack)
        return d
    if FILE in d:  # written to shared memory by the worker (vllm_sink)
        return from_file(d)
    dtype = getattr(torch, d["dtype"])
    buf = bytearray(d["data"])
    if not buf:
        return torch.empty(d["shape"], dtype=dtype)
    if dtype == torch.bfloat16:
        return torch.frombuffer(buf, dtype=torch.uint8).view(torch.bfloat16).reshape(d["shape"])
    return torch.frombuffer(buf, dtype=dtype).reshape(d["shape"])


def encode(x: Any) -> Any:
    """Tensors anywhere inside lists / tuples / dicts -> plain data."""
    if isinstance(x, torch.Tensor):
        return tensor_out(x)
    if isinstance(x, dict):
        return {k: encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    return x


def decode(x: Any) -> Any:
    if isinstance(x, dict):
        if x.get(_TENSOR):
            return tensor_in(x)
        return {k: decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode(v) for v in x]
    return x


def _positions_out(p):
    if isinstance(p, slice):
        return {"slice": [p.start, p.stop]}
    if isinstance(p, torch.Tensor):
        return {"mask": tensor_out(p)}
    if isinstance(p, list):
        return {"list": p}
    return p


def _positions_in(p):
    if not isinstance(p, dict):
        return p
    if "slice" in p:
        return slice(*p["slice"])
    if "mask" in p:
        return tensor_in(p["mask"])
    return list(p["list"])


# how a Steer field crosses the boundary when it is not plain data: (out, in), applied to a value that
# is not None; every other field travels as it is. The message is made from dataclasses.fields(Steer),
# so a field added to Steer crosses without an edit here (and a test fails if it is not plain data).
_STEER_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any] | None]] = {
    "address": (str, parse),
    "positions": (_positions_out, _positions_in),
    "value": (tensor_out, tensor_in),  # a bound steer's value is a tensor
    "bounds": (list, tuple),
}
_STEER_FIELDS = tuple(f.name for f in dataclasses.fields(Steer) if f.name != "checked")  # the message


def steer_out(s: Steer) -> dict:
    """A steer bound to one sequence (engine.core.steering.Steer.for_row) as plain data."""
    out = {}
    for name in _STEER_FIELDS:  # not `checked`: every steer steer_in makes is (the client checked it)
        v, codec = getattr(s, name), _STEER_CODECS.get(name)
        out[name] = v if v is None or codec is None else codec[0](v)
    return out


def steer_in(d: dict) -> Steer:
    """The steer steer_out sent: the client checked it when the request was made (engine.core.steering.Steer,
    the one validation), and a plan's wire form is only ever the client's own message (worker/rows.py's
    PLAN_ARG), so it is rebuilt as checked (at 30 steers a call, checking again cost about 1 ms a call)."""
    kw = {}
    for name in _STEER_FIELDS:
        if name in d:
            v, codec = d[name], _STEER_CODECS.get(name)
            kw[name] = v if v is None or codec is None or codec[1] is None else codec[1](v)
    return Steer(**kw, checked=True)


def readout_out(r: Readout) -> dict:
    """A readout as plain data: its kind by name with its declared fields (an SAE by its path: the
    worker loads it once and caches it; a probe's W and b once per request, never per step)."""
    return {"address": str(r.address), "name": r.name, "kind": type(r.kind).__name__,
            "fields": encode(kind_fields(r.kind))}


def readout_in(d: dict) -> Readout:
    return Readout(d["address"], kind_from(d["kind"], decode(d["fields"])), d["name"])


def plan_out(plan: Plan, key: str) -> dict:
    return {"key": key, "prompt_len": plan.prompt_len,
            "captures": [str(a) for a in plan.captures], "internal": [str(a) for a in plan.internal],
            "start_at": dict(plan.start_at), "steers": [steer_out(s) for s in plan.steers],
            "readouts": [readout_out(r) for r in plan.readouts]}


def plan_in(d: dict) -> Plan:
    return Plan(d["prompt_len"], [parse(a) for a in d["captures"]], [steer_in(s) for s in d["steers"]],
                [parse(a) for a in d["internal"]], dict(d["start_at"]), key=d["key"],
                readouts=[readout_in(r) for r in d.get("readouts", ())])


_RECEIPT_FIELDS = tuple(f.name for f in dataclasses.fields(Receipt))  # plain values each: no deep copy


def receipt_out(r: Receipt) -> dict:
    """A steer's receipt as plain data (non-finite norms travel as they are)."""
    return {name: getattr(r, name) for name in _RECEIPT_FIELDS}


def receipts_in(plan: Plan, ranks: "list[CollectReply] | None") -> list[Receipt]:
    """One Receipt per steer of the plan from the ranks that report it (the worker's `_reports`):
    the rows it touched (the same on each) and its change, whose parts on a sharded point add in
    quadrature."""
    got: dict = {}
    for r in ranks or []:
        for rec in r.receipts or ():
            got.setdefault(rec.index, []).append(rec)
    return [Receipt(i, str(st.address), st.op, max((p.rows for p in got.get(i, ())), default=0),
                    math.sqrt(sum(p.change_norm ** 2 for p in got.get(i, ()))))
            for i, st in enumerate(plan.steers)]


# -- what the workers send back ------------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    """A failure inside a worker, as it crosses back: the class the worker raised (a class of the engine's
    hierarchy or a builtin input check, by name: engine.core.errors.error_classes) and its message."""
    kind: str
    message: str

    @classmethod
    def of(cls, e: BaseException) -> Failure:
        return cls(library_class(e).__name__, str(e))

    def exception(self, suffix: str = "") -> BaseException:
        """The same class on this side (message + suffix); a class the engine does not declare (a CUDA
        RuntimeError) is the engine's failure, never the input's: EngineFailure naming it."""
        cls = error_classes().get(self.kind)
        if cls is None:
            return EngineFailure(f"{self.kind}: {self.message}{suffix}")
        return nearest(cls, f"{self.message}{suffix}")

    def out(self) -> list:
        return [self.kind, self.message]

    @classmethod
    def read(cls, d: list) -> Failure:
        return cls(*d)


def _failures_in(d: dict) -> dict[str, Failure]:
    return {k: Failure.read(v) for k, v in d.items()}


@dataclass
class PeekReply:
    """One rank's rows of a running request from given positions on (interp_peek): captures
    {address: (first position, encoded rows)}, `held` {address: the indices this rank holds of a sharded
    point}, readouts {name: (first position, encoded parts)}."""
    key: str
    captures: dict[str, list] = field(default_factory=dict)
    held: dict[str, list[int]] = field(default_factory=dict)
    readouts: dict[str, list] = field(default_factory=dict)
    errors: dict[str, Failure] = field(default_factory=dict)  # (none while running; gather reads both replies)

    def out(self) -> dict:
        return {"key": self.key, "captures": self.captures, "held": self.held, "readouts": self.readouts}

    @classmethod
    def read(cls, d: dict) -> PeekReply:
        return cls(d["key"], captures={k: [first, _once(rows)] for k, (first, rows) in d["captures"].items()},
                   held=d["held"], readouts=d["readouts"])


@dataclass
class CollectReply:
    """One rank's answer to the collect of one finished request (interp_collect): captures {address:
    (first position, encoded rows, or a reference into `stacks`: several keys' rows sent as one tensor)}, `held` as PeekReply's, readouts {name: encoded parts} (the rank that
    computes them), `errors` {capture or readout: what failed assembling it}, logits (rank 0: encoded
    rows from position `logits_from`), how often the request was recomputed, receipts (the steers this
    rank reports), `failed` (the request failed here: nothing else holds) and `lost` (the plan was not
    registered on this rank)."""
    key: str
    captures: dict[str, list] = field(default_factory=dict)
    stacks: list = field(default_factory=list)  # encoded [keys, positions, ...] tensors captures refer to (STACK)
    held: dict[str, list[int]] = field(default_factory=dict)
    readouts: dict[str, Any] | None = None
    errors: dict[str, Failure] = field(default_factory=dict)
    logits: dict | None = None
    logits_from: int | None = None
    recomputed: int = 0
    receipts: list[Receipt] | None = None
    failed: Failure | None = None
    lost: str | None = None

    def out(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["errors"] = {k: v.out() for k, v in self.errors.items()}
        d["receipts"] = None if self.receipts is None else [receipt_out(r) for r in self.receipts]
        d["failed"] = None if self.failed is None else self.failed.out()
        return d

    @classmethod
    def read(cls, d: dict) -> CollectReply:
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw["errors"] = _failures_in(d.get("errors") or {})
        kw["receipts"] = None if d.get("receipts") is None else [Receipt(**r) for r in d["receipts"]]
        kw["failed"] = None if d.get("failed") is None else Failure.read(d["failed"])
        stacks = [tensor_in(t) for t in d.get("stacks") or []]  # each decoded (or mapped) once
        kw["captures"] = {k: [first, stacks[rows[STACK]][rows["index"]] if isinstance(rows, dict) and STACK in rows
                              else _once(rows)] for k, (first, rows) in (d.get("captures") or {}).items()}
        kw["stacks"] = []
        return cls(**kw)


def _once(rows: Any) -> Any:
    """A capture's rows handed through a file (worker/sink.py) mapped now, once: reading it unlinks the file,
    so a reply whose capture is read twice (attention patterns recomputed from q and k, and q itself) must
    not map it again. Other forms are decoded where they are read."""
    return tensor_in(rows) if isinstance(rows, dict) and FILE in rows else rows
