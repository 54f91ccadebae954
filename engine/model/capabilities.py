"""Verdicts before running: for every point and layer of a loaded model on its backend, whether it is
served (by a hook, or recomputed), capture-only (and why), or refused (why, and what to use instead).

    m.describe()                  # a Capabilities table: one Verdict per (point, layer)
    m.serves("attn_probs.3")      # True / False
    m.refuses("attn_probs.3")     # None, or the reason it is refused
    print(m.describe().table())   # markdown

The verdicts come from the same sources a call consults (engine/core/points.py's per-backend statuses,
the family table through the site resolvers, the vLLM workers' own tables), so a verdict and the
call it predicts never disagree; tests/test_capabilities.py holds them to it point by point.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from engine.core.address import Address, parse
from engine.core.backends import REGISTRY
from engine.core.errors import AddressError
from engine.core.points import POINTS, backend_status, get_point

_LAYER = re.compile(r"at layer \d+")
_USE = re.compile(r"(?:^|[;:,(] ?)((?:use|steer|capture|declare|lens|project out|load) [^;.()]*(?:\([^)]*\)[^;.()]*)*)")


@dataclass(frozen=True)
class Verdict:
    address: str
    served: bool
    how: str | None  # "hook" | "recompute" when served
    capture_only: str | None = None  # served for capture, steering refused: why
    reason: str | None = None  # refused: why
    instead: str | None = None  # refused: what to use instead

    @property
    def steerable(self) -> bool:
        return self.served and self.capture_only is None


def instead_of(reason: str, point: str, backend: str) -> str | None:
    """What to use instead: the reason's own advice ("use z or attn_out"), else another backend
    whose catalogue entry serves the point."""
    m = _USE.search(reason or "")
    if m:
        return m.group(1).strip()
    others = [b for b, spec in REGISTRY.items()
              if b != backend and spec.captures and backend_status(point, b)[0] != "refused"]
    if backend_status(point, backend)[0] == "refused" and others:
        return f"backend={others[0]!r}"
    return None


class Capabilities(list):
    """The verdicts of one model on one backend, in catalogue order; `readouts`: each readout kind
    (engine.core.readouts.KINDS) -> None where this backend computes it at every point it serves, else
    what it refuses and why."""

    def __init__(self, verdicts: Iterable[Verdict], model: str, backend: str, readouts: dict | None = None) -> None:
        super().__init__(verdicts)
        self.model, self.backend = model, backend
        self.readouts: dict = dict(readouts or {})

    def get(self, address: Address | str) -> Verdict:
        key = str(address)
        for v in self:
            if v.address == key:
                return v
        raise KeyError(f"{key!r} is not in this table (addresses have absolute layers).")

    def served(self) -> list[Verdict]:
        return [v for v in self if v.served]

    def table(self) -> str:
        """Markdown: one row per point, its layers grouped by verdict."""
        rows = [f"{self.model} on backend {self.backend!r}", "",
                "| point | served (how) | capture-only | refused: why / instead |", "|---|---|---|---|"]
        by_point: dict = {}
        for v in self:
            by_point.setdefault(parse(v.address).point, []).append(v)
        for point, vs in by_point.items():
            served = _layers([v for v in vs if v.served])
            hows = sorted({v.how for v in vs if v.served})
            co = sorted({v.capture_only for v in vs if v.capture_only})
            ref = sorted({_LAYER.sub("at layer L", v.reason) + (f" (instead: {v.instead})" if v.instead else "")
                          for v in vs if not v.served})
            rows.append(f"| `{point}` | {served}{' (' + ', '.join(hows) + ')' if hows else ''} | {'; '.join(co)} | "
                        f"{'; '.join(r.replace('|', '/') for r in ref)} |")
        if self.readouts:
            rows += ["", "| readout | computed where the activation is |", "|---|---|"]
            rows += [f"| `{k}` | {'yes' if why is None else why.replace('|', '/')} |" for k, why in self.readouts.items()]
        return "\n".join(rows) + "\n"


def _layers(vs) -> str:
    layers = [parse(v.address).layer for v in vs]
    if not layers:
        return "-"
    if layers == [None]:
        return "yes"
    return f"layers {_ranges(layers)}"


def _ranges(xs) -> str:
    out, start, prev = [], None, None
    for x in xs:
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = x
    out.append(f"{start}-{prev}" if prev > start else str(start))
    return ", ".join(out)


class CapabilityMixin:
    """describe / serves / refuses for any model class that implements `_verdict(point, layer)`."""

    def _verdict(self, point: str, layer: int | None) -> Verdict:
        raise NotImplementedError

    def _readout_kinds(self) -> dict:
        """{readout kind: None (computed at every served point) or the reason for what is refused}."""
        from engine.core.readouts import KINDS
        return {k: None for k in KINDS}

    def describe(self) -> Capabilities:
        """Every point of the catalogue at every layer (trunk points once): served or refused, how, why."""
        self._live()
        out = []
        for p in POINTS:
            for layer in ([None] if p.scope == "trunk" else range(self.n_layers)):
                out.append(self._verdict(p.name, layer))
        return Capabilities(out, self.name, self.backend, self._readout_kinds())

    def verdict(self, address: Address | str) -> Verdict:
        """The verdict for one address (any layer form; coordinates are checked against the model)."""
        self._live()
        addr = parse(address)
        if get_point(addr.point).scope == "layer":
            addr = addr.resolved(self.n_layers)
        v = self._verdict(addr.point, addr.layer)
        if v.served and addr.coords:
            try:
                self.address(addr)
            except AddressError as e:
                return Verdict(str(addr), False, None, reason=str(e))
        return v

    def serves(self, address: Address | str) -> bool:
        return self.verdict(address).served

    def refuses(self, address: Address | str) -> str | None:
        """None when served; else the reason (and what to use instead)."""
        v = self.verdict(address)
        if v.served:
            return None
        return v.reason + (f" Instead: {v.instead}." if v.instead and v.instead not in v.reason else "")


def refused(point: str, layer: int | None, backend: str, reason: str) -> Verdict:
    addr = str(Address(point, layer))
    reason = reason.strip().rstrip(".")
    return Verdict(addr, False, None, reason=reason + ".", instead=instead_of(reason, point, backend))
