"""Files written whole or not at all: the one atomic-write helper every writer in the project uses.

A reader (or a second run writing the same file) sees the old file or the complete new one, never a
part: the data goes to a temp file in the same folder, which then replaces the target by rename. A
killed writer leaves at most a temp file whose name carries TMP_MARK, which `remove_temps` deletes.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

# every temp file is named `.{target name}{TMP_MARK}{random}`, so leftovers can be found by glob
TMP_MARK = ".tmp-"


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (the folder entry itself is flushed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: Path | str, data: bytes | str | Sequence[bytes | memoryview], *, mode: int | None = None,
                 durable: bool = False, cache: bool = True) -> None:
    """Write `data` (str is written as UTF-8; a sequence of buffers is written one after another,
    without joining them) to `path` atomically, creating its folder if needed.

    mode: the file's permission bits (default: what a plain `open` would give under the umask;
    the temp file itself is private until then). durable: also fsync the folder after the rename,
    for writers whose crash-recovery depends on the file surviving a power loss. cache=False: drop
    the file's pages from the page cache once they are on disk, for writers that stream more data
    than memory holds (harvest shards): the next writes reuse those pages instead of taking fresh
    ones, which is most of the kernel's cost of a write on a virtual machine (docs/harvest.md).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [data.encode()] if isinstance(data, str) else [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TMP_MARK}")
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
            if not cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.chmod(tmp, _umask_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def remove_temps(directory: Path) -> int:
    """Delete the temp files killed writers left in `directory`; how many."""
    n = 0
    for p in directory.glob(f".*{TMP_MARK}*"):
        p.unlink(missing_ok=True)
        n += 1
    return n
