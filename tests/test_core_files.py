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
