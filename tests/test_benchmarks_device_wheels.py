"""benchmarks/device_wheels.py: what a device call carries, asked of pip the way the device README says,
checked in a world that has only the machine's packages, and weighed against the 64 MiB a call carries."""
from __future__ import annotations

import json
import sys
import zipfile

from benchmarks import device_wheels as dw


def _fake_wheel(dest, name: str, version: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")


def test_download_asks_pip_for_py312_linux_wheels_and_drops_stale_ones(tmp_path):
    dest, record = tmp_path / "whl", tmp_path / "argv.json"
    _fake_wheel(dest, "nnsight", "0.6.0")  # another version of a carried package: two would stop the install
    _fake_wheel(dest, "transformers", "5.19.0")  # not asked for this time
    _fake_wheel(dest, "nnterp", "1.3.0")  # the carried version: kept
    pip = (sys.executable, "-c", f"import json, sys; open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))")
    dw.download(dest, with_transformers=False, pip=pip)
    argv = json.loads(record.read_text())
    assert argv[:3] == ["download", "--no-deps", "--only-binary=:all:"]
    assert argv[argv.index("--python-version") + 1] == "3.12" and argv[argv.index("--implementation") + 1] == "cp"
    assert "manylinux_2_28_x86_64" in argv and "manylinux2014_x86_64" in argv and argv[argv.index("-d") + 1] == str(dest)
    assert set(dw.CARRY) <= set(argv) and dw.TRANSFORMERS not in argv
    assert sorted(p.name for p in dest.glob("*.whl")) == ["nnterp-1.3.0-py3-none-any.whl"]
    dw.download(dest, with_transformers=True, pip=pip)
    assert dw.TRANSFORMERS in json.loads(record.read_text())


def test_the_world_has_only_the_machines_packages_and_the_carried_ones(tmp_path):
    """toml is not on the machine's image: absent until a wheel of it is carried; torch is there either way."""
    empty = tmp_path / "none"
    empty.mkdir()
    ok, text = dw.check(empty, imports=("torch", "toml"))
    assert not ok and "torch: imports" in text and "toml: FAILS: ModuleNotFoundError: No module named 'toml'" in text
    _fake_wheel(tmp_path / "carried", "toml", "0.10.2")
    ok, text = dw.check(tmp_path / "carried", imports=("torch", "toml"))
    assert ok, text
    assert "toml" not in dw.DEVICE_HAS and {"torch", "transformers", "huggingface-hub"} <= dw.DEVICE_HAS


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


def test_the_carry_set_pins_one_version_of_each():
    names = [dw.norm(w.split("==")[0]) for w in dw.CARRY]
    assert len(names) == len(set(names)) and all("==" in w for w in dw.CARRY)
    assert not set(names) & {dw.norm(d) for d in dw.DEVICE_HAS}  # nothing the machine already has
