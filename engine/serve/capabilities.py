"""/v1/points: the capability table of the loaded model, read from the engine's catalogue (point
definitions from engine/core/points.py, where each point exists from the backend's own catalogue, and
every refusal in the engine's own words). Built once at startup."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from engine.core.address import Address
from engine.core.points import POINTS, backend_status
from engine.core.steering import Steer

if TYPE_CHECKING:
    from engine.serve.runner import Runner


def _refusal(fn: Callable[[], object]) -> str | None:
    try:
        fn()
        return None
    except Exception as e:  # the engine's refusal, verbatim
        return str(e)


def table(runner: Runner) -> dict:
    m = runner.catalogue
    rows = []
    for p in POINTS:
        layers = m.point_layers(p.name)
        entry = {"name": p.name, "scope": p.scope, "group": p.group, "shape": p.shape, "coords": list(p.coords),
                 "aliases": list(p.aliases), "definition": p.definition, "served": bool(layers),
                 "layers": layers if p.scope == "layer" else None}
        if layers:
            addr = Address(p.name, layers[0]) if p.scope == "layer" else Address(p.name)
            how, why = backend_status(p.name, runner.backend)
            entry["how"] = "recompute" if how == "recompute" else "hook"
            if why:
                entry["note"] = why
            refused = _refusal(lambda: m._steer(Steer(addr, "ablate")))
            entry["steerable"] = refused is None
            if refused:
                entry["steer_refused"] = refused
            shape = runner.point_shape(m.address(addr))
            if shape is not None:
                entry["per_token_shape"] = list(shape)
        else:
            entry["refused"] = _refusal(lambda: m.address(f"{p.name}.0" if p.scope == "layer" else p.name))
        rows.append(entry)
    return {"object": "points", "model": runner.name, "backend": runner.backend, "n_layers": m.n_layers,
            "d_model": m.d_model, "max_model_len": runner.max_model_len, "points": rows}
