"""engine/interop/mappers.py `to_nnterp`: every mapped accessor, read through nnterp's StandardizedTransformer,
holds our capture. nnterp 1.3.0 runs on its own nnsight 0.7.0 (.nnterp-ref/, scripts/nnterp_reference.sh), which
cannot share a process with .venv's nnsight 0.8.1, so nnterp's side runs in a subprocess of .venv's python with
.nnterp-ref first on PYTHONPATH (tests/mapper_checks.py), as tests/test_sae_reference.py runs SAELens; one
subprocess per group of models, the comparison with our capture made there, the verdicts asserted here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.core.address import parse
from mapper_checks import FAMILIES, OTHERS
from validator.engines import NNTERP_SIDE

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_FAMILIES = ["llama", "gemma2"]


def _run_side(names: list[str], refused_ok: bool, timeout: int) -> dict:
    why = NNTERP_SIDE.problem()
    if why:
        pytest.skip(why)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(NNTERP_SIDE.path), str(NNTERP_SIDE.path.parent)])}
    argv = [sys.executable, os.path.join(HERE, "mapper_checks.py"), "nnterp",
            *(["--refused-ok"] if refused_ok else []), *names]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MAPPER-CHECKS ")), None)
    assert proc.returncode == 0 and line, f"nnterp's side failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    out = json.loads(line.split(" ", 1)[1])
    # nnterp and nnsight came from the side directory, at its pins (not .venv's nnsight)
    assert out["versions"] == {d: NNTERP_SIDE.pinned(d) for d in ("nnsight", "nnterp")}, out["versions"]
    return out["models"]


@pytest.fixture(scope="module")
def families():
    return _run_side([FAMILIES[f] for f in DEFAULT_FAMILIES], refused_ok=False, timeout=900)


@pytest.fixture(scope="module")
def others():
    return _run_side(OTHERS, refused_ok=True, timeout=3600)


@pytest.mark.parametrize("fam", DEFAULT_FAMILIES)
def test_nnterp_accessors_hold_our_tensors(fam, families):
    got = families[FAMILIES[fam]]
    assert "error" not in got, got["error"]
    assert got["bad"] == {}, got["bad"]
    assert {parse(a).point for a in got["accessors"]} >= {"resid_pre", "attn_out", "mlp_out", "resid_post", "lm_head",
                                                          "attn_probs"}


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHERS)
def test_nnterp_accessors_hold_our_tensors_on_every_twin(name, others):
    got = others[name]
    if "skipped" in got:
        pytest.skip(got["skipped"])
    assert "error" not in got, got["error"]
    assert got["bad"] == {}, got["bad"]
