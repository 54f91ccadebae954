"""The order of one round: every cell once, arranged so the two sides of a ratio run close in time.

Cells are grouped by the plain workload they are priced against (decode with capture-during-
generation and the steers; prefill with the captures and the lens; the 8-stream pair; the long-prompt
pair), so every ratio the sweep reports compares cells of one group. Inside a group each variant runs
its workloads back to back (a capture cost compares neighbours), and the variants follow one another
(a peer comparison is a few samples apart). Both orders rotate by one place per round, so over any
len(variants) rounds every variant takes every position equally often: whatever the machine does to
the first (or last) sample of a group lands on each variant alike.

It does not land alike on one variant's workloads, though: whichever of them runs first after another
variant's cells pays for the process having sat idle (measured on this 2-core VM, 2026-12-07: 10-50% slower
than the same cell run after one of its own, 0-10% in the sweep of a few hours before; this VM's DAMON pages
out memory left untouched for 60 s). With the workloads rotated, a capture against its prefill was then
biased one way in even rounds and the other way in odd ones. So a cell that `switches_in` is preceded by one
untimed run of itself (the worker's `lead_in`), and every timed sample follows a run of its own process."""
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


def switches_in(order: list[tuple[str, str]], pos: int) -> bool:
    """Whether the cell at `pos` of a round's order is the first of its variant's run of cells (the round's
    first, or after another variant's): its sample is then preceded by an untimed run (module docstring)."""
    return pos == 0 or order[pos - 1][0] != order[pos][0]
