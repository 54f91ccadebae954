"""Every `python -m <our module> ...` line in the CI workflows must be accepted by that module's own
argument parser, so a renamed or removed flag fails here instead of in the nightly GPU job (as
`--fresh` did). The module runs as `__main__` with its arguments until its parser has parsed them, then
stops: nothing is computed, no model is loaded."""
from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
OURS = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}  # engine, validator, benchmarks ...
SEPARATORS = {"&&", "||", ";", "|", ">", ">>", "2>", "&"}


class _Parsed(Exception):
    pass


def _env_values(doc: dict, job: dict, step: dict) -> dict[str, str]:
    """Workflow, job and step env; a `${{ ... || 'x' }}` expression stands for its default x."""
    out = {}
    for scope in (doc, job, step):
        for k, v in (scope.get("env") or {}).items():
            m = re.search(r"\|\|\s*'([^']*)'", str(v))
            out[k] = m.group(1) if m else "1" if "${{" in str(v) else str(v)  # ${{ matrix.shard }}: a sample value
    return out


def commands(text: str, env: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(module, argv) of each `python -m module args...` in a shell script's text."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), "1"), line)
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, w in enumerate(words[:-2]):
            if re.fullmatch(r"(\S*/)?python(3(\.\d+)?)?", w) and words[i + 1] == "-m":
                args = []
                for a in words[i + 3:]:
                    if a in SEPARATORS:
                        break
                    args.append(a)
                out.append((words[i + 2], args))
    return out


def workflow_commands(path: Path) -> list[tuple[str, list[str]]]:
    doc = yaml.safe_load(path.read_text())
    out = []
    for job in (doc.get("jobs") or {}).values():
        for step in job.get("steps") or ():
            if "run" in step:
                out += commands(step["run"], _env_values(doc, job, step))
    return out


def parse_like_cli(module: str, argv: list[str], monkeypatch) -> None:
    """Run `python -m module argv` until its top-level parse_args returns; SystemExit(2) on a bad flag."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(_Parsed):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def _our_commands():
    return [pytest.param(m, a, id=f"{p.name}:{m} {' '.join(a)}"[:120])
            for p in WORKFLOWS for m, a in workflow_commands(p) if m.split(".")[0] in OURS]


def test_the_workflows_call_our_commands():
    assert WORKFLOWS, "no workflow files found"
    called = {m.split(".")[0] for p in WORKFLOWS for m, _ in workflow_commands(p)}
    assert {"validator", "benchmarks"} <= called, called  # the extraction finds the nightly's commands
    nightly = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly-gpu.yml").read_text())
    jobs = nightly["jobs"]
    for name in ("validator", "benchmarks"):  # the GPU runners install the pinned CUDA set, nothing by hand
        assert any("scripts/setup.sh --cuda" in s.get("run", "") for s in jobs[name]["steps"]), name
    runs = [s.get("run", "") for job in jobs.values() for s in job["steps"]]
    assert any(s.get("run", "").strip() == "bash benchmarks/gpu.sh" for s in jobs["benchmarks"]["steps"])
    assert not any("pip install" in r for r in runs)


def _nightly() -> dict:
    return yaml.safe_load((ROOT / ".github" / "workflows" / "nightly-gpu.yml").read_text())


def test_the_nightly_is_a_matrix_of_gpu_runners_plus_one_publishing_job():
    """The runner count is an input; the shards job turns it into 1..N; each validator runner computes shard
    i/N of the matrix; one publishing job merges every shard and compares with last night."""
    import os
    import subprocess
    doc = _nightly()
    on = doc.get("on") or doc.get(True)  # YAML 1.1 reads the key `on` as true
    assert on["workflow_dispatch"]["inputs"]["runners"]["default"] == "2"
    assert doc["env"]["RUNNERS"] == "${{ github.event.inputs.runners || '2' }}"
    jobs = doc["jobs"]
    split = jobs["shards"]["steps"][0]["run"]
    cmd = split.split(">>")[0].strip()
    got = subprocess.run(cmd, shell=True, capture_output=True, text=True, env={**os.environ, "RUNNERS": "3"})
    assert got.stdout.strip() == "list=[1, 2, 3]"
    bad = subprocess.run(cmd, shell=True, capture_output=True, text=True, env={**os.environ, "RUNNERS": "0"})
    assert bad.returncode != 0  # no runners: refused, not an empty matrix
    v = jobs["validator"]
    assert v["needs"] == "shards" and "gpu" in v["runs-on"]
    assert v["strategy"]["matrix"]["shard"] == "${{ fromJSON(needs.shards.outputs.list) }}"
    assert v["env"]["SHARD"] == "${{ matrix.shard }}"
    shard_cmds = [(m, a) for s in v["steps"] if "run" in s for m, a in commands(s["run"], {})
                  if m == "validator"]
    assert {a[0] for _, a in shard_cmds} == {"plan", "run"}
    for _, argv in shard_cmds:
        assert argv[argv.index("--shard") + 1] == "$SHARD/$RUNNERS".replace("$SHARD", "1").replace("$RUNNERS", "1")
    upload = next(s for s in v["steps"] if "upload-artifact" in s.get("uses", ""))
    assert upload["with"]["name"] == "validator-shard-${{ matrix.shard }}" and upload["if"] == "always()"
    p = jobs["publish"]
    assert p["needs"] == ["validator", "benchmarks"] and "gpu" not in p["runs-on"]
    pub = [a for s in p["steps"] if "run" in s for m, a in commands(s["run"], {}) if m == "validator"]
    assert ["merge", "shards/validator-shard-*", "--out", "reports/validator"] in pub
    assert any(a[:2] == ["report", "--since"] for a in pub)
    last = p["steps"][-1]
    assert last["if"] == "steps.since.outcome == 'failure'" and "exit 1" in last["run"]  # published, then red


@pytest.mark.parametrize("module, argv", _our_commands())
def test_each_workflow_command_parses(module, argv, monkeypatch):
    parse_like_cli(module, argv, monkeypatch)


def test_a_made_up_flag_fails(monkeypatch, capsys):
    text = ('run: |\n  .venv/bin/python -m benchmarks run --real --fresh --device cuda \\\n'
            '    --prompt-tokens "$PROMPT_TOKENS"\n')
    (module, argv), = commands(yaml.safe_load(text)["run"], {"PROMPT_TOKENS": "512"})
    assert (module, argv) == ("benchmarks", ["run", "--real", "--fresh", "--device", "cuda", "--prompt-tokens", "512"])
    with pytest.raises(SystemExit) as e:
        parse_like_cli(module, argv, monkeypatch)
    assert e.value.code == 2
    assert "unrecognized arguments: --fresh" in capsys.readouterr().err


def test_a_bad_value_and_a_missing_subcommand_fail(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_like_cli("benchmarks", ["run", "--rounds", "many"], monkeypatch)
    assert "invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_like_cli("validator", ["--real"], monkeypatch)
