"""Command-line input shared by the validator's commands (validator/cli.py, validator/cli_scale.py): the
error bad input raises, and the parsing of the repeatable comma-separated options. Light on purpose:
`--help` and bad arguments answer before anything heavy is imported."""
from __future__ import annotations

from pathlib import Path

from validator.engines import DEFAULT_ENGINES, ENGINES


class UsageError(ValueError):
    """Bad command-line input; the message names it and the fix."""


def split_values(values, flag: str) -> list[str] | None:
    """Comma-separated values of a repeatable option; None when the option was not given, UsageError
    when it was given but names nothing (`--models ''` is a mistake, not "everything")."""
    if values is None:
        return None
    names = [v.strip() for item in values for v in item.split(",") if v.strip()]
    if not names:
        raise UsageError(f"{flag} names nothing (got {' '.join(repr(v) for v in values)}); give at least one "
                         f"name, or omit {flag} for the default.")
    return names


def parse_engines(values) -> tuple[str, ...]:
    """--engines as registry names (default: the default engines); an unknown name is refused with the closest."""
    from difflib import get_close_matches
    names = split_values(values, "--engines") or list(DEFAULT_ENGINES)
    for n in names:
        if n not in ENGINES:
            near = get_close_matches(n, list(ENGINES), n=1, cutoff=0.5)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise UsageError(f"unknown engine {n!r}.{hint} Engines: {', '.join(ENGINES)}.")
    return tuple(dict.fromkeys(names))


def rel(p: Path) -> str:
    """`p` relative to the working directory where it is inside it (what the console prints)."""
    try:
        return str(Path(p).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(p)
