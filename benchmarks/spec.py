"""What one cell runs: the sweep parameters shared by every cell, and the prompt token ids built
the same way for every variant (no padding: every row has exactly prompt_tokens tokens)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEFAULT_MODEL = "meta-llama/Llama-3.2-1B"
DTYPES = ("float32", "bfloat16", "float16")
MIN_REPEATS = 5

# A fixed paragraph; rows of a batch start at different word offsets so the 8 streams differ.
_TEXT = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
         "Researchers measure activations at every layer to understand how a model reaches its answer. "
         "A steady wind moved the clouds across the valley, and the bells rang twice before noon. ")


@dataclass(frozen=True)
class Params:
    """Sweep-wide settings; every cell records them so a table never mixes different settings."""
    model: str = DEFAULT_MODEL
    source: str = "zoo"  # "zoo" (tiny twin, offline), "real" (cached checkpoint) or "local" (a directory)
    prompt_tokens: int = 32
    new_tokens: int = 16
    warmups: int = 2
    repeats: int = 5  # at least this many timed runs per cell
    min_time_s: float = 2.0  # ... and more runs until their estimated total reaches this
    dtype: str = "float32"
    device: str = "cpu"
    # torch / OpenMP threads per cell process (0 = the library default). One by default: on a small
    # shared CPU, multi-threaded GEMMs stall on each other under contention (measured 25-100x slower)
    threads: int = 1
    steer_scale: float = 4.0  # steering vector = steer_scale * unit-variance random vector
    timeout_s: int = 600

    def __post_init__(self):
        if self.source not in ("zoo", "real", "local"):
            raise ValueError(f"source must be 'zoo', 'real' or 'local' (a model directory), got {self.source!r}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        for name in ("prompt_tokens", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
        if self.repeats < MIN_REPEATS:
            raise ValueError(f"repeats must be >= {MIN_REPEATS} (a median and a spread need them), "
                             f"got {self.repeats!r}.")
        if self.warmups < 0:
            raise ValueError(f"warmups must be >= 0, got {self.warmups!r}.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Params":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)


# Settings that must agree between cells of one table (timing knobs like repeats may differ).
COMPARABLE = ("model", "source", "prompt_tokens", "new_tokens", "dtype", "device")


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
