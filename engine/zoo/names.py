"""Zoo names: one exact name, case-insensitively, or a glob; unknown names raise naming the closest
entries. Below build.py (which resolves names) and the package (which re-exports these)."""
from __future__ import annotations

import difflib
import fnmatch

from .entries import ZOO

_GLOB_CHARS = set("*?[")


def canonical_name(name: str) -> str:
    """The zoo's spelling of one model name (repo ids match case-insensitively); ValueError otherwise."""
    if name in ZOO:
        return name
    if isinstance(name, str) and (_GLOB_CHARS & set(name) or name.strip() in ("all", "*")):
        raise ValueError(f"expected one zoo model name, got the pattern {name!r}; use resolve() for globs")
    hits = resolve(name)  # raises ValueError naming the closest entries
    return hits[0]


def _closest(name: str, n: int = 3) -> list[str]:
    names = list(ZOO)
    lowered = {k.lower(): k for k in names}
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.4)
    # also match on the part after the org ("gemma-2-2b" -> "google/gemma-2-2b")
    base = {k.split("/", 1)[-1].lower(): k for k in names}
    for h in difflib.get_close_matches(name.lower().split("/", 1)[-1], list(base), n=n, cutoff=0.4):
        if base[h].lower() not in hits:
            hits.append(base[h].lower())
    out = [lowered[h] for h in hits]
    if not out:
        out = [lowered[h] for h in difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.0)]
    return out[:n]


def resolve(pattern: str) -> list[str]:
    """Zoo names matching ``pattern``: an exact name, or an fnmatch glob (``"Qwen/*"``, ``"*gemma-2*"``).

    An exact name that is not in the zoo, or a glob that matches nothing, raises ``ValueError`` naming
    the closest entries. ``"all"`` or ``"*"`` gives every entry.
    """
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"zoo name must be a non-empty string, got {pattern!r}")
    pattern = pattern.strip()
    if pattern in ZOO:
        return [pattern]
    if pattern in ("all", "*"):
        return list(ZOO)
    if _GLOB_CHARS & set(pattern):
        hits = [n for n in ZOO if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            hits = [n for n in ZOO if fnmatch.fnmatchcase(n.lower(), pattern.lower())]
        if hits:
            return hits
        raise ValueError(
            f"zoo pattern {pattern!r} matches no entry; closest names: {', '.join(_closest(pattern))}. "
            f"`python -m engine.zoo list` prints all {len(ZOO)}."
        )
    # case-insensitive exact match is accepted (hub repo ids are case-insensitive)
    for n in ZOO:
        if n.lower() == pattern.lower():
            return [n]
    raise ValueError(
        f"unknown zoo model {pattern!r}; did you mean: {', '.join(_closest(pattern))}? "
        f"`python -m engine.zoo list` prints all {len(ZOO)}."
    )
