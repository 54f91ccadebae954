"""benchmarks/device_wheels.py: what a device call carries, asked of pip the way the device README says,
checked in a world that has only the machine's packages, and weighed against the 64 MiB a call carries."""
from __future__ import annotations

import json
import sys
import zipfile

import pytest

from benchmarks import device_wheels as dw


def _fake_wheel(dest, name: str, version: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")


def test_download_asks_pip_for_py312_linux_wheels_and_drops_stale_ones(tmp_path):
    dest, record = tmp_path / "whl", tmp_path / "argv.jsonl"
    side = dest / dw.NNTERP_REF
    _fake_wheel(dest, "nnsight", "0.6.0")  # another version of a carried package: two would stop the install
    _fake_wheel(dest, "transformers", "5.19.0")  # not asked for this time
    _fake_wheel(dest, "nnterp", "1.3.0")  # nnterp moved to its side folder: not beside nnsight 0.8.1
    _fake_wheel(dest, "nnsight", "0.8.1")  # the carried version: kept
    _fake_wheel(side, "nnsight", "0.6.0")  # the side's pin is 0.7.0
    _fake_wheel(side, "nnsight", "0.7.0")  # kept
    pip = (sys.executable, "-c", f"import json, sys; open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')")
    dw.download(dest, with_transformers=False, pip=pip)
    main, aside = [json.loads(line) for line in record.read_text().splitlines()]
    for argv, folder in ((main, dest), (aside, side)):
        assert argv[:3] == ["download", "--no-deps", "--only-binary=:all:"]
        assert argv[argv.index("--python-version") + 1] == "3.12" and argv[argv.index("--implementation") + 1] == "cp"
        assert "manylinux_2_28_x86_64" in argv and "manylinux2014_x86_64" in argv
        assert argv[argv.index("-d") + 1] == str(folder)
    assert set(dw.CARRY) <= set(main) and dw.TRANSFORMERS not in main and "nnsight==0.8.1" in main
    # the side folder: nnterp's pins (scripts/nnterp_reference.txt) and what the machine lacks for them
    assert aside[aside.index("-d") + 2:] == dw.nnterp_ref_pins()
    assert {"nnterp==1.3.0", "nnsight==0.7.0", "astor==0.8.1"} <= set(aside)
    assert sorted(p.name for p in dest.glob("*.whl")) == ["nnsight-0.8.1-py3-none-any.whl"]
    assert sorted(p.name for p in side.glob("*.whl")) == ["nnsight-0.7.0-py3-none-any.whl"]
    dw.download(dest, with_transformers=True, pip=pip)
    assert dw.TRANSFORMERS in json.loads(record.read_text().splitlines()[2])


# this environment's transformers and huggingface-hub (and what they import beyond the image) stand in for the
# image's own versions, which `device_site` installs from the registry
STAND_IN = ("transformers==5.19.0", "huggingface-hub==1.33.0", "httpcore2==0", "truststore==0", "httpx2==0")


def test_nnterp_imports_from_its_side_folder_in_the_machines_world(tmp_path):
    """The machine's world plus the side folder's wheels: nnterp imports on the side's nnsight 0.7.0; without
    astor (nnsight 0.7.0 imports it, 0.8.1 and the machine's image do not have it) it cannot."""
    from validator.engines import NNTERP_SIDE
    if NNTERP_SIDE.problem():
        pytest.skip(NNTERP_SIDE.problem())
    dest = tmp_path / "whl"
    for w in (*dw.CARRY, *STAND_IN):
        _fake_wheel(dest, w.split("==")[0].replace("-", "_"), w.split("==")[1])  # wheel names spell - as _
    for w in dw.nnterp_ref_pins():
        _fake_wheel(dest / dw.NNTERP_REF, w.split("==")[0].replace("-", "_"), w.split("==")[1])
    ok, text = dw.check_nnterp_ref(dest)
    assert ok and "nnterp (side): imports, nnterp 1.3.0 on nnsight 0.7.0 from" in text, text
    (dest / dw.NNTERP_REF / "astor-0.8.1-py3-none-any.whl").unlink()
    ok, text = dw.check_nnterp_ref(dest)
    assert not ok and "No module named 'astor'" in text, text


def test_the_world_has_only_the_machines_packages_and_the_carried_ones(tmp_path):
    """fancy_einsum (a TransformerLens dependency, so in every .venv of the pins; no dependencies of its own) is
    not on the machine's image: absent until a wheel of it is carried; torch is there either way. (toml served
    here until nnsight 0.8.1 stopped pulling it into .venv.)"""
    empty = tmp_path / "none"
    empty.mkdir()
    ok, text = dw.check(empty, imports=("torch", "fancy_einsum"))
    assert not ok and "torch: imports" in text
    assert "fancy_einsum: FAILS: ModuleNotFoundError: No module named 'fancy_einsum'" in text
    _fake_wheel(tmp_path / "carried", "fancy_einsum", "0.0.3")
    ok, text = dw.check(tmp_path / "carried", imports=("torch", "fancy_einsum"))
    assert ok, text
    assert "fancy-einsum" not in {dw.norm(d) for d in dw.DEVICE_HAS}
    assert {"torch", "transformers", "huggingface-hub"} <= dw.DEVICE_HAS


def test_size_weighs_the_checkout_and_the_wheels_against_the_limit(tmp_path, monkeypatch):
    dest = tmp_path / ".whl"
    dest.mkdir()
    (dest / "a-1-py3-none-any.whl").write_bytes(b"x" * 1000)
    tree = dw.tree_bytes()
    assert tree > 10 * 2 ** 20  # the checkout: megabytes of tracked files
    ok, text = dw.size(dest)
    assert ok and text.startswith(f"checkout {tree / 2 ** 20:.1f} MiB + .whl 0.0 MiB") and "of the 64 MiB" in text
    monkeypatch.setattr(dw, "LIMIT", tree + 999)
    ok, text = dw.size(dest)
    assert not ok and "OVER, carry fewer wheels" in text


def test_the_checkout_leaves_room_for_the_wheels_a_device_call_carries():
    """The prepared device run carries the checkout and .whl/ within 64 MiB: a checkout that grows past
    LIMIT - WHEELS_ROOM (as when the validator's cells were plain JSON, 43 MiB of a 64 MiB checkout) fails
    here, in the default run, before a lent machine is wasted on it."""
    tree = dw.tree_bytes()
    assert tree + dw.WHEELS_ROOM <= dw.LIMIT, (
        f"the checkout is {tree / 2 ** 20:.1f} MiB: with the wheels ({dw.WHEELS_ROOM / 2 ** 20:.0f} MiB) it is over "
        f"the {dw.LIMIT / 2 ** 20:.0f} MiB a device call carries; shrink what reports/ commits")


def test_the_carry_set_pins_one_version_of_each():
    names = [dw.norm(w.split("==")[0]) for w in dw.CARRY]
    assert len(names) == len(set(names)) and all("==" in w for w in dw.CARRY)
    assert not set(names) & {dw.norm(d) for d in dw.DEVICE_HAS}  # nothing the machine already has
