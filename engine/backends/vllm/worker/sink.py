"""Capture rows handed from a vLLM worker to the client through files in shared memory, not RPC bytes.

A harvest asks its workers (collective_rpc "interp_collect_to") to write each collected capture into
a file under a directory the client made in /dev/shm; the RPC then carries only {path, dtype, shape}
and the client maps the file (no copy until the rows are read) and unlinks it at once. A worker that
cannot see the directory (another machine) sends the bytes inline as before, so the reply is always
complete. Measured against inline bytes in docs/harvest.md.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable

import torch

FILE = "__file__"


def to_file(t: torch.Tensor, directory: str) -> dict:
    """Write `t`'s bytes to a new file in `directory`; the reference the client reads it back by."""
    t = t.detach().to("cpu").contiguous()
    path = os.path.join(directory, f"{os.getpid()}-{uuid.uuid4().hex}.bin")
    raw = t.view(torch.uint8) if t.dtype == torch.bfloat16 else t
    with open(path, "wb") as f:
        if t.numel():
            f.write(raw.numpy().data.cast("B"))
    return {FILE: path, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}


def from_file(d: dict) -> torch.Tensor:
    """The tensor a worker wrote (mapped copy-on-write, so nothing is copied until it is read);
    the file is unlinked here, its pages live as long as the tensor."""
    dtype = getattr(torch, d["dtype"])
    shape = d["shape"]
    n = 1
    for s in shape:
        n *= s
    path = d[FILE]
    try:
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.from_file(path, shared=False, size=n, dtype=dtype).reshape(shape)
    finally:
        Path(path).unlink(missing_ok=True)


def encoder(directory: str | None, inline: Callable[[torch.Tensor], dict]) -> Callable[[torch.Tensor], dict]:
    """The function a worker encodes collected tensors with: files under `directory` when this
    process can write there, else `inline` (vllm_wire.tensor_out: bytes in the reply)."""
    if directory is None or not os.path.isdir(directory):
        return inline
    return lambda t: to_file(t, directory)
