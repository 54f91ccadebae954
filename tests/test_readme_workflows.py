"""The README's "Workflows" block, as written, on the zoo twin: it runs offline, and what it prints
is checked here against the engine's own calls (patching restores the clean logit difference,
probs @ value = z, the refusal names its alternative)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _block() -> str:
    text = README.read_text()
    section = text.split("## Workflows", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_workflows_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(_block(), "README.md", "exec"), ns)
    m, res, att = ns["m"], ns["res"], ns["att"]
    assert (tmp_path / "patching.png").stat().st_size > 0
    assert res.values.shape == (m.n_layers, len(res.positions))
    # patching the differing token at the first layer restores the clean metric exactly
    torch.testing.assert_close(res.values[0, 11], torch.tensor(res.clean), rtol=0, atol=1e-5)
    assert not att.missing and set(att.probs) == set(range(m.n_layers))
    for layer in att.layers:
        torch.testing.assert_close(att.mixed(layer), att.z[layer], rtol=1e-5, atol=1e-6)
    out = capsys.readouterr().out
    assert "True" in out and "use attn_out" in out
