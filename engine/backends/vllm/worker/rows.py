"""Which of our requests sits in which row of vLLM's persistent batch, learned through vLLM's public
logits-processor interface.

vLLM hands every logits processor a `BatchUpdate` before each forward: requests added at a batch
index (with their SamplingParams, where our plan key rides in `extra_args`), removed, or moved. The
flat tokens of a step are laid out in batch-index order, so this map plus the forward context's
`query_start_loc` says which rows of a step belong to which plan. The processor never changes the
logits. One model runner per worker process, so the map is a module global of that process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

EXTRA_KEY = "interp_plan"
PLAN_ARG = "interp_plan_wire"  # the plan itself (wire form), registered when the request is first scheduled
ROWS: dict[int, str] = {}  # persistent-batch index -> plan key (only requests that carry one)


def apply_update(rows: dict, update: BatchUpdate) -> None:
    """Apply one BatchUpdate in vLLM's documented order: removed, added, moved."""
    for i in update.removed:
        rows.pop(i, None)
    for i, params, _prompt, _out in update.added:
        key = (getattr(params, "extra_args", None) or {}).get(EXTRA_KEY) if params is not None else None
        if key is None:
            rows.pop(i, None)
        else:
            rows[i] = key
    for a, b, direction in update.moved:
        ka, kb = rows.pop(a, None), rows.pop(b, None)
        if ka is not None:
            rows[b] = ka
        if direction == MoveDirectionality.SWAP and kb is not None:
            rows[a] = kb


class RowMap(LogitsProcessor):
    """Tracks ROWS; argmax-invariant and the identity on logits."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        ROWS.clear()

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            apply_update(ROWS, batch_update)
