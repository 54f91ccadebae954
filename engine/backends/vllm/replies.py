"""What a vLLM request's workers send back, made into the engine's results.

Every rank answers a collect with a CollectReply (or a peek with a PeekReply), declared and encoded in
engine/backends/vllm/worker/wire.py: its captures {address: (first position, rows)}, the indices it holds
of sharded points, readouts, logits, receipts, and the request's Failure when it failed there (raised
here as the class the worker raised). These functions turn those replies into one RequestResult per request (a
sharded point's heads or neurons put in place, attention patterns recomputed from q and k) and a
call's requests into one left-padded GenerationResult. Nothing here talks to vLLM; the client
(engine/backends/vllm/client.py) calls them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.backends.vllm.worker import attn as vllm_attn
from engine.backends.vllm.worker import wire as vllm_wire
from engine.core.address import Address, parse
from engine.core.errors import EngineError
from engine.core.plan import Plan
from engine.core.readouts import Readout, as_value
from engine.core.results import (
    ActivationCache,
    GenerationResult,
    RequestResult,
    Sequences,
    batch_cache,
    columns,
    combine,
    pad_rows,
)

if TYPE_CHECKING:
    from engine.backends.vllm.catalogue import VLLMCatalogue

def gather(catalogue: VLLMCatalogue, key: str,
           ranks: list[vllm_wire.CollectReply] | list[vllm_wire.PeekReply]) -> torch.Tensor:
    """One capture from every rank's part (CollectReply or PeekReply): a sharded point's heads / neurons
    put in place."""
    parts = [(r.captures[key][0], vllm_wire.tensor_in(r.captures[key][1])) for r in ranks if key in r.captures]
    errors = [r.errors[key] for r in ranks if key in r.errors]
    if errors:
        raise errors[0].exception()
    if not parts:
        raise RuntimeError(f"{key} was never computed for this request.")
    addr = parse(key)
    info = catalogue.info(addr.base)
    if len(parts) == 1 or not info.get("sharded") or addr.coords:
        return parts[0][1]
    held = [r for r in ranks if key in r.captures]
    full = torch.zeros(parts[0][1].shape[0], *info["shape"], dtype=parts[0][1].dtype)
    for (_, t), r in zip(parts, held):
        full[:, torch.tensor(r.held[key])] = t
    return full


def readout_value(r: Readout, ranks: list[vllm_wire.CollectReply] | None) -> Any:
    """One readout's result from the rank that computed it (rank 0)."""
    for rank in ranks or []:
        if r.name in rank.errors:
            raise rank.errors[r.name].exception()
        if rank.readouts is not None and r.name in rank.readouts:
            return as_value(r.kind, tuple(vllm_wire.decode(rank.readouts[r.name])))
    raise RuntimeError(f"readout {r.name!r} was never computed for this request.")


def _raise_failure(ranks: list[vllm_wire.CollectReply]) -> None:
    """Raise the request's failure in a worker, if any, as the class the worker raised (its own input's
    fault: a steer, a readout; or the engine's: EngineFailure), saying that other requests are unaffected."""
    lost = [r.lost for r in ranks if r.lost is not None]
    if lost:
        raise EngineError(f"a worker lost this request's plan: {lost[0]}")
    failed = [r.failed for r in ranks if r.failed is not None]
    if failed:
        raise failed[0].exception(" (this request alone failed inside the vLLM worker; other requests and the "
                                  "engine are unaffected)")


def rekey(captures: dict, keys: dict) -> dict:
    """`captures` ({capture key: tensor}) under the keys they were asked for (keys: {capture key: the keys
    asked}, where they differ), in place; returned."""
    for k, asked in keys.items():
        if dict.__contains__(captures, k):
            t = dict.pop(captures, k)
            for a in asked:
                dict.__setitem__(captures, a, t)
    return captures


def request_result(plan: Plan, prompt: list[int], derived: tuple[Address, ...], out: Any,
                   ranks: list[vllm_wire.CollectReply] | None, want_logits: bool, prefill: bool, *, catalogue: VLLMCatalogue,
                   n_layers: int, tokenizer: Any, keys: dict | None = None) -> RequestResult:
    """One request's result from vLLM's final output `out` and its ranks' collect replies (None: it
    ran no plan). derived: attention patterns recomputed here from the captured q and k; prefill: logits
    at every prompt position, else those each new token was chosen from."""
    if out is None:
        raise EngineError("vLLM returned no output for a request (aborted?).")
    if ranks:
        _raise_failure(ranks)
    new = torch.tensor(list(out.outputs[0].token_ids), dtype=torch.long)
    cache = ActivationCache(n_layers)
    for addr in plan.captures:
        cache[str(addr)] = gather(catalogue, str(addr), ranks or [])
    for addr in derived:
        layer = addr.layer
        assert layer is not None  # attention patterns are per layer
        q, k = gather(catalogue, f"q.{layer}", ranks or []), gather(catalogue, f"k.{layer}", ranks or [])
        t = vllm_attn.scores(q, k, catalogue.attn[layer])
        t = vllm_attn.probs(t) if addr.point == "attn_probs" else t
        cache[str(addr)] = t[:, addr.coords[0][1]] if addr.coords else t
    rekey(cache, keys or {})
    for r in plan.readouts:
        cache.put_readout(r.name, readout_value(r, ranks), r.kind.per_position)
    logits = None
    if want_logits and ranks and ranks[0].logits is not None:
        logits = vllm_wire.tensor_in(ranks[0].logits)  # rows from position ranks[0].logits_from
        if not prefill:  # the scores each new token was chosen from: the last prompt position on
            start = plan.prompt_len - 1 - (ranks[0].logits_from or 0)
            logits = logits[start:start + len(new)]
    text = tokenizer.decode(new.tolist(), skip_special_tokens=True)
    return RequestResult(torch.tensor(prompt, dtype=torch.long), new, text, cache, logits,
                         int(getattr(out, "num_cached_tokens", 0) or 0),
                         max([r.recomputed for r in ranks or []], default=0),
                         vllm_wire.receipts_in(plan, ranks))


def batch_result(res: list[RequestResult], pad: int, n_layers: int) -> GenerationResult:
    """A call's requests as one generation: tokens, masks and captures padded on the left (as eager's),
    new tokens and logits on the right, with `pad` where a row is shorter."""
    seqs = Sequences.of(res, pad)
    receipts = combine([r.receipts for r in res])
    cache = batch_cache([r.cache for r in res], seqs.seen, seqs.width - 1, n_layers, receipts)  # as eager's
    got = [r.logits for r in res if r.logits is not None]
    logits = None
    if len(got) == len(res):  # every request kept its logits
        logits = pad_rows(got, columns([t.shape[0] for t in got], seqs.n_new, "right"), seqs.n_new)
    return GenerationResult(seqs.tokens, seqs.new, [r.text for r in res], cache, logits, seqs.mask, res, receipts)
