"""The engine knobs a vLLM load chooses when the caller leaves them unset (engine/backends/vllm/sizing.py):
CPU keeps the twin numbers the project always used, CUDA takes a GPU user's (checkpoint dtype, the
model's context capped by what fits, vLLM's batch sizes and memory fraction). Fake platforms, no engine."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from engine.backends.vllm import sizing as vs
from engine.core.errors import OptionError

GIB = 2**30


class FakePlatform:
    def __init__(self, device_type: str, total: int = 0):
        self.device_type, self.total = device_type, total

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.total


def _cfg(**kw):
    base = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                intermediate_size=14336, max_position_embeddings=131072, vocab_size=128256, dtype="bfloat16")
    return LlamaConfig(**{**base, **kw})


def _per_token(cfg, bytes_per):  # independent of the module: layers x (K and V) x kv heads x head dim
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * bytes_per


def test_cpu_defaults_are_unchanged():
    cfg = _cfg(max_position_embeddings=2048, dtype="bfloat16")
    s = vs.choose(cfg, FakePlatform("cpu"))
    assert (s.dtype, s.max_model_len, s.max_num_seqs, s.gpu_memory_utilization) == ("float32", 512, 8, None)
    # the budget the CPU path always had: 8 sequences of 512 + 128 tokens, twice over, float32
    assert s.kv_cache_memory_bytes == max(16 << 20, 2 * _per_token(cfg, 4) * 8 * (512 + 128))
    assert s.engine_kw() == dict(dtype="float32", max_model_len=512, max_num_seqs=8,
                                 kv_cache_memory_bytes=s.kv_cache_memory_bytes)
    assert s.why["dtype"] == "the CPU default" and "8 sequences of 512 tokens" in s.why["kv_cache_memory_bytes"]


def test_cuda_defaults_follow_the_checkpoint_and_the_gpu(tmp_path):
    cfg = _cfg()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 1000)
    s = vs.choose(cfg, FakePlatform("cuda", 80 * GIB), path=str(tmp_path))
    assert s.dtype == "bfloat16" and s.why["dtype"] == "the checkpoint's dtype"
    # an 8B-shaped model on an 80 GiB GPU: the KV cache for the whole 131072-token context fits
    assert s.max_model_len == 131072 and s.why["max_model_len"] == "the model's context"
    assert s.max_num_seqs is None and s.kv_cache_memory_bytes is None and s.gpu_memory_utilization is None
    assert s.engine_kw() == dict(dtype="bfloat16", max_model_len=131072)  # the rest is vLLM's own
    line = s.line()
    assert "on cuda" in line and "max_num_seqs vLLM's default (vLLM's default for this GPU)" in line


def test_cuda_context_is_capped_by_what_fits(tmp_path):
    cfg = _cfg()
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (GIB // 4))  # stands for the weights
    total, util = 24 * GIB, 0.5
    s = vs.choose(cfg, FakePlatform("cuda", total), gpu_memory_utilization=util, path=str(tmp_path))
    budget = int((int(total * util) - GIB // 4) * vs.KV_SHARE)
    expect = budget // _per_token(cfg, 2) // 16 * 16
    assert expect < 131072 and s.max_model_len == expect
    assert "capped by the KV cache that fits" in s.why["max_model_len"]
    assert s.gpu_memory_utilization == util and s.engine_kw()["gpu_memory_utilization"] == util
    # float32 weights on disk, bf16 in memory: half the bytes count against the GPU
    cfg32 = _cfg(dtype="float32")
    s32 = vs.choose(cfg32, FakePlatform("cuda", total), gpu_memory_utilization=util, path=str(tmp_path))
    assert s32.dtype == "bfloat16" and "stored in float32" in s32.why["dtype"]
    assert s32.max_model_len == int((int(total * util) - GIB // 8) * vs.KV_SHARE) // _per_token(cfg, 2) // 16 * 16


def test_caller_values_win_and_are_reported():
    s = vs.choose(_cfg(), FakePlatform("cuda", 80 * GIB), torch.float16, max_model_len=4096, max_num_seqs=32)
    assert (s.dtype, s.max_model_len, s.max_num_seqs) == ("float16", 4096, 32)
    assert s.why["dtype"] == s.why["max_model_len"] == s.why["max_num_seqs"] == vs.CALLER
    c = vs.choose(_cfg(), FakePlatform("cpu"), "auto", max_model_len=128, max_num_seqs=2)
    assert (c.dtype, c.max_model_len, c.max_num_seqs) == ("float32", 128, 2)


def test_bad_values_are_refused_by_name():
    with pytest.raises(OptionError, match="gpu_memory_utilization=1.5 must be in"):
        vs.choose(_cfg(), FakePlatform("cuda", 80 * GIB), gpu_memory_utilization=1.5)
    with pytest.raises(OptionError, match="gpu_memory_utilization is a CUDA setting; vLLM runs on cpu"):
        vs.choose(_cfg(), FakePlatform("cpu"), gpu_memory_utilization=0.5)
    with pytest.raises(OptionError, match="leave no room for a KV cache"):
        vs.choose(_cfg(), FakePlatform("cuda", GIB // 1024))
    class NoContext:  # a config that states no context length under any of the usual names
        hidden_size, num_attention_heads, num_hidden_layers, dtype = 64, 4, 2, "bfloat16"
    with pytest.raises(OptionError, match="states no context length"):
        vs.choose(NoContext(), FakePlatform("cuda", 80 * GIB))


def test_our_default_memory_fraction_is_vllms():
    from vllm.config import CacheConfig
    field = next(f for f in dataclasses.fields(CacheConfig) if f.name == "gpu_memory_utilization")
    assert getattr(field.default, "default", field.default) == vs.GPU_MEMORY_UTILIZATION
