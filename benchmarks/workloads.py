"""The workload table: what each benchmark times, how many tokens one run produces, and which
plain workload its overhead is priced against."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    what: str  # what one timed run does
    batch: int  # prompts per run
    generates: bool  # tokens counted are new tokens (else prompt tokens)
    baseline: str  # the plain workload of the same variant its cost is compared with

    def tokens(self, prompt_tokens: int, new_tokens: int) -> int:
        """Tokens one timed run accounts for (tok/s = tokens / seconds)."""
        return self.batch * (new_tokens if self.generates else prompt_tokens)


WORKLOADS: tuple[Workload, ...] = (
    Workload("decode", "decode (1 stream)",
             "greedy generation of new_tokens from one prompt; prefill included in the time", 1, True, "decode"),
    Workload("concurrency8", "concurrency 8 (aggregate)",
             "8 different prompts generated together (one batch / 8 concurrent requests); "
             "tok/s is the aggregate over the 8 streams", 8, True, "concurrency8"),
    Workload("prefill", "prefill", "one forward pass over the prompt, no capture", 1, False, "prefill"),
    Workload("capture_one", "capture at one layer",
             "one forward pass over the prompt capturing resid_post at the middle layer", 1, False, "prefill"),
    Workload("capture_all", "capture at every layer",
             "one forward pass over the prompt capturing resid_post at every layer", 1, False, "prefill"),
    Workload("capture_gen", "capture during generation",
             "greedy generation of new_tokens capturing resid_post at every layer for the prompt and "
             "every generated token", 1, True, "decode"),
    Workload("steer", "steer",
             "greedy generation of new_tokens with a vector added to resid_post at the middle layer at "
             "every position; the cell is invalid unless the tokens differ from unsteered generation",
             1, True, "decode"),
    Workload("lens", "logit lens",
             "one forward pass capturing resid_post at every layer, then the unembedding (final norm, "
             "lm_head) applied to each", 1, False, "prefill"),
)

BY_NAME = {w.name: w for w in WORKLOADS}
NAMES = tuple(BY_NAME)


def get(name: str) -> Workload:
    if name not in BY_NAME:
        from engine.address import closest
        raise ValueError(f"unknown workload {name!r}.{closest(name, NAMES)} Workloads: {', '.join(NAMES)}.")
    return BY_NAME[name]
