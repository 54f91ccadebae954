"""load_model: a name in, a model on the chosen backend out, saying where its weights came from.

The real checkpoint is used when it is in the local HF cache; otherwise the zoo twin (same
architecture, tiny, seeded random weights) is built and loaded from the zoo's private cache.
"""
from __future__ import annotations

import logging

import torch

from engine.errors import ModelNotFoundError
from engine.families.base import family_for

log = logging.getLogger("engine")
BACKENDS = ("eager", "vllm", "vllm-static", "vllm-generate")
SOURCES = ("auto", "zoo", "real")


def load_hf(name: str, source: str = "auto", dtype=torch.float32, device: str = "cpu"):
    """(hf_model, tokenizer, source_used) for a name, from the real cache or the zoo."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import zoo
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}.")
    use_real = source == "real" or (source == "auto" and zoo.real_checkpoint_available(name))
    if source == "real" and not zoo.real_checkpoint_available(name):
        raise ModelNotFoundError(f"{name!r} is not in the local HF model cache; download it first "
                                 f"(huggingface-cli download {name}) or use source='zoo' for its tiny twin.")
    if use_real:
        hf = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True,
                                                  attn_implementation="eager")
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
        used = "real"
    else:
        if name not in zoo.ZOO:
            zoo.resolve(name)  # raises with the closest names
        zoo.ensure_twin(name)
        hf = AutoModelForCausalLM.from_pretrained(name, cache_dir=zoo.zoo_hub_cache(), local_files_only=True,
                                                  dtype=dtype, attn_implementation="eager")
        tok = AutoTokenizer.from_pretrained(name, cache_dir=zoo.zoo_hub_cache(), local_files_only=True)
        used = "zoo"
    hf.eval().to(device)
    log.info("loaded %s from %s", name, "the local HF cache (real weights)" if used == "real"
             else "the zoo (tiny twin, seeded random weights)")
    return hf, tok, used


def load_model(name: str, backend: str = "eager", source: str = "auto", dtype=torch.float32,
               device: str = "cpu", **backend_kw):
    """Load `name` on `backend`. `source`: "auto" (real if cached, else zoo twin), "zoo", "real"."""
    if backend not in BACKENDS:
        from engine.address import closest
        raise ValueError(f"unknown backend {backend!r}.{closest(backend, BACKENDS)} Backends: {', '.join(BACKENDS)}.")
    if backend == "eager":
        from engine.backends.eager import EagerModel
        hf, tok, used = load_hf(name, source, dtype, device)
        return EagerModel(name, hf, tok, family_for(hf.config.model_type), used)
    from engine.backends import vllm_backend
    return vllm_backend.load(name, backend=backend, source=source, dtype=dtype, device=device, **backend_kw)
