"""What a sweep runs: the settings every cell of one sweep shares, and the prompt token ids built the
same way for every variant (no padding: every row has exactly the tokens its workload says)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from benchmarks.ci import BOUND

DEFAULT_MODEL = "meta-llama/Llama-3.2-1B"
DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("zoo", "real", "local")  # local: a model directory
SIZES = ("tiny", "real")
CLOCKS = ("cpu", "wall")
# Fewer rounds cannot give a 95% interval for a median: with n rounds, [min, max] covers the median
# with probability 1 - 2 * 0.5**n, which first reaches 95% at n = 6.
MIN_ROUNDS = 6

# A fixed paragraph; rows of a batch start at different word offsets so the 8 streams differ.
_TEXT = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
         "Researchers measure activations at every layer to understand how a model reaches its answer. "
         "A steady wind moved the clouds across the valley, and the bells rang twice before noon. ")


@dataclass(frozen=True)
class Params:
    """Sweep-wide settings; every cell records them so a table never mixes different settings."""
    model: str = DEFAULT_MODEL
    source: str = "zoo"  # "zoo" (offline twin), "real" (cached checkpoint) or "local" (a directory)
    size: str = "tiny"  # zoo twin size: "tiny" (framework overhead dominates) or "real" (real shape)
    prompt_tokens: int = 32
    long_prompt_tokens: int = 512  # the long-prompt workloads
    new_tokens: int = 16
    rounds: int = 15  # every variant of every workload runs once per round
    warmups: int = 2  # untimed runs per cell before the first round
    # one sample repeats a short run back to back until about this long, and lasts its fastest run
    # (short samples keep a round short, so the two sides of a ratio run seconds apart)
    min_sample_s: float = 0.2
    dtype: str = "float32"
    device: str = "cpu"
    # torch / OpenMP threads per worker (0 = the library default). One by default: on a small shared
    # CPU, multi-threaded GEMMs stall on each other under contention (measured 25-100x slower)
    threads: int = 1
    # what a sample's duration is: "cpu" (CPU seconds of the worker and its child processes: time spent
    # waiting for a core other work holds does not count, which makes a 2-core machine shared with
    # other jobs measurable, but vLLM's processes busy-wait between messages, so it cannot time them) or
    # "wall" (elapsed: needs an otherwise idle machine; the only meaningful clock on a GPU). "auto":
    # wall on a GPU; on a CPU, decided by the sweep's variants (Params.for_variants). Both clocks are
    # recorded for every sample either way.
    clock: str = "auto"
    steer_scale: float = 4.0  # steering vector = steer_scale * unit-variance random vector
    ci_level: float = 0.95  # confidence of the interval around each median
    ci_bound: float = BOUND  # a ratio whose interval spans more than this fraction of it is unresolved
    timeout_s: int = 900  # one worker request (load, warmup or one sample)

    def __post_init__(self):
        if self.clock == "auto" and (self.device != "cpu" or self.threads != 1):
            object.__setattr__(self, "clock", "wall")
        for name, allowed in (("source", SOURCES), ("size", SIZES), ("dtype", DTYPES), ("clock", ("auto", *CLOCKS))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if self.source != "zoo" and self.size != "tiny":
            raise ValueError(f"size applies to zoo twins; a {self.source} checkpoint is always its own size "
                             f"(drop --size).")
        for name in ("prompt_tokens", "long_prompt_tokens", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
        if self.clock == "cpu" and self.threads != 1:
            raise ValueError(f"clock 'cpu' needs threads=1 (the CPU time of a {self.threads or 'multi'}-threaded "
                             f"worker adds its threads up); use clock='wall' with threads={self.threads}.")
        if self.clock == "cpu" and self.device != "cpu":
            raise ValueError(f"clock 'cpu' on device {self.device!r} would time the host, not the device; use "
                             f"clock='wall'.")
        if self.rounds < MIN_ROUNDS:
            raise ValueError(f"rounds must be >= {MIN_ROUNDS} (fewer cannot give a 95% interval for a "
                             f"median), got {self.rounds!r}.")
        if self.warmups < 1:
            raise ValueError(f"warmups must be >= 1 (one untimed run sizes the samples), got {self.warmups!r}.")
        if not 0.5 < self.ci_level < 1:
            raise ValueError(f"ci_level must be in (0.5, 1), got {self.ci_level!r}.")
        if self.ci_bound <= 0:
            raise ValueError(f"ci_bound must be > 0, got {self.ci_bound!r}.")

    def for_variants(self, busy_waiting: list[str]) -> "Params":
        """These settings with the clock decided for a sweep whose variants `busy_waiting` (names) spin
        between messages: "auto" becomes wall when there are any (one clock for the whole sweep, so
        every ratio pairs like with like) and cpu otherwise; "cpu" with any of them is refused."""
        if self.clock == "auto":
            return dataclasses.replace(self, clock="wall" if busy_waiting else "cpu")
        if self.clock == "cpu" and busy_waiting:
            raise ValueError(f"clock 'cpu' cannot time {', '.join(busy_waiting)}: their processes busy-wait "
                             f"between messages, so their CPU time counts spinning, not work. Use --clock wall "
                             f"on an otherwise idle machine, or leave them out (--variants).")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Params":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def model_label(self) -> str:
        """How tables name the model: the checkpoint and which weights ran."""
        what = {"tiny": "tiny zoo twin", "real": "real-size zoo twin"}[self.size] if self.source == "zoo" else \
            "real weights"
        return f"{self.model} ({what})"


# Settings every cell of one sweep must share (a ratio pairs rounds of one run on one model).
COMPARABLE = tuple(f.name for f in dataclasses.fields(Params) if f.name != "timeout_s")


def prompt_ids(tokenizer, n_tokens: int, batch: int = 1):
    """[batch, n_tokens] token ids of the fixed paragraph, row i starting i words later."""
    import torch
    words = _TEXT.split()
    rows = []
    for i in range(batch):
        text = " ".join(words[i:] + words[:i])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(ids) < n_tokens:
            ids = ids + ids
        rows.append(ids[:n_tokens])
    return torch.tensor(rows, dtype=torch.long)


def steer_vector(d_model: int, scale: float, dtype=None):
    """A fixed random direction (seed 0) with unit-variance entries, times `scale`."""
    import torch
    g = torch.Generator().manual_seed(0)
    v = torch.randn(d_model, generator=g) * scale
    return v if dtype is None else v.to(dtype)
