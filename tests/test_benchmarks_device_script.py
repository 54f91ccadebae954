"""benchmarks/device.sh, the check for a lent GPU machine with torch and transformers but no vLLM and
no registry, tested the only way this machine can: on CPU with the tiny twin, in a world where vLLM and
TransformerLens are not installed (tests/device_world hides them from every process): it must run
eager and the importable peers, skip the missing ones by name, publish and validate what ran."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks import cells as cellio

HIDE = "vllm,transformer_lens"


@pytest.mark.slow
def test_device_script_runs_without_vllm_and_skips_what_is_missing(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "SIZE": "tiny", "MODELS": "meta-llama/Llama-3.2-1B", "PROMPT": "16",
           "NEW": "4", "ROUNDS": "6", "MIN_SAMPLE": "0", "CANDIDATES": "eager,hf-generate,transformerlens,vllm",
           "WORKLOADS": "prefill,capture_all", "ENGINES": "hf,transformer_lens",
           "VALIDATOR_ARGS": "--points resid_post --no-decode --no-steer", "RESULTS": str(tmp_path / "r"),
           "INTERP_HIDE_MODULES": HIDE, "PYTHONPATH": str(cellio.ROOT / "tests" / "device_world")}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(cellio.ROOT / "benchmarks" / "device.sh")], env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    world = (tmp_path / "r" / "device-env.txt").read_text()
    assert "vllm: missing" in world and "transformer_lens: missing" in world and "torch 2." in world
    assert "device: variants eager,hf-generate" in world
    assert "transformerlens: skipped, transformer_lens is not importable here" in out
    cells = cellio.load_sweep(tmp_path / "r" / "sweeps" / "cpu-llama-3.2-1b-tiny")
    assert {c["id"]: c["status"] for c in cells} == {"eager__prefill": "ok", "eager__capture_all": "ok",
                                                     "hf-generate__prefill": "ok", "hf-generate__capture_all": "ok"}
    assert (tmp_path / "r" / "published" / "results-latest.md").exists()
    assert "cpu-llama-3.2-1b-tiny" in (tmp_path / "r" / "benchmarks.generated.ts").read_text()  # the site data
    assert "| eager, capture at every layer / HF forward |" in (tmp_path / "r" / "THROUGHPUT.md").read_text()
    vcells = {p.name: json.loads(p.read_text()) for p in (tmp_path / "r" / "validator" / "cells").glob("*.json")}
    hf = next(c for n, c in vcells.items() if "__hf@" in n)
    tl = next(c for n, c in vcells.items() if "__transformer_lens@" in n)
    assert "== validator eager columns: exit 0" in out and "== publish: exit 0" in out and "== site data: exit 0" in out
    assert hf["status"] == "ok" and hf["summary"]["pass"] > 0 and hf["summary"]["fail"] == 0
    assert hf["variant"]["device"] == "cpu"
    assert tl["status"] == "skipped" and "'transformer_lens' is not importable here" in tl["reason"]


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
