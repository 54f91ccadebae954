"""Which token positions an intervention touches: the one definition every backend uses.

A position spec is one of
    "all"        every position the call processes (prompt and fed-back tokens)
    "last"       the last prompt token, then every generated token fed back
    "generated"  only tokens fed back during generation (decode steps)
    int          one absolute position; negative counts back from the end of the prompt (-1 = last
                 prompt token)
    slice / (start, stop)
                 a range of absolute positions, step 1; negative bounds count from the end of the
                 prompt, a missing stop runs to the end of the call
    list of ints explicit positions (negative ones count back from the end of the prompt)
    bool tensor  a mask over absolute positions: [pos] for every sequence of the call, or
                 [batch, pos] one row per sequence (positions past its end are False); a row may
                 select nothing (per-row patching), the whole mask must select something

Positions are always a sequence's own token positions (0 = its first real token), never columns of
a padded batch. A spec that matches no token of a call is an error, not a silent no-op.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.core.errors import SteeringError
from engine.core.integers import as_int

WORDS = ("all", "last", "generated")
_END = 1 << 62
FORMS = "'all', 'last', 'generated', an int, a slice, (start, stop), a list of ints or a bool mask tensor"


def is_mask(p: object) -> bool:
    return isinstance(p, torch.Tensor)


def normalize(p: Any) -> "str | int | slice | list[int] | torch.Tensor":
    """Check the form of a position spec (no lengths needed); tuples become slices."""
    if isinstance(p, bool) or p is None:
        raise SteeringError(f"positions={p!r} is not a position spec; use {FORMS}.")
    if (n := as_int(p)) is not None:  # numpy and 0-d tensor integers too
        return n
    if isinstance(p, torch.Tensor):
        if p.dtype != torch.bool or p.dim() not in (1, 2):
            raise SteeringError(f"a positions mask is a bool tensor [pos] or [batch, pos], got dtype {p.dtype} "
                                f"and shape {tuple(p.shape)}.")
        return p.detach().to("cpu")
    if isinstance(p, list):
        ints = [as_int(x) for x in p]
        if not p or None in ints:
            raise SteeringError(f"a positions list holds one or more ints, got {p!r:.80}.")
        return sorted({n for n in ints if n is not None})
    if isinstance(p, str):
        if p not in WORDS:
            raise SteeringError(f"positions {p!r} is not one of {WORDS}, an int, a slice or (start, stop).")
        return p
    if isinstance(p, tuple):
        if len(p) != 2 or not all(x is None or as_int(x) is not None for x in p):
            raise SteeringError(f"a positions tuple is (start, stop) of ints, got {p!r}.")
        p = slice(*p)
    if isinstance(p, slice):
        if p.step is not None and as_int(p.step) != 1:
            raise SteeringError(f"positions slice {p!r} has step {p.step}; only contiguous ranges (step 1) are "
                                f"supported: pass several steers for strided positions.")
        bounds = [None if x is None else as_int(x) for x in (p.start, p.stop)]
        if any(b is None and x is not None for b, x in zip(bounds, (p.start, p.stop))):
            raise SteeringError(f"positions slice bounds must be ints or None, got {p!r}.")
        return slice(*bounds)
    raise SteeringError(f"positions must be {FORMS}; got {p!r} ({type(p).__name__}).")


def absolute(p: Any, prompt_len: int) -> Any:
    """The spec with negative ints / bounds resolved against the prompt length."""
    if isinstance(p, list):
        return [x + prompt_len if x < 0 else x for x in p]
    if isinstance(p, int):
        return p + prompt_len if p < 0 else p
    if isinstance(p, slice):
        start = 0 if p.start is None else (p.start + prompt_len if p.start < 0 else p.start)
        stop = _END if p.stop is None else (p.stop + prompt_len if p.stop < 0 else p.stop)
        return slice(start, stop)
    return p


def call_length(prompt_len: int, max_new_tokens: int) -> int:
    """Tokens a call processes: the prompt, then every generated token but the last fed back."""
    return prompt_len + max(max_new_tokens - 1, 0)


def check(p: Any, prompt_len: int, max_new_tokens: int, what: str) -> None:
    """Refuse a spec that matches no position of a call processing prompt_len prompt tokens and then
    feeding back max_new_tokens - 1 generated ones (0 new tokens: a plain forward)."""
    fed_back = max(max_new_tokens - 1, 0)
    n = prompt_len + fed_back
    call = (f"a plain forward over {prompt_len} prompt tokens" if max_new_tokens == 0 else
            f"a call over {prompt_len} prompt tokens and {fed_back} fed-back generated tokens")
    if isinstance(p, str) and p == "generated" and fed_back == 0:
        why = ("generation feeds back every new token but the last, so 1 new token feeds back none"
               if max_new_tokens == 1 else "a plain forward has no generated tokens")
        raise SteeringError(f"{what}: positions='generated' matches no token in {call} ({why}); use 'last' or "
                            f"'all', or generate at least 2 tokens.")
    if is_mask(p):
        if p.dim() != 1:
            raise SteeringError(f"{what}: a [batch, pos] positions mask is bound to one row per sequence before "
                                f"it runs; this one has shape {tuple(p.shape)}.")
        beyond = torch.nonzero(p[n:]).flatten()
        if beyond.numel():
            raise SteeringError(f"{what}: the positions mask selects position {int(beyond[0]) + n}, past the "
                                f"{n} tokens of {call}.")
        return
    a = absolute(p, prompt_len)
    if isinstance(a, list):
        bad = [x for x, y in zip(p, a) if not 0 <= y < n]
        if bad:
            raise SteeringError(f"{what}: positions {bad} match no token in {call} (valid: 0..{n - 1}, or "
                                f"-{prompt_len}..-1 counting back from the end of the prompt).")
        return
    if isinstance(a, int) and not 0 <= a < n:
        raise SteeringError(f"{what}: position {p} matches no token in {call} (valid: 0..{n - 1}, or "
                            f"-{prompt_len}..-1 counting back from the end of the prompt).")
    if isinstance(a, slice):
        if a.start < 0:
            raise SteeringError(f"{what}: positions {p} starts before the first token in {call}.")
        if a.start >= min(a.stop, n):
            raise SteeringError(f"{what}: positions {p} matches no token in {call} (resolved to "
                                f"{a.start}..{min(a.stop, n) - 1}; valid positions are 0..{n - 1}).")


def mask(p: Any, pos0: int, n: int, prompt_len: int, device: "torch.device | str | None" = None) -> torch.Tensor:
    """Bool [n]: which of the n tokens at absolute positions pos0 .. pos0+n-1 the spec touches."""
    idx = torch.arange(pos0, pos0 + n, device=device)
    if is_mask(p):
        m = torch.zeros(n, dtype=torch.bool)
        lo, hi = min(pos0, p.shape[0]), min(pos0 + n, p.shape[0])
        m[: hi - lo] = p[lo:hi]
        return m.to(device)
    if isinstance(p, str) and p == "all":
        return torch.ones(n, dtype=torch.bool, device=device)
    if p == "generated":
        return idx >= prompt_len
    if p == "last":
        return idx >= prompt_len - 1
    a = absolute(p, prompt_len)
    if isinstance(a, list):
        return torch.isin(idx, torch.tensor(a, device=device))
    if isinstance(a, int):
        return idx == a
    return (idx >= a.start) & (idx < a.stop)


def offsets(p: Any, pos0: int, n: int, prompt_len: int) -> np.ndarray:
    """The offsets (0..n-1, int64, ascending) of the tokens at absolute positions pos0 .. pos0+n-1
    that the spec touches: `mask` as host indices, with no tensor made for the common forms."""
    if isinstance(p, str):
        lo = {"all": 0, "generated": prompt_len, "last": prompt_len - 1}[p]
        return np.arange(max(lo - pos0, 0), n, dtype=np.int64)
    if is_mask(p):
        return np.flatnonzero(mask(p, pos0, n, prompt_len).numpy()).astype(np.int64)
    a = absolute(p, prompt_len)
    if isinstance(a, int):
        return np.array([a - pos0], dtype=np.int64) if pos0 <= a < pos0 + n else np.zeros(0, np.int64)
    if isinstance(a, slice):
        return np.arange(max(a.start - pos0, 0), max(min(a.stop - pos0, n), 0), dtype=np.int64)
    at = np.unique(np.asarray(a, dtype=np.int64)) - pos0  # one token named twice ([0, -n]) is touched once
    return at[(at >= 0) & (at < n)]
