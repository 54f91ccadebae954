"""Manifests: what an output holds and what produced it; the guard against mixing runs.

Layout of an output directory OUT:

    OUT/part-00000-of-00002/part.json          this part's identity, shards and resume cursors
    OUT/part-00000-of-00002/shard-000000.safetensors
    OUT/part-00001-of-00002/...
    OUT/manifest.json                           written once every part is complete (the merge)

`identity` holds everything that changes the bytes of a shard (model, points, dtypes, positions,
context, shard and batch sizes, the input, the number of parts); a run whose identity differs from
what OUT already holds is refused rather than mixed in. Timestamps live only under the keys in
`TIMESTAMPS`, so two runs of the same harvest differ nowhere else.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from engine.core.errors import MixingError, PartBusyError
from engine.core.files import write_atomic

FORMAT = "interp-harvest/1"
TIMESTAMPS = ("created", "updated", "merged")
MANIFEST, PART = "manifest.json", "part.json"


def part_dir(out: Path, part: int, of: int) -> Path:
    return Path(out) / f"part-{part:05d}-of-{of:05d}"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def dumps(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def read(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise MixingError(f"{path} is not a readable manifest ({e}); it was not written by the harvester.") from None


def compare(held: dict, wanted: dict, where: Path) -> None:
    """Raise MixingError naming every field that differs."""
    diff = [f"{k}: held {held.get(k)!r}, asked {wanted.get(k)!r}" for k in sorted(set(held) | set(wanted))
            if held.get(k) != wanted.get(k)]
    if diff:
        raise MixingError(f"{where} holds a different harvest; refusing to mix into it ({'; '.join(diff)}). "
                          f"Use another --out, or delete it to start over.")


def check_out(out: Path, identity: dict) -> dict | None:
    """Before loading anything: the merged manifest if OUT already holds this finished harvest;
    None if there is work to do; MixingError if OUT holds something else."""
    out = Path(out)
    if not out.exists():
        return None
    if not out.is_dir():
        raise MixingError(f"--out {out} is a file, not a directory.")
    if (out / MANIFEST).is_file():
        m = read(out / MANIFEST)
        compare(m.get("identity", {}), identity, out / MANIFEST)
        return m
    parts = sorted(p for p in out.iterdir() if p.is_dir() and p.name.startswith("part-"))
    others = [p.name for p in out.iterdir() if not p.name.startswith("part-") and not p.name.startswith(".")]
    if others:
        raise MixingError(f"--out {out} holds files that are not a harvest ({', '.join(sorted(others)[:5])}); "
                          f"choose an empty or new directory.")
    for p in parts:
        if (p / PART).is_file():
            compare(read(p / PART).get("identity", {}), identity, p / PART)
        elif not p.name.endswith(f"-of-{identity['parts']:05d}"):
            raise MixingError(f"{p} belongs to a harvest split into other parts than {identity['parts']}.")
    return None


@contextlib.contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    """Hold the part's lock: two processes writing one part (a retried array task next to the
    original, a command started twice) would interleave shards, so the second one is refused."""
    fd = os.open(Path(directory) / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PartBusyError(f"{directory} is being harvested by another process right now; wait for it "
                              f"or stop it (it resumes where it stopped).") from None
        yield
    finally:
        os.close(fd)


class PartManifest:
    """One part's part.json: identity, resolved facts, shards written, complete flag."""

    def __init__(self, directory: Path, data: dict) -> None:
        self.directory, self.data = Path(directory), data

    @classmethod
    def open(cls, directory: Path, identity: dict, resolved: dict, info: dict) -> "PartManifest":
        """Load this part's manifest (checking identity and resolved facts) or create it."""
        directory = Path(directory)
        path = directory / PART
        if path.is_file():
            data = read(path)
            compare(data["identity"], identity, path)
            compare(data["resolved"], resolved, path)
            return cls(directory, data)
        directory.mkdir(parents=True, exist_ok=True)
        m = cls(directory, {"format": FORMAT, "identity": identity, "resolved": resolved, "info": info,
                            "part": directory.name, "shards": [], "complete": False, "created": now()})
        m.save()
        return m

    @property
    def shards(self) -> list[dict]:
        return self.data["shards"]

    @property
    def complete(self) -> bool:
        return self.data["complete"]

    @property
    def rows(self) -> int:
        return self.shards[-1]["rows"][1] if self.shards else 0

    def add(self, entry: dict, final: bool = False) -> None:
        self.shards.append(entry)
        if final:
            self.data["complete"] = True
        self.save()

    def finish(self) -> None:
        self.data["complete"] = True
        self.save()

    def save(self) -> None:
        self.data["updated"] = now()
        write_atomic(self.directory / PART, dumps(self.data), durable=True)


def merge(out: str | os.PathLike[str]) -> dict | None:
    """Write OUT/manifest.json once every part is complete (None while some are not). Idempotent:
    an existing merged manifest with the same content is left untouched."""
    out = Path(out)
    parts = sorted(p for p in out.glob("part-*") if (p / PART).is_file())
    if not parts:
        raise MixingError(f"{out} holds no harvest parts.")
    ms = [read(p / PART) for p in parts]
    of = ms[0]["identity"]["parts"]
    for p, m in zip(parts, ms):
        compare(m["identity"], ms[0]["identity"], p / PART)
        compare(m["resolved"], ms[0]["resolved"], p / PART)
    if len(ms) < of or not all(m["complete"] for m in ms):
        return None
    shards, rows = [], 0
    for p, m in zip(parts, ms):
        for s in m["shards"]:
            n = s["rows"][1] - s["rows"][0]
            shards.append({"file": f"{p.name}/{s['file']}", "part": p.name, "rows": [rows, rows + n],
                           "docs": s["docs"], "sha256": s["sha256"], "bytes": s["bytes"]})
            rows += n
    merged = {"format": FORMAT, "identity": ms[0]["identity"], "resolved": ms[0]["resolved"],
              "info": ms[0]["info"], "rows": rows, "shards": shards,
              "columns": next((m["columns"] for m in ms if m.get("columns")), None),
              "created": min(m["created"] for m in ms), "merged": now()}
    path = out / MANIFEST
    if path.is_file():
        held = read(path)
        if {k: v for k, v in held.items() if k not in TIMESTAMPS} == \
                {k: v for k, v in merged.items() if k not in TIMESTAMPS}:
            return held
        compare(held["identity"], merged["identity"], path)
    write_atomic(path, dumps(merged), durable=True)
    return merged
