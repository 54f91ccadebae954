"""Plain-data messages between the engine's client and vLLM's workers (another process).

collective_rpc carries msgpack-able data: tensors travel as {dtype, shape, raw bytes}, plans as
dicts of address strings, ops and position specs. Nothing callable ever crosses the boundary.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from engine.backends.vllm.worker.sink import FILE, from_file
from engine.core.address import parse
from engine.core.plan import Plan
from engine.core.readouts import Readout, kind_fields, kind_from
from engine.core.results import Receipt
from engine.core.steering import Steer

_TENSOR = "__tensor__"


def tensor_out(t: torch.Tensor) -> dict:
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dtype == torch.bfloat16 else t
    return {_TENSOR: True, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "data": raw.numpy().tobytes()}


def tensor_in(d: dict) -> torch.Tensor:
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
    "address": (str, None),  # Steer parses it
    "positions": (_positions_out, _positions_in),
    "value": (tensor_out, tensor_in),  # a bound steer's value is a tensor
    "bounds": (list, tuple),
}


def steer_out(s: Steer) -> dict:
    """A steer bound to one sequence (engine.core.steering.Steer.for_row) as plain data."""
    out = {}
    for f in dataclasses.fields(Steer):
        if f.name == "checked":  # the worker checks what it receives
            continue
        v, codec = getattr(s, f.name), _STEER_CODECS.get(f.name)
        out[f.name] = v if v is None or codec is None else codec[0](v)
    return out


def steer_in(d: dict) -> Steer:
    kw = {}
    for f in dataclasses.fields(Steer):
        if f.name in d:
            v, codec = d[f.name], _STEER_CODECS.get(f.name)
            kw[f.name] = v if v is None or codec is None or codec[1] is None else codec[1](v)
    return Steer(**kw)


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


def receipt_out(r: Receipt) -> dict:
    """A steer's receipt as plain data (non-finite norms travel as they are)."""
    return dataclasses.asdict(r)


def receipts_in(plan: Plan, ranks: list[dict] | None) -> list[Receipt]:
    """One Receipt per steer of the plan from the ranks that report it (the worker's `_reports`):
    the rows it touched (the same on each) and its change, whose parts on a sharded point add in
    quadrature."""
    got: dict = {}
    for r in ranks or []:
        for d in r.get("receipts", ()):
            got.setdefault(d["index"], []).append(Receipt(**d))
    return [Receipt(i, str(st.address), st.op, max((p.rows for p in got.get(i, ())), default=0),
                    math.sqrt(sum(p.change_norm ** 2 for p in got.get(i, ()))))
            for i, st in enumerate(plan.steers)]
