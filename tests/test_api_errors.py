"""One error per bad input, everywhere (issue 49): every call-level bad input of tests/test_inputs.py and the
issue's drifts (tests/api_conformance.py) raise the library's same class, naming the same field, on eager,
vllm and vllm-static, and through engine.connect to an eager server, each on its sync side and its async
side (m.aio, awaited from the caller's own loop). The vLLM servers run the same table in
tests/test_remote_vllm.py (slow).

The engines are the session's shared ones (tests/test_vllm_common.py); the eager server runs in this
process around the session's eager model (tests/remote_common.InProcess), with an --sae-dir holding the
cases' SAE, which local backends name by its path and the server's clients by its folder name."""
from __future__ import annotations

import pytest

from api_conformance import CASES, Awaited, Env, check, write_sae
from engine import connect
from engine.serve.app import build_app
from engine.serve.runner import EagerRunner
from engine.serve.settings import ServeSettings
from remote_common import InProcess
from test_vllm_common import MAX_LEN, eager_model, vllm_model

LLAMA = "meta-llama/Llama-3.2-1B"
DECLARED = ["resid_post", "mlp_out.1", "z.1"]  # the shared vllm-static engine of test_vllm_interventions
POSITIONS = {"eager": 512, "vllm": MAX_LEN, "vllm-static": MAX_LEN, "remote-eager": 512}


@pytest.fixture(scope="module")
def saes(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    write_sae(root / "sae")
    return root


@pytest.fixture(scope="module")
def targets(saes):
    made: dict = {}
    servers = []

    def get(target: str):
        if target not in made:
            if target == "eager":
                made[target] = eager_model(LLAMA)
            elif target == "vllm":
                made[target] = vllm_model(LLAMA)
            elif target == "vllm-static":
                made[target] = vllm_model(LLAMA, "vllm-static", static_points=DECLARED)
            else:  # not runner.close() afterwards: the model is the session's shared one
                runner = EagerRunner(eager_model(LLAMA))
                srv = InProcess(build_app(runner, ServeSettings(sae_dir=str(saes))))
                servers.append((srv, runner))
                made[target] = connect(srv.url, timeout=300)
        return made[target]
    yield get
    for target, m in made.items():
        if target.startswith("remote"):
            m.close()
    for srv, runner in servers:
        srv.stop()
        runner.pool.shutdown(wait=True)


def _params():
    for target in ("eager", "remote-eager", "vllm", "vllm-static"):
        marks = (pytest.mark.vllm,) if target.startswith("vllm") else ()
        for side in ("sync", "async"):
            for name, call, exp in CASES:
                yield pytest.param(target, side, name, call, exp, id=f"{target}-{side}-{name}", marks=marks)


@pytest.mark.parametrize("target,side,name,call,exp", list(_params()))
def test_the_same_bad_input_raises_the_same_class_everywhere(targets, saes, target, side, name, call, exp):
    m = targets(target)
    sae = "sae" if target.startswith("remote") else str(saes / "sae")
    check(name, call, exp, Env(m if side == "sync" else Awaited(m.aio), POSITIONS[target], sae), target)
