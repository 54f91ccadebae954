"""What counts as an integer wherever the engine takes one (a layer, a head, a feature, a position, a
token id, a count): a Python int or any integer scalar that says so through `__index__`, so numpy's
`np.int64(3)` and a 0-d integer tensor or array pass as 3. Bools, floats (3.0 included) and arrays
of more than one element are not integers: torch lets a one-element tensor of any shape through
`__index__`, which would turn `tensor([3])` into 3 silently.

Every check that takes an integer calls `as_int` and names its own field in its error."""
from __future__ import annotations

import operator


def as_int(value: object) -> int | None:
    """`value` as a Python int when it is an integer scalar, else None (the caller names the field)."""
    if isinstance(value, bool) or getattr(value, "ndim", 0) != 0:
        return None
    if str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):  # np.bool_, a 0-d bool tensor
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def is_int(value: object) -> bool:
    """Whether `value` is an integer scalar (see `as_int`)."""
    return as_int(value) is not None


def described(value: object) -> str:
    """`value` named for an error message: its type and a short repr (`float 3.0`, `Tensor tensor([3])`)."""
    return f"{type(value).__name__} {value!r:.40}"
