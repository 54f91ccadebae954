"""engine.core.files.write_atomic: the one atomic writer (whole file or the old one, never a part)."""
import os
import stat

import pytest

from engine.core import files


def test_writes_str_and_bytes_creating_the_folder(tmp_path):
    p = tmp_path / "a" / "b" / "x.txt"
    files.write_atomic(p, "h\u00e9")
    assert p.read_bytes() == "h\u00e9".encode()
    files.write_atomic(str(p), b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    assert [q.name for q in p.parent.iterdir()] == ["x.txt"]


def test_mode_defaults_to_the_umask_and_can_be_set(tmp_path):
    umask = os.umask(0o027)
    try:
        files.write_atomic(tmp_path / "u", "x")
        files.write_atomic(tmp_path / "m", "x", mode=0o644)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "u").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == 0o644


def test_a_failed_rename_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "x.json"
    files.write_atomic(p, "old", durable=True)

    def boom(*a):
        raise OSError("disk full")
    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        files.write_atomic(p, "new")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["x.json"]


def test_remove_temps_deletes_only_leftover_temps(tmp_path):
    (tmp_path / f".x.json{files.TMP_MARK}abc").write_text("half")
    (tmp_path / "x.json").write_text("whole")
    (tmp_path / ".hidden").write_text("keep")
    assert files.remove_temps(tmp_path) == 1
    assert sorted(q.name for q in tmp_path.iterdir()) == [".hidden", "x.json"]


def test_a_sequence_of_buffers_is_written_in_order(tmp_path):
    p = tmp_path / "parts.bin"
    files.write_atomic(p, [b"head", memoryview(b"--body--")[2:6], bytearray(b"tail")], durable=True)
    assert p.read_bytes() == b"headbodytail"


def _resident_pages(path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages of the file), from mincore(2) over a mapping."""
    import ctypes
    import mmap
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: nothing is written back
    try:
        buf = (ctypes.c_char * size).from_buffer(mm)
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        del buf
        return sum(v & 1 for v in vec), len(vec)
    finally:
        mm.close()


def _on_tmpfs(path) -> bool:
    best, kind = "", ""
    for line in open("/proc/mounts"):
        mount, fs = line.split()[1:3]
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fs
    return kind in ("tmpfs", "ramfs")


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/mounts"), reason="Linux only")
def test_cache_false_leaves_the_written_pages_out_of_the_page_cache(tmp_path):
    """A harvest streams more than memory holds: its shards' pages are dropped once on disk (the
    next writes reuse them), while other writers keep theirs cached."""
    if _on_tmpfs(tmp_path):
        pytest.skip("tmpfs files live in the page cache")
    data = os.urandom(4 << 20)
    files.write_atomic(tmp_path / "kept", data)
    files.write_atomic(tmp_path / "dropped", data, durable=True, cache=False)
    kept, pages = _resident_pages(tmp_path / "kept")
    dropped, _ = _resident_pages(tmp_path / "dropped")
    assert kept > pages // 2, (kept, pages)  # the measure sees cached pages
    assert dropped < pages // 10, (dropped, pages)
    assert (tmp_path / "dropped").read_bytes() == data
