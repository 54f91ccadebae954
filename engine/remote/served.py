"""What a model server runs and serves, read once from its /v1/capabilities when a client connects:
the backend, the model's facts, the point table (where each point is served, steerable or refused,
and why), the readout kinds, the sampling fields and the limits. A client checks a call against it
before sending what the server would refuse anyway, and names the refusal as the server words it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.address import Address, known_point, parse
from engine.core.errors import AddressError, OptionError, SteeringError, UnsupportedPointError
from engine.core.points import POINTS
from engine.core.steering import Steer
from engine.model.capabilities import Verdict, refused
from engine.serve.wire import PROTOCOL


@dataclass(frozen=True)
class Served:
    url: str
    model: str  # the name the server's model answers to
    names: tuple[str, ...]  # every name it answers to (--served-model-name)
    backend: str
    n_layers: int
    d_model: int
    vocab_size: int | None
    max_model_len: int | None
    points: dict  # point name -> the row of its point table (engine/serve/capabilities.py)
    readouts: dict  # readout kind -> None (computed everywhere it serves) or what it refuses
    sampling_extras: tuple[str, ...]  # request fields beyond the engine's knobs this backend honours
    lens: str | None  # None: the logit lens is served; else why not
    sae: bool  # whether the server names SAEs (--sae-dir)
    tokenizer: dict  # pad_token_id, bos_token_id, eos_token_id, size
    limits: dict = field(default_factory=dict)

    @classmethod
    def of(cls, url: str, obj: dict) -> "Served":
        from engine.remote.errors import RemoteError
        if not isinstance(obj, dict) or obj.get("object") != "capabilities":
            raise RemoteError(f"{url} answered /v1/capabilities with something else; is it an interp-engine server "
                              f"(`python -m engine.serve`)?")
        if obj.get("protocol") != PROTOCOL:
            raise RemoteError(f"{url} speaks protocol {obj.get('protocol')!r} and this client {PROTOCOL}; use the same "
                              f"version of the engine on both sides.")
        return cls(url, obj["model"], tuple(obj["served"]), obj["backend"], obj["n_layers"], obj["d_model"],
                   obj.get("vocab_size"), obj.get("max_model_len"), {p["name"]: p for p in obj["points"]},
                   obj.get("readouts", {}), tuple(obj["sampling"]["extras"]), obj.get("lens"), bool(obj.get("sae")),
                   obj.get("tokenizer", {}), obj.get("limits", {}))

    def point_layers(self, point: str) -> list[int]:
        """Layers at which the server serves `point` ([-1] stands for a trunk point), as the local
        PointCatalogue.point_layers says it."""
        p = known_point(point)  # AddressError for an unknown name, as locally
        row = self.points.get(p.name)
        if row is None or not row["served"]:
            return []
        return list(row["layers"]) if p.scope == "layer" else [-1]

    def point_names(self) -> list[str]:
        """Every point served at one layer or more, in catalogue order."""
        return [p.name for p in POINTS if self.point_layers(p.name)]

    def why_not(self, point: str) -> str:
        """Why the server does not serve `point` (its own words), for a refusal."""
        row = self.points.get(known_point(point).name) or {}
        return row.get("refused") or row.get("steer_refused") or "not in its point table"

    def verdict(self, point: str, layer: int | None) -> Verdict:
        """The server's verdict on one point at one layer, from its table (engine/serve/capabilities.py)."""
        row = self.points.get(point) or {}
        if layer is not None and layer not in (row.get("layers") or ()):
            why = row.get("refused") or f"{point} is not served at layer {layer} by the {self.backend} server at {self.url}"
            return refused(point, layer, self.backend, why)
        if layer is None and not row.get("served"):
            return refused(point, layer, self.backend, row.get("refused") or "not served by this server")
        only = None if row.get("steerable", True) else row.get("steer_refused") or "capture only"
        return Verdict(str(Address(point, layer)), True, row.get("how") or "hook", only)

    def address(self, a: "Address | str") -> Address:
        """Parse and check an address against the server's table: an absolute layer it serves the point
        at, coordinates in range; the library's own classes when not (AddressError, UnsupportedPointError)."""
        addr = parse(a)
        if known_point(addr.point).scope == "layer":
            addr = addr.resolved(self.n_layers)
        v = self.verdict(addr.point, addr.layer)
        if not v.served:
            raise UnsupportedPointError(f"{addr} is not served by the {self.backend} server at {self.url}: {v.reason}")
        shape = self.points[addr.point].get("per_token_shape")
        for name, value in addr.coords:
            n = shape[0] if shape else None
            if n is not None and not -n <= value < n:
                raise AddressError(f"{name} {value} is out of range for {addr.point!r} ({n} {name}s).")
        return addr

    def check_steer(self, st: Steer) -> Steer:
        """A steer checked against the server's table, before it is sent: its address served and steerable,
        its value's per-position shape the point's (the server checks it against the model again)."""
        addr = self.address(st.address)
        row = self.points[addr.point]
        if not row.get("steerable", True):
            raise SteeringError(f"{addr} can be captured but not steered on the {self.backend} server at {self.url}: "
                                f"{row.get('steer_refused')}")
        shape = row.get("per_token_shape")
        if shape is not None:
            st.at(addr).check_shape(tuple(shape[len(addr.coords):]))
        return st

    def check_extras(self, extras: dict) -> None:
        """Refuse sampling fields this server's backend does not honour, by name."""
        bad = sorted(k for k in extras if k not in self.sampling_extras)
        if bad:
            takes = ", ".join(self.sampling_extras) or "none"
            raise OptionError(f"unknown sampling option{'s' if len(bad) > 1 else ''} {bad} for the {self.backend} "
                              f"server at {self.url}; it takes the knobs temperature, top_p, top_k, seed and the "
                              f"extras: {takes}.")

    def describe(self) -> str:
        return (f"{self.model} on backend {self.backend!r} at {self.url} ({self.n_layers} layers, d_model "
                f"{self.d_model}, {len(self.point_names())} points)")
