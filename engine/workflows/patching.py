"""Activation patching, the classic experiment, as one call on any backend that serves `set`.

    res = patch_sweep(model, clean, corrupted, "resid_pre", logit_diff(model, " Paris", " Rome"))
    res.values          # [n_addresses, n_positions]: the metric with that one activation patched
    res.normalized()    # 0 = corrupted run, 1 = clean run
    res.plot()          # a heatmap (matplotlib)

For each address (a bare layer point means every layer that has it) and each position, the
corrupted prompt runs with that one activation replaced by the clean run's (a `set` steer whose
value is the clean capture `[pos, ...]`, aligned by position, and whose [batch, pos] mask selects
one (position) per batch row). Rows of one forward each patch something different, so a sweep of
L addresses x P positions costs ceil(L*P / batch_size) forwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.core.errors import InputError
from engine.core.inputs import limits_of, token_rows
from engine.core.integers import as_int
from engine.core.steering import Steer


@dataclass
class PatchResult:
    values: torch.Tensor  # [n_addresses, n_positions]
    addresses: list[str]
    positions: list[int]  # [-1] when every position was patched at once
    clean: float  # the metric on the clean run
    corrupted: float  # ... and on the corrupted run
    tokens: list[str]  # the corrupted prompt's tokens, for labels

    def normalized(self) -> torch.Tensor:
        """(value - corrupted) / (clean - corrupted): 1 where the patch restores the clean metric."""
        span = self.clean - self.corrupted
        if span == 0:
            raise ValueError("the metric is the same on the clean and corrupted runs; nothing to normalize by.")
        return (self.values - self.corrupted) / span

    def plot(self, ax: Any = None, normalized: bool = True, title: str | None = None) -> Any:
        """A heatmap of the sweep (addresses x positions); returns the matplotlib Axes."""
        import matplotlib.pyplot as plt
        data = (self.normalized() if normalized else self.values).float().numpy()
        if ax is None:
            _, ax = plt.subplots(figsize=(1 + 0.5 * data.shape[1], 1 + 0.3 * data.shape[0]))
        im = ax.imshow(data, cmap="RdBu_r", aspect="auto", vmin=-1 if normalized else None,
                       vmax=1 if normalized else None)
        ax.set_yticks(range(len(self.addresses)), self.addresses)
        labels = [self.tokens[p] for p in self.positions] if self.positions != [-1] else ["all"]
        ax.set_xticks(range(len(labels)), [f"{p}:{t!r}" for p, t in zip(self.positions, labels)], rotation=90)
        ax.set_title(title or ("patched metric (normalized)" if normalized else "patched metric"))
        ax.figure.colorbar(im, ax=ax)
        return ax


def logit_diff(model: Any, answer: int | str, wrong: int | str, position: int = -1) -> Callable:
    """Metric: logit of `answer` minus logit of `wrong` at `position` (token ids or single-token texts)."""
    a, b = _token_id(model, answer), _token_id(model, wrong)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, position, a] - logits[:, position, b]
    return metric


def _token_id(model, t) -> int:
    if (i := as_int(t)) is not None:
        return i
    ids = model.tokenizer(t, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise InputError(f"{t!r} is {len(ids)} tokens for this tokenizer ({ids}); a logit difference needs one "
                         f"token each: pass a token id.")
    return ids[0]


def _one_prompt(model, prompt, what: str) -> list[int]:
    rows = token_rows(prompt, model.tokenizer, limits_of(model))
    if len(rows) != 1:
        raise InputError(f"patch_sweep takes one {what} prompt, got {len(rows)}.")
    return rows[0]


def patch_sweep(model: Any, clean: Any, corrupted: Any, points: Any = "resid_pre", metric: Callable | None = None,
                positions: Any = "each", batch_size: int = 32) -> PatchResult:
    """Patch each clean activation into the corrupted run, one (address, position) per batch row.

    points: a layer point name (every layer that has it) or a list of addresses (`z.3.head-1`...).
    metric(logits [batch, pos, vocab]) -> [batch]; default: the logit of the clean run's top token
    at the last position. positions: "each" (every position), a list of positions, or "all" (every
    position patched at once, one column). Clean and corrupted must have the same number of tokens.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    c_ids, x_ids = _one_prompt(model, clean, "clean"), _one_prompt(model, corrupted, "corrupted")
    if len(c_ids) != len(x_ids):
        raise InputError(f"clean and corrupted prompts must have the same number of tokens to patch position by "
                         f"position: clean has {len(c_ids)}, corrupted {len(x_ids)}.")
    n = len(x_ids)
    addrs = [str(a) for a in model.expand(points)]
    clean_logits, cache = model.run_with_cache(torch.tensor([c_ids]), addrs)
    x_logits = model.run_with_cache(torch.tensor([x_ids]))[0]
    if metric is None:
        top = int(clean_logits[0, -1].argmax())
        metric = lambda logits: logits[:, -1, top]  # noqa: E731
    if positions == "each":
        cols = list(range(n))
    elif positions == "all":
        cols = [-1]
    else:
        cols = [p + n if p < 0 else p for p in positions]
        bad = [p for p in cols if not 0 <= p < n]
        if bad:
            raise InputError(f"patch positions {bad} are outside the {n}-token prompt.")
    jobs = [(a, p) for a in addrs for p in cols]
    clean_rows = {a: cache.entry(a).rows[0] for a in addrs}  # [pos, ...] per address
    out = []
    for i in range(0, len(jobs), batch_size):
        chunk = jobs[i:i + batch_size]
        steers = []
        for a in dict.fromkeys(a for a, _ in chunk):
            mask = torch.zeros(len(chunk), n, dtype=torch.bool)
            for r, (b, p) in enumerate(chunk):
                if b == a:
                    mask[r, slice(None) if p == -1 else p] = True
            steers.append(Steer(a, "set", clean_rows[a], positions=mask))
        logits = model.run_with_cache(torch.tensor([x_ids] * len(chunk)), (), steers)[0]
        vals = torch.as_tensor(metric(logits)).reshape(-1)
        if vals.shape[0] != len(chunk):
            raise ValueError(f"metric must return one value per batch row ([batch]); got shape {tuple(vals.shape)} "
                             f"for {len(chunk)} rows.")
        out.append(vals.detach().float().cpu())
    values = torch.cat(out).reshape(len(addrs), len(cols))
    toks = [model.tokenizer.decode([t]) for t in x_ids] if model.tokenizer is not None else [str(t) for t in x_ids]
    return PatchResult(values, addrs, cols, float(metric(clean_logits)[0]), float(metric(x_logits)[0]), toks)
