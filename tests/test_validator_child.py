"""The nnterp column in a child process on its own nnsight (validator/engines/child.py, side.py): the proxy
gives the tensors the in-process `hf` column gives, bit for bit; the child's nnsight / nnterp versions are
the ones reported; a missing or stale side directory is a skip that names the script; the digest follows
the side pins; an exception in the child crosses with its type's name; a child that died is replaced; the
child dies with its parent; and a child whose nnsight was imported before the side directory fails loudly."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from importlib import metadata
from pathlib import Path

import psutil
import pytest
import torch

from validator import cells as vcells
from validator import prompts, runner
from validator.engines import ENGINES, NNTERP_SIDE, adapter_class, availability
from validator.engines.base import EngineUnavailable, Missing, ModelContext
from validator.engines.child import ChildError, ChildReference
from validator.models import zoo_spec

REPO = Path(__file__).resolve().parents[1]
LLAMA, GPT2 = "meta-llama/Llama-3.2-1B", "openai-community/gpt2"
ADDRESSES = ["embeddings", "resid_pre.0", "attn_probs.0", "attn_out.0", "mlp_out.1", "resid_post.1", "final_norm",
             "lm_head", "q.0"]
PINS = {d: NNTERP_SIDE.pinned(d) for d in ("nnsight", "nnterp")}


def _need_side():
    why = NNTERP_SIDE.problem()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def llama():
    hf, tok = zoo_spec(LLAMA).load_reference()
    ctx = ModelContext(LLAMA, hf, tok, "zoo")
    return ctx, prompts.build_cases(tok, ctx.config)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _side_at(monkeypatch, folder: Path):
    """The nnterp engine with its side install at `folder` (the pins stay the project's)."""
    spec = ENGINES["nnterp"]
    monkeypatch.setitem(ENGINES, "nnterp", dataclasses.replace(spec, side=dataclasses.replace(spec.side,
                                                                                              folder=str(folder))))


def test_the_proxy_gives_the_hf_columns_tensors_and_the_childs_versions(llama):
    _need_side()
    ctx, cases = llama
    assert metadata.version("nnsight") != PINS["nnsight"]  # this process runs .venv's nnsight, not the side's
    hf = adapter_class("hf")(ctx)
    ref = adapter_class("nnterp")(ctx)
    try:
        assert isinstance(ref, ChildReference) and ref.pid != os.getpid() and _alive(ref.pid)
        assert ref.versions() == PINS  # the child's, from .nnterp-ref
        assert ref.TENSORS["resid_post"] == "layers_output[L]" and ref.steers
        for case in cases:  # the short prompt and the left-padded batch
            got, want = ref.capture(case, ADDRESSES), hf.capture(case, ADDRESSES)
            for a in ADDRESSES[:-1]:
                assert type(got[a]) is torch.Tensor, (a, got[a])
                torch.testing.assert_close(got[a], want[a], rtol=0, atol=0)  # same modules, same kernels: same bits
            assert isinstance(got["q.0"], Missing) and "has no accessor for 'q'" in got["q.0"].reason
        v = torch.randn(ctx.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 5
        steered = ref.steer_logits(cases[0], 1, v)
        torch.testing.assert_close(steered, hf.steer_logits(cases[0], 1, v), rtol=0, atol=0)
        assert not torch.equal(steered, hf.capture(cases[0], ["lm_head"])["lm_head"])  # the steer did something
        # two proxies open at once in the one child each read their own model
        hf2, tok2 = zoo_spec(GPT2).load_reference()
        ctx2 = ModelContext(GPT2, hf2, tok2, "zoo")
        other = adapter_class("nnterp")(ctx2)
        try:
            assert other.pid == ref.pid  # one child serves the run
            c2 = prompts.build_cases(tok2, ctx2.config)[0]
            torch.testing.assert_close(other.capture(c2, ["resid_post.0"])["resid_post.0"],
                                       adapter_class("hf")(ctx2).capture(c2, ["resid_post.0"])["resid_post.0"],
                                       rtol=0, atol=0)
            probs = other.capture(c2, ["attn_probs.0"])["attn_probs.0"]  # GPT-2: the declared nnterp-probs-source gap
            assert isinstance(probs, Missing) and "nnterp disabled attention probabilities" in probs.reason
            torch.testing.assert_close(ref.capture(cases[0], ["lm_head"])["lm_head"],
                                       hf.capture(cases[0], ["lm_head"])["lm_head"], rtol=0, atol=0)
        finally:
            other.close()
        # an exception in the child crosses with its type's name and message, and the child serves on
        with pytest.raises(ChildError, match="invalid literal for int") as err:
            ref.capture(cases[0], ["resid_post.x"])
        assert type(err.value).__name__ == "ValueError"
        torch.testing.assert_close(ref.capture(cases[0], ["resid_post.0"])["resid_post.0"],
                                   hf.capture(cases[0], ["resid_post.0"])["resid_post.0"], rtol=0, atol=0)
    finally:
        ref.close()
    with pytest.raises(ChildError, match="the nnterp reference is closed"):
        ref.capture(cases[0], ["resid_post.0"])


def test_a_cell_through_the_runner_records_the_childs_versions(tmp_path):
    _need_side()
    opts = runner.Options(engines=("hf", "nnterp"), out=tmp_path, points=["resid_post", "attn_out", "lm_head", "q"])
    written = runner.run_model(zoo_spec(LLAMA), opts)
    cells = {vcells.read(p)["engine"]: vcells.read(p) for p in written}
    cell = cells["nnterp"]
    assert cell["status"] == "ok", cell.get("error")
    assert cell["reference_versions"] == PINS
    assert cell["provenance"]["versions"]["nnsight"] == PINS["nnsight"] and "nnterp" not in cells["hf"]["provenance"][
        "versions"]
    assert cells["hf"]["provenance"]["versions"]["nnsight"] == metadata.version("nnsight")  # the parent's own
    verdicts = {(r["case"], r.get("steer") or r["point"]): r["verdict"] for r in cell["rows"]}
    assert verdicts[("short", "resid_post")] == "pass" and verdicts[("steer", "add@'all'")] == "pass"
    assert verdicts[("steer", "project_out")] == "gap"  # nnterp's API only adds: declared, with its reason
    assert verdicts[("short", "q")] == "gap" and cell["summary"].get("fail", 0) == 0
    # an architecture nnterp cannot standardize: unavailable in the child, still recorded with the child's versions
    refused = vcells.read(runner.run_model(zoo_spec("microsoft/phi-1_5"), runner_opts(tmp_path))[0])
    assert refused["unavailable"].startswith("StandardizedTransformer failed: RenamingError")
    assert refused["reference_versions"] == PINS and refused["provenance"]["versions"]["nnsight"] == PINS["nnsight"]
    assert {r["verdict"] for r in refused["rows"]} == {"gap"} and {r["known"] for r in refused["rows"]} == {
        "nnterp-unsupported-arch"}


def runner_opts(out: Path) -> runner.Options:
    return runner.Options(engines=("nnterp",), out=out / "refused", points=["resid_post", "lm_head"], steer=False,
                          decode=False)


def test_a_missing_or_stale_side_directory_is_a_skip_that_names_the_script(tmp_path, monkeypatch):
    _side_at(monkeypatch, tmp_path / "nowhere")
    ok, why = availability("nnterp")
    assert not ok and "nowhere/, which is missing" in why and "run `bash scripts/nnterp_reference.sh`" in why
    with pytest.raises(EngineUnavailable, match=r"bash scripts/nnterp_reference\.sh"):
        adapter_class("nnterp")(None)
    written = runner.run_model(zoo_spec(LLAMA), runner.Options(engines=("nnterp",), out=tmp_path / "out"))
    cell = vcells.read(written[0])  # written before any model loads
    assert cell["status"] == "skipped" and "scripts/nnterp_reference.sh" in cell["reason"]
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / ".stamp").write_text("nnterp==1.2.0 nnsight==0.6.0\n")
    _side_at(monkeypatch, stale)
    ok, why = availability("nnterp")
    assert not ok and "holds 'nnterp==1.2.0 nnsight==0.6.0' while scripts/nnterp_reference.txt pins" in why
    (stale / ".stamp").write_text(NNTERP_SIDE.wanted() + "\n")  # stamped, but no packages in it
    ok, why = availability("nnterp")
    assert not ok and "stamped but has no 'nnsight'" in why


def test_the_nnterp_digest_follows_the_side_pins_and_no_other_columns(tmp_path, monkeypatch):
    spec, opts = zoo_spec(LLAMA), runner.Options(engines=("hf", "nnterp"), out=tmp_path)
    side = tmp_path / "side"
    side.mkdir()
    _side_at(monkeypatch, side)
    (side / ".stamp").write_text("nnterp==1.3.0 nnsight==0.7.0\n")
    before = {e: runner.inputs_digest(spec, e, opts) for e in ("hf", "nnterp")}
    (side / ".stamp").write_text("nnterp==1.3.0 nnsight==0.7.1\n")
    after = {e: runner.inputs_digest(spec, e, opts) for e in ("hf", "nnterp")}
    assert after["hf"] == before["hf"] and after["nnterp"] != before["nnterp"]
    (side / ".stamp").unlink()
    assert runner.inputs_digest(spec, "nnterp", opts) not in (before["nnterp"], after["nnterp"])


@pytest.mark.slow  # a child of its own: about 5 s (the default run stays under its 10 minutes)
def test_a_child_that_died_is_named_and_replaced(llama):
    _need_side()
    ctx, cases = llama
    ref = adapter_class("nnterp")(ctx)
    pid = ref.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ChildError, match=rf"child process \(pid {pid}\) died \(exit code -9"):
        ref.capture(cases[0], ["resid_post.0"])
    ref.close()  # closing a proxy whose child died is quiet
    again = adapter_class("nnterp")(ctx)
    try:
        assert again.pid != pid and _alive(again.pid)
        assert type(again.capture(cases[0], ["resid_post.0"])["resid_post.0"]) is torch.Tensor
    finally:
        again.close()


_PARENT = textwrap.dedent("""
    import sys
    from validator.engines import NNTERP_SIDE
    from validator.engines.child import child_for
    if __name__ == "__main__":
        child = child_for("nnterp", NNTERP_SIDE)
        print(child.process.pid, flush=True)
        sys.stdin.read()  # until killed
""")


@pytest.mark.slow  # a child of its own: about 5 s (the default run stays under its 10 minutes)
def test_the_child_dies_with_its_parent(tmp_path):
    _need_side()
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        pid = int(parent.stdout.readline())  # the child is up: it entered .nnterp-ref and imported nnterp
        assert _alive(pid) and psutil.Process(pid).ppid() == parent.pid
        parent.kill()
        parent.wait(timeout=60)
        deadline = time.time() + 60  # the kernel's parent-death signal: immediate; generous on a loaded machine
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), f"the nnterp child {pid} outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.slow  # a child of its own: about 5 s (the default run stays under its 10 minutes)
def test_nnsight_imported_before_the_side_directory_fails_loudly(tmp_path):
    """A parent whose __main__ imports nnsight (.venv's 0.8.1): spawn re-imports that module in the child before
    the side directory can come first, so nnterp would run on the wrong nnsight; the child refuses, by name."""
    _need_side()
    script = tmp_path / "user_script.py"
    script.write_text("import nnsight  # noqa: F401\n" + _PARENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert "nnsight already imported in the .nnterp-ref child before the side install was entered" in proc.stderr
    assert "__main__" in proc.stderr and "site-packages/nnsight/__init__.py" in proc.stderr


def test_a_validator_run_stops_the_children_it_started(tmp_path, monkeypatch):
    """`validator run` stops its reference children when it ends (an in-process run used to leave the nnterp
    child running until the process exited: a later check of the process's own children saw it)."""
    _need_side()
    from validator import cli
    from validator.engines import child
    started = []

    def run_model(spec, opts):  # the run's work, reduced to starting the column's child
        started.append(child.child_for("nnterp", NNTERP_SIDE))
        return []
    monkeypatch.setattr(runner, "run_model", run_model)
    code = cli.main(["run", "--engines", "nnterp", "--models", LLAMA, "--out", str(tmp_path / "v"), "--force"])
    assert code == 0 and len(started) == 1
    started[0].process.join(timeout=30)
    assert not started[0].process.is_alive() and child._CHILDREN == {}
