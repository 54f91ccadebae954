"""load_model: name resolution, source selection and its errors."""
import pytest
import torch

from engine import ModelNotFoundError, load_model


def test_zoo_twin_loads_by_name_and_says_so():
    m = load_model("Qwen/Qwen3-0.6B")
    assert m.source == "zoo" and "zoo" in repr(m)
    assert m.config.model_type == "qwen3" and m.family.name == "qwen3"
    logits, cache = m.run_with_cache("The capital of France is", ["resid_post.-1"])
    assert logits.shape[:2] == cache["resid_post.-1"].shape[:2]
    assert torch.isfinite(logits).all()


def test_real_source_without_cache_says_how_to_fix():
    with pytest.raises(ModelNotFoundError, match=r"not in the local HF model cache.*source='zoo'"):
        load_model("Qwen/Qwen3-0.6B", source="real")


def test_unknown_names_and_options():
    with pytest.raises(ValueError, match="Qwen/Qwen3-0.6B"):
        load_model("Qwen/Qwen3-0.6")
    with pytest.raises(ValueError, match=r"unknown backend 'vlm'.*Did you mean 'vllm'"):
        load_model("Qwen/Qwen3-0.6B", backend="vlm")
    with pytest.raises(ValueError, match="source must be one of"):
        load_model("Qwen/Qwen3-0.6B", source="hub")
