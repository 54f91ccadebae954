"""The order of one round: every cell once, arranged so the two sides of a ratio run close in time.

Cells are grouped by the plain workload they are priced against (decode with capture-during-
generation and the steers; prefill with the captures and the lens; the 8-stream pair; the long-prompt
pair), so every ratio the sweep reports compares cells of one group. Inside a group each variant runs
its workloads back to back (a capture cost compares neighbours), and the variants follow one another
(a peer comparison is a few samples apart). Both orders rotate by one place per round, so over any
len(variants) rounds every variant takes every position equally often: whatever the machine does to
the first (or last) sample of a group lands on each variant alike."""
from __future__ import annotations


def rotated(items: list, round_index: int) -> list:
    """`items` rotated left by `round_index` places."""
    if not items:
        return []
    k = round_index % len(items)
    return list(items[k:]) + list(items[:k])


def groups(cells: list[tuple[str, str]], baseline_of) -> dict[str, dict[str, list[str]]]:
    """{baseline workload: {variant: [workloads]}}, each level in the order of `cells`."""
    out: dict[str, dict[str, list[str]]] = {}
    for v, w in cells:
        out.setdefault(baseline_of(w), {}).setdefault(v, []).append(w)
    return out


def schedule(cells: list[tuple[str, str]], round_index: int, baseline_of) -> list[tuple[str, str]]:
    """(variant, workload) in the order round `round_index` runs them (see the module docstring)."""
    order = []
    for by_variant in groups(cells, baseline_of).values():
        for v in rotated(list(by_variant), round_index):
            order += [(v, w) for w in rotated(by_variant[v], round_index)]
    return order
