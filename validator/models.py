"""Model names -> ModelSpecs: the zoo twin (default) or the real checkpoint from the local HF cache.

The reference copy is loaded here with transformers directly (eager attention), never through the
engine's loader, so nothing the engine does to its own copy can leak into the references.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from validator.runner import DTYPES, ModelSpec


def resolve_names(patterns: list[str] | None) -> list[str]:
    """Zoo names for exact names (any case) or globs, and model directories as absolute paths (default:
    the whole zoo); unknown names raise with the closest zoo names (engine/model/sources.py)."""
    from engine.model import sources
    return sources.expand(patterns)


# the engine under test is loaded as users load it (config "auto": load_model's default attention, sdpa for most
# families) and, for the columns that compare with it, with attention="eager" (config "eager"); the reference
# copy is loaded with the attention implementation the engine runs (validator.runner.native_attention), so
# both sides use the same kernels
CONFIGS = {"auto": "auto", "eager": "eager"}


def _from_pretrained(name: str, dtype: str, device: str, cache_dir=None, attention: str = "eager"):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kw = dict(local_files_only=True, dtype=DTYPES[dtype], attn_implementation=attention)
    if cache_dir is not None:
        kw["cache_dir"] = str(cache_dir)
    if device == "auto":  # a model larger than one GPU: accelerate places it as the engine's copy is placed
        hf = AutoModelForCausalLM.from_pretrained(name, device_map="auto", **kw).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(name, **kw).eval().to(device)
    tok = AutoTokenizer.from_pretrained(name, **{k: v for k, v in kw.items() if k == "cache_dir"},
                                        local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return hf, tok


def zoo_spec(name: str, dtype: str = "float32", device: str = "cpu") -> ModelSpec:
    from engine import zoo
    from engine.model import sources
    if sources.looks_like_path(name):
        return local_spec(name, dtype, device)
    from engine.loading import load_model
    snap = Path(zoo.snapshot_dir(name)).name

    def load_engine(config: str = "auto"):
        zoo.ensure_twin(name)
        return load_model(name, source="zoo", dtype=DTYPES[dtype], device=device, attention=CONFIGS[config])

    def load_reference(attention: str = "eager"):
        zoo.ensure_twin(name)
        return _from_pretrained(name, dtype, device, cache_dir=zoo.zoo_hub_cache(), attention=attention)

    entry = zoo.ZOO[name]
    return ModelSpec(name, "zoo", f"zoo:{snap}", load_engine, load_reference, n_layers=entry.layers,
                     model_type=entry.model_type)


def real_spec(name: str, dtype: str = "float32", device: str = "cpu") -> ModelSpec:
    from engine import zoo
    from engine.model import sources
    if sources.looks_like_path(name):
        return local_spec(name, dtype, device)
    from engine.loading import load_model
    if not zoo.real_checkpoint_available(name):
        raise FileNotFoundError(f"{name!r} is not in the local HF model cache; download it first "
                                f"(huggingface-cli download {name}) or drop --real to validate its zoo twin.")
    from huggingface_hub import try_to_load_from_cache
    cfg_path = try_to_load_from_cache(repo_id=name, filename="config.json")
    snap = Path(cfg_path).parent.name if isinstance(cfg_path, str) else "unknown"
    cfg = json.loads(Path(cfg_path).read_text()) if isinstance(cfg_path, str) else {}
    return ModelSpec(name, "real", f"real:{snap}",
                     lambda config="auto": load_model(name, source="real", dtype=DTYPES[dtype], device=device,
                                                      attention=CONFIGS[config]),
                     lambda attention="eager": _from_pretrained(name, dtype, device, attention=attention),
                     n_layers=(cfg.get("text_config") or cfg).get("num_hidden_layers"),
                     model_type=(cfg.get("text_config") or cfg).get("model_type", "?"))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def local_spec(path: str, dtype: str = "float32", device: str = "cpu") -> ModelSpec:
    """A model directory (a fine-tune, what save_pretrained wrote): engine and reference load its files."""
    from engine.loading import load_model
    from engine.model import sources
    src = sources.resolve(path, "local")
    return ModelSpec(src.name, "local", src.fingerprint(),
                     lambda config="auto": load_model(src.path, dtype=DTYPES[dtype], device=device,
                                                      attention=CONFIGS[config]),
                     lambda attention="eager": _from_pretrained(src.path, dtype, device, attention=attention))
