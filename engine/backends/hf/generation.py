"""Generation on the eager backend: a call checked whole before anything runs (`prepare`: its inputs,
sampling knobs, steers and readouts become plans), then HF generate with the plans' sites attached
(`run`), its results cut per sequence. generate, generate_batch and stream (engine/backends/hf/stream.py,
which prepares in the caller's thread and runs on its own) all go through these two."""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.backends.hf.grid import Call, decode_layouts, padded, pattern_rows, prefill_layout
from engine.core.inputs import new_tokens
from engine.core.plan import Plan
from engine.core.results import (
    PATTERNS,
    ActivationCache,
    GenerationResult,
    RequestResult,
    batch_readouts,
    check_strict,
    combine,
    scatter,
)
from engine.families import limits as family_limits
from engine.model.api import unserved
from engine.model.batch import Progress, requests_of
from engine.model.sampling import Sampling

# `m` below is the EagerModel: typed Any because engine/backends/hf/eager.py imports this module and an
# import back, even for type checking only, would be a cycle (tests/test_imports.py)
_HEADS = ("lm_head", "lm_head_raw")  # read at the last prompt token and each new one while generating


@dataclass
class Prepared:
    """One generation call, checked: its padded batch, sampling knobs and one plan per row."""
    batch: Any  # engine.backends.hf.eager.Batch
    knobs: Sampling
    plans: list[Plan]
    max_new_tokens: int


def prepare(m: Any, inputs: Any, max_new_tokens: Any, points: Any, steer: Any, sampling: dict,
            readouts: Any = (), strict: bool = False, internal: Any = ()) -> Prepared:
    """Everything a generation checks, before anything runs (in the caller's thread and context: the
    steers of its steering() blocks are bound here). `internal`: addresses read for the engine itself
    (a stream's logits), from the last prompt token."""
    m._live()
    n_new = new_tokens(max_new_tokens)
    knobs = Sampling.parse(sampling, "eager")
    batch = m._inputs(inputs, n_new)
    family_limits.check(m.config.model_type, "eager", "generate", batch=batch.mask.shape[0])
    if not batch.mask[:, -1].all():
        raise ValueError("generate needs left padding (pad on the left so every row ends in a real "
                         "token); use model.to_tokens(texts, padding_side='left').")
    plans = m._plans(batch, points, steer, n_new, readouts, strict)
    for p in plans:
        for a in internal:
            p.internal.append(a)
            p.start_at.setdefault(str(a), p.prompt_len - 1)
    return Prepared(batch, knobs, plans, n_new)


def run(m: Any, prep: Prepared, streamer: Any = None, stopping: Any = None, on_plans: Any = None,
        strict: bool = False) -> GenerationResult:
    """HF generate over a prepared call, the plans' sites attached for its forwards only."""
    batch, knobs, plans, n_max = prep.batch, prep.knobs, prep.plans, prep.max_new_tokens
    mask = batch.mask
    lengths = mask.sum(1).tolist()
    with contextlib.closing(Call(m.device)) as call:  # its chunks and steps go when the result is built
        if on_plans is not None:
            on_plans(plans, call)
        layouts = itertools.chain([prefill_layout(plans, mask, call)], decode_layouts(plans, mask, n_max, call))
        # a seed is the call's own: torch's global generator gets its state back afterwards
        forked = contextlib.nullcontext() if knobs.seed is None else torch.random.fork_rng(
            devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else [])
        with m._lock, torch.no_grad(), m._attached(plans, layouts), forked:
            if knobs.seed is not None:
                torch.manual_seed(knobs.seed)
            # PreTrainedModel declares no generate: the CausalLM classes mix GenerationMixin in
            out = m.hf.generate(**batch.enc, max_new_tokens=n_max,  # type: ignore[operator]
                                **knobs.hf(), min_new_tokens=n_max, output_logits=True,
                                return_dict_in_generate=True, streamer=streamer, stopping_criteria=stopping,
                                pad_token_id=m.tokenizer.pad_token_id)
        outcomes = m._outcomes(plans, call)
        seq = out.sequences
        seq_host = seq.cpu()  # the tokens' one copy to the host: the text and each request's tokens
        n_new = seq.shape[1] - mask.shape[1]
        new, new_host = seq[:, mask.shape[1]:], seq_host[:, mask.shape[1]:]
        logits = torch.stack(out.logits, dim=1) if out.logits else None
        text = m.tokenizer.batch_decode(new_host, skip_special_tokens=True)
        width = seq.shape[1] - 1
        full = np.concatenate([mask, np.ones((mask.shape[0], n_new), dtype=bool)], axis=1)
        real = torch.from_numpy(full[:, :width]).to(m.device)
        cols = [torch.from_numpy(np.flatnonzero(row)) for row in full[:, :width]]
        cache = ActivationCache(m.n_layers, cols)
        own: list[dict] = [{} for _ in plans]  # each sequence's own [len + new - 1, ...] rows
        for addr in plans[0].captures:
            key = str(addr)
            if key in _HEADS:  # [b, new, vocab], like the logits: the last prompt column, then each step's
                chunks = [c for _, c in call.store[key]]
                cache[key] = torch.cat([chunks[0][:, -1:], *chunks[1:]], dim=1)
                for r, o in enumerate(own):
                    o[key] = cache[key][r]
            elif key.split(".")[0] in PATTERNS:
                pattern_rows(call, key, m._compress_rate(key))
                for o, p in zip(own, plans):
                    o[key] = p.tensor(key)
                cache[key] = scatter(key, [o[key] for o in own], cols, width)
            else:
                cache[key] = padded(call.grid(key), real)
                for r, (o, n) in enumerate(zip(own, lengths)):
                    o[key] = cache[key][r, width - (n + n_new - 1):]
        caches = []
        for o, p in zip(own, plans):
            c = m._readouts(p)
            c.update(o)
            caches.append(c)
        batch_readouts(cache, caches, cols, width)
        reqs = [RequestResult(seq_host[r, -(n + n_new):-n_new], new_host[r], text[r], caches[r],
                              None if logits is None else logits[r], receipts=p.receipts(outcomes.get(p.key)))
                for r, (n, p) in enumerate(zip(lengths, plans))]
        receipts = combine([r.receipts for r in reqs])
        cache.receipts = receipts
        if strict:
            check_strict(receipts, "generation")
        return GenerationResult(seq, new, text, cache, logits, torch.from_numpy(full).long(), reqs, receipts)


def without_logits(out: GenerationResult) -> GenerationResult:
    """return_logits=False: the result without its logits (the call's and each sequence's)."""
    out.logits = None
    for r in out.requests:
        r.logits = None
    return out


def generate_batch(m: Any, requests: Any, return_logits: bool, progress: bool, strict: bool,
                   sink: str | None) -> list[RequestResult]:
    """Each request as its own generation, one after another; every request is checked before the first
    runs."""
    m._live()
    if sink is not None:
        raise unserved(m.backend, "sink= (the vLLM workers' shared-memory hand-off of captured rows)",
                       "leave it unset: the results come back in memory")
    prepared = [prepare(m, r.prompt, r.max_new_tokens, r.points, r.steer, r.sampling, r.readouts, strict)
                for r in requests_of(requests)]
    out = []
    with Progress(len(prepared), progress) as bar:
        for prep in prepared:
            (res,) = run(m, prep).requests
            if not return_logits:
                res.logits = None
            if strict:
                check_strict(res.receipts, "request")
            out.append(res)
            bar.tick()
    return out
