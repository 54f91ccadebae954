"""load_model: a name in, a model on the chosen backend out, saying where its weights came from.

Names resolve once for every backend (engine/model/sources.py): a local model directory (what
`save_pretrained` wrote), the real checkpoint when it is in the local HF cache, otherwise the zoo
twin (same architecture, tiny, seeded random weights) built in the zoo's private cache. Repo ids
match in any letter case and nothing is downloaded. dtype and device are parsed by engine/model/options.py;
the backend's registry entry (engine/core/backends.py) says which engine loads it.
"""
from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch

from engine.core.backends import HF, VLLM, VLLM_BACKENDS, backend_for
from engine.core.errors import OptionError, ZooTwinWarning
from engine.families.base import family_for
from engine.model import options, sources

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


log = logging.getLogger("engine")
SOURCES = sources.SOURCES
_FROM = {"real": "the local HF cache (real weights)", "zoo": "the zoo (tiny twin, seeded random weights)",
         "local": "a local model directory"}


ATTENTION = ("auto", "eager", "sdpa", "flash_attention_2")

# third-party loggers whose warnings repeat on every load (the RoPE check runs once per config parse, and a load
# parses the config twice): each distinct message is let through once per process
REPEATING = ("transformers.modeling_rope_utils",)
_twins_said: set[str] = set()


class _OncePerMessage(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg in self.seen:
            return False
        self.seen.add(msg)
        return True


def quiet_repeats() -> None:
    """Install the once-per-message filter on the REPEATING loggers (idempotent)."""
    for name in REPEATING:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OncePerMessage) for f in logger.filters):
            logger.addFilter(_OncePerMessage())


def say_twin(src: sources.ModelSource, stacklevel: int = 3) -> None:
    """Warn once per name and process that a name loaded as its zoo twin: random weights, noise for text."""
    if src.source != "zoo" or src.name in _twins_said:
        return
    _twins_said.add(src.name)
    warnings.warn(f"{src.name} loaded as its zoo twin (no real checkpoint in the local HF cache): the "
                  f"architecture is the checkpoint's, the weights are seeded random, so generated text is noise.",
                  ZooTwinWarning, stacklevel=stacklevel)


def _load_hf(src: sources.ModelSource, dtype, device, attention: str = "auto"):
    """HF's model and tokenizer. attention="auto": the implementation HF picks for the model (sdpa, or
    eager where it has no other); the eager backend runs its calls that read a pattern eager anyway.
    `device` a dict or "auto": the layers placed by accelerate's dispatch (what was offloaded to disk
    goes to a folder of its own, removed with the model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not one of {', '.join(ATTENTION)}.")
    placed = {}
    if isinstance(device, dict) or device == "auto":
        import tempfile
        placed = {"device_map": device, "offload_folder": tempfile.mkdtemp(prefix="interp-offload-")}
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, local_files_only=True,
                                              attn_implementation=None if attention == "auto" else attention, **placed)
    tok = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
    if placed:
        import shutil
        import weakref
        weakref.finalize(hf, shutil.rmtree, placed["offload_folder"], True)
        hf.eval()
    else:
        hf.eval().to(device)
    log.info("loaded %s from %s", src.name, _FROM[src.source])
    return hf, tok


def _device(device, backend: str):
    """A device string, or a placement across devices ("auto", a device map) for the eager backend."""
    if isinstance(device, dict) or device == "auto":
        return options.parse_placement(device, backend)
    return options.parse_device(device, backend)


def load_hf(name: str, source: str = "auto", dtype: torch.dtype | str | None = torch.float32,
            device: str | dict = "cpu", attention: str = "auto") -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """(hf_model, tokenizer, source_used) for a name or a model directory; never downloads."""
    src = sources.resolve(name, source)
    quiet_repeats()
    hf, tok = _load_hf(src, options.parse_dtype(dtype, "eager"), _device(device, "eager"), attention)
    return hf, tok, src.source


def load_model(name: str, backend: str = "eager", source: str = "auto", dtype: torch.dtype | str | None = None,
               device: str | dict | None = None, attention: str = "auto", **backend_kw: Any) -> Any:
    """Load `name` (a repo id in any case, or a model directory) on `backend`. `source`: "auto"
    (the directory, else real if cached, else the zoo twin), "zoo", "real" or "local". `dtype`: a
    torch dtype or a name ("bf16", "float16", ...); unset (or "auto" on vLLM), the backend's own (eager:
    float32; vLLM: float32 on CPU, the checkpoint's dtype on CUDA). `device`: "cpu", "cuda", "cuda:N"; unset, the
    backend's own (eager: cpu; vLLM: the device the installed vLLM runs on, the only one it takes). Eager
    also takes a model larger than one GPU: "auto" (layers spread over the visible GPUs, then host memory
    and disk, by accelerate) or a device map {module: "cuda:N" | "cpu" | "disk"}; each site's work runs on
    the main device (the input embedding's) and results are gathered there.
    `attention` (eager): "auto" (HF's choice for the model, usually sdpa; calls reading attn_scores /
    attn_probs run eager), or one implementation for every call that reads no pattern.
    `backend_kw`: the vLLM backends' load options and engine arguments
    (engine/backends/vllm/load_options.py); eager takes none. An unknown keyword is refused by name."""
    spec = backend_for(backend)
    runtime = spec.runtime
    if runtime is HF and backend_kw:
        raise OptionError(f"unknown keyword{'s' if len(backend_kw) > 1 else ''} {', '.join(map(repr, backend_kw))} "
                          f"for backend {backend!r}: it takes source, dtype, device and attention only (load options "
                          f"such as max_model_len and static_points are the vLLM backends': {', '.join(VLLM_BACKENDS)}).")
    opts = None
    if runtime is VLLM:
        if attention != "auto":
            raise OptionError(f"attention={attention!r} chooses the eager backend's HF attention; backend {backend!r} "
                              f"runs vLLM's own kernels: leave attention unset.")
        from engine.backends.vllm.load_options import LoadOptions
        opts = LoadOptions.parse(backend, backend_kw)  # before anything loads
    sources.check_source(source)
    platform_dtype = runtime.default_dtype is None  # an unset dtype (or "auto") is the platform's choice
    if dtype is None:
        dtype = runtime.default_dtype
    if not (platform_dtype and dtype in (None, "auto")):
        dtype = options.parse_dtype(dtype, backend)
    device = _device(device, backend)
    src = sources.resolve(name, source)
    quiet_repeats()
    say_twin(src)
    if runtime is HF:
        from engine.backends.hf.eager import EagerModel
        hf, tok = _load_hf(src, dtype, device, attention)
        return EagerModel(src.name, hf, tok, family_for(hf.config.model_type), src.source)
    from engine.backends.vllm import backend as vllm_backend
    assert isinstance(device, str)  # a placement across devices is refused for vLLM by options.parse_placement
    return vllm_backend.load(src.name, backend, src.source, dtype, device, opts)
