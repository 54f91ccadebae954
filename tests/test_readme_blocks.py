"""scripts/readme_blocks.py: the README examples the tests and the device script run, found by section;
the quick start as written; every example's tensors built on the model's device; the runner's verdicts."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import readme_blocks

ROOT = Path(__file__).resolve().parents[1]


def test_every_block_is_found_once_and_is_python():
    for b in readme_blocks.BLOCKS:
        code = b.code()
        compile(code, f"README.md:{b.name}", "exec")
        assert "load_model(" in code
    with pytest.raises(ValueError, match="unknown README block 'nope'; blocks: quick-start, sae"):
        readme_blocks.get("nope")
    with pytest.raises(LookupError, match="README.md has no section '## Quick start'"):
        readme_blocks.get("quick-start").code("# nothing here\n")


def test_the_examples_build_their_tensors_where_the_model_runs():
    """A tensor an example makes for a model (a steer vector, an SAE) is made on m.device (issue 35: the
    quick start's torch.randn(m.d_model) failed against a cuda model)."""
    for b in readme_blocks.BLOCKS:
        code = b.code()
        for line in code.splitlines():
            if re.search(r"torch\.(randn|zeros|ones|rand|tensor)\(", line):
                assert "m.device" in line, f"{b.name}: {line.strip()}"
            if "load_sae(" in line:
                assert "device=m.device" in line, f"{b.name}: {line.strip()}"


def test_the_quick_start_runs_as_written(capsys):
    ns: dict = {}
    exec(compile(readme_blocks.get("quick-start").code(), "README.md", "exec"), ns)
    m, out = ns["m"], ns["out"]
    assert ns["v"].device == m.device and out.cache["resid_post.1"].shape[-1] == m.d_model
    printed = capsys.readouterr().out
    n = ns["logits"].shape[1]
    assert f"'attn_probs.0': (1, {n}, " in printed and f"torch.Size([1, {n + 5 - 1}, {m.d_model}])" in printed


def test_the_runner_sends_every_load_to_the_device_and_says_what_failed(tmp_path, monkeypatch, capsys):
    """On a README of two blocks, asked for cuda on a machine without one: the first block's load_model fails
    because it was sent to cuda (the runner's default reached it), the second raises its own error; each is
    named with its message and the exit status is 1."""
    fake = tmp_path / "README.md"
    fake.write_text('# R\n\n## Quick start\n\n```bash\npython -c "\nfrom engine import load_model\n'
                    "m = load_model('meta-llama/Llama-3.2-1B')\n\"\n```\n\n"
                    "## SAEs and transcoders\n\n```python\nfrom engine import load_model\n"
                    "raise RuntimeError('the example broke')\n```\n")
    monkeypatch.setattr(readme_blocks, "README", fake)
    rc = readme_blocks.main(["--device", "cuda", "--names", "quick-start,sae", "--workdir", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert rc == 1
    quick, sae = out.split("readme sae on cuda:")
    assert "readme quick-start on cuda: FAILED" in quick and "OptionError" in quick and "cuda" in quick
    assert sae.startswith(" FAILED") and "RuntimeError: the example broke" in sae
    assert out.rstrip().endswith("0 of 2 ran; failed: quick-start, sae")


def test_the_runner_on_the_cpu_runs_the_quick_start():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_blocks.py"), "--names", "quick-start"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "readme quick-start on cpu: ok" in proc.stdout and "1 of 1 ran" in proc.stdout


@pytest.mark.slow
def test_the_runner_runs_every_block_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_blocks.py"), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(readme_blocks.BLOCKS)} of {len(readme_blocks.BLOCKS)} ran" in proc.stdout
    assert (tmp_path / "patching.png").stat().st_size > 0  # the workflows block wrote its plot where it ran
