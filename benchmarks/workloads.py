"""The workload table: what each benchmark times, how many tokens one run accounts for, what its
check proves, and which plain workload of the same variant its cost is priced against.

The batch_* workloads are the GPU-sized ones (issue 35): BATCH prompts of prompt_tokens each in one
forward, or BATCH streams generating together, each with capture, steering and a readout at every
layer. At batch 1 a GPU spends its time launching kernels; at batch a sample is seconds of real work
and the ratios of issue 33's GPU goals resolve."""
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
    # a linear-probe readout instead: `probe` directions projected at the captured layers
    # (engine.core.readouts.Project), the [batch, pos, probe] scores coming back instead of the rows
    probe: int = 0

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
# readout_gen (a readout of resid_post at every layer while generating), steer_forward (one forward with the
# steer vector at the layers `steers` says), readout (one forward with a readout of resid_post at every layer);
# a readout is an SAE's top-k latents (sae_k) or a linear probe's scores (probe)
RUNS = ("generate", "forward", "capture", "capture_gen", "steer", "lens", "readout_gen", "steer_forward", "readout")
BATCH = 16  # prompts (or streams) of the batch_* workloads: issue 33's GPU goals are stated at 16 x 512
PROBE = 16  # directions of the batch_* workloads' probe readout

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
    Workload("concurrency32", "concurrency 32 (aggregate)",
             f"{_GEN} for 32 different prompts together; tok/s is the aggregate over the 32 streams", 32, True,
             "concurrency32", runs="generate"),
    Workload("capture_gen32", "capture during generation, 32 streams",
             f"{_GEN} for 32 prompts together, each capturing resid_post at every layer", 32, True,
             "concurrency32", runs="capture_gen", captures=-1),
    Workload("steer_all8", "steer every layer, 8 streams",
             f"{_GEN} for 8 prompts together with a vector added to resid_post at every layer at every position",
             8, True, "concurrency8", runs="steer", steers=-1),
    Workload("steer_all32", "steer every layer, 32 streams",
             f"{_GEN} for 32 prompts together with a vector added to resid_post at every layer at every position",
             32, True, "concurrency32", runs="steer", steers=-1),
    Workload("long_prefill", "long prompt prefill", "one forward pass over the long prompt, no capture", 1,
             False, "long_prefill", runs="forward", long=True),
    Workload("long_capture", "long prompt, capture at every layer",
             "one forward pass over the long prompt capturing resid_post at every layer", 1, False,
             "long_prefill", runs="capture", long=True, captures=-1),
    Workload("batch_prefill", f"batched prefill ({BATCH} prompts)",
             f"one forward pass over {BATCH} prompts together, no capture", BATCH, False, "batch_prefill",
             runs="forward"),
    Workload("batch_capture", f"batched prefill, capture at every layer ({BATCH} prompts)",
             f"one forward pass over {BATCH} prompts capturing resid_post at every layer", BATCH, False,
             "batch_prefill", runs="capture", captures=-1),
    Workload("batch_steer", f"batched prefill, steer every layer ({BATCH} prompts)",
             f"one forward pass over {BATCH} prompts with a vector added to resid_post at every layer at every "
             "position (the logits come back)", BATCH, False, "batch_prefill", runs="steer_forward", steers=-1),
    Workload("batch_readout", f"batched prefill, probe readout at every layer ({BATCH} prompts)",
             f"one forward pass over {BATCH} prompts reading, at resid_post of every layer, a linear probe of "
             f"{PROBE} directions computed where the activation is (the scores come back instead of the rows)",
             BATCH, False, "batch_prefill", runs="readout", captures=-1, probe=PROBE),
    Workload("batch_generate", f"batched generation ({BATCH} streams)",
             f"{_GEN} for {BATCH} prompts together; tok/s is the aggregate over the streams", BATCH, True,
             "batch_generate", runs="generate"),
    Workload("batch_capture_gen", f"batched generation, capture at every layer ({BATCH} streams)",
             f"{_GEN} for {BATCH} prompts together, each capturing resid_post at every layer", BATCH, True,
             "batch_generate", runs="capture_gen", captures=-1),
    Workload("batch_steer_gen", f"batched generation, steer every layer ({BATCH} streams)",
             f"{_GEN} for {BATCH} prompts together with a vector added to resid_post at every layer at every "
             "position", BATCH, True, "batch_generate", runs="steer", steers=-1),
    Workload("batch_readout_gen", f"batched generation, probe readout at every layer ({BATCH} streams)",
             f"{_GEN} for {BATCH} prompts together reading a {PROBE}-direction linear probe at resid_post of "
             "every layer for the prompt and every fed-back token", BATCH, True, "batch_generate",
             runs="readout_gen", captures=-1, probe=PROBE),
)
GPU_PREFILL = ("batch_prefill", "batch_capture", "batch_steer", "batch_readout")
GPU_GENERATION = ("batch_generate", "batch_capture_gen", "batch_steer_gen", "batch_readout_gen")
# the stock-relative vLLM ratios at 8 and 32 streams (issue 52: benchmarks/gpu.sh), for a GPU's batch sizes
GPU_STREAMS = ("concurrency32", "capture_gen32", "steer_all8", "steer_all32")

BY_NAME = {w.name: w for w in WORKLOADS}
NAMES = tuple(BY_NAME)
# what a sweep runs when no workloads are named: the batch_* ones are for a GPU, named by benchmarks/device.sh,
# and so are the 32-stream ones (and steer_all8), named by benchmarks/gpu.sh
DEFAULT = tuple(n for n in NAMES if n not in GPU_PREFILL + GPU_GENERATION + GPU_STREAMS)


def get(name: str) -> Workload:
    if name not in BY_NAME:
        from engine.core.address import closest
        raise ValueError(f"unknown workload {name!r}.{closest(name, NAMES)} Workloads: {', '.join(NAMES)}.")
    return BY_NAME[name]


def _check_table() -> None:
    for w in WORKLOADS:
        if w.runs not in RUNS:
            raise AssertionError(f"workload {w.name!r} runs {w.runs!r}, which is not one of {RUNS}")
        if (w.sae_k > 0) != (w.sae_expansion > 0):
            raise AssertionError(f"workload {w.name!r}: sae_k and sae_expansion go together")
        if ((w.sae_k > 0) + (w.probe > 0) == 1) != (w.runs in ("readout", "readout_gen")):
            raise AssertionError(f"workload {w.name!r}: a readout workload (runs 'readout' or 'readout_gen') "
                                 f"reads one kind, an SAE (sae_k) or a probe (probe); no other workload reads any")
        base = BY_NAME.get(w.baseline)
        if base is None or base.baseline != base.name or base.generates != w.generates or base.long != w.long \
                or base.batch != w.batch:
            raise AssertionError(f"workload {w.name!r} is priced against {w.baseline!r}, which is not a plain "
                                 f"workload of the same shape")


_check_table()
