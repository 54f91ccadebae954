"""The workload table: what each benchmark times, how many tokens one run accounts for, what its
check proves, and which plain workload of the same variant its cost is priced against."""
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
    runs: str  # which job a Runner builds for it (one of RUNS), on the prompt batch/long say
    long: bool = False  # the prompt is Params.long_prompt_tokens long (else prompt_tokens)
    captures: int = 0  # layers whose resid_post it returns: 0, 1, or -1 for every layer
    steers: int = 0  # layers it steers: 0, 1 (the middle one) or -1 for every layer
    # an SAE readout instead of raw rows at the captured layers: the k largest latents per row of a random
    # SAE `sae_expansion` times d_model wide (engine.core.readouts.SAEFeatures), 0 for none
    sae_k: int = 0
    sae_expansion: int = 0

    def prompt_len(self, p) -> int:
        return p.long_prompt_tokens if self.long else p.prompt_tokens

    def tokens(self, p) -> int:
        """Tokens one timed run accounts for (tok/s = tokens / seconds)."""
        return self.batch * (p.new_tokens if self.generates else self.prompt_len(p))

    def rows(self, p) -> int:
        """Positions a full capture returns per prompt: the prompt, plus every generated token that
        was fed back (the last one never is)."""
        return self.prompt_len(p) + (p.new_tokens - 1 if self.generates else 0)


# what a workload runs: the Runner method (benchmarks/variants/base.py) that builds its Job from (workload,
# prompt ids): generate (greedy new_tokens), forward (no capture), capture (resid_post at the layers
# `captures` says), capture_gen (resid_post at every layer while generating), steer (generation with the
# steer vector at the layers `steers` says), lens (resid_post at every layer, then the unembedding),
# readout_gen (an SAE top-k readout of resid_post at every layer while generating)
RUNS = ("generate", "forward", "capture", "capture_gen", "steer", "lens", "readout_gen")

_GEN = "greedy generation of new_tokens (prefill included in the time)"
WORKLOADS: tuple[Workload, ...] = (
    Workload("decode", "decode (1 stream)", f"{_GEN} from one prompt", 1, True, "decode", runs="generate"),
    Workload("concurrency8", "concurrency 8 (aggregate)",
             f"{_GEN} for 8 different prompts together (one batch / 8 concurrent requests); tok/s is the "
             "aggregate over the 8 streams", 8, True, "concurrency8", runs="generate"),
    Workload("prefill", "prefill", "one forward pass over the prompt, no capture", 1, False, "prefill",
             runs="forward"),
    Workload("capture_one", "capture at one layer",
             "one forward pass capturing resid_post at the middle layer", 1, False, "prefill",
             runs="capture", captures=1),
    Workload("capture_all", "capture at every layer",
             "one forward pass capturing resid_post at every layer", 1, False, "prefill",
             runs="capture", captures=-1),
    Workload("lens", "logit lens",
             "one forward pass capturing resid_post at every layer, then the unembedding (final norm, lm_head) "
             "applied to each", 1, False, "prefill", runs="lens", captures=-1),
    Workload("capture_gen", "capture during generation",
             f"{_GEN} capturing resid_post at every layer for the prompt and every fed-back token", 1, True,
             "decode", runs="capture_gen", captures=-1),
    Workload("capture_gen8", "capture during generation, 8 streams",
             f"{_GEN} for 8 prompts together, each capturing resid_post at every layer", 8, True,
             "concurrency8", runs="capture_gen", captures=-1),
    Workload("readout_gen", "SAE top-k readout during generation",
             f"{_GEN} reading, at resid_post of every layer for the prompt and every fed-back token, the 32 largest "
             "latents of a random SAE 8 x d_model wide, computed where the activation is (sparse indices + "
             "values come back instead of raw rows: compare with capture_gen)", 1, True, "decode",
             runs="readout_gen", captures=-1, sae_k=32, sae_expansion=8),
    Workload("steer", "steer one layer",
             f"{_GEN} with a vector added to resid_post at the middle layer at every position", 1, True, "decode",
             runs="steer", steers=1),
    Workload("steer_all", "steer every layer",
             f"{_GEN} with a vector added to resid_post at every layer at every position", 1, True, "decode",
             runs="steer", steers=-1),
    Workload("long_prefill", "long prompt prefill", "one forward pass over the long prompt, no capture", 1,
             False, "long_prefill", runs="forward", long=True),
    Workload("long_capture", "long prompt, capture at every layer",
             "one forward pass over the long prompt capturing resid_post at every layer", 1, False,
             "long_prefill", runs="capture", long=True, captures=-1),
)

BY_NAME = {w.name: w for w in WORKLOADS}
NAMES = tuple(BY_NAME)


def get(name: str) -> Workload:
    if name not in BY_NAME:
        from engine.core.address import closest
        raise ValueError(f"unknown workload {name!r}.{closest(name, NAMES)} Workloads: {', '.join(NAMES)}.")
    return BY_NAME[name]


def _check_table() -> None:
    for w in WORKLOADS:
        if w.runs not in RUNS:
            raise AssertionError(f"workload {w.name!r} runs {w.runs!r}, which is not one of {RUNS}")
        if (w.sae_k > 0) != (w.runs == "readout_gen") or (w.sae_k > 0) != (w.sae_expansion > 0):
            raise AssertionError(f"workload {w.name!r}: sae_k and sae_expansion go together, with runs='readout_gen'")
        base = BY_NAME.get(w.baseline)
        if base is None or base.baseline != base.name or base.generates != w.generates or base.long != w.long \
                or base.batch != w.batch:
            raise AssertionError(f"workload {w.name!r} is priced against {w.baseline!r}, which is not a plain "
                                 f"workload of the same shape")


_check_table()
