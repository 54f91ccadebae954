"""benchmarks/gpu.sh, the GPU run, tested the only way this machine can: on CPU with the tiny twin,
two variants and two workloads, into temporary folders (builds, sweeps, publishes, stays in budget).
The variants are eager and plain HF so the test stays near 30 s (a vLLM engine alone takes 30-60 s
to start here); the vLLM variants run in every sweep (benchmarks/cpu.sh)."""
from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks import cells as cellio


@pytest.mark.slow
def test_gpu_script_runs_on_cpu_with_a_tiny_model(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# R\n<!-- THROUGHPUT:START -->\n<!-- THROUGHPUT:END -->\n")
    env = {**os.environ, "DEVICE": "cpu", "SIZE": "tiny", "MODELS": "meta-llama/Llama-3.2-1B", "PROMPT": "16",
           "NEW": "4", "ROUNDS": "6", "MIN_SAMPLE": "0", "VARIANTS": "eager,hf-generate",
           "WORKLOADS": "prefill,capture_all", "SKIP_TESTS": "1", "SKIP_VALIDATOR": "1", "SKIP_SERVE": "1", "OUT": str(tmp_path / "sw"),
           "PUBLISH_ARGS": f"--readme {readme} --out {tmp_path / 'o'}", "SITE_ARGS": f"--out {tmp_path / 's'}"}
    proc = subprocess.run(["bash", str(cellio.ROOT / "benchmarks" / "gpu.sh")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== sweep meta-llama/Llama-3.2-1B: exit 0" in proc.stdout and "== publish: exit 0" in proc.stdout
    assert "== site data: exit 0" in proc.stdout and "cpu-llama-3.2-1b-tiny" in (tmp_path / "s" / "benchmarks.generated.ts").read_text()
    cells = cellio.load_sweep(tmp_path / "sw" / "cpu-llama-3.2-1b-tiny")
    status = {c["id"]: c["status"] for c in cells}
    assert status == {"eager__prefill": "ok", "eager__capture_all": "ok", "hf-generate__prefill": "ok",
                      "hf-generate__capture_all": "ok"}
    assert "| eager, capture at every layer / HF forward |" in readme.read_text()
