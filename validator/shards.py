"""Shards for CI runners: `run --shard i/N` computes one part of the matrix, `merge DIR...` joins the parts.

A shard is a set of whole models (a model's cells share its loads), chosen by a pure function of the
selected models and their estimated task times (validator/schedule.py): the longest task first, each
to the shard with the least time so far (ties: the lower index, then the model's name), so every
runner computes the same split from the same checkout and the parts cover the selection exactly once.

`merge` checks before it writes anything: every directory holds cells; within each column every cell
ran on the same package versions; every cell ran the same validator and engine code (code digest); a
cell found in two directories has one inputs digest and the same content (timings aside). A mix is
refused by name (which package or digest, which directories); nothing is written then.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from validator import cells

VOLATILE = ("seconds", "engine_seconds")  # provenance fields that differ between two computations of one cell


class ShardError(ValueError):
    """A bad --shard spec, or directories that cannot be merged; the message names the problem."""


@dataclass(frozen=True)
class Shard:
    index: int  # 1..count
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse(text: str) -> Shard:
    """'i/N' (1 <= i <= N) -> Shard; anything else raises ShardError naming the spec."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m:
        raise ShardError(f"--shard {text!r}: expected i/N, shard i of N counted from 1 (e.g. 1/4).")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1:
        raise ShardError(f"--shard {text!r}: the shard count must be at least 1.")
    if not 1 <= i <= n:
        raise ShardError(f"--shard {text!r}: shard {i} does not exist; shards of {n} are 1/{n} .. {n}/{n} "
                         f"(counted from 1).")
    return Shard(i, n)


def split(costs: dict[str, float], count: int) -> list[list[str]]:
    """The models of `costs` (estimated seconds) in `count` parts, balanced by cost: longest first, each to the
    least loaded part (ties: lower index). Deterministic; each part in the input's order."""
    loads = [0.0] * count
    parts: list[set[str]] = [set() for _ in range(count)]
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        i = min(range(count), key=lambda j: (loads[j], j))
        parts[i].add(name)
        loads[i] += costs[name]
    return [[n for n in costs if n in p] for p in parts]


def select(names: list[str], costs: dict[str, float], shard: Shard) -> list[str]:
    """The models of `names` in `shard`."""
    return split({n: costs[n] for n in names}, shard.count)[shard.index - 1]


# -- merge ----------------------------------------------------------------------------------------------
def comparable(cell: dict) -> dict:
    """A cell without what differs between two computations of it (its timings)."""
    prov = {k: v for k, v in (cell.get("provenance") or {}).items() if k not in VOLATILE}
    return {**cell, "provenance": prov}


def _first_conflict(seen: dict, what: str, value, where: str) -> str:
    if what in seen and seen[what][0] != value:
        return f"{seen[what][1]} has {seen[what][0]}, {where} has {value}"
    seen.setdefault(what, (value, where))
    return ""


def check(dirs: list[Path]) -> dict[str, tuple[dict, Path]]:
    """{cell key: (cell, its directory)} of every cell in `dirs`, or ShardError naming the first mix."""
    if not dirs:
        raise ShardError("merge needs at least one directory of cells.")
    merged: dict[str, tuple[dict, Path]] = {}
    seen: dict = {}
    for d in dirs:
        if not cells.cell_dir(d).is_dir():
            raise ShardError(f"{d} holds no cells/ directory (give the --out directories of the shard runs).")
        found = cells.load_all(d)
        if not found:
            raise ShardError(f"{d}/cells holds no cells.")
        for c in found:
            name = cells.key_of(c)
            prov = c.get("provenance") or {}
            where = f"{d} ({name})"
            for pkg, ver in sorted((prov.get("versions") or {}).items()):
                bad = _first_conflict(seen, ("version", c["engine"], pkg), ver, where)
                if bad:
                    raise ShardError(f"mixed versions of {pkg} in column {c['engine']}: {bad}. Merge runs of one "
                                     f"environment only.")
            if "code_digest" in prov:
                bad = _first_conflict(seen, ("code",), prov["code_digest"], where)
                if bad:
                    raise ShardError(f"mixed code digests: {bad}. The shards ran different validator or engine "
                                     f"code; rerun them from one commit.")
            if name in merged:
                other, od = merged[name]
                if other.get("inputs_digest") != c.get("inputs_digest"):
                    raise ShardError(f"mixed inputs digests for cell {name}: {od} has {other.get('inputs_digest')}, "
                                     f"{d} has {c.get('inputs_digest')}.")
                if comparable(other) != comparable(c):
                    raise ShardError(f"cell {name} is in {od} and {d} with different results; the shards "
                                     f"overlapped and disagree. Keep one of them.")
                continue
            merged[name] = (c, d)
    return merged


def merge(dirs: list[Path], out: Path) -> list[Path]:
    """Every cell of `dirs` written into `out` (after `check`); returns the paths written (the reports are
    the caller's: render them from `out`)."""
    merged = check([Path(d) for d in dirs])
    written = []
    for c, _ in merged.values():
        path = cells.cell_path(out, c["model"], c["engine"], c.get("variant_tag", ""))
        if cells.read(path) != c:
            cells.write(path, c)
        written.append(path)
    return written
