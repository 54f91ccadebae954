"""Shards: fixed-size row buffers, and the writer thread that puts them on disk atomically.

A shard becomes visible only by an atomic rename of a complete, fsynced file, and it counts only once
the manifest lists it (the manifest is rewritten the same way, after the shard). A crash therefore
leaves complete shards, at most one complete shard the manifest does not list yet (rewritten with the
same bytes on resume), and temp files that resume deletes.

Writing happens on one thread behind a bounded queue, so the forward never waits on the disk unless
the disk is slower than the model, and at most `depth` shards wait in memory.
"""
from __future__ import annotations

import hashlib
import json
import queue
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.core.files import write_atomic
from engine.harvest.priority import ThreadCPU, lower_this_thread

# the index columns every shard holds beside one column per address
INDEX_COLUMNS = {"token_ids": torch.int32, "doc_index": torch.int64, "position": torch.int32}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


# safetensors' name for each dtype a shard can hold, and its rank in safetensors' own layout order
# (it lays tensors out widest dtype first, then by name); `shard_parts` writes that exact layout
SAFETENSORS_DTYPES = {torch.int64: ("I64", 3), torch.float32: ("F32", 2), torch.int32: ("I32", 1),
                      torch.bfloat16: ("BF16", 0), torch.float16: ("F16", -1)}


def shard_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[bytes | memoryview]:
    """A shard's safetensors bytes as the header followed by views of the tensors' own memory: the
    bytes `safetensors.torch.save` would return (tests/test_harvest_shards.py compares them), without
    copying every row into one more buffer the size of the shard. The metadata goes in as one sorted
    JSON string under "harvest", because safetensors writes a metadata map in hash order, which would
    differ from run to run."""
    meta = {"harvest": json.dumps(metadata, sort_keys=True)}
    if sys.byteorder != "little" or any(t.dtype not in SAFETENSORS_DTYPES for t in tensors.values()):
        from safetensors.torch import save  # safetensors stores little-endian; it converts
        return [save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)]
    header: dict[str, object] = {"__metadata__": meta}
    views: list[bytes | memoryview] = []
    at = 0
    for name in sorted(tensors, key=lambda k: (-SAFETENSORS_DTYPES[tensors[k].dtype][1], k)):
        t = tensors[name].contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [at, at + size]}
        views.append(t.reshape(-1).view(torch.uint8).numpy().data)  # the bytes in place
        at += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces
    return [struct.pack("<Q", len(text)) + text, *views]


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
    """Hash and atomically write one shard straight from its tensors' memory; (sha256, bytes). Its
    pages leave the page cache once on disk (a harvest writes more than memory holds)."""
    parts = shard_parts(tensors, metadata)
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    write_atomic(path, parts, durable=True, cache=False)
    return digest.hexdigest(), sum(memoryview(p).nbytes for p in parts)


class ShardBuffer:
    """Preallocated rows of the next shard; columns cast to the storage dtype as they are filled."""

    def __init__(self, size: int, columns: dict[str, tuple[tuple, torch.dtype]]) -> None:
        self.size, self.n = size, 0
        self.tensors = {k: torch.empty((size, *shape), dtype=dt) for k, (shape, dt) in columns.items()}
        self.docs: list[int] = []  # first and last document index held

    @property
    def full(self) -> bool:
        return self.n == self.size

    def fill(self, rows: dict[str, torch.Tensor], a: int, b: int) -> None:
        for k, t in self.tensors.items():
            t[self.n:self.n + b - a].copy_(rows[k][a:b])
        d = rows["doc_index"]
        self.docs = [int(d[a]) if not self.docs else self.docs[0], int(d[b - 1])]
        self.n += b - a

    def rows(self) -> dict[str, torch.Tensor]:
        return {k: t[:self.n] for k, t in self.tensors.items()}


@dataclass
class Pending:
    """A full (or final) shard on its way to disk, with what its manifest entry says."""
    index: int
    tensors: dict[str, torch.Tensor]
    entry: dict
    final: bool = False


@dataclass
class WriterStats:
    shards: int = 0
    bytes: int = 0
    write_s: float = 0.0  # time the writer thread spent serializing, hashing and writing
    cpu: ThreadCPU = field(default_factory=ThreadCPU)  # the writer thread's CPU (part of write_s; the rest waits)
    stall_s: float = 0.0  # time the forward loop waited for room in the queue


class ShardWriter:
    """Writes shards on a thread, in order, then records each in the manifest (`on_written`)."""

    def __init__(self, directory: Path, on_written: Callable[[dict, bool], None], metadata: dict[str, str],
                 depth: int = 2, nice: int = 0) -> None:
        self.directory, self.on_written, self.metadata, self.nice = directory, on_written, metadata, nice
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.stats = WriterStats()
        self.thread = threading.Thread(target=self._run, name="harvest-writer", daemon=True)
        self.thread.start()

    def _run(self):
        lower_this_thread(self.nice)  # engine/harvest/priority.py
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # drain: after a failure nothing else may be recorded
            try:
                self.write(item)
                self.stats.cpu.update()
            except BaseException as e:  # noqa: BLE001 (handed to the forward loop)
                self.error = e

    def write(self, item: Pending) -> None:
        """One shard hashed, written and recorded in the manifest (the writer's thread does this for each
        queued shard)."""
        t0 = time.perf_counter()
        meta = dict(self.metadata, shard=str(item.index), rows=f"{item.entry['rows'][0]}-{item.entry['rows'][1]}")
        sha, n = write_shard(self.directory / shard_name(item.index), item.tensors, meta)
        item.entry.update(file=shard_name(item.index), sha256=sha, bytes=n)
        self.on_written(item.entry, item.final)
        self.stats.shards += 1
        self.stats.bytes += n
        self.stats.write_s += time.perf_counter() - t0

    def submit(self, item: Pending) -> None:
        """Queue a shard; blocks (counted as stall) only while `depth` shards are already waiting."""
        self.check()
        t0 = time.perf_counter()
        while True:
            try:
                self.queue.put(item, timeout=0.5)
                break
            except queue.Full:
                self.check()
        self.stats.stall_s += time.perf_counter() - t0

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"writing shards to {self.directory} failed: {self.error}") from self.error

    def close(self) -> None:
        """Wait for every queued shard; re-raise a write failure."""
        self.queue.put(None)
        self.thread.join()
        self.check()
