"""Readouts: reductions computed where the activation is (the eager hook, the vLLM worker), so only
their result leaves the forward, never the captured rows.

    Readout("resid_post.1", Mean())                  the mean over the call's positions  [*shape]
    Readout("resid_post.1", Max()) / Last()          elementwise max / the last position  [*shape]
    Readout("resid_post.1", Norm())                  each position's L2 norm              [pos]
    Readout("resid_post.1", Project(W, b, act="sigmoid"))   W [out, d] (or one direction [d]): per
                                                     position act(x @ W.T + b)            [pos, out] / [pos]
    Readout("resid_post.1", LensTopK(5))             logit lens: the top-k token ids and their
                                                     log-probabilities per position       TopK [pos, k]
    Readout("resid_post.1", SAEFeatures(path_or_sae, k=32, threshold=None))
                                                     an SAE's top-k latents per position  TopK [pos, k]

A kind is an object (its parameters validated when it is made); `Readout.name` keys the result
(default "address:kind"). Results land in `cache.readouts[name]` of every result type, and per token
in a stream's `StreamStep.readouts`. Per-position kinds give one row per position the call computed
(a forward: the prompt; a generation: the prompt, then each token fed back, like a capture);
position kinds reduce over those same positions.

A backend binds each readout of a plan to its own environment (`Env`: how to unembed rows, how to load
an SAE) as an `Accumulator`, which takes the rows of each forward chunk at their absolute positions
and keeps only the readout's result (per-position rows, or a running partial). A chunk recomputed
after preemption replaces what it covers, as captures do; gaps are an error at assembly.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from engine.core.address import Address, parse
from engine.core.errors import ReadoutError, SAEError  # (defined with every other error; importable here too)
from engine.core.points import INTEGER_POINTS, KEY_AXIS_POINTS, RESIDUAL_POINTS


@dataclass(frozen=True)
class TopK:
    """Sparse per-position output: `indices` [..., k] (int64; -1 where a threshold dropped the slot)
    and `values` [..., k] (float32), highest first."""
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def shape(self) -> tuple:
        return tuple(self.indices.shape)

    def dense(self, width: int) -> torch.Tensor:
        """[..., width] with each kept value at its index and 0 elsewhere."""
        out = torch.zeros(*self.indices.shape[:-1], width + 1, dtype=self.values.dtype)
        idx = torch.where(self.indices < 0, width, self.indices)
        out.scatter_(-1, idx.cpu(), self.values.cpu())
        return out[..., :width]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TopK":
        return TopK(fn(self.indices), fn(self.values))


@dataclass(frozen=True)
class Env:
    """What a backend gives its readouts: `lens(rows, point)` -> logits [n, vocab] through the model's
    own final norm and head; `sae(spec)` -> a loaded SAE (from a path, cached by the backend)."""
    lens: "Callable[[torch.Tensor, str], torch.Tensor] | None" = None
    sae: "Callable[[Any], Any] | None" = None


@dataclass(frozen=True)
class Facts:
    """What a model tells its readouts before anything runs (Kind.check_model): its vocabulary (a lens's
    top k), the flattened per-position width at the readout's address (None: not known there), and
    whether an SAE named by a path is read where the call is checked (False on a remote client: the
    server names its own SAEs and checks them)."""
    vocab: int | None = None
    width: int | None = None
    local_saes: bool = True


class Kind:
    """A readout kind. `per_position`: one result row per position (else one result per call)."""
    per_position: ClassVar[bool] = True
    sparse: ClassVar[bool] = False
    label: ClassVar[str] = ""

    def check(self, address: Address) -> None:
        """Refuse an address this kind cannot read (model-independent)."""

    def check_model(self, facts: Facts, address: Address) -> None:
        """Refuse what the model's facts rule out (a k above the vocabulary or the SAE's latents, a width
        that is not the point's), before anything runs, on every backend alike."""

    def bind(self, env: Env, address: Address) -> Callable[[torch.Tensor], tuple]:
        """rows [n, *shape] at `address` -> parts: per-position kinds a tuple of [n, ...] tensors (dense: one;
        sparse: indices, values), position kinds a partial for `combine`."""
        raise NotImplementedError

    def combine(self, partials: list[tuple], n: int) -> tuple:
        raise NotImplementedError

    def segments(self, x: torch.Tensor, counts: list[int], device: torch.device) -> tuple:
        """Position kinds: the partial of each of several members' consecutive rows of x at once
        (counts: rows per member), as a tuple of [members, ...] tensors, one whole-batch reduction."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.label


def _lengths(counts: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(counts, dtype=torch.long)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


# -- position kinds ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mean(Kind):
    """The mean over positions (float32)."""
    per_position: ClassVar[bool] = False
    label: ClassVar[str] = "mean"

    def bind(self, env: Env, address: Address) -> Callable[[torch.Tensor], tuple]:
        return lambda x: (x.float().sum(0),)

    def combine(self, partials: list[tuple], n: int) -> tuple:
        return (torch.stack([p[0] for p in partials]).sum(0) / n,)

    def segments(self, x: torch.Tensor, counts: list[int], device: torch.device) -> tuple:
        return (torch.segment_reduce(x.float(), "sum", lengths=_lengths(counts, device), axis=0),)


@dataclass(frozen=True)
class Max(Kind):
    """The elementwise max over positions."""
    per_position: ClassVar[bool] = False
    label: ClassVar[str] = "max"

    def bind(self, env: Env, address: Address) -> Callable[[torch.Tensor], tuple]:
        return lambda x: (x.amax(0),)

    def combine(self, partials: list[tuple], n: int) -> tuple:
        return (torch.stack([p[0] for p in partials]).amax(0),)

    def segments(self, x: torch.Tensor, counts: list[int], device: torch.device) -> tuple:
        return (torch.segment_reduce(x, "max", lengths=_lengths(counts, device), axis=0),)


@dataclass(frozen=True)
class Last(Kind):
    """The last position's value."""
    per_position: ClassVar[bool] = False
    label: ClassVar[str] = "last"

    def bind(self, env: Env, address: Address) -> Callable[[torch.Tensor], tuple]:
        return lambda x: (x[-1].clone(),)  # a copy: vLLM reuses its activation buffers

    def combine(self, partials: list[tuple], n: int) -> tuple:
        return partials[-1]

    def segments(self, x: torch.Tensor, counts: list[int], device: torch.device) -> tuple:
        import numpy as np
        last = torch.from_numpy(np.cumsum(counts) - 1)
        return (x.index_select(0, last if device.type == "cpu" else last.to(device, non_blocking=True)),)


# -- per-position kinds --------------------------------------------------------------------------
@dataclass(frozen=True)
class Norm(Kind):
    """Each position's L2 norm over the point's per-position dims (float32)."""
    label: ClassVar[str] = "norm"

    def bind(self, env: Env, address: Address) -> Callable[[torch.Tensor], tuple]:
        return lambda x: (x.float().reshape(x.shape[0], -1).norm(dim=-1),)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "softmax": lambda y: torch.softmax(y, dim=-1), "log_softmax": lambda y: torch.log_softmax(y, dim=-1),
}


def _finite_matrix(t, what: str, dims: tuple) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ReadoutError(f"{what} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() not in dims or t.numel() == 0:
        raise ReadoutError(f"{what} must have {' or '.join(map(str, dims))} dims and no empty axis, got shape "
                           f"{tuple(t.shape)}.")
    if t.device.type == "meta" or not bool(torch.isfinite(t).all()):
        raise ReadoutError(f"{what} holds no data or non-finite values; give finite numbers on a real device.")
    return t.detach().float().cpu()


@dataclass(frozen=True, eq=False)
class Project(Kind):
    """A linear probe or a set of directions: act(x @ W.T + b) per position, x the flattened
    per-position vector. W [out, d] gives [pos, out]; one direction W [d] gives [pos]. `act`: None or
    one of ACTIVATIONS."""
    W: torch.Tensor
    b: Any = None  # a tensor [out] or [1], or a number; held as a float32 tensor
    act: str | None = None
    label: ClassVar[str] = "project"

    def __post_init__(self):
        W = _finite_matrix(self.W, "Project W", (1, 2))
        b = self.b
        if b is not None:
            b = _finite_matrix(torch.as_tensor(b, dtype=torch.float32).reshape(-1) if not isinstance(b, torch.Tensor)
                               else b.reshape(-1), "Project b", (1,))
            want = 1 if W.dim() == 1 else W.shape[0]
            if b.numel() not in (1, want):
                raise ReadoutError(f"Project b has {b.numel()} entries; W {tuple(W.shape)} gives {want} outputs.")
        if self.act is not None and self.act not in ACTIVATIONS:
            raise ReadoutError(f"Project act {self.act!r} is not one of {', '.join(ACTIVATIONS)} (or None).")
        object.__setattr__(self, "W", W)
        object.__setattr__(self, "b", b)

    @property
    def width(self) -> int:
        return self.W.shape[-1]

    def check_width(self, width: int, where: "Address | str", shape: tuple = ()) -> None:
        """Refuse a point whose flattened per-position width is not W's."""
        if width != self.width:
            raise ReadoutError(f"Project W reads {self.width} dims but {where} has {width} per position"
                               f"{f' (shape {shape})' if shape else ''}; give W of shape [out, {width}].")

    def check_model(self, facts: Facts, address: Address) -> None:
        if facts.width is not None:
            self.check_width(facts.width, address)

    def bind(self, env: Env, address: Address) -> Callable[[torch.Tensor], tuple]:
        placed: dict = {}

        def fn(x: torch.Tensor) -> tuple:
            flat = x.reshape(x.shape[0], -1)
            self.check_width(flat.shape[1], address, tuple(x.shape[1:]))
            if flat.device not in placed:  # moved to the activation's device once
                placed[flat.device] = (self.W.to(flat.device), None if self.b is None else self.b.to(flat.device))
            W, b = placed[flat.device]
            y = flat.float() @ (W.T if W.dim() == 2 else W)
            if b is not None:
                y = y + (b if W.dim() == 2 else b[0])
            return ((ACTIVATIONS[self.act](y) if self.act else y),)
        return fn

    def describe(self) -> str:
        return f"project[{'x'.join(map(str, self.W.shape))}{',' + self.act if self.act else ''}]"


def _positive_int(k, what: str) -> int:
    from engine.core.integers import as_int, described
    n = as_int(k)
    if n is None or n < 1:
        raise ReadoutError(f"{what} must be a positive int, got {described(k)}.")
    return n


@dataclass(frozen=True)
class LensTopK(Kind):
    """Logit lens at a residual point: the k most likely token ids and their log-probabilities."""
    k: int = 5
    sparse: ClassVar[bool] = True
    label: ClassVar[str] = "lens_topk"

    def __post_init__(self):
        object.__setattr__(self, "k", _positive_int(self.k, "LensTopK k"))

    def check(self, address: Address) -> None:
        if address.point not in RESIDUAL_POINTS or address.coords:
            raise ReadoutError(f"LensTopK reads a whole residual point; {address} is not one (use one of: "
                               f"{', '.join(RESIDUAL_POINTS)}).")

    def check_model(self, facts: Facts, address: Address) -> None:
        if facts.vocab is not None and self.k > facts.vocab:
            raise ReadoutError(f"LensTopK k={self.k} exceeds the vocabulary's {facts.vocab} tokens; ask for at most "
                               f"{facts.vocab}.")

    def bind(self, env: Env, address: Address) -> Callable[[torch.Tensor], tuple]:
        lens = env.lens
        if lens is None:
            raise ReadoutError("this backend has no logit lens for readouts; use backend='eager' or 'vllm'.")

        def fn(x: torch.Tensor) -> tuple:
            lp = torch.log_softmax(lens(x, address.point).float(), dim=-1)
            if self.k > lp.shape[-1]:  # the vocabulary is known here first (the server refuses it up front)
                raise ReadoutError(f"LensTopK k={self.k} exceeds the vocabulary's {lp.shape[-1]} tokens; ask for "
                                   f"at most {lp.shape[-1]}.")
            v, i = lp.topk(self.k, dim=-1)
            return i, v
        return fn

    def describe(self) -> str:
        return f"lens_top{self.k}"


@dataclass(frozen=True, eq=False)
class SAEFeatures(Kind):
    """An SAE's latents per position, sparse: the k largest (highest first); with `threshold`, slots
    whose value is not above it hold index -1 and value 0. `sae` is a directory in SAELens's format
    (cfg.json + sae_weights.safetensors), loaded once per process and cached, or a loaded SAE (eager
    only: the vLLM workers load from a path)."""
    sae: Any
    k: int = 32
    threshold: float | None = None
    sparse: ClassVar[bool] = True
    label: ClassVar[str] = "sae"

    def __post_init__(self):
        object.__setattr__(self, "k", _positive_int(self.k, "SAEFeatures k"))
        if isinstance(self.sae, Path):
            object.__setattr__(self, "sae", str(self.sae))
        if isinstance(self.sae, str) and not self.sae:
            raise ReadoutError("SAEFeatures sae is empty; give an SAE directory (or, on a model server, the name of "
                               "an SAE folder inside its --sae-dir).")
        if not isinstance(self.sae, str) and not callable(getattr(self.sae, "encode", None)):
            raise ReadoutError(f"SAEFeatures sae must be a directory path or a loaded SAE (with encode), "
                               f"got {type(self.sae).__name__}.")
        t = self.threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)):
            raise ReadoutError(f"SAEFeatures threshold must be a finite number or None, got {t!r}.")

    def check_model(self, facts: Facts, address: Address) -> None:
        if isinstance(self.sae, str) and not facts.local_saes:
            return
        from engine.core.sae_files import sae_header
        sae = sae_header(self.sae, "SAEFeatures")
        if self.k > int(sae.d_sae):
            raise ReadoutError(f"SAEFeatures k={self.k} exceeds the SAE's {sae.d_sae} latents.")
        if facts.width is not None and facts.width != sae.d_in:
            raise SAEError(f"{sae.where()}: d_in is {sae.d_in} (cfg.json field 'd_in') but {address} is "
                           f"{facts.width} wide; attach an SAE trained on this model's {address}.")

    def bind(self, env: Env, address: Address) -> Callable[[torch.Tensor], tuple]:
        from engine.core.features import topk
        sae = self.sae if not isinstance(self.sae, str) else (env.sae(self.sae) if env.sae else None)
        if sae is None:
            raise ReadoutError("this backend cannot load SAEs for readouts; use backend='eager' or 'vllm'.")
        if self.k > int(sae.d_sae):
            raise ReadoutError(f"SAEFeatures k={self.k} exceeds the SAE's {sae.d_sae} latents.")

        def fn(x: torch.Tensor) -> tuple:
            flat = x.reshape(x.shape[0], -1)
            sae.check_width(flat.shape[1], str(address))
            i, v = topk(sae.encode(flat).float(), self.k)
            if self.threshold is not None:
                drop = v <= self.threshold
                i, v = i.masked_fill(drop, -1), v.masked_fill(drop, 0.0)
            return i, v
        return fn

    def describe(self) -> str:
        where = Path(self.sae).name if isinstance(self.sae, str) else type(self.sae).__name__
        return f"sae[{where},k={self.k}{'' if self.threshold is None else f',>{self.threshold:g}'}]"


KINDS: dict[str, type] = {k.__name__: k for k in (Mean, Max, Last, Norm, Project, LensTopK, SAEFeatures)}


@dataclass(eq=False)
class Readout:
    """What to read at `address` and how (`kind`, an object of KINDS); `name` keys its result
    (default "address:kind"). Readouts compare by identity, like steers."""
    address: "str | Address"
    kind: Kind
    name: str | None = None

    def __post_init__(self):
        self.address = parse(self.address)
        if not isinstance(self.kind, Kind):
            raise ReadoutError(f"Readout kind must be one of {', '.join(KINDS)} (an object, e.g. Mean() or "
                               f"LensTopK(5)), got {type(self.kind).__name__} {self.kind!r:.60}.")
        point = self.address.point
        if point in KEY_AXIS_POINTS or point in INTEGER_POINTS or point in ("lm_head", "lm_head_raw"):
            raise ReadoutError(f"readouts read per-position activation vectors; {point!r} is not one (attention "
                               f"patterns, expert indices and logits are captured, or use LensTopK at a residual "
                               f"point / logprobs= for the model's own next-token distribution).")
        self.kind.check(self.address)
        if self.name is None:
            self.name = f"{self.address}:{self.kind.describe()}"
        elif not isinstance(self.name, str) or not self.name:
            raise ReadoutError(f"Readout name must be a non-empty string, got {self.name!r}.")

    def at(self, address: Address) -> "Readout":
        """The same readout at a resolved address, its name kept."""
        return dataclasses.replace(self, address=address)


def validate_readouts(readouts: Any) -> list[Readout]:
    """The readouts of a `readouts=` argument (a Readout, an iterable of them, or None), checked:
    Readout objects with distinct names."""
    if readouts is None:
        return []
    items = [readouts] if isinstance(readouts, Readout) else None
    if items is None:
        if isinstance(readouts, (str, bytes, dict, torch.Tensor)) or not hasattr(readouts, "__iter__"):
            raise ReadoutError(f"readouts must be a Readout or a list of them, got {type(readouts).__name__}; "
                               f"e.g. readouts=[Readout('resid_post.1', Mean())].")
        items = list(readouts)
    names: dict = {}
    for i, r in enumerate(items):
        if not isinstance(r, Readout):
            raise ReadoutError(f"readouts entry {i} is {type(r).__name__} {r!r:.60}, not a Readout; build it with "
                               f"Readout(address, kind), e.g. Readout('resid_post.1', Mean()).")
        if r.name in names:
            raise ReadoutError(f"two readouts are named {r.name!r} (entries {names[r.name]} and {i}); give one "
                               f"of them name=.")
        names[r.name] = i
    return items


DEFER_ROWS = 32  # a per-position readout's rows computed together once this many wait (see Accumulator.defer)


@dataclass(eq=False)
class Accumulator:
    """One readout of one plan, bound where it runs: takes each chunk's rows [n, ...] at absolute
    position pos0 and keeps the readout's parts (chunks of (pos0, n, parts)).

    A per-position readout's small chunks (a decode step's row) may wait (`defer`) and be computed
    together: the readout reads its weights once per `fn` call (an SAE's encoder, a lens's head), which
    over one row at a time reads nearly what the model's own step reads. They are computed when DEFER_ROWS wait,
    before anything later is kept, and before the result is read (`result`, `rows_from`), so what is
    read is the same in either case, up to float rounding of a product over more rows at once."""
    readout: Readout
    fn: Callable[[torch.Tensor], tuple]
    chunks: list = field(default_factory=list)
    error: str | None = None
    waiting: list = field(default_factory=list)  # (pos0, rows [n, ...]) deferred, in order (< DEFER_ROWS rows)

    def add(self, pos0: int, x: torch.Tensor) -> None:
        self.put(pos0, x.shape[0], self.fn(x))

    def defer(self, pos0: int, x: torch.Tensor) -> None:
        """Keep rows x [n, ...] (a copy the caller no longer writes) at absolute position pos0, to be
        computed with the rest waiting."""
        self.waiting.append((pos0, x))
        if sum(w.shape[0] for _, w in self.waiting) >= DEFER_ROWS:
            self.settle()

    def settle(self) -> None:
        """Compute every deferred chunk in one `fn` call; a failure is kept as the readout's error."""
        if not self.waiting:
            return
        waiting, self.waiting = self.waiting, []
        try:
            counts = [x.shape[0] for _, x in waiting]
            parts = self.fn(waiting[0][1] if len(waiting) == 1 else torch.cat([x for _, x in waiting]))
        except Exception as e:  # noqa: BLE001  (read back as this readout's error, as a failed chunk is)
            self.error = f"{self.readout.name}: {type(e).__name__}: {e}"
            return
        for (pos0, _), piece in zip(waiting, zip(*(p.split(counts) for p in parts))):
            self._keep(pos0, piece[0].shape[0], piece)

    def put(self, pos0: int, n: int, parts: tuple) -> None:
        """Keep the parts of the n rows from absolute position pos0 (computed by the caller for many
        accumulators at once: engine.core.site.readout), after any deferred rows."""
        self.settle()
        self._keep(pos0, n, parts)

    def _keep(self, pos0: int, n: int, parts: tuple) -> None:
        if self.chunks:
            p, k, _ = self.chunks[-1]
            if pos0 < p + k:  # recomputed after preemption: drop what is being recomputed
                kept = []
                for p, k, c in self.chunks:
                    if p + k <= pos0:
                        kept.append((p, k, c))
                    elif p < pos0:
                        if not self.readout.kind.per_position:
                            self.error = (f"{self.readout.name}: the scheduler recomputed this request from "
                                          f"position {pos0}, inside a reduced chunk; rerun the request")
                            kept = []
                            break
                        kept.append((p, pos0 - p, tuple(t[:pos0 - p] for t in c)))
                self.chunks = kept
        self.chunks.append((pos0, n, parts))

    def _contiguous(self, start: int) -> list:
        self.settle()
        if self.error:
            raise RuntimeError(self.error)
        if not self.chunks:
            raise RuntimeError(f"readout {self.readout.name} saw no position of this request.")
        at = start
        for p, n, _ in self.chunks:
            if p != at:
                raise RuntimeError(f"readout {self.readout.name}: positions {at}..{p - 1} were never computed in "
                                   f"this request (no forward ran its site there); report this as a bug.")
            at += n
        return self.chunks

    def result(self) -> torch.Tensor | TopK:
        """The readout's value: [pos, ...] (or TopK) per position, else the reduced value."""
        chunks = self._contiguous(0)
        kind = self.readout.kind
        if not kind.per_position:
            return kind.combine([c for _, _, c in chunks], sum(n for _, n, _ in chunks))[0]
        return as_value(kind, tuple(torch.cat(ts) for ts in zip(*(c for _, _, c in chunks))))

    def rows_from(self, start: int) -> "tuple | None":
        """Per-position parts from absolute position `start` up to the first gap (a stream's read)."""
        self.settle()
        parts, at = [], start
        for p, n, c in self.chunks:
            if p + n <= at:
                continue
            if p > at:
                break
            parts.append(tuple(t[at - p:] for t in c))
            at = p + n
        return tuple(torch.cat(ts) for ts in zip(*parts)) if parts else None


def as_value(kind: Kind, parts: tuple) -> torch.Tensor | TopK:
    """Parts -> what a user gets: a tensor, or TopK for sparse kinds."""
    return TopK(*parts) if kind.sparse else parts[0]


def parts_of(value: torch.Tensor | TopK) -> tuple:
    return (value.indices, value.values) if isinstance(value, TopK) else (value,)


def bind(readouts: list[Readout], env: Env) -> dict:
    """{name: Accumulator} for one plan's readouts on a backend."""
    return {r.name: Accumulator(r, r.kind.bind(env, parse(r.address))) for r in readouts}


# -- plain data (the vLLM wire) ------------------------------------------------------------------
def kind_fields(kind: Kind) -> dict:
    """A kind's declared fields (tensors left as tensors), for the wire."""
    return {f.name: getattr(kind, f.name) for f in dataclasses.fields(kind)}  # type: ignore[arg-type]


def kind_from(name: str, fields: dict) -> Kind:
    if name not in KINDS:
        raise ReadoutError(f"unknown readout kind {name!r}; kinds: {', '.join(KINDS)}.")
    return KINDS[name](**fields)
