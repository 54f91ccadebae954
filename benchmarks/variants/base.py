"""What a variant implements: load a model once, then hand out one Job per workload.

The workload table (benchmarks/workloads.py) says what each workload runs (`Workload.runs`: generate,
forward, capture, capture_gen, steer or lens) and on which prompt (batch, long); a Runner implements
those few kinds, each taking the workload and its prompt ids. A workload a variant cannot do is "n/a"
with the reason from the variant's table entry (benchmarks/variants/__init__.py).
Every job's check (run on the last timed output) proves what the figure claims: a capture returned
every layer and every row, a steer changed the generated tokens; the worker also counts the tokens
a generation produced.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from benchmarks.spec import Params, prompt_ids
from benchmarks.workloads import WORKLOADS, Workload
from benchmarks.workloads import get as get_workload


class NotApplicable(Exception):
    """Raised by a Runner when the loaded model or backend cannot do a workload; the message is
    the cell's "n/a" reason."""


@dataclass
class Job:
    """`run` is timed; `check(last_output)` (untimed, after the rounds) returns
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
        # the prompts load() tokenizes (`tokenize`), by (batch, long): every shape the workload table uses
        self.ids: dict[tuple[int, bool], Any] = {}

    def load(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Free what load() holds (vLLM engines); the worker calls it before exiting."""

    def job(self, workload: str) -> Job:
        """The Job for `workload`: the Runner's method named by the workload's `runs` (generate, forward,
        capture, capture_gen, steer, lens; each takes the workload and its prompt ids), on its prompt."""
        wl = get_workload(workload)
        build = getattr(self, wl.runs, None)
        if build is None:
            return self.cannot(wl)
        return build(wl, self.prompt(wl))

    def cannot(self, wl: Workload) -> Job:
        """What a variant answers for a workload it cannot build."""
        raise NotImplementedError(f"variant {self.name!r} has no {wl.name!r} workload")

    def tokenize(self, tokenizer) -> None:
        """The prompt ids of every (batch, long) shape in the workload table, on the sweep's device, built
        the same way for every variant (benchmarks/spec.py prompt_ids)."""
        for wl in WORKLOADS:
            if (wl.batch, wl.long) not in self.ids:
                self.ids[(wl.batch, wl.long)] = prompt_ids(tokenizer, wl.prompt_len(self.p), wl.batch).to(self.p.device)

    def prompt(self, wl: Workload) -> Any:
        """The prompt ids `wl` runs on: its batch of prompts, each of its length (the long one or not)."""
        ids = self.ids.get((wl.batch, wl.long))
        return self.cannot(wl) if ids is None else ids

    # helpers shared by runners --------------------------------------------------------------
    def middle_layer(self, n_layers: int) -> int:
        return n_layers // 2

    def capture_layers(self, wl: Workload, n_layers: int) -> list[int]:
        return [self.middle_layer(n_layers)] if wl.captures == 1 else list(range(n_layers))

    def steer_layers(self, workload: str, n_layers: int) -> list[int]:
        return list(range(n_layers)) if get_workload(workload).steers == -1 else [self.middle_layer(n_layers)]

    def capture_check(self, workload: str, n_layers: int, shapes: list, d: int | None = None) -> Callable:
        """A check that `shapes(last_output)` holds every layer the workload captures, each with the
        workload's batch and rows (and width `d` when given)."""
        wl = get_workload(workload)
        layers = n_layers if wl.captures == -1 else wl.captures
        return lambda out: rows_check(shapes(out), layers, wl.batch, wl.rows(self.p), d)


def rows_check(shapes: list[tuple], layers: int, batch: int, rows: int, width: int | None = None) -> dict:
    """Whether a capture returned `layers` tensors of [batch, rows, (width)]."""
    want = (batch, rows) + ((width,) if width else ())
    bad = [s for s in shapes if tuple(s[:len(want)]) != want]
    ok = len(shapes) == layers and not bad
    detail = (f"{len(shapes)} layers captured, each {list(want)}" if ok else
              f"expected {layers} layers of {list(want)}, got {len(shapes)} layers"
              + (f", shapes {sorted({tuple(s) for s in bad})[:3]}" if bad else ""))
    return {"passed": ok, "detail": detail, "layers": len(shapes), "expected": [layers, *want]}


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


def logits_changed(steered, unsteered) -> dict:
    """The check of a steered forward: how many positions' logits differ from the unsteered forward's (a
    no-op steer changes none) and how far the most likely token moved."""
    import torch
    a, b = torch.as_tensor(steered).float(), torch.as_tensor(unsteered).float()
    if a.shape != b.shape:
        return {"passed": False, "detail": f"steered logits {tuple(a.shape)} and unsteered {tuple(b.shape)} differ "
                                           f"in shape", "changed_positions": None}
    moved = (a != b).flatten(2).any(-1) if a.dim() > 2 else (a != b)
    n, total = int(moved.sum()), int(moved.numel())
    top = int((a.argmax(-1) != b.argmax(-1)).sum())
    return {"passed": n > 0, "changed_positions": n, "total_positions": total, "changed_top_tokens": top,
            "detail": f"{n} of {total} positions' logits differ from the unsteered forward's ({top} top tokens "
                      f"changed)" if n else "steered logits equal the unsteered ones: the steer was a no-op"}


def generated_tokens(out, prompt_len: int) -> int | None:
    """How many new tokens a generation run produced, across its streams, from whatever the variant
    returned (engine results carry new_tokens; HF / TL / nnsight return prompt + new token ids;
    interp-engine a completion's token_ids); None when the output says nothing about it."""
    import torch
    if isinstance(out, tuple) and out:
        out = out[0]
    if isinstance(out, list) and all(isinstance(t, int) for t in out):  # token ids of one stream
        return len(out)
    new = getattr(out, "new_tokens", None)
    if new is None:
        new = getattr(out, "token_ids", None)
    if new is not None:
        if torch.is_tensor(new):
            return int(new.numel())
        return sum(len(x) for x in new) if new and not isinstance(new[0], int) else len(new)
    seq = getattr(out, "sequences", out)
    if torch.is_tensor(seq) and seq.dim() == 2:
        return int(seq.shape[0] * (seq.shape[1] - prompt_len))
    return None
