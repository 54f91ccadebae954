"""Zoo names: one exact name, case-insensitively, or a glob; unknown names raise naming the closest
entries. Below build.py (which resolves names) and the package (which re-exports these).

Short names: the hub moved its first, org-less models into organisations (`gpt2` is now
`openai-community/gpt2`, `distilgpt2` `distilbert/distilgpt2`) and redirects the old ids; a bare name
that is such a model's name resolves here as the hub's redirect does (:func:`hub_id`)."""
from __future__ import annotations

import difflib
import fnmatch

from .entries import ZOO

_GLOB_CHARS = set("*?[")
# the organisations the hub moved its org-less models into (2024), whose old bare ids it redirects
LEGACY_ORGS = ("openai-community", "distilbert", "google-bert", "FacebookAI", "google-t5", "openai-gpt")


def hub_id(name: str) -> str:
    """The repo id the hub redirects a bare legacy id to (`gpt2` -> `openai-community/gpt2`) when the zoo
    has it; any other name unchanged."""
    if not isinstance(name, str) or "/" in name:
        return name
    bare = name.strip().lower()
    hits = [n for n in ZOO if n.split("/", 1)[0] in LEGACY_ORGS and n.split("/", 1)[1].lower() == bare]
    return hits[0] if len(hits) == 1 else name


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
    # case-insensitive exact match is accepted (hub repo ids are case-insensitive), and a bare legacy id
    # as the hub redirects it
    for n in ZOO:
        if n.lower() == pattern.lower() or n == hub_id(pattern):
            return [n]
    raise ValueError(
        f"unknown zoo model {pattern!r}; did you mean: {', '.join(_closest(pattern))}? "
        f"`python -m engine.zoo list` prints all {len(ZOO)}."
    )
