"""The order of one round: every variant of a workload runs once, in an order rotated per round.

Rotation puts every variant in every position equally often over any run of len(variants) rounds,
so whatever the machine does to the first (or last) run of a block lands on each variant alike,
and a variant's samples are never clustered at one end of the sweep."""
from __future__ import annotations


def rotated(variants: list[str], round_index: int) -> list[str]:
    """`variants` rotated left by `round_index` places."""
    if not variants:
        return []
    k = round_index % len(variants)
    return list(variants[k:]) + list(variants[:k])


def schedule(blocks: dict[str, list[str]], round_index: int) -> list[tuple[str, str]]:
    """(variant, workload) in the order round `round_index` runs them: workload blocks in the table's
    order, each block's variants rotated by the round index."""
    return [(v, w) for w, vs in blocks.items() for v in rotated(vs, round_index)]
