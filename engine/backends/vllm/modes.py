"""The three ways the engine runs vLLM, as objects that carry what differs between them.

    HooksMode       backend="vllm": Python hooks in the workers, attached per registered request;
                    any servable point, any op; the forward runs uncompiled (hooks do not fire in
                    graph replay)
    StaticTapsMode  backend="vllm-static": a tap set declared at load, baked into the compiled
                    forward as fixed buffers; serves only what it declared, writes only its write
                    taps, runs only the ops whose row in engine/core/ops.py has an affine form (in
                    the order the taps compose)
    StockMode       backend="vllm-generate": stock vLLM, no capture, no steering, no logit lens

The client (client.py, backend.py, catalogue.py) asks its mode instead of comparing backend names:
what the engine is started with (`setup`), whether and what it serves (`unserved`, `check_served`,
`capture_only`), a steer's extra rules (`check_steer`, `check_steers`), and what its load report
adds (`report`, `prove`). `MODES` holds one of each, by backend name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.core.address import Address, parse
from engine.core.backends import VLLM_BACKENDS, Backend, backend_for
from engine.core.errors import SteeringError, UnsupportedPointError
from engine.core.ops import OPS
from engine.core.points import backend_status
from engine.core.steering import Steer

NO_CAPTURE = ("vllm-generate is stock vLLM: no capture, no steering, no logit lens; load the model with "
              "backend='vllm' (any servable point, per request) or backend='vllm-static' (declared taps)")


@dataclass(frozen=True)
class Setup:
    """What a mode adds to vLLM's engine arguments and environment, and the taps it declares."""
    kw: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    declared: list[Address] | None = None  # vllm-static: every tap (write taps, then the engine's own reads)


class Mode:
    """One vLLM backend. Subclasses override what differs; the defaults are the hooked backend's. What
    the backend is (captures, declares taps, its defaults) is its registry entry, `spec`."""
    name: ClassVar[str]
    unserved: ClassVar[str | None] = None  # why this mode serves no capture / steering at all

    def __repr__(self) -> str:
        return f"<vLLM mode {self.name}>"

    @property
    def spec(self) -> Backend:
        """This backend's entry in engine/core/backends.py."""
        return backend_for(self.name)

    @property
    def worker(self) -> bool:
        """The engine's worker extension runs (capture, steering, logit lens)."""
        return self.spec.captures

    @property
    def declares(self) -> bool:
        """Taps declared at load (the static_points option, default `spec.static_points`)."""
        return self.spec.declares

    # -- loading -----------------------------------------------------------------------------------
    def setup(self, declared: list[Address] | None, compile: bool) -> Setup:
        """Engine arguments and environment for this mode (declared: the checked static_points)."""
        from engine.backends.vllm import runtime as rt
        return Setup({"worker_extension_cls": rt.WORKER_EXTENSION, "logits_processors": [rt.ROW_MAP],
                      "async_scheduling": False, "enforce_eager": True})  # hooks never fire in graph replay

    def report(self, engine: Any, compile: bool) -> dict:
        """LoadReport fields this mode sets (compiled, cudagraph_mode)."""
        return {}

    def prove(self, model: Any) -> dict | None:
        """The startup proof that capture and steering work in this mode (None: nothing to prove)."""
        return None

    # -- serving -----------------------------------------------------------------------------------
    def check_served(self, addr: Address, declared: list[Address] | None) -> bool:
        """Raise UnsupportedPointError when this mode cannot serve addr (declared: the engine's static
        taps); True when the mode settles it (no table lookup needed), False when the table decides."""
        status, reason = backend_status(addr.point, self.name)
        if status == "refused":
            raise UnsupportedPointError(f"{addr} cannot be served by backend {self.name!r}: {reason}.")
        return False

    def capture_only(self, info: dict) -> str | None:
        """Why a served point cannot be steered in this mode beyond the engine's table (None: it can)."""
        return None

    def check_steer(self, st: Steer, info: dict) -> None:
        """This mode's extra rules for one steer (its address resolved; info: the engine's table entry)."""

    def check_steers(self, steers: list[Steer]) -> None:
        """This mode's extra rules for the steers of one request together."""


class HooksMode(Mode):
    name = "vllm"

    def setup(self, declared: list[Address] | None, compile: bool) -> Setup:
        """The forward runs uncompiled (enforce_eager), and so does the rest of the worker: vLLM's sampler
        ranks a sampled token's logprob with a torch.compile'd function, which Inductor compiled on the
        first request asking for a logprob (every stream): 25 s on 2 CPU cores with a cold cache."""
        base = Mode.setup(self, declared, compile)
        return Setup(base.kw, {**base.env, "TORCH_COMPILE_DISABLE": "1"})


class StaticTapsMode(Mode):
    name = "vllm-static"
    READ_ONLY = "a read-only tap of this vllm-static engine; declare it in static_points to steer it"

    def setup(self, declared: list[Address] | None, compile: bool) -> Setup:
        assert declared is not None, "vllm-static declares its taps at load"
        base = Mode.setup(self, declared, compile)
        internal = [] if Address("final_norm") in declared else [Address("final_norm")]
        taps = [[str(a), True] for a in declared] + [[str(a), False] for a in internal]
        kw = {**base.kw, "enforce_eager": not compile, "load_format": "interp_static",
              "model_loader_extra_config": {"interp_static": taps}}
        # vLLM's own CUDA-graph mode (FULL_AND_PIECEWISE on CUDA): the taps are persistent buffers the
        # graphs read and write, filled and read around each replay (the worker's step anchor); the
        # startup proof runs under the chosen mode and refuses one it cannot prove. vLLM keys its
        # compiled-graph cache on its config and model class, not on our taps: never save or load one
        return Setup(kw, {"VLLM_DISABLE_COMPILE_CACHE": "1"}, declared + internal)

    def report(self, engine: Any, compile: bool) -> dict:
        if not compile:
            return {}
        mode = engine.vllm_config.compilation_config.cudagraph_mode
        return {"compiled": True, "cudagraph_mode": getattr(mode, "name", str(mode))}

    def prove(self, model: Any) -> dict | None:
        from engine.backends.vllm.proof import prove_taps
        return prove_taps(model)

    def check_served(self, addr: Address, declared: list[Address] | None) -> bool:
        declared = declared or []
        if addr in declared:
            return True
        status, reason = backend_status(addr.point, "vllm")
        if status != "refused":
            reason = (f"{backend_status(addr.point, self.name)[1] or 'not declared'}; declared at "
                      f"load: {', '.join(str(a) for a in declared)}")
        raise UnsupportedPointError(f"{addr} cannot be served by backend {self.name!r}: {reason}.")

    def capture_only(self, info: dict) -> str | None:
        return None if info.get("writable") else self.READ_ONLY

    def check_steer(self, st: Steer, info: dict) -> None:
        if not info.get("writable"):
            raise UnsupportedPointError(f"steer address {st.address} is {self.READ_ONLY}, or use backend='vllm'.")
        why = OPS[st.op].static_refusal(st)
        if why:
            given = "".join(f" ({k}={getattr(st, k)!r})" for k in OPS[st.op].params)
            raise SteeringError(f"{st.op!r} at {st.address} cannot run on {self.name}: {why}{given}; use "
                                f"backend='vllm' or 'eager'.")

    def check_steers(self, steers: list[Steer]) -> None:
        """An op whose affine form sets the direction u (its row's `first`) composes only ahead of the
        other ops at the same tap, and once per tap and request."""
        seen_affine: set[str] = set()
        for st in steers:
            self.check_steer_op(st)
            k = _tap_of(st)
            first = OPS[st.op].first
            if first and k in seen_affine:
                raise SteeringError(f"{self.name} applies {st.op} at {k} before any other op there; "
                                    f"put the {st.op} steer first or use backend='vllm'.")
            if not first:
                seen_affine.add(k)
        ks = [_tap_of(s) for s in steers if OPS[s.op].first]
        if len(ks) != len(set(ks)):
            raise SteeringError(f"{self.name} holds one project_out direction per tap and request; "
                                f"combine the directions or use backend='vllm'.")

    def check_steer_op(self, st: Steer) -> None:
        """The op alone (no engine table): refused by name when its row has no affine form for it."""
        self.check_steer(st, {"writable": True})


def _tap_of(st: Steer) -> str:
    """The tap a steer writes (its address without coordinates)."""
    return str(parse(st.address).base)


class StockMode(Mode):
    name = "vllm-generate"
    unserved = NO_CAPTURE

    def setup(self, declared: list[Address] | None, compile: bool) -> Setup:
        return Setup()

    def check_served(self, addr: Address, declared: list[Address] | None) -> bool:
        raise UnsupportedPointError(NO_CAPTURE + ".")

    def check_steer(self, st: Steer, info: dict) -> None:
        raise SteeringError(NO_CAPTURE + ".")


MODES: dict[str, Mode] = {m.name: m for m in (HooksMode(), StaticTapsMode(), StockMode())}
assert tuple(MODES) == tuple(VLLM_BACKENDS), "a vLLM backend of engine/core/backends.py without a mode, or the reverse"


def mode_for(backend: str) -> Mode:
    """The mode of a vLLM backend name, or a ValueError naming the accepted ones."""
    if backend not in MODES:
        from engine.core.address import closest
        raise ValueError(f"unknown vLLM backend {backend!r}.{closest(backend, MODES)} Use one of {VLLM_BACKENDS}.")
    return MODES[backend]
