"""Known limitations of a family's upstream (HF transformers) implementation, one table keyed by
model_type. A backend calls `check(model_type, backend, op, batch=...)` before handing the request to
HF, so that the user gets the limitation and its workaround instead of an error from deep inside
transformers. Each entry records the raw upstream error it replaces and the versions it was seen
with; tests/test_inputs.py checks that the upstream failure is still real, so a fixed one is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.core.errors import FamilyLimitationError


@dataclass(frozen=True)
class Limitation:
    family: str  # the family's display name
    backend: str  # backend the limitation applies to
    op: str  # "generate", "run_with_cache", ...
    applies: Callable[[dict], bool]  # given the request's facts (batch=...), does it hit the limitation
    what: str  # the limitation, in the user's terms
    workaround: str
    upstream_error: str  # what HF raises without this check
    seen_with: str  # versions it was observed with


LIMITATIONS: dict[str, list[Limitation]] = {
    "falcon_h1": [
        Limitation(
            family="Falcon-H1", backend="eager", op="generate",
            applies=lambda facts: facts.get("batch", 1) > 1,
            what=("HF transformers' Falcon-H1 cannot generate more than one prompt at a time with eager "
                  "attention (the decode-step attention mask comes out one key short, padded batch or not)"),
            workaround=("generate one prompt at a time, e.g. [model.generate(p, n) for p in prompts]; "
                        "run_with_cache on a batch is not affected"),
            upstream_error="RuntimeError: The size of tensor a (18) must match the size of tensor b (17) at "
                           "non-singleton dimension 3",
            seen_with="transformers 5.19.0 (attn_implementation='eager', which the eager backend uses)",
        ),
    ],
}


def check(model_type: str, backend: str, op: str, **facts: object) -> None:
    """Raise FamilyLimitationError when (model_type, backend, op) with these facts is a known limitation."""
    for lim in LIMITATIONS.get(model_type, ()):
        if lim.backend == backend and lim.op == op and lim.applies(facts):
            shown = ", ".join(f"{k}={v}" for k, v in facts.items())
            raise FamilyLimitationError(
                f"{lim.family} ({model_type!r}) on backend {backend!r}: {op} with {shown} is a known limitation: "
                f"{lim.what}. Workaround: {lim.workaround}. (Without this check HF raises '{lim.upstream_error}'; "
                f"seen with {lim.seen_with}.)")
