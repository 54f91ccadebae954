"""What a vLLM load takes beyond the name, source, dtype and device: one frozen object, checked once
where load_model's keywords enter (as vLLM's EngineArgs become its VllmConfig).

    LoadOptions.parse("vllm", {"max_model_len": 256, "enable_prefix_caching": False})
        -> LoadOptions(max_model_len=256, ..., engine_kw={"enable_prefix_caching": False})
    LoadOptions.parse("vllm", {"max_num_seq": 4})
        -> OptionError: unknown keyword 'max_num_seq' for backend 'vllm'. Did you mean 'max_num_seqs'? ...

A keyword is one of the fields below or one of vLLM's engine arguments (AsyncEngineArgs' fields,
passed through as `engine_kw`); anything else is refused by name before an engine starts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.core.backends import backend_for
from engine.core.errors import OptionError, closest


def _whole(name: str, value: Any, least: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        unset = " (or None for the platform's choice)" if optional else ""
        raise OptionError(f"{name} must be a whole number >= {least}{unset}, got {value!r}.")


@dataclass(frozen=True)
class LoadOptions:
    """One vLLM load's options; unset sizes are chosen for the platform (engine/backends/vllm/sizing.py)."""
    static_points: Any = None  # vllm-static's taps: "auto" or names / addresses; None: the backend's default
    compile: bool = True  # vllm-static: keep vLLM's compiled forward and CUDA graphs (False: eager)
    max_model_len: int | None = None  # positions per sequence
    max_num_seqs: int | None = None  # sequences per step
    max_num_batched_tokens: int | None = None  # tokens per step
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None  # CUDA only (engine/backends/vllm/sizing.py checks it)
    seed: int = 0
    prove: bool = True  # run the mode's startup proof (vllm-static: taps capture, steers act)
    tensor_parallel_size: int = 1
    engine_kw: dict = field(default_factory=dict)  # vLLM engine arguments passed through as given

    def __post_init__(self) -> None:
        for name in ("compile", "prove"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            _whole(name, getattr(self, name), 1)
        _whole("tensor_parallel_size", self.tensor_parallel_size, 1, optional=False)
        _whole("seed", self.seed, 0, optional=False)

    @classmethod
    def parse(cls, backend: str, kw: dict) -> LoadOptions:
        """load_model's keywords for `backend`: the fields above, the rest vLLM's engine arguments;
        an unknown keyword, or static_points on a backend that declares no taps, is refused by name."""
        spec = backend_for(backend)
        ours = {f.name for f in dataclasses.fields(cls)} - {"engine_kw"}
        given = {k: v for k, v in kw.items() if k in ours}
        engine_kw = {k: v for k, v in kw.items() if k not in ours}
        unknown = sorted(set(engine_kw) - engine_arg_names()) if engine_kw else []
        if unknown:
            near = closest(unknown[0], sorted(ours | engine_arg_names()))
            raise OptionError(f"unknown keyword{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                              f"backend {backend!r}.{near} It takes source, dtype, device, {', '.join(sorted(ours))} "
                              f"and vLLM's engine arguments (the fields of vllm.engine.arg_utils.AsyncEngineArgs).")
        points = given.get("static_points")
        if not spec.declares and points not in (None, "auto"):
            raise OptionError(f"static_points is for backend='vllm-static', not {backend!r}.")
        given["static_points"] = (spec.static_points if points is None else points) if spec.declares else None
        return cls(**given, engine_kw=engine_kw)


def engine_arg_names() -> set[str]:
    """The engine arguments the installed vLLM takes (AsyncEngineArgs' fields)."""
    from engine.backends.vllm.runtime import prepare_env
    prepare_env()  # before vLLM is first imported
    from vllm.engine.arg_utils import AsyncEngineArgs
    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}
