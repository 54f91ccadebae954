"""The vLLM backends' synchronous model class and `load`.

    m = load_model("meta-llama/Llama-3.2-1B", backend="vllm")
    logits, cache = m.run_with_cache("Hello world", ["resid_post", "z.1.head-2"])
    out = m.generate(["a", "b"], 8, points=["resid_post.-1"], steer=[Steer("resid_post.1", "add", v)])
    res = m.generate_batch([Request("a", 8, points=["mlp_out.0"]), Request("b", 8, steer=[...])])
    logits, cache = await m.aio.capture("Hello world", ["resid_post.-1"])      # the async API

`vllm` attaches hooks in the workers per registered request, `vllm-static` serves the taps declared
at load from buffers inside the compiled forward, `vllm-generate` is stock vLLM and refuses capture
and steering. The engine core runs in its own process; `VLLMModel` drives the async model
(engine/backends/vllm/client.py) on a private event loop, so its calls are safe from any thread.
"""
from __future__ import annotations

import inspect
import os
import weakref

import torch

from engine.backends.vllm import runtime as rt
from engine.backends.vllm import sizing as vllm_sizing
from engine.backends.vllm.catalogue import VLLMCatalogue
from engine.backends.vllm.client import AsyncVLLMModel, StreamEvent
from engine.backends.vllm.worker import runner as vllm_runner
from engine.core.address import Address, closest, parse
from engine.core.errors import AddressError, FamilyLimitationError, UnsupportedPointError
from engine.core.points import ALIASES, BY_NAME, VLLM_BACKENDS, backend_status, get_point
from engine.core.results import GenerationResult, Request, RequestResult
from engine.model import options

__all__ = ["load", "VLLMModel", "AsyncVLLMModel", "Request", "RequestResult", "GenerationResult", "StreamEvent"]


def _shutdown(aio: AsyncVLLMModel, loop: rt.Loop) -> None:
    try:
        loop.run(aio.aclose())
    finally:
        loop.stop()


class VLLMModel:
    """The synchronous API over AsyncVLLMModel (same names as EagerModel's). `aio` is the async
    model itself, for use from an event loop."""

    def __init__(self, aio: AsyncVLLMModel, loop: rt.Loop, report: rt.LoadReport):
        self.aio, self._loop, self.load_report = aio, loop, report
        self.startup_s, self.kv_cache_bytes = report.startup_s, report.kv_cache_bytes
        self.tap_buffer_bytes = report.tap_buffer_bytes
        self._finalizer = weakref.finalize(self, _shutdown, aio, loop)  # dropped without close(): freed

    def __getattr__(self, name):  # catalogue and attributes: name, backend, n_layers, points(), address() ...
        if name.startswith("__") or name in ("aio", "_loop"):
            raise AttributeError(name)
        value = getattr(self.aio, name)
        if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
            raise AttributeError(f"VLLMModel.{name} is async only: call `await model.aio.{name}(...)` from "
                                 f"an event loop (the sync API is run_with_cache / forward / generate / "
                                 f"generate_batch / logit_lens).")
        return value

    def __repr__(self):
        return repr(self.aio).replace("AsyncVLLMModel", "VLLMModel", 1)

    @property
    def prepend_bos(self):
        """The BOS policy for text prompts (engine/core/tokens.py); set it here, it applies to the async model."""
        return self.aio.prepend_bos

    @prepend_bos.setter
    def prepend_bos(self, value):
        self.aio.prepend_bos = value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _run(self, coro):
        try:
            self.aio._live()
        except BaseException:
            coro.close()  # never started: no "was never awaited" warning on top of the clear error
            raise
        return self._loop.run(coro)

    def run_with_cache(self, inputs, points=(), steer=(), strict: bool = False, readouts=()):
        """One forward per prompt. Returns (logits [b, pos, vocab], cache of [b, pos, ...]), padded
        like eager's (left, or the layout of a given attention_mask); padded positions hold 0. The
        cache's receipts say what each steer did; strict=True fails a steer that touched no row."""
        return self._run(self.aio.capture(inputs, points, steer, strict, readouts))

    def forward(self, inputs, steer=(), strict: bool = False):
        return self.run_with_cache(inputs, (), steer, strict)[0]

    def generate(self, inputs, max_new_tokens: int = 8, points=(), steer=(), return_logits: bool = True,
                 strict: bool = False, readouts=(), **sampling) -> GenerationResult:
        """Greedy (by default) generation of every prompt in one continuous batch, with the same
        captures, steers and readouts for each; see generate_batch for per-request ones."""
        return self._run(self.aio.generate(inputs, max_new_tokens, points, steer, return_logits, strict, readouts,
                                           **sampling))

    def generate_batch(self, requests: list[Request], return_logits: bool = True, progress: bool = False,
                       strict: bool = False, sink: str | None = None):
        """Run requests concurrently (one continuous batch); each keeps its own captures, steers and
        receipts (strict=True: a steer that touched no row of its request fails the call; sink: see
        AsyncVLLMModel.generate_batch)."""
        return self._run(self.aio.generate_batch(requests, return_logits, strict, sink))

    def stream(self, prompt, max_new_tokens: int = 8, points=(), steer=(), logprobs: int = 0,
               return_logits: bool = True, rows: bool = True, strict: bool = False, readouts=(), **sampling):
        """Iterate StreamSteps of one prompt (see AsyncVLLMModel.stream: checked, and the steering
        blocks around this call bound, here); closing the iterator aborts the request."""
        self.aio._live()
        return self._steps(self.aio.stream(prompt, max_new_tokens, points, steer, logprobs, return_logits, rows,
                                           strict, readouts, **sampling))

    def _steps(self, agen):
        """The async stream stepped from this thread (Loop.iterate: Ctrl-C is a KeyboardInterrupt, and
        closing the stream aborts the request after any interrupted step has unwound)."""
        return self._loop.iterate(agen)

    def logit_lens(self, x, point: str = "resid_post") -> torch.Tensor:
        return self._run(self.aio.logit_lens(x, point))

    def steering(self, *steers):
        return self.aio.steering(*steers)

    def close(self) -> None:
        """Shut the engine down and free its processes (idempotent)."""
        self._finalizer()


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


def load(name: str, backend: str = "vllm", source: str = "auto", dtype=None, device: str | None = None,
         static_points="auto", compile: bool = True, max_model_len: int | None = None,
         max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
         kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float | None = None,
         seed: int = 0, prove: bool = True, tensor_parallel_size: int = 1, **engine_kw) -> VLLMModel:
    """Load `name` on a vLLM backend (see module docstring). Extra kwargs go to vLLM's engine args.
    Unset dtype / max_model_len / max_num_seqs / KV cache are chosen for the platform
    (engine/backends/vllm/sizing.py: CPU keeps the small twin numbers, CUDA a GPU user's), and the
    load report says what was chosen and why."""
    if backend not in VLLM_BACKENDS:
        raise ValueError(f"unknown vLLM backend {backend!r}.{closest(backend, VLLM_BACKENDS)} "
                         f"Use one of {VLLM_BACKENDS}.")
    if backend != "vllm-static" and static_points != "auto":
        raise ValueError(f"static_points is for backend='vllm-static', not {backend!r}.")
    rt.check_engine_args(backend, engine_kw)
    rt.prepare_env()
    options.parse_device(device, backend)  # vLLM runs on its platform's device; another is an error
    if dtype is not None and dtype != "auto":
        dtype = options.parse_dtype(dtype, backend)
    path, used = rt.model_path(name, source)
    from transformers import AutoConfig
    hf_cfg = AutoConfig.from_pretrained(path)
    text_cfg = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    from vllm.platforms import current_platform
    rt.check_executor(engine_kw, current_platform)
    sizing = vllm_sizing.choose(text_cfg, current_platform, dtype, max_model_len, max_num_seqs,
                                kv_cache_memory_bytes, gpu_memory_utilization, path, tensor_parallel_size)
    kw = dict(**sizing.engine_kw(), seed=seed, tensor_parallel_size=tensor_parallel_size)
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    env, runner_note = vllm_runner.force_v1(backend, engine_kw)
    if env:
        rt.log.info("%s: %s", name, runner_note)
    binding = rt.cpu_binding(tensor_parallel_size)
    if binding and current_platform.device_type == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    declared = None
    if backend != "vllm-generate":
        kw.update(worker_extension_cls=rt.WORKER_EXTENSION, logits_processors=[rt.ROW_MAP], async_scheduling=False)
    if backend == "vllm":
        kw.update(enforce_eager=True)  # Python hooks never fire in graph replay
    elif backend == "vllm-static":
        declared = _declared(static_points, text_cfg.num_hidden_layers)
        internal = [] if Address("final_norm") in declared else [Address("final_norm")]
        taps = [[str(a), True] for a in declared] + [[str(a), False] for a in internal]
        kw.update(enforce_eager=not compile, load_format="interp_static",
                  model_loader_extra_config={"interp_static": taps})
        # vLLM's own CUDA-graph mode (FULL_AND_PIECEWISE on CUDA): the taps are persistent buffers the
        # graphs read and write, filled and read around each replay (vllm_worker's step anchor); the
        # startup proof below runs under the chosen mode and refuses one it cannot prove
        # vLLM keys its compiled-graph cache on its config and model class, not on our taps: never
        # save or load one
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        declared = declared + internal
    kw.update(engine_kw)
    loop = rt.Loop(f"{name} ({backend})")
    try:
        engine, startup = loop.run(_start(path, env, kw))
    except BaseException:
        loop.stop()
        raise
    aio = None
    try:
        catalogue = None
        if backend != "vllm-generate":
            describes = loop.run(engine.collective_rpc("interp_setup", args=(backend,)))
            vllm_runner.check(backend, [d["runner"] for d in describes])
            catalogue = VLLMCatalogue(describes, backend, declared)
            if catalogue.anchor_error:
                raise FamilyLimitationError(f"{name} on {backend}: {catalogue.anchor_error}.")
            for addr, why in catalogue.tap_errors.items():
                raise UnsupportedPointError(f"{addr} cannot be a vllm-static tap on this model: {why}.")
        aio = AsyncVLLMModel(name, backend, used, path, engine, catalogue, text_cfg, engine.get_tokenizer(), loop)
        cache = engine.vllm_config.cache_config
        tokens = (cache.num_gpu_blocks or 0) * cache.block_size
        kv_bytes = sizing.kv_cache_memory_bytes or tokens * vllm_sizing.kv_bytes_per_token(text_cfg, getattr(torch, sizing.dtype))
        report = rt.LoadReport(backend, startup, kv_bytes, tokens, catalogue.tap_bytes if catalogue else 0,
                               rt.rss_gib(), compiled=backend == "vllm-static" and compile,
                               tensor_parallel_size=tensor_parallel_size, sizing=sizing, runner=runner_note)
        if backend == "vllm-static" and compile:
            report.extra["cudagraph_mode"] = _cudagraph_mode(engine)
        model = VLLMModel(aio, loop, report)
    except BaseException:
        loop.run(_stop(engine))
        loop.stop()
        raise
    rt.log.info("%s %s", name, report.line())
    if backend == "vllm-static" and prove:
        from engine.backends.vllm.proof import prove_taps
        try:
            report.extra["proof"] = prove_taps(model)
        except Exception:
            model.close()
            raise
    return model


def _cudagraph_mode(engine) -> str:
    """The CUDA-graph mode vLLM resolved for this engine (NONE on CPU)."""
    mode = engine.vllm_config.compilation_config.cudagraph_mode
    return getattr(mode, "name", str(mode))


async def _start(path, env, kw):
    return rt.start_engine(path, env, **kw)


async def _stop(engine):
    rt.stop_engine(engine)

