"""Steering specs and the ops they apply: the one implementation every backend calls.

A Steer is pure data (so the vLLM backends can ship it to their workers). Its op is a row of
engine.core.ops.OPS (re-exported here), which carries the op's maths, its vllm-static form and its
parameters. Applying them is engine/core/site.py's job (every backend's one routine).

Values and their axes (k = the point's per-position dims, e.g. 1 for resid_post, 2 for z):
    [*shape]               the same value at every touched position of every sequence
    [pos, *shape]          value[p] at absolute position p of each sequence (its own token
                           positions, 0 = its first real token, never padded columns)
    [batch, pos, *shape]   value[r, p] for sequence r of the call at its position p (a batch of
                           one applies to every sequence)
    an ActivationCache entry, `cache.entry(key)` or `(cache, key)`: each captured row at its own
                           positions, whatever padding the capture had (the way to patch from a
                           padded batch); a cache of one sequence applies to every sequence
`scale` also takes a scalar. A touched position the value does not cover is an error, as is a
value whose trailing dims are not the point's per-position shape (both shapes are named).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.core import positions as pos
from engine.core.address import Address, parse
from engine.core.errors import SteeringError
from engine.core.ops import OPS, Op
from engine.core.points import INTEGER_POINTS, get_point

_TAKES = ("coeff", "bounds", "sae", "feature")  # the optional parameters an op's row may list
DIRECTION_MIN_NORM = 1e-6  # below this a direction (project_out, rescale, ...) is treated as zero
__all__ = ["OPS", "Op", "Steer", "CacheEntry", "NonFiniteSteer", "failure", "overflowed"]


@dataclass(eq=False, slots=True)
class Steer:
    """One intervention. `value` per the module docstring; `positions` a spec of engine.core.positions;
    `coeff` for rescale / norm_scaled_add; `bounds=(min, max)` for projection_cap; `exclude`
    positions never touched: a list of positions (negative counts from the prompt end) or
    "special" (the tokenizer's special tokens in the prompt: BOS, chat markers). Steers compare by
    identity: two equal-looking steers are two interventions."""
    address: "str | Address"
    op: str = "add"
    value: "torch.Tensor | float | tuple | CacheEntry | None" = None
    positions: "str | int | slice | tuple | list | torch.Tensor" = "all"
    coeff: float | None = None
    bounds: "tuple | None" = None
    exclude: "list | str | None" = None
    sae: Any = None  # feature ops: an SAE directory in SAELens's format (or a loaded SAE, eager only)
    feature: "int | list[int] | None" = None  # feature ops: the SAE feature index (or indices)
    # set by the engine (metadata "engine": not part of a request, e.g. over HTTP): leading axes of
    # value before the per-position shape (None: not yet known),
    # and for a batch value from a cache, each sequence's own length
    lead: int | None = dataclasses.field(default=None, repr=False, metadata={"engine": True})
    lengths: "list | None" = dataclasses.field(default=None, repr=False, metadata={"engine": True})
    # a copy the engine made of a checked steer (replace): its fields are trusted, not checked again
    checked: bool = dataclasses.field(default=False, repr=False, compare=False, metadata={"engine": True})

    def __post_init__(self):
        if self.checked:
            return
        self.address = parse(self.address)
        if self.op not in OPS:
            from engine.core.address import closest
            raise SteeringError(f"unknown steering op {self.op!r}.{closest(self.op, OPS)} Ops: {', '.join(OPS)}.")
        op = OPS[self.op]
        if self.address.point in INTEGER_POINTS:
            raise SteeringError(f"{self.address.point!r} holds integer expert indices and cannot be steered; "
                                f"steer router_logits or expert_weights instead.")
        self._check_params(op)
        self._take_value(op)
        self.positions = pos.normalize(self.positions)
        self.exclude = _exclusion(self.exclude)

    def _check_params(self, op: Op) -> None:
        """coeff / bounds / sae / feature: given only to an op whose row lists them, and then required
        and valid."""
        for k in _TAKES:
            if getattr(self, k) is not None and k not in op.params:
                takes = {k: [o.name for o in OPS.values() if k in o.params] for k in _TAKES}
                raise SteeringError(f"op {self.op!r} takes no {k} ({' and '.join(takes[k]) or 'no op'} "
                                    f"{'does' if len(takes[k]) == 1 else 'do'}).")
        if "coeff" in op.params:
            if self.coeff is None:
                raise SteeringError(f"op {self.op!r} needs coeff= ({op.doc}).")
            self.coeff = finite_number(self.coeff, f"coeff of {self.op!r}", f"at {self.address}")
        if "bounds" in op.params:
            b = self.bounds
            if not isinstance(b, (tuple, list)) or len(b) != 2 or all(x is None for x in b):
                raise SteeringError(f"{self.op} needs bounds=(min, max) with at least one of them set, got {b!r}.")
            lo, hi = (None if x is None else finite_number(
                x, f"a bound of {self.op} bounds={b!r:.80}", f"at {self.address}", "give finite numbers (None leaves a side "
                "open)") for x in b)
            if lo is not None and hi is not None and lo > hi:
                raise SteeringError(f"{self.op} bounds {b!r}: min is above max.")
            self.bounds = (lo, hi)
        if "sae" in op.params:
            self._check_feature()

    def _check_feature(self) -> None:
        from engine.core.integers import as_int, described  # the one integer rule (np.int64, 0-d tensors)
        if isinstance(self.sae, Path):
            self.sae = str(self.sae)
        if isinstance(self.sae, str):  # a directory, or a model server's name for one: read where the call is checked
            if not self.sae:
                raise SteeringError(f"{self.op} at {self.address}: sae is empty; give an SAE directory (or, on a "
                                    f"model server, the name of an SAE folder inside its --sae-dir).")
        elif not callable(getattr(self.sae, "encode", None)):
            raise SteeringError(f"{self.op} at {self.address} needs sae= (an SAE directory, or a loaded SAE on "
                                f"eager), got {type(self.sae).__name__}.")
        f = self.feature
        many = f if isinstance(f, (list, tuple)) else [f]
        ints = [as_int(i) for i in many]
        bad = [(i, n) for i, n in zip(many, ints) if n is None or n < 0]
        if not many or bad:
            why = ("an empty list" if not many else "none" if f is None else
                   f"{described(bad[0][0])}, not an integer" if bad[0][1] is None else f"{bad[0][1]}, a negative index")
            raise SteeringError(f"{self.op} at {self.address} needs feature= (a feature index >= 0, numpy and 0-d "
                                f"tensor integers too, or a non-empty list of them), got {why}.")
        self.feature = [n for n in ints if n is not None] if isinstance(f, (list, tuple)) else ints[0]

    def _take_value(self, op: Op) -> None:
        v = self.value
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], (str, Address)) and hasattr(v[0], "entry"):
            v = v[0].entry(v[1])
        if isinstance(v, CacheEntry):
            self.value, self.lead, self.lengths = v.as_value()
            v = self.value
        if op.value == "none":
            if v is not None:
                raise SteeringError("op 'ablate' zeroes the point and takes no value; use 'mean_ablate' "
                                    "with value=<mean vector> for mean ablation." if self.op == "ablate" else
                                    f"op {self.op!r} takes no value ({op.doc}); give coeff= instead.")
            return
        if v is None:
            raise SteeringError(f"op {self.op!r} at {self.address} needs a value "
                                f"({'a scalar or tensor' if op.value == 'scale' else 'a tensor'}).")
        if not isinstance(v, torch.Tensor):
            if op.value != "scale" or isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SteeringError(f"op {self.op!r} needs a torch.Tensor value, got {type(v).__name__}.")
            v = self.value = torch.tensor(finite_number(v, f"the scale of {self.op!r}", f"at {self.address}"))
        if not torch.is_floating_point(v):
            raise SteeringError(f"steering value for {self.address} must be a floating tensor, got dtype {v.dtype}.")
        if v.device.type == "meta":
            return  # refused by name when the steer is used (engine.core.steer_checks)
        if not torch.isfinite(v).all():
            raise SteeringError(f"steering value for {self.address} contains NaN or inf.")
        if op.value == "direction" and self.lead is None:
            norm = float(v.detach().double().norm())
            if not norm >= DIRECTION_MIN_NORM:
                raise SteeringError(f"{self.op} at {self.address} needs a direction, but its value has norm {norm:.3g} "
                                    f"(below {DIRECTION_MIN_NORM:g}), which would remove nothing; pass a non-zero "
                                    f"vector (it is normalized for you).")

    def replace(self, **changes: Any) -> "Steer":
        """A copy with `changes`, made by the engine from this checked steer (validated once: not again)."""
        return dataclasses.replace(self, checked=True, **changes)

    def at(self, address: Address, value: "torch.Tensor | None" = None) -> "Steer":
        """The same intervention at a resolved address (and value cast for the model)."""
        return self.replace(address=address, value=self.value if value is None else value)

    # -- binding to the sequences of a call -------------------------------------------------------
    @property
    def scalar(self) -> bool:
        """Whether the value is one number for every element (a scale op's scalar)."""
        return OPS[self.op].value == "scale" and isinstance(self.value, torch.Tensor) and self.value.dim() == 0

    def check_shape(self, shape: tuple) -> None:
        """Refuse, naming both shapes, a value whose per-position shape is not the point's `shape` (the
        one check of a value against its point: the vLLM client at plan time, the eager step at its site)."""
        v = self.value
        if v is None or self.scalar:
            return
        lead = self.bound().lead
        if tuple(v.shape[lead:]) != tuple(shape):
            lead_txt = {0: "", 1: " (after 1 leading pos axis)", 2: " (after 2 leading batch, pos axes)"}[lead]
            raise SteeringError(f"steering value for {self.address} has shape {tuple(v.shape)}{lead_txt} but the "
                                f"point's per-position shape is {tuple(shape)}.")

    def per_position_dims(self) -> int:
        """How many per-position axes the point has (from the catalogue's shape), minus coordinates."""
        return len(get_point(self.address.point).shape.strip("[]").split(",")) - 2 - len(self.address.coords)

    def bound(self) -> "Steer":
        """This steer with `lead` known: how many leading (batch / pos) axes its value has."""
        if self.lead is not None or self.value is None:
            return self
        k, v = self.per_position_dims(), self.value
        lead = v.dim() - k
        if self.scalar:
            lead = 0
        if lead not in (0, 1, 2):
            raise SteeringError(f"steering value for {self.address} has shape {tuple(v.shape)}, which does not fit "
                                f"the point's {k} per-position dim{'s' if k != 1 else ''}; give [*shape], "
                                f"[pos, *shape] or [batch, pos, *shape].")
        if OPS[self.op].value == "activation" and lead == 0:
            raise SteeringError(f"swap at {self.address} replaces each position with another prompt's activation "
                                f"there: give that capture ([pos, *shape], [batch, pos, *shape] or cache.entry(key)), "
                                f"got one vector of shape {tuple(v.shape)} (for one vector everywhere, use set).")
        return self.replace(lead=lead)

    def for_row(self, row: int, n_rows: int, prompt_ids: "list[int] | None" = None,
                special_ids: "set[int] | tuple" = ()) -> "Steer":
        """The steer as it applies to sequence `row` of a call of `n_rows`: a batch value or mask
        reduced to that row, `exclude` resolved to explicit positions (the prompt's special tokens)."""
        st = self.bound()
        changes: dict = {}
        if st.lead == 2:
            if st.value.shape[0] == 1:  # a batch of one broadcasts over the call's sequences
                row = 0
            elif st.value.shape[0] != n_rows:
                raise SteeringError(f"steering value for {st.address} has shape {tuple(st.value.shape)}: a batch "
                                    f"axis of {st.value.shape[0]} for a call of {n_rows} sequence"
                                    f"{'s' if n_rows != 1 else ''}.")
            v = st.value[row]
            changes.update(value=v if st.lengths is None else v[: st.lengths[row]], lead=1, lengths=None)
        p = st.positions
        if pos.is_mask(p) and p.dim() == 2:
            if p.shape[0] != n_rows:
                raise SteeringError(f"the positions mask of {st.op!r} at {st.address} has shape {tuple(p.shape)}: "
                                    f"{p.shape[0]} rows for a call of {n_rows} sequences.")
            changes["positions"] = p[row]
        if st.exclude == "special":
            if prompt_ids is None:
                raise SteeringError("exclude='special' needs the prompt's token ids.")
            special = set(special_ids)
            changes["exclude"] = [i for i, t in enumerate(prompt_ids) if int(t) in special]
        return st.replace(**changes) if changes else st

    def offsets(self, pos0: int, n: int, prompt_len: int) -> np.ndarray:
        """Host int64 offsets (ascending) of the tokens at pos0 .. pos0+n-1 this steer touches: its
        spec minus `exclude` (the form every backend builds its row index from)."""
        off = pos.offsets(self.positions, pos0, n, prompt_len)
        if self.exclude:
            if not isinstance(self.exclude, list):
                raise SteeringError(f"exclude={self.exclude!r} of {self.op!r} at {self.address} is resolved per "
                                    f"sequence before it runs (report this as a bug).")
            off = np.setdiff1d(off, pos.offsets(self.exclude, pos0, n, prompt_len), assume_unique=True)
        return off

    def touched(self, pos0: int, n: int, prompt_len: int, device: "torch.device | str | None" = None) -> torch.Tensor:
        """Bool [n]: the positions pos0 .. pos0+n-1 this steer touches (its spec minus `exclude`)."""
        m = pos.mask(self.positions, pos0, n, prompt_len, device)
        if self.exclude:
            m &= ~pos.mask(list(self.exclude), pos0, n, prompt_len, device)
        return m


def check_feature_steer(st: Steer, sae: Any, width: int | None = None) -> None:
    """A feature steer against its SAE (loaded, or its cfg.json's facts: engine.core.sae_files.sae_header):
    feature indices in range, an SAE (a transcoder reads one point and writes another: its feature edit
    needs both, which a steer at one address does not have), and its d_in the point's per-position
    `width` when that is known."""
    if sae.arch.transcoder and OPS[st.op].encodes:
        raise SteeringError(f"{st.op} at {st.address}: {sae.where()} is a {sae.arch.name} (it encodes one point and "
                            f"decodes into another); clamp or scale features of an SAE, or use feature_add.")
    for i in (st.feature if isinstance(st.feature, list) else [st.feature]):
        if not 0 <= i < sae.d_sae:
            raise SteeringError(f"{st.op} at {st.address}: feature {i} is out of range; {sae.where()} has "
                                f"{sae.d_sae} features (0..{sae.d_sae - 1}).")
    if width is not None and width != sae.d_in:
        from engine.core.errors import SAEError
        raise SAEError(f"{sae.where()}: d_in is {sae.d_in} (cfg.json field 'd_in') but {st.address} is {width} wide; "
                       f"attach an SAE trained on this model's {st.address}.")


def finite_number(x: object, what: str, where: str = "", fix: str = "give a finite number") -> float:
    """x as a finite float, or a SteeringError naming `what`: a bool or a non-number is refused, and
    so is inf / NaN (an int too big for a float counts as inf). The one check of a steer's numbers."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise SteeringError(f"{what} is a number, got {type(x).__name__}.")
    try:
        f = float(x)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise SteeringError(f"{what}{' ' + where if where else ''} is {f}; {fix}.")
    return f


def _exclusion(x):
    if x is None or (isinstance(x, str) and x == "special"):
        return x
    if isinstance(x, (list, tuple)):
        from engine.core.integers import as_int
        ints = [as_int(i) for i in x]
        if all(i is not None for i in ints):
            return sorted(set(ints))  # type: ignore[type-var]
    raise SteeringError(f"exclude is a list of positions or 'special' (the tokenizer's special tokens), got {x!r}.")


@dataclass(eq=False, slots=True)
class CacheEntry:
    """One captured point of an ActivationCache, as each sequence's rows at its own positions (the
    padding of the capture removed): the value form that aligns a patch by position."""
    key: str
    rows: list  # per sequence, [len_r, *shape]
    batched: bool = True

    def as_value(self) -> tuple:
        """(value, lead, lengths): [batch, max_len, *shape] zero-filled past each length, or [pos, *shape]."""
        if not self.batched:
            return self.rows[0], 1, None
        n = max(r.shape[0] for r in self.rows)
        out = self.rows[0].new_zeros((len(self.rows), n, *self.rows[0].shape[1:]))
        for i, r in enumerate(self.rows):
            out[i, : r.shape[0]] = r
        return out, 2, [int(r.shape[0]) for r in self.rows]

    def resampled(self, seed: int = 0) -> "CacheEntry":
        """Each sequence takes another sequence's rows (a random derangement): resample ablation.
        Sequences must have equal lengths."""
        n = len(self.rows)
        if n < 2:
            raise SteeringError("resampling needs a cache of two or more sequences.")
        if len({r.shape[0] for r in self.rows}) != 1:
            raise SteeringError(f"resampling swaps whole sequences, so they need equal lengths; got "
                                f"{[r.shape[0] for r in self.rows]}.")
        g = torch.Generator().manual_seed(seed)
        while True:
            perm = torch.randperm(n, generator=g)
            if not bool((perm == torch.arange(n)).any()):
                break
        return CacheEntry(self.key, [self.rows[int(i)] for i in perm], True)


# -- applying one op to the rows of one sequence -------------------------------------------------
class NonFiniteSteer(SteeringError):
    """A steer whose value (cast to the model's dtype) or result is inf or NaN: it fails its own
    request (on vLLM, before anything it computed reaches the KV cache) and nothing else."""


def overflowed(steer: Steer, dtype: torch.dtype, cause: str = "the steered activation overflows") -> NonFiniteSteer:
    """The error of a steer whose result is inf or NaN (the hooks' check and vllm-static's in-graph flag)."""
    return NonFiniteSteer(f"{steer.op!r} at {steer.address} produced inf or NaN in the model's "
                          f"{str(dtype).replace('torch.', '')} ({cause}); the request was stopped before it reached "
                          f"the rest of the model; give smaller values.")


def failure(steer: "Steer | None", dtype: torch.dtype, steers: "list[Steer] | None" = None) -> NonFiniteSteer:
    """The error of a request whose rows went non-finite (read from the ledger, engine/core/ledger.py):
    `steer` made them so at its own site (a value that does not fit `dtype` said as such), or, None, a
    later layer's hidden state overflowed from the request's `steers`."""
    if steer is None:
        named = "; ".join(f"{s.op!r} at {s.address}" for s in steers or []) or "none"
        return NonFiniteSteer(f"the hidden state of this request became inf or NaN in the model's "
                              f"{str(dtype).replace('torch.', '')} (or too large for any norm after it) downstream "
                              f"of its steers ({named}): each steer's "
                              f"own result was finite, but together or in a later layer they overflow; the request "
                              f"was stopped and nothing it computed reaches another; give smaller values.")
    v = steer.value
    if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v.to(dtype)).all()):
        return NonFiniteSteer(f"steering value of {steer.op!r} at {steer.address} does not fit the model's "
                              f"{str(dtype).replace('torch.', '')} (it becomes inf); give smaller values.")
    return overflowed(steer, dtype)
