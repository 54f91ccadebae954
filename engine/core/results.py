"""What every backend returns: one set of result types, so the backends are peers.

    ActivationCache   captured tensors keyed by address string ([batch, pos, ...] or [pos, ...])
    Request           one sequence of a concurrent batch: its prompt, length, captures, steers
    RequestResult     one sequence's tokens, text, captures ([pos, ...]) and logits
    StreamStep        one token of a streamed generation (token, text, logprobs, captured rows)
    GenerationResult  a batch: padded [batch, ...] tensors plus the per-sequence results
    Receipt           what one steer did: the rows it touched and the norm of its change

Every result carries its receipts, one per steer of the call (`ActivationCache.receipts` for a
forward, `RequestResult.receipts` per sequence, `GenerationResult.receipts` summed over the batch);
with `strict=True` a call fails when a steer touched no row (check_strict).

A batch of sequences of different lengths is padded (left by default, like the tokenizer's batch):
`attention_mask` marks the real tokens, captures are zero at padded positions, and attention
patterns hold the masked value (probability 0, the most negative score) at padded keys.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core.address import parse
from engine.core.errors import AddressError, SteeringError
from engine.core.points import KEY_AXIS_POINTS

if TYPE_CHECKING:
    from engine.core.readouts import TopK

PATTERNS = KEY_AXIS_POINTS  # the points with a key-position axis (Point.key_axis)

if TYPE_CHECKING:
    from engine.core.steering import CacheEntry


@dataclass(frozen=True)
class Receipt:
    """What one steer did in one result. `rows`: the positions it touched, each counted once (summed
    over the sequences of a batch); `change_norm`: the L2 norm of (steered - unsteered) over all those
    rows, each steer measured from the value it received (after the steers before it at the same
    site). A steer whose positions select nothing that ran (a position generation never reached, a
    logit the model does not compute, a per-row mask's empty row) reports rows=0."""
    index: int  # its place among the call's steers: steering() blocks' first (outermost first), then steer=
    address: str  # absolute address, coordinates included
    op: str
    rows: int = 0
    change_norm: float = 0.0

    def as_json(self) -> dict:
        """Plain JSON (a non-finite change_norm as null: JSON has no inf / nan)."""
        d = dataclasses.asdict(self)
        if not math.isfinite(self.change_norm):
            d["change_norm"] = None
        return d


class StrictSteerError(SteeringError):
    """A steer touched no row of a call made with strict=True; `receipt` says which."""

    def __init__(self, message: str, receipt: Receipt) -> None:
        super().__init__(message)
        self.receipt = receipt


def combine(per_sequence: "list[list[Receipt]]") -> list[Receipt]:
    """One call's receipts from its sequences' (the same steers in the same order): rows add up,
    norms add in quadrature."""
    return [dataclasses.replace(same[0], rows=sum(r.rows for r in same),
                                change_norm=math.sqrt(sum(r.change_norm ** 2 for r in same)))
            for same in zip(*per_sequence)]


def check_strict(receipts: list[Receipt], what: str = "call") -> None:
    """strict=True: refuse a result in which a steer touched no row (it silently did nothing)."""
    for r in receipts:
        if r.rows == 0:
            raise StrictSteerError(
                f"steer {r.index} ({r.op!r} at {r.address}) touched no row of this {what} (strict=True): its "
                f"positions select nothing that ran (a position generation did not reach before it stopped, a "
                f"logit the model does not compute there); fix its positions, or pass "
                f"strict=False to accept a receipt of 0 rows.", r)


class ActivationCache(dict):
    """Captured tensors keyed by address string; also indexable by Address or 'point.-1'.

    `columns`: for a padded batch ([batch, pos, ...] entries), the columns each sequence's own
    positions occupy; None for the cache of one sequence ([pos, ...] entries). `entry(key)` gives
    a capture as each sequence's own rows, the form a steer aligns by position (patching).
    `receipts`: what each steer of the call did (run_with_cache's receipts). `readouts`: each
    readout's result by name (engine.core.readouts: a tensor or a TopK; per-position ones
    [b, pos, ...] like a capture, named in `positional`; reductions [b, ...])."""

    def __init__(self, n_layers: int, columns: "list[torch.Tensor] | None" = None,
                 receipts: "list[Receipt] | None" = None) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.columns = columns
        self.receipts: list[Receipt] = list(receipts or [])
        self.readouts: dict = {}
        self.positional: set = set()

    def put_readout(self, name: str, value: torch.Tensor | TopK, per_position: bool) -> None:
        self.readouts[name] = value
        if per_position:
            self.positional.add(name)

    def entry(self, key: str) -> "CacheEntry":
        """The capture at `key` as a CacheEntry: per sequence, its rows at its own positions."""
        from engine.core.steering import CacheEntry
        t = self[key]
        k = self._key(key)
        if self.columns is None:
            return CacheEntry(k, [t], batched=False)
        if k.split(".")[0] in PATTERNS:
            return CacheEntry(k, [t[i, c][..., c.to(t.device)] for i, c in enumerate(self.columns)])
        return CacheEntry(k, [t[i, c.to(t.device)] for i, c in enumerate(self.columns)])

    def _key(self, key):
        return str(parse(key).resolved(self.n_layers))

    def __getitem__(self, key):
        k = self._key(key)
        if not dict.__contains__(self, k):
            raise KeyError(f"{k!r} was not captured; captured: {', '.join(self) or 'nothing'}.")
        return dict.__getitem__(self, k)

    def __contains__(self, key):
        try:
            return dict.__contains__(self, self._key(key))
        except AddressError:
            return False

    def get(self, key: str, default: object = None) -> object:
        return self[key] if key in self else default

    def cpu(self) -> "ActivationCache":
        """The cache with every capture and readout on the host: captures stay on the model's device
        (as TransformerLens and nnsight return them); this moves them all at once, each copy issued
        without waiting and one wait at the end (a single host sync, not one per tensor)."""
        from engine.core.readouts import TopK
        out = ActivationCache(self.n_layers, self.columns, self.receipts)
        device = None

        def move(t: torch.Tensor) -> torch.Tensor:
            nonlocal device
            if t.device.type == "cpu":
                return t
            device = t.device
            return t.to("cpu", non_blocking=True)
        for k in self:
            dict.__setitem__(out, k, move(dict.__getitem__(self, k)))
        for name, v in self.readouts.items():
            out.put_readout(name, v.map(move) if isinstance(v, TopK) else move(v), name in self.positional)
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return out


@dataclass
class Request:
    """One request of a concurrent batch: its own prompt, length, captures, steers and sampling.
    max_new_tokens is checked when the Request is made (engine.core.inputs.new_tokens), then trusted."""
    prompt: "str | list[int]"
    max_new_tokens: int = 8
    points: "list | tuple | str" = ()
    steer: "list | tuple" = ()
    sampling: dict = field(default_factory=dict)
    readouts: "list | tuple" = ()  # engine.core.readouts.Readout

    def __post_init__(self) -> None:
        from engine.core.inputs import new_tokens
        self.max_new_tokens = new_tokens(self.max_new_tokens)


@dataclass
class RequestResult:
    prompt_ids: torch.Tensor  # [P]
    new_tokens: torch.Tensor  # [N]
    text: str
    cache: ActivationCache  # [pos, ...]: the prompt, then every generated token fed back (P + N - 1)
    logits: torch.Tensor | None  # [N, vocab] (generation) or [P, vocab] (a forward)
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (0 when capturing/steering)
    recomputed: int = 0  # times the scheduler preempted and recomputed this request
    receipts: list[Receipt] = field(default_factory=list)  # one per steer: rows touched, norm of its change

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.new_tokens])


@dataclass
class StreamStep:
    """One generated token of a stream, the same on every backend. `logprob` and `top_logprobs`
    ({token id: log-probability}, the n most likely, with logprobs=n) are over the model's raw
    next-token distribution (before temperature / top-p / top-k); `rows` holds the captures of the
    forward that produced this token ({address: [n, ...]}: the prompt for the first token, then the
    previous token fed back), when points were asked. The last step carries the request's result."""
    index: int
    token: int
    text: str
    logprob: float | None = None
    top_logprobs: dict = field(default_factory=dict)
    rows: dict | None = None
    readouts: dict | None = None  # per-position readouts of that forward ({name: [n, ...] or TopK})
    result: "RequestResult | None" = None


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [b, P + N], padded
    new_tokens: torch.Tensor  # [b, N]
    text: list[str]
    cache: ActivationCache  # [b, P + N - 1, ...]: prompt then each fed-back token, padded
    logits: torch.Tensor | None  # [b, N, vocab], the scores each new token was chosen from
    attention_mask: torch.Tensor  # [b, P + N]: 1 on real tokens
    requests: list[RequestResult] = field(default_factory=list)
    receipts: list[Receipt] = field(default_factory=list)  # per steer, over every sequence (results.combine)


@dataclass(frozen=True)
class Sequences:
    """A call's generated sequences padded as every backend returns them: tokens and mask [b, P + N] on
    the left, new tokens [b, N] on the right (a sequence that stopped early), captures [b, P + N - 1, ...]
    on the left (every position but the last was fed to the model). Built once by `of`; a backend pads
    its captures and logits at `seen` and `new_cols`."""
    tokens: torch.Tensor  # [b, width]
    mask: torch.Tensor  # [b, width]: 1 on real tokens
    new: torch.Tensor  # [b, n_new]
    width: int  # P + N of the longest sequence
    n_new: int
    new_cols: list[torch.Tensor]  # each sequence's columns in the new tokens (and logits)
    seen: list[torch.Tensor]  # each sequence's columns in the captures [b, width - 1, ...]

    @classmethod
    def of(cls, res: list[RequestResult], pad: int) -> Sequences:
        lengths = [r.tokens.shape[0] for r in res]
        width = max(lengths)
        cols = columns(lengths, width, "left")
        n_new = max(r.new_tokens.shape[0] for r in res)
        new_cols = columns([r.new_tokens.shape[0] for r in res], n_new, "right")
        return cls(pad_rows([r.tokens for r in res], cols, width, pad),
                   pad_rows([torch.ones_like(r.tokens) for r in res], cols, width, 0),
                   pad_rows([r.new_tokens for r in res], new_cols, n_new, pad), width, n_new, new_cols,
                   columns([n - 1 for n in lengths], width - 1, "left"))


def columns(lengths: list[int], width: int, side: str) -> list[torch.Tensor]:
    """Per sequence, the columns of a padded batch of `width` its positions 0..len-1 occupy."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}.")
    return [torch.arange(width - n, width) if side == "left" else torch.arange(n) for n in lengths]


def columns_of(mask: torch.Tensor) -> list[torch.Tensor]:
    """The columns of each row's real tokens in a [b, T] attention mask."""
    return [torch.nonzero(row.bool(), as_tuple=True)[0].cpu() for row in mask]


def one_run_per_row(mask: torch.Tensor) -> bool:
    """Whether every row of a [b, T] attention mask holds its real tokens in one unbroken, non-empty run
    (padding on one side only), found with whole-mask operations instead of a nonzero per row."""
    real = mask.bool().to(torch.int8)
    first = real.argmax(1)  # the first maximum: the first real column
    last = real.shape[1] - 1 - real.flip(1).argmax(1)
    return bool((last - first + 1 == real.sum(1)).all())  # an empty row reads width == 0: False


def scatter(key: str, rows: list[torch.Tensor], cols: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack per-sequence [len, ...] captures into [b, width, ...], each at its own columns (an
    attention pattern's key axis too); padded entries hold 0 (the most negative score for scores).
    Keys past a pattern's positions (DeepSeek-V4's compressor entries) go after the `width` columns."""
    first = rows[0]
    pattern = key.split(".")[0] in PATTERNS
    fill = torch.finfo(first.dtype).min if key.startswith("attn_scores") else 0.0
    extra = max(r.shape[-1] - len(c) for r, c in zip(rows, cols)) if pattern else 0
    shape = ((len(rows), width, *first.shape[1:-1], width + extra) if pattern
             else (len(rows), width, *first.shape[1:]))
    out = torch.full(shape, fill, dtype=first.dtype, device=first.device)
    for i, (r, c) in enumerate(zip(rows, cols)):
        c = c.to(r.device)
        if pattern:
            n = len(c)
            keys = torch.cat([c, torch.arange(width, width + r.shape[-1] - n, device=r.device)])
            out[i, c[:, None], ..., keys[None, :]] = r.movedim(-1, 1) if r.dim() > 2 else r
        else:
            out[i, c] = r
    return out


def batch_cache(caches: list[ActivationCache], cols: list[torch.Tensor], width: int, n_layers: int,
                receipts: "list[Receipt] | None" = None) -> ActivationCache:
    """One [b, width, ...] ActivationCache from per-sequence [len, ...] caches."""
    out = ActivationCache(n_layers, [c.cpu() for c in cols], receipts)
    for key in (caches[0] if caches else {}):
        out[key] = scatter(key, [c[key] for c in caches], cols, width)
    if caches and isinstance(caches[0], ActivationCache):
        batch_readouts(out, caches, cols, width)
    return out


def batch_readouts(out: ActivationCache, caches: list[ActivationCache], cols: list[torch.Tensor], width: int) -> None:
    """The readouts of per-sequence caches into `out`: per-position ones [b, width, ...] at each
    sequence's columns, reductions stacked [b, ...]."""
    for name in caches[0].readouts:
        values = [c.readouts[name] for c in caches]
        positional = name in caches[0].positional
        out.put_readout(name, batch_readout(values, cols, width) if positional else _stack(values), positional)


def batch_readout(values: list, cols: list[torch.Tensor], width: int) -> torch.Tensor | TopK:
    """Per-position readouts of each sequence ([len, ...] tensors or TopKs) as [b, width, ...] at
    their columns; padded positions hold 0 (a TopK's indices -1)."""
    from engine.core.readouts import TopK
    if isinstance(values[0], TopK):
        return TopK(pad_rows([v.indices for v in values], cols, width, -1),
                    pad_rows([v.values for v in values], cols, width, 0))
    return pad_rows(values, cols, width)


def _stack(values: list):
    from engine.core.readouts import TopK
    if isinstance(values[0], TopK):
        return TopK(torch.stack([v.indices for v in values]), torch.stack([v.values for v in values]))
    return torch.stack(values)


def pad_rows(rows: list[torch.Tensor], cols: list[torch.Tensor], width: int, fill: float = 0) -> torch.Tensor:
    """[b, width, ...] from per-sequence [len, ...] tensors (token ids, logits) at their columns, on
    their device."""
    out = torch.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=rows[0].dtype, device=rows[0].device)
    for i, (r, c) in enumerate(zip(rows, cols)):
        out[i, c.to(r.device, non_blocking=True)] = r
    return out
