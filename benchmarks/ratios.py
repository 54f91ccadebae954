"""The ratios a sweep answers, as one table, and how each is computed: per round, then the median
with its interval over rounds.

Every ratio is tok/s of the first cell over tok/s of the second (above 1: the first is faster),
computed round by round from samples taken in the same round, so drift on the machine between
rounds cancels instead of landing on one side. A ratio whose interval spans more than the sweep's
bound (Params.ci_bound, as a fraction of the median) is unresolved: it is shown as such and never
as a figure."""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks.ci import Interval, median_ci
from benchmarks.spec import MIN_ROUNDS
from benchmarks.workloads import BY_NAME as WORKLOADS

EAGER, STOCK, HF = "eager", "vllm-generate", "hf-generate"
PEERS = ("transformerlens", "nnsight", "interp-engine")
VLLM_OURS = ("vllm", "vllm-static")

GROUPS = {
    "hf": "Our capture against a plain HF forward",
    "peers": "Ours (eager) against the peers, same workload",
    "stock": "vLLM with capture or steering against stock vLLM generate",
    "steer": "Steering at every layer against no steering",
    "own": "Capture, steering and lens against the same variant's plain run",
    "readout": "SAE top-k readout against raw capture at the same points (resid_post, every layer), during generation",
    "gpu": "Batched (16 prompts or streams): the GPU goals of issue 33",
}


@dataclass(frozen=True)
class RatioSpec:
    group: str
    num: tuple[str, str]  # (variant, workload)
    den: tuple[str, str]
    label: str = ""
    goal: float | None = None  # the ratio this spec must reach (issue 33's GPU goals), shown in its title

    @property
    def key(self) -> str:
        return f"{self.num[0]}:{self.num[1]}/{self.den[0]}:{self.den[1]}"

    @property
    def title(self) -> str:
        text = self.label or f"{self.num[0]} {self.num[1]} / {self.den[0]} {self.den[1]}"
        return text + (f" (goal ≥ {self.goal:g})" if self.goal is not None else "")


def _s(group, nv, nw, dv, dw, label="", goal=None):
    return RatioSpec(group, (nv, nw), (dv, dw), label, goal)


# issue 33's goals on a GPU (bf16, a 1B model, 16 x 512): the engine as fast as HF's default forward, capture
# as cheap as HF's own output_hidden_states, steering nearly free, and capture and steering at least as fast as
# every peer's (the fastest, nnsight, is the bar)
GPU: tuple[RatioSpec, ...] = (
    _s("gpu", EAGER, "batch_prefill", HF, "batch_prefill",
       "eager forward / HF forward (its default attention, SDPA), batched", 0.98),
    _s("gpu", EAGER, "batch_capture", HF, "batch_capture",
       "eager, capture at every layer / HF forward with output_hidden_states, batched", 0.95),
    _s("gpu", EAGER, "batch_steer", EAGER, "batch_prefill", "eager, steer every layer / no steer, batched prefill",
       0.95),
    _s("gpu", EAGER, "batch_steer_gen", EAGER, "batch_generate",
       "eager, generation with a steer at every layer / without, batched", 0.9),
    *(_s("gpu", EAGER, w, p, w, f"eager / {p}, {WORKLOADS[w].title}", 1.0)
      for p in ("nnsight", "interp-engine", "transformerlens") for w in ("batch_capture", "batch_steer")),
    _s("gpu", EAGER, "batch_capture", EAGER, "batch_prefill", "eager, capture at every layer / no capture, batched"),
    _s("gpu", EAGER, "batch_readout", EAGER, "batch_prefill", "eager, probe readout at every layer / none, batched"),
    _s("gpu", EAGER, "batch_capture_gen", EAGER, "batch_generate",
       "eager, generation capturing every layer / without, batched"),
)

HEADLINE: tuple[RatioSpec, ...] = (
    _s("hf", EAGER, "capture_all", HF, "prefill", "eager, capture at every layer / HF forward"),
    _s("hf", EAGER, "long_capture", HF, "long_prefill", "eager, capture at every layer / HF forward, 512-token prompt"),
    *(_s("peers", EAGER, w, p, w, f"eager / {p}, {WORKLOADS[w].title}")
      for p in PEERS for w in ("capture_all", "capture_gen", "steer_all")),
    *(_s("stock", v, w, STOCK, WORKLOADS[w].baseline,
         f"{v}, {WORKLOADS[w].title} / stock {WORKLOADS[WORKLOADS[w].baseline].title}")
      for v in VLLM_OURS for w in ("capture_gen", "capture_gen8", "capture_gen32", "steer_all", "steer_all8",
                                   "steer_all32", "readout_gen")),
    _s("stock", EAGER, "capture_gen", STOCK, "decode", "eager, capture during generation / stock decode (1 stream)"),
    *(_s("steer", v, "steer_all", v, "decode", f"{v}, steer every layer / no steer")
      for v in (EAGER, *VLLM_OURS)),
    *(_s("readout", v, "readout_gen", v, "capture_gen", f"{v}, SAE top-k readout / raw capture")
      for v in (EAGER, *VLLM_OURS)),
    *GPU,
)


def all_specs(variants: list[str], workloads: list[str]) -> list[RatioSpec]:
    """Every ratio the full report shows for a sweep with these variants and workloads: the
    headline ones, then each variant's costs against its own plain run, ours against every peer and
    against stock vLLM on every workload. Specs whose cells the sweep lacks are dropped."""
    out = list(HEADLINE)
    for v in variants:
        for w in workloads:
            base = WORKLOADS[w].baseline
            if base != w:
                out.append(_s("own", v, w, v, base))
    for w in workloads:
        for p in (HF, *PEERS):
            out.append(_s("peers", EAGER, w, p, w))
        for v in (EAGER, *VLLM_OURS):
            out.append(_s("stock", v, w, STOCK, WORKLOADS[w].baseline))
    have = set(variants), set(workloads)
    seen, kept = set(), []
    for s in out:
        if s.key in seen or not (s.num[0] in have[0] and s.den[0] in have[0] and s.num[1] in have[1]
                                 and s.den[1] in have[1]) or s.num == s.den:
            continue
        seen.add(s.key)
        kept.append(s)
    return kept


@dataclass(frozen=True)
class RatioResult:
    """A ratio's interval over rounds; `rerun` the same ratio from the sweep run again (None: no rerun, or
    the rerun lacks it). Resolved only when its interval is narrow enough and, where it was rerun, the
    rerun's median falls inside it: a figure a rerun on the same machine does not reproduce is never
    published as a figure."""
    spec: RatioSpec
    interval: Interval
    per_round: dict[int, float]
    bound: float
    rerun: Interval | None = None

    @property
    def reproduced(self) -> bool:
        return self.rerun is None or self.interval.lo <= self.rerun.median <= self.interval.hi

    @property
    def resolved(self) -> bool:
        return self.interval.resolved(self.bound) and self.reproduced


def _over_rounds(table, spec: RatioSpec) -> tuple[dict[int, float], Interval] | None:
    a, b = table.per_round(*spec.num), table.per_round(*spec.den)
    common = sorted(a.keys() & b.keys())
    if len(common) < MIN_ROUNDS:
        return None
    per = {r: a[r] / b[r] for r in common}
    return per, median_ci(list(per.values()), table.params().ci_level)


def compute(table, spec: RatioSpec) -> RatioResult | None:
    """The ratio over the rounds both cells have, or None when either cell has no published figure; with
    the sweep's rerun's figure where it has one."""
    got = _over_rounds(table, spec)
    if got is None:
        return None
    again = _over_rounds(table.again, spec) if table.again is not None else None
    return RatioResult(spec, got[1], got[0], table.params().ci_bound, again[1] if again else None)
