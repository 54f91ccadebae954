"""The README's and docs' blocks, as written, on the zoo twins, offline: the Workflows, readouts and SAE / probe
blocks run here (what they print checked against the engine's own calls: patching restores the
clean logit difference, probs @ value = z, the readouts are the SAE's and the probe's own maths); the
vLLM blocks are complete scripts run as files by scripts/readme_blocks.py (slow: each starts an engine), the
harvest commands parse with the CLI's parser and run as pasted, from a temporary folder."""
from __future__ import annotations

import ast
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import readme_blocks

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


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


def _code(block: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in block.splitlines())


def _run(tmp_path: Path, name: str, text: str | None = None) -> tuple[bool, str, str]:
    """Run block `name` (its text replaced by `text`) as scripts/readme_blocks.py runs it, from tmp_path:
    (passed, stdout, stderr)."""
    block = readme_blocks.get(name)
    if text is not None:
        block = dataclasses.replace(block, text=text)
    env, _ = readme_blocks.environment(sys.executable, tmp_path)
    proc = readme_blocks.execute(block, "cpu", tmp_path, {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                                 timeout_s=900)
    return proc.returncode == 0, proc.stdout, proc.stderr


def test_every_readme_block_that_starts_vllm_is_a_script_under_a_main_guard():
    """vLLM spawns its engine core, which imports the user's script again: a block that loads a vLLM
    backend at the top level fails pasted into a file, and nothing pasted into stdin can start one."""
    starting = [b.code() for b in readme_blocks.all_blocks() if b.python and re.search(r"backend=[\"']vllm", _code(b.code()))]
    assert len(starting) >= 2, "the README's vLLM examples were not found"
    for b in starting:
        code = _code(b)
        guard = code.index('if __name__ == "__main__":')
        load = code.index("load_model(")
        assert guard < load and re.search(r"\n[ ]{4,}.*load_model\(", code[guard:]), b[:200]
        assert "import" in code.split("\n", 1)[0] or code.lstrip().startswith(("import", "from")), \
            f"a vLLM block must be complete (its imports first):\n{b[:200]}"


def _printed(stdout: str) -> list[str]:
    """What a script printed, without the log lines vLLM's processes write to the same stdout."""
    return [line for line in stdout.splitlines()
            if line.strip() and not re.match(r"(\(\w+ pid=\d+\) )?(INFO|WARNING|DEBUG|ERROR) ", line)]


@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm]), "eager"])
def test_readme_async_script_runs_as_a_file(tmp_path, backend):
    """The async block (vllm-async) saved as a file and run on each backend it names: `asyncio.run(...)` starts the
    reader's own event loop, not the model's, and m.aio hands each call to the engine's loop (vLLM) or a
    worker thread (eager); its stream prints the tokens eager generates, each with a log-probability, and
    the captures have the eager capture's shape."""
    from test_vllm_common import eager_model
    block = readme_blocks.get("vllm-async").code()
    assert 'backend="vllm"' in block and 'with `backend="eager"` too' in README.read_text()
    ok, out, err = _run(tmp_path, "vllm-async", block.replace('backend="vllm"', f'backend="{backend}"'))
    assert ok, err[-3000:]
    lines = _printed(out)
    steps, shapes = lines[:-1], ast.literal_eval(lines[-1])
    em = eager_model("meta-llama/Llama-3.2-1B")
    ref = em.generate("a prompt", 16)
    assert [int(line.split(" ", 1)[0]) for line in steps] == ref.new_tokens[0].tolist()
    assert all(float(line.rsplit(" ", 1)[1]) <= 0 for line in steps)  # each step's log-probability
    want = [tuple(em.run_with_cache(p, ["resid_post.1"])[1]["resid_post.1"].shape)
            for p in ("a prompt", "another prompt")]
    assert shapes == want


@pytest.mark.slow
@pytest.mark.vllm
def test_readme_tensor_parallel_script_runs_as_a_file(tmp_path):
    """The TP=2 block (vllm-tp) saved as a file and run (on CPU one core per rank): the gathered captures have the
    full shapes eager gives, and the steered request's receipt touched rows."""
    from test_vllm_common import eager_model
    ok, out, err = _run(tmp_path, "vllm-tp")
    assert ok, err[-3000:]
    shapes, last = _printed(out)[-2:]
    em = eager_model("meta-llama/Llama-3.2-1B")
    _, ref = em.run_with_cache(["a prompt", "another"], ["resid_post.-1", "z.1", "mlp_act.0"])
    assert ast.literal_eval(shapes) == {k: tuple(t.shape) for k, t in ref.items()}
    assert "Receipt(" in last and "rows=0" not in last


def test_a_vllm_load_from_stdin_is_refused_before_an_engine_starts():
    """Code read on stdin cannot start vLLM (the spawned engine process cannot read '<stdin>' again: it
    failed with FileNotFoundError there); the load says so, and what to do, before starting anything."""
    code = ("from engine import load_model\n"
            "load_model('meta-llama/Llama-3.2-1B', backend='vllm')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1
    assert ("EngineError: a vLLM backend cannot start from code read on stdin: vLLM spawns its engine core, which "
            "imports the main script again, and stdin cannot be read twice; save the code to a file, with the load "
            'under `if __name__ == "__main__":`, and run that file.') in proc.stderr
    assert "EngineCore" not in proc.stderr  # refused before any engine process


@pytest.mark.slow
@pytest.mark.vllm
def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    """A load at the top level of a script ran again in vLLM's spawned engine process and failed with
    multiprocessing's bootstrapping error under "Engine core initialization failed"; the root cause
    printed above that error now names the script and the guard."""
    script = tmp_path / "noguard.py"
    script.write_text("from engine import load_model\nm = load_model('meta-llama/Llama-3.2-1B', backend='vllm')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env)
    # the status read 0 after tests/test_harvest_ray.py while Ray's subreaper option made this pytest
    # process ignore SIGCHLD (engine/harvest/cluster.py CLUSTER_ENV)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "RuntimeError: Engine core initialization failed" in proc.stderr, proc.stderr[-2000:]
    assert (f"EngineError: a vLLM backend was loaded while vLLM's engine process was importing {tmp_path / 'noguard.py'}"
            f' again (vLLM spawns its engine core, which imports the script that started it): put the load under '
            f'`if __name__ == "__main__":`.') in proc.stderr
    # the hint was buried mid-traceback, under vLLM's "Engine core initialization failed": it is now the last line
    assert proc.stderr.rstrip().splitlines()[-1] == (
        f"engine.core.errors.EngineError: the vLLM engine did not start because {tmp_path / 'noguard.py'} loads it at "
        f"its top level: vLLM spawns its engine core, which imports that script again and runs the load a second "
        f'time; put the load under `if __name__ == "__main__":`.')


def test_an_unguarded_load_is_told_from_a_guarded_one(tmp_path):
    """What the failed start's last line rests on: a call from the main script's top level (directly or through a
    function called there) outside `if __name__ == "__main__":` is found; one under the guard is not."""
    script = tmp_path / "where.py"
    script.write_text("from engine.backends.vllm.runtime import unguarded_main_load as u\n"
                      "def load():\n    return u()\n"
                      "print('top', load() is not None)\n"
                      "if __name__ == '__main__':\n    print('guarded', load() is not None)\n"
                      "    def inner():\n        return load()\n    print('nested', inner() is not None)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["top", "True", "guarded", "False", "nested", "False"]


# -- the harvest commands ------------------------------------------------------------------------------------
def _harvest_commands() -> list[list[str]]:
    """Every `python -m engine.harvest ...` command of the harvest blocks, as argv after the module."""
    out = []
    for name in ("harvest-eager", "harvest-vllm", "harvest-ray"):
        for line in readme_blocks.get(name).code().replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("python -m engine.harvest"):
                out.append(shlex.split(line.replace('"$SAMPLE"', "sample.txt"))[3:])
            else:
                assert line == "" or line.startswith(("printf ", "SAMPLE=")), line
    return out


def _guide() -> str:
    return (REPO / "docs" / "harvest.md").read_text().split("## Guide", 1)[1].split("\n## ", 1)[0]


def test_readme_harvest_commands_parse_and_its_option_table_matches_the_cli():
    """The command was printed with literal `[--backend vllm|vllm-static|eager] ...` brackets and failed
    pasted ("unrecognized arguments"): each command now parses, and the option table's names and
    defaults are the CLI's own."""
    from engine.harvest.__main__ import parser
    cmds = _harvest_commands()
    assert len(cmds) >= 4
    p = parser()
    for argv in cmds:
        if argv[:1] in (["verify"], ["merge"], ["saelens"]):
            continue
        p.parse_args(argv)  # exits (SystemExit 2) on an unknown argument or a bad choice
    rows = re.findall(r"^\| (`--[^|]*`) \| [^|]* \| ([^|]*) \|$", _guide(), re.M)
    known = {o for a in p._actions for o in a.option_strings}
    defaults = {o: a.default for a in p._actions for o in a.option_strings}
    assert len(rows) >= 10
    for names, default in rows:
        for opt in re.findall(r"`(--[a-z-]+)", names):
            assert opt in known, f"docs/harvest.md lists {opt}, which python -m engine.harvest does not take"
        listed = re.fullmatch(r"`([^`]*)`", default.strip())
        if listed and names.count("`--") == 1:
            opt = re.findall(r"`(--[a-z-]+)", names)[0]
            assert str(defaults[opt]) == listed.group(1), f"docs/harvest.md says {opt} defaults to " \
                                                          f"{listed.group(1)}, the CLI to {defaults[opt]}"


def test_readme_eager_harvest_command_runs_as_written(tmp_path):
    """The README's harvest block (harvest-eager), pasted into bash in a folder outside the checkout: it writes its
    documents, harvests them on eager, and its verify command passes; the rows are the eager model's own
    captures."""
    import torch

    from engine.harvest import HarvestDataset
    from test_vllm_common import eager_model
    ok, _, err = _run(tmp_path, "harvest-eager")
    assert ok, err[-3000:]
    ds = HarvestDataset(tmp_path / "acts")
    row = ds[0]
    em = eager_model("meta-llama/Llama-3.2-1B")
    first = (tmp_path / "docs.txt").read_text().splitlines()[0]
    _, cache = em.run_with_cache(first, ["resid_post.1"])
    assert ds.points == ["resid_post.1", "mlp_out.1"] and int(row["doc_index"]) == 0
    torch.testing.assert_close(row["resid_post.1"], cache["resid_post.1"][0, int(row["position"])], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.vllm
def test_readme_vllm_harvest_command_runs_as_written(tmp_path):
    """docs/harvest.md's vLLM command (harvest-vllm), pasted: the bundled sample harvested on vLLM and exported
    in SAELens's layout."""
    import datasets
    ok, _, err = _run(tmp_path, "harvest-vllm")
    assert ok, err[-3000:]
    ds = datasets.load_from_disk(str(tmp_path / "acts-saelens"))
    assert ds.features["blocks.1.hook_resid_post"].shape == (128, 256) and len(ds) > 0


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


def test_readme_sae_folder_and_probe_file_block_runs_as_written(tmp_path, monkeypatch, capsys):
    """Loading an SAE from a local SAELens-format folder and a probe from a tensor file: the readouts
    are the loaded SAE's top-k of the captured activation and the probe's softmax(x @ W.T + b)."""
    from safetensors.torch import load_file

    from engine.core.features import topk
    from engine.core.sae_files import load_sae
    monkeypatch.chdir(tmp_path)
    block = readme_blocks.get("real-saes").code()
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    cache = ns["cache"]
    x = cache["resid_post.1"][0]
    sae, probe = load_sae(tmp_path / "saes/blocks.1.hook_resid_post"), load_file(tmp_path / "probe.safetensors")
    idx, vals = topk(sae.encode(x), 8)
    torch.testing.assert_close(cache.readouts["feats"].values[0], vals, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.readouts["feats"].indices[0], idx)
    torch.testing.assert_close(cache.readouts["probe"][0], torch.softmax(x @ probe["W"].T + probe["b"], -1),
                               rtol=1e-5, atol=1e-6)
    assert sae.hook_name == "blocks.1.hook_resid_post" and "jumprelu 256 1024 blocks.1.hook_resid_post" in \
        capsys.readouterr().out
