"""The vLLM backends' synchronous model class and `load`.

    m = load_model("meta-llama/Llama-3.2-1B", backend="vllm")
    logits, cache = m.run_with_cache("Hello world", ["resid_post", "z.1.head-2"])
    out = m.generate(["a", "b"], 8, points=["resid_post.-1"], steer=[Steer("resid_post.1", "add", v)])
    res = m.generate_batch([Request("a", 8, points=["mlp_out.0"]), Request("b", 8, steer=[...])])
    logits, cache = await m.aio.run_with_cache("Hello world", ["resid_post.-1"])   # the async API

`vllm` attaches hooks in the workers per registered request, `vllm-static` serves the taps declared
at load from buffers inside the compiled forward, `vllm-generate` is stock vLLM and refuses capture
and steering. The engine core runs in its own process; `VLLMModel` drives the async model
(engine/backends/vllm/client.py) on a private event loop, so its calls are safe from any thread.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
from typing import TYPE_CHECKING, Any

import torch

from engine.backends.vllm import runtime as rt
from engine.backends.vllm import sizing as vllm_sizing
from engine.backends.vllm.catalogue import VLLMCatalogue
from engine.backends.vllm.client import AsyncVLLMModel, StreamEvent
from engine.backends.vllm.load_options import LoadOptions
from engine.backends.vllm.modes import mode_for
from engine.backends.vllm.worker import runner as vllm_runner
from engine.core.address import Address, parse
from engine.core.errors import AddressError, EngineError, FamilyLimitationError, OptionError, UnsupportedPointError
from engine.core.points import ALIASES, BY_NAME, backend_status, get_point
from engine.core.results import GenerationResult, Request, RequestResult
from engine.model import options as model_options
from engine.model.facade import OnLoop

if TYPE_CHECKING:
    pass

__all__ = ["load", "LoadOptions", "VLLMModel", "AsyncVLLMModel", "Request", "RequestResult", "GenerationResult", "StreamEvent"]


class VLLMModel(OnLoop):
    """The synchronous model API (engine/model/api.py) over AsyncVLLMModel, generated from the
    declarations (engine/model/facade.OnLoop); `aio` is the async model itself, for use from an event
    loop. The async model's other attributes (its catalogue, config, tokenizer) read through."""

    aio: AsyncVLLMModel

    def __init__(self, aio: AsyncVLLMModel, loop: rt.Loop, report: rt.LoadReport) -> None:
        super().__init__(aio, loop)
        self.load_report = report
        self.startup_s, self.kv_cache_bytes = report.startup_s, report.kv_cache_bytes
        self.tap_buffer_bytes = report.tap_buffer_bytes

    def __getattr__(self, name):  # the async model's own attributes: address(), point_shape(), config, tokenizer ...
        if name.startswith("__") or name in ("aio", "_loop", "_finalizer"):
            raise AttributeError(name)
        value = getattr(self.aio, name)
        if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
            raise AttributeError(f"VLLMModel.{name} is async only: call `await model.aio.{name}(...)` from "
                                 f"an event loop.")
        return value

    def __repr__(self):
        return repr(self.aio).replace("AsyncVLLMModel", "VLLMModel", 1)

    @property
    def prepend_bos(self) -> bool | None:
        """The BOS policy for text prompts (engine/core/tokens.py); set it here, it applies to the async model."""
        return self.aio.prepend_bos

    @prepend_bos.setter
    def prepend_bos(self, value: bool | None) -> None:
        self.aio.prepend_bos = value

    def worker_syncs(self, on: bool) -> list[dict]:
        """Count the engine's host reads inside the workers' steps (AsyncVLLMModel.worker_syncs)."""
        return self._run(self.aio.worker_syncs(on))

    def worker_ops(self, on: bool) -> list[dict]:
        """Count the ops the workers dispatch around their steps (AsyncVLLMModel.worker_ops)."""
        return self._run(self.aio.worker_ops(on))

    def worker_timing(self, on: bool) -> list[dict]:
        """Time the host work of the workers around their steps (AsyncVLLMModel.worker_timing)."""
        return self._run(self.aio.worker_timing(on))


# -- loading ----------------------------------------------------------------------------------------
def _declared(spec, n_layers: int) -> list[Address]:
    """static_points: "auto" (resid_post at every layer) or names / addresses (bare name = every layer)."""
    if spec == "auto":
        return [Address("resid_post", layer) for layer in range(n_layers)]
    spec = [spec] if isinstance(spec, (str, Address)) else list(spec)
    if not spec:
        raise ValueError("static_points is empty; use 'auto' or a list such as ['resid_post', 'attn_out.2'].")
    out = []
    for s in spec:
        if isinstance(s, str) and "." not in s and (s in BY_NAME or s in ALIASES) and get_point(s).scope == "layer":
            out += [Address(get_point(s).name, layer) for layer in range(n_layers)]
            continue
        addr = parse(s).resolved(n_layers)
        if addr.coords:
            raise AddressError(f"declare {addr.base} rather than {addr}: a tap holds the whole point and "
                               f"serves its coordinates.")
        out.append(addr)
    for addr in out:
        status, reason = backend_status(addr.point, "vllm")
        if status == "refused":
            raise UnsupportedPointError(f"{addr} cannot be a vllm-static tap: {reason}.")
        if status == "recompute":
            raise UnsupportedPointError(f"{addr} cannot be a vllm-static tap: it is {reason}; declare "
                                        f"q.{addr.layer} and k.{addr.layer} or use backend='vllm'.")
    return list(dict.fromkeys(out))


def load(name: str, backend: str = "vllm", source: str = "auto", dtype: Any = None, device: str | None = None,
         options: LoadOptions | None = None, **kw: Any) -> VLLMModel:
    """Load `name` on a vLLM backend (see module docstring). `options`, or its fields and vLLM's
    engine arguments as keywords (engine/backends/vllm/load_options.py: unknown ones are refused).
    Unset dtype / max_model_len / max_num_seqs / KV cache are chosen for the platform
    (engine/backends/vllm/sizing.py: CPU keeps the small twin numbers, CUDA a GPU user's), and the
    load report says what was chosen and why."""
    rt.check_main_module()
    mode = mode_for(backend)
    rt.prepare_env()
    if options is not None and kw:
        raise OptionError(f"give the load options as a LoadOptions or as keywords, not both (got {sorted(kw)}).")
    opts = options if options is not None else LoadOptions.parse(backend, kw)
    engine_kw = opts.engine_kw
    if mode.worker:
        rt.check_engine_args(backend, engine_kw)
    model_options.parse_device(device, backend)  # vLLM runs on its platform's device; another is an error
    if dtype is not None and dtype != "auto":
        dtype = model_options.parse_dtype(dtype, backend)
    path, used = rt.model_path(name, source)
    from transformers import AutoConfig
    hf_cfg = AutoConfig.from_pretrained(path)
    text_cfg = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    from vllm.platforms import current_platform
    rt.check_executor(engine_kw, current_platform)
    tp = opts.tensor_parallel_size
    sizing = vllm_sizing.choose(text_cfg, current_platform, dtype, opts.max_model_len, opts.max_num_seqs,
                                opts.kv_cache_memory_bytes, opts.gpu_memory_utilization, path, tp)
    kw = dict(**sizing.engine_kw(), seed=opts.seed, tensor_parallel_size=tp)
    if opts.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = opts.max_num_batched_tokens
    env, runner_note = vllm_runner.force_v1(backend, engine_kw)
    if env:
        rt.log.info("%s: %s", name, runner_note)
    binding = rt.cpu_binding(tp)
    if binding and current_platform.device_type == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    setup = mode.setup(_declared(opts.static_points, text_cfg.num_hidden_layers)
                       if mode.declares else None, opts.compile)
    kw.update(setup.kw)
    env.update(setup.env)
    declared = setup.declared
    kw.update(engine_kw)
    loop = rt.Loop(f"{name} ({backend})")
    try:
        engine, startup = loop.run(_start(path, env, kw))
    except BaseException as e:
        loop.stop()
        script = rt.unguarded_main_load() if isinstance(e, Exception) else None
        if script:  # the cause is printed above; the fix is the last line a reader sees
            raise EngineError(f"the vLLM engine did not start because {script} loads it at its top level: vLLM "
                              f"spawns its engine core, which imports that script again and runs the load a second "
                              f"time; put the load under `{rt.GUARD}`.") from e
        raise
    aio = None
    try:
        catalogue = None
        if mode.worker:
            describes = loop.run(engine.collective_rpc("interp_setup", args=(backend,)))
            vllm_runner.check(backend, [d["runner"] for d in describes])
            catalogue = VLLMCatalogue(describes, mode, declared)
            if catalogue.anchor_error:
                raise FamilyLimitationError(f"{name} on {backend}: {catalogue.anchor_error}.")
            for addr, why in catalogue.tap_errors.items():
                raise UnsupportedPointError(f"{addr} cannot be a vllm-static tap on this model: {why}.")
        aio = AsyncVLLMModel(name, mode, used, path, engine, catalogue, text_cfg, engine.get_tokenizer(), loop)
        cache = engine.vllm_config.cache_config
        tokens = (cache.num_gpu_blocks or 0) * cache.block_size
        kv_bytes = sizing.kv_cache_memory_bytes or tokens * vllm_sizing.kv_bytes_per_token(text_cfg, getattr(torch, sizing.dtype))
        report = rt.LoadReport(backend, startup, kv_bytes, tokens, catalogue.tap_bytes if catalogue else 0,
                               rt.rss_gib(), tensor_parallel_size=tp, sizing=sizing,
                               runner=runner_note, **mode.report(engine, opts.compile))
        model = VLLMModel(aio, loop, report)
    except BaseException:
        loop.run(_stop(engine))
        loop.stop()
        raise
    rt.log.info("%s %s", name, report.line())
    if opts.prove:
        try:
            proof = mode.prove(model)
        except Exception:
            model.close()
            raise
        if proof is not None:  # the report as proven (a new report: its fields are set once)
            model.load_report = dataclasses.replace(report, proof=proof)
    return model


async def _start(path, env, kw):
    return rt.start_engine(path, env, **kw)


async def _stop(engine):
    rt.stop_engine(engine)

