"""The README's "Workflows" block, as written, on the zoo twin: it runs offline, and what it prints
is checked here against the engine's own calls (patching restores the clean logit difference,
probs @ value = z, the refusal names its alternative)."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from scripts import readme_blocks

README = Path(__file__).resolve().parents[1] / "README.md"


def _block() -> str:
    return readme_blocks.get("workflows").code()


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


def _async_block() -> str:
    """The README's async example: the block under "The vLLM backends" that runs asyncio."""
    section = README.read_text().split("## The vLLM backends", 1)[1].split("\n## ", 1)[0]
    return next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "asyncio.run(" in b)


@pytest.mark.vllm
def test_readme_async_example_runs_as_written_from_its_own_loop():
    """`asyncio.run(...)` starts the reader's own event loop, not the model's: m.aio must hand each call
    to the engine's loop and bring the result back (it used to wait forever)."""
    from test_vllm_common import check, vllm_model
    m = vllm_model("meta-llama/Llama-3.2-1B")
    printed: list = []
    ns: dict = {"m": m, "print": lambda *a, **k: printed.append(a)}
    done = threading.Event()

    def run():
        try:
            exec(compile(_async_block(), "README.md", "exec"), ns)
        finally:
            done.set()
    t = threading.Thread(target=run, daemon=True)  # a hang fails the test instead of stalling the run
    t.start()
    assert done.wait(300), "the README's async example did not finish within 300 s"
    outs = ns["outs"]
    assert len(outs) == 2
    for p, (logits, cache) in zip(["a prompt", "another prompt"], outs):
        ref_logits, ref = m.run_with_cache(p, ["resid_post.1"])
        check(cache["resid_post.1"], ref["resid_post.1"], "resid_post")
        check(logits, ref_logits, "lm_head")
    ref = m.generate("a prompt", 16)
    assert [a[0] for a in printed] == ref.new_tokens[0].tolist()
    assert all(isinstance(a[2], float) for a in printed)  # each step's log-probability


def _readouts_block() -> str:
    return readme_blocks.get("readouts").code()


def test_readme_readouts_example_runs_as_written(capsys):
    """The README's readout / feature-steering example: a random SAE written to disk, read out and
    steered with; the clamp removes the feature it clamped to 0 from the last token's top features."""
    ns: dict = {}
    exec(compile(_readouts_block(), "README.md", "exec"), ns)
    cache, steered, f = ns["cache"], ns["steered"], ns["f"]
    assert cache.readouts["feats"].indices.shape[-1] == 5 and steered.receipts[0].rows == 1
    from engine.core.sae_files import load_sae
    sae = load_sae(ns["sae"])
    # clamping feature f to 0 removes exactly its decoded part: value * its decoder row
    want = float(cache.readouts["feats"].values[0, -1, 0]) * float(sae.W_dec[f].norm())
    assert abs(steered.receipts[0].change_norm - want) < 1e-4 * max(1.0, want)
    assert ns["out"].cache.readouts["feats"].indices.shape[-1] == 5
    assert "Receipt(" in capsys.readouterr().out
