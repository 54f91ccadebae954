"""A harvest's options as one frozen HarvestSettings (issue 36): checked once where they enter, each
bad value named with what is accepted, the backend's defaults from its registry entry, and the model
loaded with the sizes its backend takes. No model is loaded here."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.core.errors import OptionError
from engine.harvest import runner
from engine.harvest.settings import Flow, HarvestSettings


def test_defaults_and_the_backends_batch_size():
    s = HarvestSettings.of("m")
    assert (s.backend, s.positions, s.context, s.part, s.flow, s.readouts) == ("vllm", "all", 256, (0, 1), Flow(), ())
    assert s.tokens_per_batch == 8192 and HarvestSettings.of("m", backend="eager").tokens_per_batch == 1024
    assert HarvestSettings.of("m", batch_tokens=512).tokens_per_batch == 512
    assert HarvestSettings.of("m", model_dtype="bf16").model_dtype_name == "bfloat16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.context = 1  # type: ignore[misc]


def test_a_loaded_model_brings_its_backend_and_dtype():
    class Loaded:
        backend, dtype = "eager", torch.bfloat16
    s = HarvestSettings.of(Loaded(), backend="vllm", model_dtype="float32", spare_threads=1)
    assert (s.backend, s.model_dtype_name, s.spare_threads) == ("eager", "bfloat16", 1)


def test_an_unknown_option_is_refused_by_name():
    with pytest.raises(OptionError, match=r"unknown harvest option 'contxt'\. Did you mean 'context'\?.*The options: "
                                          r"backend, positions"):
        HarvestSettings.of("m", contxt=128)


@pytest.mark.parametrize("options,message", [
    ({"backend": "vllm-generate"}, "backend 'vllm-generate' captures nothing"),
    ({"backend": "vlm"}, "unknown backend 'vlm'. Did you mean 'vllm'"),
    ({"spare_threads": -1}, "spare_threads must be a whole number of threads"),
    ({"spare_threads": 2}, "the vllm backend runs its forward in its own processes. Drop spare_threads"),
    ({"positions": "first"}, r"positions must be one of \('all', 'last'\), got 'first'"),
    ({"dtype": "int8"}, "dtype must be one of bf16, fp16, fp32, got 'int8'"),
    ({"model_dtype": "fp8"}, "model dtype must be one of float32, fp32, bfloat16"),
    ({"shard_tokens": 0}, "shard_tokens must be a positive number of rows, got 0"),
    ({"context": True}, "context must be a positive number of tokens, got True"),
    ({"backend": "eager", "batch_tokens": 100, "context": 128},
     r"batch_tokens \(100\) must hold at least one context window \(128\)"),
    ({"part": (2, 2)}, r"part must be \(index, count\) with 0 <= index < count, got \(2, 2\)"),
    ({"flow": {"inflight": 1}}, "flow must be a Flow"),
])
def test_each_bad_value_is_named_with_what_is_accepted(options, message):
    with pytest.raises(OptionError, match=message):
        HarvestSettings.of("m", **options)


def test_run_part_takes_settings_or_keywords_not_both(tmp_path):
    with pytest.raises(OptionError, match=r"as HarvestSettings or as keywords, not both \(got \['context'\]\)"):
        runner.run_part("m", "resid_post.0", tmp_path / "d.txt", tmp_path / "out", HarvestSettings.of("m"),
                        context=64)


@pytest.mark.parametrize("backend,sized", [
    ("eager", {}),
    ("vllm", {"max_model_len": 129, "max_num_seqs": 64}),
    ("vllm-static", {"max_model_len": 129, "max_num_seqs": 64, "static_points": ["resid_post.1", "mlp_out"]}),
])
def test_the_model_is_loaded_with_what_its_backend_takes(monkeypatch, backend, sized):
    import engine
    seen = {}
    monkeypatch.setattr(engine, "load_model", lambda name, **kw: seen.update(kw, name=name) or "model")
    s = HarvestSettings.of("m", backend=backend, context=128, batch_tokens=8192, model_dtype="bf16")
    assert runner.load("m", s, ["resid_post.1", "mlp_out"]) == "model"
    assert seen == {"name": "m", "backend": backend, "dtype": torch.bfloat16, **sized}
    seen.clear()  # the caller's load_kw wins over the harvest's sizes
    runner.load("m", dataclasses.replace(s, load_kw={"max_model_len": 4096} if sized else {}), ["resid_post.1"])
    assert seen.get("max_model_len") == (4096 if sized else None)
