"""Request bodies from the library's own objects: a Steer, a Readout and a position spec as the server's
JSON (engine/serve/schemas.py reads them back into the same types), tensors as base64 tensor objects
(engine/serve/encoding.py; never JSON floats, never pickled).

Only what JSON carries as it is goes as it is; the rest is refused here by name: a loaded SAE object
(the server loads SAEs from its own --sae-dir by folder name) and an engine-only field.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.core.errors import SteeringError
from engine.core.readouts import Readout, ReadoutError, kind_fields
from engine.core.steering import Steer
from engine.serve import encoding

# Steer's own fields a request sets (those marked "engine" are the engine's bookkeeping, never sent)
STEER_FIELDS = [f.name for f in dataclasses.fields(Steer) if not f.metadata.get("engine")]


def tensor(t: torch.Tensor) -> dict:
    return encoding.encode(t)


def positions(p: Any) -> Any:
    """A normalized position spec (engine.core.positions.normalize) as the server's JSON."""
    if isinstance(p, slice):
        return [p.start, p.stop]
    if isinstance(p, list):
        return {"at": p}
    if isinstance(p, torch.Tensor):
        return {"mask": p.tolist()}
    return p  # "all" | "last" | "generated" | int


def _sae(sae: Any, where: str, err: type[Exception]) -> str | None:
    if sae is None or isinstance(sae, str):
        return sae
    raise err(f"{where}: a loaded SAE ({type(sae).__name__}) cannot be sent to a model server; name the SAE "
              f"folder inside the server's --sae-dir instead.")


def steer(st: Steer) -> dict:
    """One steer, bound to one sequence (a batch value or a [batch, pos] mask cut to its row first:
    the server runs each prompt as its own request)."""
    out: dict[str, Any] = {}
    for name in STEER_FIELDS:
        v = getattr(st, name)
        if name == "address":
            v = str(v)
        elif name == "value" and v is not None:
            v = tensor(v)
        elif name == "positions":
            v = positions(v)
        elif name == "bounds" and v is not None:
            v = list(v)
        elif name == "sae":
            v = _sae(v, f"{st.op} at {st.address}", SteeringError)
        if v is not None:
            out[name] = v
    return out


def readout(r: Readout) -> dict:
    """One readout: its address, kind (a class name of engine.core.readouts.KINDS), name and the kind's fields."""
    out: dict[str, Any] = {"address": str(r.address), "kind": type(r.kind).__name__, "name": r.name}
    for k, v in kind_fields(r.kind).items():
        if k == "sae":
            v = _sae(v, f"readout {r.name}", ReadoutError)
        elif isinstance(v, torch.Tensor):
            v = tensor(v)
        if v is not None:
            out[k] = v
    return out


def interp(points: list[str], steers: list[Steer], readouts: list[Readout], logits: bool = False) -> dict:
    """The `interp` field: every position captured whole (the client cuts and pads as the library does),
    strict left to the client (it checks the call's combined receipts, as the library does); `logits`:
    a generation's logits returned."""
    body: dict[str, Any] = {"strict": False}
    if logits:
        body["logits"] = True
    if points or readouts:
        body["capture"] = {"points": points, "positions": "all", "reduction": "none",
                           "readouts": [readout(r) for r in readouts]}
    if steers:
        body["steer"] = [steer(s) for s in steers]
    return body
