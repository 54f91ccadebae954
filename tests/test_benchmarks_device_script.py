"""benchmarks/device.sh, the check for a lent GPU machine with torch and transformers but no vLLM and no
registry, tested the only way this machine can: DRY=1 runs every phase tiny on the CPU, in a world where
vLLM and TransformerLens are not installed (tests/device_world hides them from every process). It must
run eager and the importable peers, skip the missing ones by name, run the README's examples, validate,
publish, print the one table, and hand back at most 8 files no deeper than $OUT/a/b/file."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile

import pytest

from benchmarks import cells as cellio

HIDE = "vllm,transformer_lens"
SCRIPT = cellio.ROOT / "benchmarks" / "device.sh"


def _default(name: str) -> str:
    m = re.search(rf'^{name}=\$\{{{name}:-"?([^}}"]*)"?\}}', SCRIPT.read_text(), re.M)
    assert m, f"device.sh sets no default for {name}"
    return m.group(1)


def test_the_script_names_only_variants_workloads_and_blocks_that_exist():
    """A typo in a default would cost the one device run its phase (bash -n cannot see it)."""
    from benchmarks.variants import get as get_variant
    from benchmarks.workloads import GPU_GENERATION, GPU_PREFILL
    from benchmarks.workloads import get as get_workload
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    for v in _default("PEERS").split(","):
        get_variant(v)
    for w in _default("PREFILL_WORK").split(",") + _default("GEN_WORK").split(","):
        get_workload(w)
    assert set(_default("PREFILL_WORK").split(",")) <= set(GPU_PREFILL)
    assert set(_default("GEN_WORK").split(",")) <= set(GPU_GENERATION)
    from engine.zoo import ZOO
    for m in _default("MODELS").split() + [_default("SMOL_MODEL")]:
        assert m in ZOO, m


@pytest.mark.slow
def test_a_dry_run_does_every_phase_and_hands_back_eight_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "DRY": "1", "OUT": str(out), "RESULTS": str(tmp_path / "r"),
           "MODELS": "meta-llama/Llama-3.2-1B", "SMOL_MODEL": "", "README_BLOCKS": "quick-start,sae",
           "INTERP_HIDE_MODULES": HIDE, "PYTHONPATH": str(cellio.ROOT / "tests" / "device_world")}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1500)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(len(f.parts) <= 3 for f in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for f in files for part in f.parts), files
    assert {str(f) for f in files} >= {"summary.md", "device.log", "device-env.txt", "readme.log", "sweeps.tgz",
                                       "validator.tgz", "published.tgz"}
    world = (out / "device-env.txt").read_text()
    assert "vllm: missing" in world and "transformer_lens: missing" in world and "torch 2." in world
    assert "device: variants eager,hf-generate,nnsight,interp-engine" in world
    assert "transformerlens: skipped, transformer_lens is not importable here" in text
    # the README examples ran on the chosen device; the table is printed last and handed back
    assert "readme blocks on cpu: 2 of 2 ran" in (out / "readme.log").read_text()
    summary = (out / "summary.md").read_text()
    assert summary.strip() in text and "(goal ≥ 0.98)" not in summary  # goals in their own column
    assert "| eager forward / HF forward (its default attention, SDPA), batched | `cpu-llama-3.2-1b-tiny-batch` |" \
        in summary
    assert "| eager, generation with a steer at every layer / without, batched | `cpu-llama-3.2-1b-tiny-batch-gen` |" \
        in summary
    assert "readme blocks on cpu: 2 of 2 ran" in summary and "| hf | meta-llama/Llama-3.2-1B | cpu |" in summary
    # what came back unpacks into sweeps whose cells ran, and validator cells made on the chosen device
    for name in ("sweeps", "validator", "published"):
        with tarfile.open(out / f"{name}.tgz") as t:
            t.extractall(tmp_path / "back", filter="data")
    sweeps = tmp_path / "back" / "sweeps"
    got = {c["id"]: c["status"] for d in sorted(sweeps.iterdir()) for c in cellio.load_sweep(d)}
    for cell in ("eager__batch_prefill", "eager__batch_capture", "eager__batch_steer", "hf-generate__batch_capture",
                 "nnsight__batch_steer", "interp-engine__batch_capture", "eager__batch_steer_gen"):
        assert got[cell] == "ok", (cell, got)
    assert got["hf-generate__batch_steer"] == "n/a" and not [c for c in got if c.startswith("transformerlens")]
    from validator import cells as vcells
    vc = {c["engine"]: c for c in vcells.load_all(tmp_path / "back" / "validator")}
    assert vc["hf"]["status"] == "ok" and vc["hf"]["summary"]["fail"] == 0 and vc["hf"]["variant"]["device"] == "cpu"
    assert vc["transformer_lens"]["status"] == "skipped"
    assert "'transformer_lens' is not importable here" in vc["transformer_lens"]["reason"]
    assert (tmp_path / "back" / "published" / "results-latest.md").exists()
    assert "cpu-llama-3.2-1b-tiny-batch" in (tmp_path / "back" / "published" / "benchmarks.generated.ts").read_text()
    assert "== site data: exit 0" in text  # the site's data file, visualizer_data's own command
    # the steered decode step's host breakdown ran on the chosen device, its figures in logs.tgz
    assert "== decode sites: exit 0" in text and "| engine: the steered sites |" in text
    with tarfile.open(out / "logs.tgz") as t:
        assert json.load(t.extractfile("logs/decode-sites.json"))["device"] == "cpu"


def test_the_hider_makes_a_module_missing(tmp_path):
    env = {**os.environ, "INTERP_HIDE_MODULES": HIDE, "PYTHONPATH": str(cellio.ROOT / "tests" / "device_world")}
    code = ("import importlib.util as u\n"
            "def f(m):\n"
            "    try: return u.find_spec(m) is not None\n"
            "    except ImportError: return False\n"
            "print(f('vllm'), f('transformer_lens'), f('torch'))")
    proc = subprocess.run([str(cellio.ROOT / ".venv" / "bin" / "python"), "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.split() == ["False", "False", "True"], proc.stderr


def test_the_summary_says_what_is_missing(tmp_path):
    """The table names a sweep folder with no cells, an absent validator folder and a README phase that did
    not run, instead of leaving them out."""
    import sys
    (tmp_path / "empty-sweep").mkdir()
    proc = subprocess.run([sys.executable, str(cellio.ROOT / "scripts" / "device_summary.py"), "--sweeps",
                           str(tmp_path / "empty-sweep"), "--validator", str(tmp_path / "nov"), "--readme",
                           str(tmp_path / "none.log")], capture_output=True, text=True, timeout=120, cwd=cellio.ROOT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "| (no cells) | `empty-sweep` | — | | missing |" in out
    assert f"no validator cells under {tmp_path / 'nov'}" in out
    assert f"README examples: no log at {tmp_path / 'none.log'} (the phase did not run)" in out


def test_the_summary_marks_goals_met_missed_and_unresolved():
    from benchmarks.ci import Interval
    from benchmarks.ratios import RatioResult, RatioSpec
    from scripts.device_summary import verdict
    spec = RatioSpec("gpu", ("eager", "batch_steer"), ("eager", "batch_prefill"), goal=0.95)

    def res(median, lo, hi):
        return RatioResult(spec, Interval(median, lo, hi, 6, 0.97), {}, 0.25)
    assert verdict(res(0.97, 0.95, 0.99), 0.95) == "meets"
    assert verdict(res(0.90, 0.88, 0.93), 0.95) == "misses"
    assert verdict(res(0.90, 0.5, 1.2), 0.95) == "unresolved"
    assert verdict(res(0.90, 0.88, 0.93), None) == ""
