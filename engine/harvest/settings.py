"""A harvest's options as one frozen object, checked once where they enter (run_part's keywords, the
CLI, a Ray actor), then trusted by the loop: `HarvestSettings.of(model, **keywords)`.

    HarvestSettings.of("meta-llama/Llama-3.2-1B", backend="eager", context=128)
    HarvestSettings.of(model, positions="last")      # a loaded model: its backend and dtype are used
    HarvestSettings.of(name, contxt=128)              -> OptionError: unknown harvest option 'contxt'. Did you mean 'context'? ...

Flow (how rows travel; never part of the harvest's identity) is one of its fields.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from engine.core.backends import backend_for
from engine.core.errors import OptionError, closest
from engine.harvest import batches
from engine.harvest.priority import HELPER_NICE
from engine.harvest.shards import DTYPES

if TYPE_CHECKING:
    from engine.core.readouts import Readout

MODEL_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16"}
HANDOFFS = ("shm", "rpc")


@dataclass(frozen=True)
class Flow:
    """How rows travel from the model to the writer; never changes a written byte (not part of the
    harvest's identity). inflight: harvest batches in the vLLM engine at once (the engine computes
    the next while this process stores the last; eager runs one at a time); handoff: how vLLM's
    workers hand the rows over, "shm" (files in /dev/shm, only paths in the RPC reply) or "rpc"
    (bytes inline in the reply); nice: how much lower than the forward the reader and writer threads
    run (engine/harvest/priority.py; 0: the same priority). Measured in docs/harvest.md."""
    inflight: int = 2
    handoff: str = "shm"
    nice: int = HELPER_NICE

    def __post_init__(self):
        if self.handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {HANDOFFS}, got {self.handoff!r}.")
        if not isinstance(self.inflight, int) or self.inflight < 1:
            raise ValueError(f"inflight must be a positive number of batches, got {self.inflight!r}.")
        if not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be a whole number from 0 to 19, got {self.nice!r}.")


def _count(name: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be a positive number of {what}, got {value!r}.")


@dataclass(frozen=True)
class HarvestSettings:
    """run_part's options (see engine.harvest.runner.run_part for what each does)."""
    backend: str = "vllm"
    positions: str = "all"  # "all" rows of every window, or its "last"
    shard_tokens: int = 65536  # rows per shard
    dtype: str = "fp32"  # how rows are stored (engine/harvest/shards.py)
    context: int = 256  # tokens per forward window
    batch_tokens: int | None = None  # tokens per forward batch; None: the backend's (`tokens_per_batch`)
    part: tuple[int, int] = (0, 1)  # (i, N): this run's part of the input
    text_field: str = "text"
    model_dtype: str = "float32"  # the model's dtype (an alias such as bf16 is kept as its name)
    progress: bool | Callable[[int], None] = True  # a bar, or a function called with each batch's tokens
    load_kw: dict | None = None  # load_model's keywords for a model loaded by name
    merge: bool = True  # merge the parts' manifests when this part completes the harvest
    flow: Flow = field(default_factory=Flow)
    readouts: tuple[Readout, ...] = ()
    spare_threads: int = 0  # eager on CPU: intra-op threads left to the reader and writer

    def __post_init__(self) -> None:
        spec = backend_for(self.backend)
        if not spec.captures:
            raise OptionError(f"backend {self.backend!r} captures nothing ({spec.summary}); harvest on a backend that "
                              f"captures.")
        sp = self.spare_threads
        if not isinstance(sp, int) or isinstance(sp, bool) or sp < 0:
            raise OptionError(f"spare_threads must be a whole number of threads (0: the forward keeps them all), "
                              f"got {sp!r}.")
        if sp and spec.runtime.own_processes:
            raise OptionError(f"spare_threads leaves CPU threads of an eager forward to the reader and writer; the "
                              f"{self.backend} backend runs its forward in its own processes. Drop spare_threads.")
        if self.positions not in batches.POSITIONS:
            raise OptionError(f"positions must be one of {batches.POSITIONS}, got {self.positions!r}.")
        if self.dtype not in DTYPES:
            raise OptionError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if self.model_dtype not in MODEL_DTYPES:
            raise OptionError(f"model dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.model_dtype!r}.")
        _count("shard_tokens", self.shard_tokens, "rows")
        _count("context", self.context, "tokens")
        if self.batch_tokens is not None:
            _count("batch_tokens", self.batch_tokens, "tokens")
        if self.tokens_per_batch < self.context:
            raise OptionError(f"batch_tokens ({self.tokens_per_batch}) must hold at least one context window "
                              f"({self.context}).")
        i, n = self.part if isinstance(self.part, tuple) and len(self.part) == 2 else (None, None)
        if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n):
            raise OptionError(f"part must be (index, count) with 0 <= index < count, got {self.part!r}.")
        if not isinstance(self.flow, Flow):
            raise OptionError(f"flow must be a Flow (engine.harvest.runner.Flow), got {type(self.flow).__name__}.")
        if not isinstance(self.readouts, tuple):
            raise OptionError(f"readouts must be a tuple of Readout, got {type(self.readouts).__name__} "
                              f"(HarvestSettings.of takes any iterable).")

    @classmethod
    def of(cls, model: Any = None, **options: Any) -> HarvestSettings:
        """The settings from run_part's keywords; a loaded `model` sets backend and model_dtype (its own).
        An unknown keyword is refused by name."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise OptionError(f"unknown harvest option{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(map(repr, unknown))}.{closest(unknown[0], names)} The options: "
                              f"{', '.join(names)}.")
        if model is not None and not isinstance(model, str):
            options.update(backend=model.backend, model_dtype=str(model.dtype).removeprefix("torch."))
        if isinstance(options.get("part"), list):
            options["part"] = tuple(options["part"])
        if options.get("flow") is None:
            options.pop("flow", None)
        options["readouts"] = tuple(options.get("readouts") or ())
        return cls(**options)

    @property
    def tokens_per_batch(self) -> int:
        """batch_tokens, or the backend's default (engine/core/backends.py: eager materializes
        [batch, pos, vocab] logits, vLLM does not)."""
        return self.batch_tokens or backend_for(self.backend).runtime.batch_tokens

    @property
    def model_dtype_name(self) -> str:
        """The model's dtype by its torch name (bf16 -> bfloat16), as the harvest's identity records it."""
        return MODEL_DTYPES[self.model_dtype]

    @property
    def store_dtype(self) -> torch.dtype:
        """The torch dtype rows are stored in."""
        return DTYPES[self.dtype]
