"""Count the host reads of device values that the engine's own code makes: free on a CPU, a stall on a GPU.

    with SyncCounter() as c:
        model.run_with_cache(...)
    c.count, c.sites            # how many, and where (file:line -> count)

A TorchFunctionMode sees every torch call made from Python. Sync-shaped calls are the ones that hand
a tensor's value to Python or copy it to the host: item, tolist, bool / int / float of a tensor,
nonzero, cpu, numpy, to(cpu), equal; and the ones whose output's size depends on a device value, which
CUDA must read before it can allocate: indexing by a boolean mask (read or write), masked_select,
one-argument where, argwhere, unique, and repeat_interleave by a tensor of counts with no output_size.
On a CPU they cost nothing, so they are counted by what they would
cost on a GPU; only calls made from the engine's own files count (the model's library and torch
itself sync where they do, which is not ours to change). On CUDA, torch.cuda.set_sync_debug_mode
reports the real ones (tests marked gpu).
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ENGINE = str(Path(__file__).resolve().parents[1])  # .../engine
_TENSOR = torch.Tensor
SYNC_CALLS = {
    _TENSOR.item, _TENSOR.tolist, _TENSOR.__bool__, _TENSOR.__int__, _TENSOR.__float__, _TENSOR.__index__,
    _TENSOR.nonzero, torch.nonzero, _TENSOR.cpu, torch.equal, _TENSOR.__array__,
}


SIZED_BY_VALUE = {
    _TENSOR.masked_select, torch.masked_select, torch.argwhere, _TENSOR.argwhere, torch.unique, _TENSOR.unique,
    torch.unique_consecutive, _TENSOR.unique_consecutive,
}
INDEXING = {_TENSOR.__getitem__, _TENSOR.__setitem__, _TENSOR.index_put_, _TENSOR.index_put, torch.index_put}


def _is_bool_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8) and x.dim() > 0


def _sized_by_value(func: Any, args: tuple, kwargs: dict) -> bool:
    """Calls whose output's shape is a device value: on CUDA each reads it back before allocating."""
    if func in SIZED_BY_VALUE:
        return True
    if func in INDEXING and len(args) > 1:
        index = args[1]
        return any(_is_bool_tensor(i) for i in (index if isinstance(index, (tuple, list)) else (index,)))
    if func is torch.where:
        return len(args) + len(kwargs) == 1
    if func in (torch.repeat_interleave, _TENSOR.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
    return False


def _is_host_copy(func: Any, args: tuple, kwargs: dict) -> bool:
    """to("cpu") (the device named as a string: a copy to the host, whatever the model's device) and
    numpy(force=True). to(device) with a device object is the code's own placement (on a GPU, an upload)."""
    if func is _TENSOR.numpy:
        return bool(kwargs.get("force"))
    if func is not _TENSOR.to:
        return False
    return any(isinstance(a, str) and torch.device(a).type == "cpu" for a in (*args[1:], *kwargs.values()))


class SyncCounter(TorchFunctionMode):
    """Counts the sync-shaped torch calls made from engine/ while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter = Counter()
        self.active = False

    def __enter__(self) -> "SyncCounter":
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        super().__exit__(*exc)

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in SYNC_CALLS or _is_host_copy(func, args, kwargs) or _sized_by_value(func, args, kwargs):
            f: Any = sys._getframe(1)
            while f is not None and "/torch/" in f.f_code.co_filename:
                f = f.f_back
            if f is not None and f.f_code.co_filename.startswith(_ENGINE) and f.f_code.co_filename != __file__:
                self.sites[f"{Path(f.f_code.co_filename).relative_to(Path(_ENGINE).parent)}:{f.f_lineno}"] += 1
        return func(*args, **kwargs)
