"""Host time spent inside named functions and methods for the span of one measurement.

    spent: dict[str, list[float]] = {}
    with timing([(EagerModel, "_plans", "_plans"), (grid, "decode_layout", "layout")], spent):
        ...                                  # each call appends its seconds to spent[label]

A label may be a function of the call's arguments that returns the label, or None to leave that call
untimed (a decode forward's site apart from a prefill's). The wrapped attributes are put back when the
block ends, however it ends, so a caller in the same process gets the plain functions back. On a GPU a
wrapped call's time is the host's (Python and kernel launches) unless the call itself waits.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator

Label = str | Callable[..., "str | None"]


def _timed(label: Label, fn: Callable, spent: dict[str, list[float]]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        name = label if isinstance(label, str) else label(*args, **kw)
        if name is None:
            return fn(*args, **kw)
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            spent.setdefault(name, []).append(time.perf_counter() - t)
    return wrapper


@contextlib.contextmanager
def timing(targets: list[tuple[object, str, Label]], spent: dict[str, list[float]]) -> Iterator[None]:
    """Within the block, every call of `owner.attribute` for each (owner, attribute, label) of `targets`
    appends its seconds to spent[label] (a callable label is called with the call's arguments first)."""
    saved = [(owner, attr, vars(owner).get(attr)) for owner, attr, _ in targets]
    try:
        for owner, attr, label in targets:
            setattr(owner, attr, _timed(label, getattr(owner, attr), spent))
        yield
    finally:
        for owner, attr, old in reversed(saved):
            if old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
