"""What a variant implements: load a model once, then hand out one Job per workload.

A Runner has one method per workload it supports, named after the workload; a workload without
a method is "n/a" with the reason from the variant's table entry (benchmarks/variants/__init__.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from benchmarks.spec import Params


class NotApplicable(Exception):
    """Raised by a Runner when the loaded model or backend cannot do a workload; the message is
    the cell's "n/a" reason."""


@dataclass
class Job:
    """`run` is timed; `check(last_output)` (untimed, after the repeats) returns
    {"passed": bool, "detail": str, ...}; `notes` say how this row ran differently from the
    workload's definition."""
    run: Callable[[], Any]
    check: Callable[[Any], dict] | None = None
    notes: list[str] = field(default_factory=list)


class Runner:
    def __init__(self, params: Params, variant):
        self.p = params
        self.variant = variant
        self.name = variant.name
        self.backend = variant.backend
        self.model_info: dict = {}

    def load(self) -> None:
        raise NotImplementedError

    def job(self, workload: str) -> Job:
        fn = getattr(self, workload, None)
        if fn is None:
            raise NotImplementedError(f"variant {self.name!r} has no {workload!r} workload")
        return fn()

    # helpers shared by runners --------------------------------------------------------------
    def middle_layer(self, n_layers: int) -> int:
        return n_layers // 2


def tokens_changed(steered, unsteered) -> dict:
    """The steer check: how many generated tokens differ (a no-op steer changes none)."""
    import torch
    a, b = torch.as_tensor(steered), torch.as_tensor(unsteered)
    if a.shape != b.shape:
        return {"passed": True, "detail": f"steered output shape {tuple(a.shape)} differs from "
                                          f"unsteered {tuple(b.shape)}", "changed_tokens": None}
    n = int((a != b).sum())
    return {"passed": n > 0, "changed_tokens": n, "total_tokens": int(a.numel()),
            "detail": f"{n} of {a.numel()} generated tokens differ from unsteered generation"
                      if n else "steered generation equals unsteered generation: the steer was a no-op"}


def generated_tokens(out, prompt_len: int) -> int | None:
    """How many new tokens a generation run produced, across its streams, from whatever the variant
    returned (engine results carry new_tokens; HF / TL / nnsight return prompt + new token ids);
    None when the output says nothing about it."""
    import torch
    if isinstance(out, tuple) and out:
        out = out[0]
    new = getattr(out, "new_tokens", None)
    if new is not None:
        return int(new.numel()) if torch.is_tensor(new) else sum(len(x) for x in new)
    seq = getattr(out, "sequences", out)
    if torch.is_tensor(seq) and seq.dim() == 2:
        return int(seq.shape[0] * (seq.shape[1] - prompt_len))
    return None
