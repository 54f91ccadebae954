"""What a decode step costs outside the model: HF's generate against a bare greedy loop, and the engine's
generate beside them, on one sequence of a zoo twin, in interleaved rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_overhead.py [--model meta-llama/Llama-3.2-1B] [--size tiny]
        [--prompt 32] [--new-tokens 16] [--rounds 9] [--reps 5]

The bare loop calls the model's forward once per token with a DynamicCache and takes the argmax: no
logits processors, no stopping criteria, no per-step read of whether to stop. It is what an engine-owned
decode loop could cost at best, and only for the plain case (one unpadded sequence, greedy, a family whose
forward makes its own cache): the script refuses to time it unless its tokens equal HF's. Each round times
every arm `--reps` times (the median is the round's figure), in an order that alternates by round; the
table gives milliseconds per generated token and the ratios to HF's generate, each a median over rounds
with its 95% distribution-free interval (benchmarks/ci.py), "unresolved" when wider than 25% of it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

from benchmarks.ci import median_ci, ratio_shown
from benchmarks.stats import fmt_interval


def _arms(model_name: str, prompt: int, new: int) -> dict[str, Callable[[], torch.Tensor]]:
    from transformers import DynamicCache

    from engine import load_model
    m = load_model(model_name, source="zoo")
    hf = m.hf
    ids = torch.randint(3, min(200, hf.config.vocab_size), (1, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def hf_generate() -> torch.Tensor:
        return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=m.tokenizer.pad_token_id)

    @torch.no_grad()
    def bare_loop() -> torch.Tensor:
        cache = DynamicCache(config=hf.config)
        logits = hf(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        tokens, seen = [], mask
        for _ in range(new):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            tokens.append(nxt)
            if len(tokens) == new:
                break
            seen = torch.cat([seen, torch.ones_like(nxt)], dim=1)
            logits = hf(input_ids=nxt, attention_mask=seen, past_key_values=cache, use_cache=True).logits
        return torch.cat([ids, *tokens], dim=1)

    def engine_generate() -> torch.Tensor:
        return m.generate({"input_ids": ids, "attention_mask": mask}, new).tokens

    want = hf_generate()
    for name, arm in (("bare loop", bare_loop), ("engine generate", engine_generate)):
        got = arm()
        if not torch.equal(got.to(want.device), want):
            sys.exit(f"decode_overhead: the {name}'s tokens differ from HF's generate on {model_name}; nothing timed.")
    return {"HF generate": hf_generate, "bare loop": bare_loop, "engine generate": engine_generate}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--size", default="tiny", choices=["tiny", "real"])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    if a.new_tokens < 2 or a.rounds < 6 or a.reps < 1:
        ap.error("--new-tokens must be at least 2, --rounds at least 6 (a 95% interval needs them), --reps at least 1")
    os.environ["INTERP_ZOO_SIZE"] = a.size
    torch.set_num_threads(1)
    arms = _arms(a.model, a.prompt, a.new_tokens)
    names = list(arms)
    per_token: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            arms[name]()  # warm
            times = []
            for _ in range(a.reps):
                t = time.perf_counter()
                arms[name]()
                times.append(time.perf_counter() - t)
            per_token[name].append(statistics.median(times) / a.new_tokens * 1e3)
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{n} {per_token[n][-1]:.3f} ms" for n in names), flush=True)
    print(f"\n{a.model} ({a.size}), one sequence, {a.prompt}-token prompt, {a.new_tokens} new tokens, greedy, "
          f"{a.rounds} rounds x {a.reps} reps, 1 torch thread\n")
    print("| arm | ms per token | / HF generate |\n|---|---:|---:|")
    for n in names:
        ms = median_ci(per_token[n])
        ratio = ratio_shown(median_ci([x / h for x, h in zip(per_token[n], per_token["HF generate"])]))
        print(f"| {n} | {fmt_interval(ms.median, ms.lo, ms.hi)} | {ratio if n != 'HF generate' else '1'} |")


if __name__ == "__main__":
    main()
