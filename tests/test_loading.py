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


def test_a_twin_says_its_weights_are_random_and_a_repeating_warning_prints_once(tmp_path):
    """Twins generated gibberish with no word saying why, and transformers' RoPE warning printed twice on every
    load: a load now warns once per name that the weights are random (ZooTwinWarning), and the RoPE message
    prints once per process however often it is logged."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "twice.py"
    script.write_text("from engine import load_model\n"
                      "for _ in range(2):\n"
                      "    m = load_model('meta-llama/Llama-3.2-1B')\n"
                      "print(m.generate('The capital of France is', 2).text)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("ZooTwinWarning: meta-llama/Llama-3.2-1B loaded as its zoo twin") == 1, proc.stderr
    assert "weights are seeded random, so generated text is noise" in proc.stderr
    assert proc.stderr.count("original_max_position_embeddings field must be less than") == 1, proc.stderr
