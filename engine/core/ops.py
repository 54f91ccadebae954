"""The steering op table: one row per op, carrying its maths and its static-tap form.

Each `Op` row says everything the engine knows about one op, and every check reads it:
  value     what value the op takes: "none" | "vector" | "scale" | "direction" | "activation"
  params    which of `coeff` / `bounds` it reads (and needs)
  whole     whether it reads the whole per-token vector (norms, projections): refused on a
            tensor-parallel shard
  apply     its eager maths on touched rows: apply(x [m, *shape], v, params) -> new rows
  affine    its form on vllm-static's per-row affine taps, y = (x - (x.u) u) * mul + add:
            affine(AffineRows, v, params) -> AffineRows composed with this op (mul -> mul * a,
            add -> add * a + b, u kept or, for a `first` op, its own: the worker composes a step's
            steers on the host from that form); None when the taps cannot express it, and `static`
            then says why
  static_if for an op the taps express only for some parameters (rescale: coeff 0), the test
  first     the affine form sets the projection direction u, so it must come first at a tap and
            once per tap and request

To add an op: one `Op(...)` row below (plus its fields in steering.Steer if it takes new
parameters). The hooked backends call `apply`; vllm-static composes each steer's `affine` form of the identity
(engine/backends/vllm/worker/table.py), which its tests hold to `affine` on any prior.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

VALUE_KINDS = ("none", "vector", "scale", "direction", "activation")


class Params(Protocol):
    """What an op reads of its steer besides the value (engine.core.steering.Steer has them)."""
    coeff: float | None
    bounds: tuple | None
    sae: Any  # feature ops: an SAE directory (or a loaded SAE, eager only)
    feature: "int | list[int] | None"


@dataclass(frozen=True)
class AffineRows:
    """The affine coefficients of some tap rows: y = (x - (x.u) u) * mul + add, each [n, width]."""
    u: torch.Tensor
    mul: torch.Tensor
    add: torch.Tensor

    @staticmethod
    def identity(n: int, width: int, dtype: torch.dtype = torch.float32,
                 device: "torch.device | str | None" = None) -> "AffineRows":
        return AffineRows(torch.zeros(n, width, dtype=dtype, device=device),
                          torch.ones(n, width, dtype=dtype, device=device),
                          torch.zeros(n, width, dtype=dtype, device=device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The affine map applied to rows x [n, width] (as the tap's compiled forward does)."""
        return (x - (x * self.u).sum(-1, keepdim=True) * self.u) * self.mul + self.add


Apply = Callable[[torch.Tensor, "torch.Tensor | None", Params], torch.Tensor]
Affine = Callable[[AffineRows, "torch.Tensor | None", Params], AffineRows]


@dataclass(frozen=True)
class Op:
    name: str
    value: str
    doc: str
    apply: Apply
    affine: Affine | None = None
    static: str | None = None  # None: the taps express it (see static_if); else why they cannot
    params: tuple = ()
    whole: bool = False
    static_if: Callable[[Params], bool] | None = None
    first: bool = False
    encodes: bool = False  # runs the SAE's encoder on x: refused with a transcoder (it encodes another point)

    def __post_init__(self) -> None:
        if self.value not in VALUE_KINDS:
            raise ValueError(f"op {self.name!r}: value kind {self.value!r} is not one of {VALUE_KINDS}.")
        if self.affine is None and not self.static:
            raise ValueError(f"op {self.name!r} has no affine form: give static=<why vllm-static cannot run it>.")
        if self.static_if is not None and not self.static:
            raise ValueError(f"op {self.name!r} is static only under a condition: give static=<why not otherwise>.")

    def static_refusal(self, p: Params) -> str | None:
        """Why vllm-static's taps cannot run this op with these parameters (None: they can)."""
        if self.affine is not None and (self.static_if is None or self.static_if(p)):
            return None
        return self.static


# -- the maths -------------------------------------------------------------------------------------
def unit(v: torch.Tensor) -> torch.Tensor:
    """Unit vectors along the last axis, computed in float32, in v's dtype."""
    f = v.float()
    return (f / f.norm(dim=-1, keepdim=True).clamp_min(1e-12)).to(v.dtype)


def _along(x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x flattened to [m, d], the unit direction(s) u, the projections x.u [m, 1])."""
    flat = x.reshape(x.shape[0], -1)
    u = unit(v.reshape(x.shape[0] if v.dim() == x.dim() else 1, flat.shape[1]))
    return flat, u, (flat * u).sum(-1, keepdim=True)


def _direction(f: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Params], torch.Tensor]) -> Apply:
    """An op on the flattened per-token vector along a direction, reshaped back."""
    def run(x: torch.Tensor, v: "torch.Tensor | None", p: Params) -> torch.Tensor:
        flat, u, dot = _along(x, _given(v))
        return f(flat, u, dot, p).reshape(x.shape)
    return run


def _given(v: "torch.Tensor | None") -> torch.Tensor:
    """The value of an op whose row takes one (Steer checked it is there)."""
    assert v is not None, "this op's row takes a value"
    return v


def _coeff(p: Params) -> float:
    assert p.coeff is not None, "this op's row takes coeff (Steer checked it is there)"
    return p.coeff


def _replace(x: torch.Tensor, v: "torch.Tensor | None", p: Params) -> torch.Tensor:
    return _given(v).expand_as(x).clone()


def _replace_affine(a: AffineRows, v: "torch.Tensor | None", p: Params) -> AffineRows:
    return AffineRows(a.u, torch.zeros_like(a.mul), torch.zeros_like(a.add) + _given(v))


def _project_affine(a: AffineRows, v: "torch.Tensor | None", p: Params) -> AffineRows:
    return AffineRows(torch.zeros_like(a.u) + unit(_given(v).to(torch.float32)).to(a.u.dtype), a.mul, a.add)


def _cap(flat: torch.Tensor, u: torch.Tensor, dot: torch.Tensor, p: Params) -> torch.Tensor:
    lo, hi = p.bounds or (None, None)
    return flat + (dot.clamp(min=lo, max=hi) - dot) * u


def _feature(edit: str) -> Apply:
    """A feature op through the steer's SAE (engine/core/features.py) on the flattened per-token
    vector: encode, edit feature(s) `feature` with coeff, decode, the reconstruction error kept."""
    def run(x: torch.Tensor, v: "torch.Tensor | None", p: Params) -> torch.Tensor:
        from engine.core import features
        from engine.core.sae_store import sae_for
        assert p.feature is not None, "feature ops take feature= (Steer checked it is there)"
        flat = x.reshape(x.shape[0], -1)
        out = getattr(features, edit)(sae_for(p.sae, x.device), flat, p.feature, _coeff(p))
        return out.reshape(x.shape)
    return run


def _feature_add_affine(a: AffineRows, v: "torch.Tensor | None", p: Params) -> AffineRows:
    from engine.core import features
    from engine.core.sae_store import sae_for
    assert p.feature is not None, "feature ops take feature= (Steer checked it is there)"
    zero = torch.zeros(1, a.add.shape[-1], dtype=torch.float32, device=a.add.device)
    d = features.add_feature_direction(sae_for(p.sae, a.add.device), zero, p.feature, _coeff(p))
    return AffineRows(a.u, a.mul, a.add + d.to(a.add.dtype))


_FEATURE = ("coeff", "sae", "feature")

_AFFINE = "vllm-static taps apply y = (x - (x.u)u) * mul + add per row, which cannot express {what}"

OPS: dict[str, Op] = {o.name: o for o in (
    Op("add", "vector", "x + value", lambda x, v, p: x + _given(v),
       lambda a, v, p: AffineRows(a.u, a.mul, a.add + _given(v))),
    Op("set", "vector", "value (replaces the activation)", _replace, _replace_affine),
    Op("scale", "scale", "x * value (a scalar, or elementwise)", lambda x, v, p: x * _given(v),
       lambda a, v, p: AffineRows(a.u, a.mul * _given(v), a.add * _given(v))),
    Op("ablate", "none", "zero", lambda x, v, p: torch.zeros_like(x),
       lambda a, v, p: AffineRows(a.u, torch.zeros_like(a.mul), torch.zeros_like(a.add))),
    Op("mean_ablate", "vector", "value (a mean activation)", _replace, _replace_affine),
    Op("project_out", "direction", "x - (x.u) u, u = value / |value| (rescale with coeff 0)",
       _direction(lambda flat, u, dot, p: flat - dot * u), _project_affine, whole=True, first=True),
    Op("rescale", "direction", "x + (coeff - 1) (x.u) u: the component along u scaled by coeff",
       _direction(lambda flat, u, dot, p: flat + (_coeff(p) - 1.0) * dot * u), _project_affine,
       _AFFINE.format(what="a rescale by a coefficient other than 0 (that is project_out)"),
       ("coeff",), True, static_if=lambda p: p.coeff == 0.0, first=True),
    Op("projection_cap", "direction", "x + (clamp(x.u, min, max) - x.u) u: the projection onto u held in "
       "bounds=(min, max) (None = open)", _direction(_cap), None,
       _AFFINE.format(what="a clamp of the projection"), ("bounds",), True),
    Op("norm_scaled_add", "direction", "x + coeff |x| u: a direction added at a fraction coeff of the row's "
       "own norm", _direction(lambda flat, u, dot, p: flat + _coeff(p) * flat.norm(dim=-1, keepdim=True)
                              * u), None,
       _AFFINE.format(what="an add that depends on the row's norm"), ("coeff",), True),
    Op("swap", "activation", "another prompt's activation at the same positions (value with a pos axis, or "
       "a cache entry); resample ablation with CacheEntry.resampled()", _replace, _replace_affine),
    Op("feature_clamp", "none", "x + decode(f') - decode(f), f = SAE.encode(x), f' = f with feature(s) set to coeff "
       "(the SAE's reconstruction error kept)", _feature("clamp_feature"), None,
       _AFFINE.format(what="an SAE encode and decode"), _FEATURE, True, encodes=True),
    Op("feature_scale", "none", "x + decode(f') - decode(f), f' = f with feature(s) multiplied by coeff",
       _feature("scale_feature"), None, _AFFINE.format(what="an SAE encode and decode"), _FEATURE, True,
       encodes=True),
    Op("feature_add", "none", "x + coeff * the SAE decoder direction of feature(s)",
       _feature("add_feature_direction"), _feature_add_affine, None, _FEATURE, True),
)}
