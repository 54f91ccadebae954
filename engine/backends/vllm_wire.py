"""Plain-data messages between the engine's client and vLLM's workers (another process).

collective_rpc carries msgpack-able data: tensors travel as {dtype, shape, raw bytes}, plans as
dicts of address strings, ops and position specs. Nothing callable ever crosses the boundary.
"""
from __future__ import annotations

import torch

from engine.address import parse
from engine.plan import Plan
from engine.steering import Steer

_TENSOR = "__tensor__"


def tensor_out(t: torch.Tensor) -> dict:
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dtype == torch.bfloat16 else t
    return {_TENSOR: True, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "data": raw.numpy().tobytes()}


def tensor_in(d: dict) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    buf = bytearray(d["data"])
    if not buf:
        return torch.empty(d["shape"], dtype=dtype)
    if dtype == torch.bfloat16:
        return torch.frombuffer(buf, dtype=torch.uint8).view(torch.bfloat16).reshape(d["shape"])
    return torch.frombuffer(buf, dtype=dtype).reshape(d["shape"])


def encode(x):
    """Tensors anywhere inside lists / tuples / dicts -> plain data."""
    if isinstance(x, torch.Tensor):
        return tensor_out(x)
    if isinstance(x, dict):
        return {k: encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    return x


def decode(x):
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
    return p


def _positions_in(p):
    return slice(*p["slice"]) if isinstance(p, dict) else p


def plan_out(plan: Plan, key: str) -> dict:
    return {"key": key, "prompt_len": plan.prompt_len,
            "captures": [str(a) for a in plan.captures], "internal": [str(a) for a in plan.internal],
            "start_at": dict(plan.start_at),
            "steers": [{"address": str(s.address), "op": s.op, "positions": _positions_out(s.positions),
                        "value": None if s.value is None else tensor_out(s.value)} for s in plan.steers]}


def plan_in(d: dict) -> Plan:
    steers = [Steer(s["address"], s["op"], None if s["value"] is None else tensor_in(s["value"]),
                    _positions_in(s["positions"])) for s in d["steers"]]
    return Plan(d["prompt_len"], [parse(a) for a in d["captures"]], steers,
                [parse(a) for a in d["internal"]], dict(d["start_at"]), key=d["key"])
