"""Building an in-process vLLM engine and reaching its model runner; the load-time report.

The engine core must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that hooks,
closures and tap buffers reach the torch model. Several engines may live in one process, but
vLLM's shutdown tears down process-wide distributed state, so only the last engine alive is shut
down fully (`release`).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from engine import sources

log = logging.getLogger("engine.vllm")
if not log.handlers:  # the load report is a log line users should see without configuring logging
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log.addHandler(_h)
    log.setLevel(logging.INFO)

ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                "VLLM_NO_USAGE_STATS": "1"}  # offline: no usage report to stats.vllm.ai either
_LIVE: list = []  # engines alive in this process (see release)


def prepare_env() -> None:
    """Environment vLLM must see before it is imported / an engine is built."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # hooks need the engine core in-process


def model_path(name: str, source: str) -> tuple[str, str]:
    """(local directory to hand vLLM, source used), resolved by engine.sources as on every backend."""
    src = sources.resolve(name, source)
    return src.path, src.source


def kv_bytes_for(hf_config, max_num_seqs: int, max_model_len: int, dtype: torch.dtype) -> int:
    """A KV cache budget that fits max_num_seqs full-length sequences twice over (min 16 MiB)."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 1)
    kvh = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 1)
    per_token = layers * 2 * max(kvh, 1) * hd * torch.tensor([], dtype=dtype).element_size()
    return max(16 << 20, 2 * per_token * max_num_seqs * (max_model_len + 128))


@dataclass
class LoadReport:
    """What loading cost: seconds, KV cache and tap buffer sizes, process memory."""
    backend: str
    startup_s: float
    kv_cache_bytes: int
    kv_cache_tokens: int
    tap_buffer_bytes: int = 0
    rss_gib: float = 0.0
    compiled: bool = False
    extra: dict = field(default_factory=dict)

    def line(self) -> str:
        return (f"{self.backend}: startup {self.startup_s:.1f} s, KV cache {self.kv_cache_bytes / 2**20:.1f} MiB "
                f"({self.kv_cache_tokens} tokens), tap buffers {self.tap_buffer_bytes / 2**10:.1f} KiB, "
                f"RSS {self.rss_gib:.2f} GiB, {'compiled' if self.compiled else 'eager'} forward")


def rss_gib() -> float:
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return float("nan")


@contextlib.contextmanager
def after_load_model(fn):
    """Run fn(runner) right after vLLM loads the weights and before it compiles/captures graphs,
    so that modules changed by fn are what torch.compile traces."""
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner
    classes = [gpu_model_runner.GPUModelRunner, cpu_model_runner.CPUModelRunner]
    originals = [c.__dict__.get("load_model") for c in classes]

    def wrap(orig):
        def load_model(self, *a, **kw):
            orig(self, *a, **kw)
            fn(self)
        return load_model
    try:
        for c, o in zip(classes, originals):
            if o is not None:
                c.load_model = wrap(o)
        yield
    finally:
        for c, o in zip(classes, originals):
            if o is not None:
                c.load_model = o


@contextlib.contextmanager
def scoped_env(env: dict):
    """Environment variables for one engine's construction. vLLM caches its env reads once an
    engine is up, so the cache is dropped first, or a second engine would see the first's."""
    import vllm.envs
    vllm.envs.disable_envs_cache()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_PATCHED_KEYS = ("__init__", "__call__", "_ignore_compile_vllm")


@contextlib.contextmanager
def hf_classes_kept_pristine(found: list):
    """vLLM's Transformers backend decorates the HF decoder class *in place* for torch.compile
    (new __init__, __call__ and base class), after which the eager backend can no longer build that
    class in this process ("Current vLLM config is not set"). Record each HF class it decorates,
    so that `restore_hf_classes` can undo it once the engine exists."""
    from vllm.compilation import decorators as d
    orig = d._support_torch_compile

    def record(cls, *args, **kwargs):
        if cls.__module__.startswith("transformers.") and d.TorchCompileWithNoGuardsWrapper not in cls.__bases__:
            found.append((cls, cls.__bases__, {k: cls.__dict__[k] for k in _PATCHED_KEYS if k in cls.__dict__}))
        return orig(cls, *args, **kwargs)
    d._support_torch_compile = record
    try:
        yield
    finally:
        d._support_torch_compile = orig


def restore_hf_classes(found: list, model) -> None:
    """Give the engine's instances a private subclass carrying vLLM's decoration, and put the
    shared HF class back the way transformers defined it."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    for cls, bases, saved in found:
        decorated = {k: cls.__dict__[k] for k in _PATCHED_KEYS if k in cls.__dict__}
        for k in decorated:
            delattr(cls, k)
        for k, v in saved.items():
            setattr(cls, k, v)
        cls.__bases__ = bases
        private = type(cls.__name__, (cls, TorchCompileWithNoGuardsWrapper),
                       {**decorated, "__module__": cls.__module__, "__qualname__": f"vllm[{cls.__qualname__}]"})
        for m in model.modules():
            if type(m) is cls:
                m.__class__ = private


def build_llm(path: str, install=None, env: dict | None = None, **llm_kw):
    """Construct vllm.LLM in-process; `install(runner)` runs between weight load and compile."""
    prepare_env()
    from vllm import LLM
    t0 = time.perf_counter()
    ctx = after_load_model(install) if install is not None else contextlib.nullcontext()
    decorated: list = []
    with scoped_env(env or {}), ctx, hf_classes_kept_pristine(decorated):
        llm = LLM(model=path, **llm_kw)
    restore_hf_classes(decorated, runner_of(llm).get_model())
    _LIVE.append(llm)
    return llm, time.perf_counter() - t0


def runner_of(llm):
    """The model runner of an in-process engine (raises when the engine core is another process)."""
    try:
        return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        raise RuntimeError("the vLLM engine core is not in this process; the vllm backends need "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 (set by engine.backends before vLLM starts)") from None


def kv_cache_size(runner) -> tuple[int, int]:
    """(bytes, tokens) of the KV cache vLLM allocated."""
    cfg = getattr(runner, "kv_cache_config", None)
    if cfg is None:
        return 0, 0
    nbytes = sum(t.size for t in cfg.kv_cache_tensors)
    block = cfg.kv_cache_groups[0].kv_cache_spec.block_size if cfg.kv_cache_groups else 0
    return nbytes, cfg.num_blocks * block


def release(llm) -> None:
    """Free an engine. vLLM's full shutdown also destroys the process-wide distributed state that
    other live engines need, so it runs only for the last engine alive."""
    if llm not in _LIVE:
        return
    _LIVE.remove(llm)
    client = llm.llm_engine.engine_core
    if not _LIVE:
        client.shutdown()
    else:  # vLLM's finalizers would run the full shutdown when this object is collected: detach them
        for owner in (llm.llm_engine, client):
            fin = getattr(owner, "_finalizer", None)
            if fin is not None:
                fin.detach()
        client.engine_core.model_executor.shutdown()
        client.engine_core.scheduler.shutdown()
        gc.unfreeze()
    gc.collect()
