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
import torch

from api_conformance import CASES, Awaited, Env, check, write_sae
from api_conformance import targets as conformance_targets
from test_vllm_common import MAX_LEN

POSITIONS = {"eager": 512, "vllm": MAX_LEN, "vllm-static": MAX_LEN, "remote-eager": 512}


@pytest.fixture(scope="module")
def saes(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    write_sae(root / "sae")
    return root


@pytest.fixture(scope="module")
def targets(saes):
    with conformance_targets(str(saes)) as get:
        yield get


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


def test_a_closed_remote_model_refuses_every_call(targets):
    """After close() every declared method of a connect()ed model, on both sides, says it was closed, as a
    local model's does (its catalogue answered from the table it read at connect)."""
    import asyncio

    from engine import connect
    from engine.core.errors import EngineError
    from engine.model import api
    url = targets("remote-eager").url
    m = connect(url)
    m.close()
    for side, obj in (("sync", m), ("async", m.aio)):
        for name in api.SHARED + api.RUNS + api.STREAMS:
            fn = getattr(obj, name)
            args = ["resid_post.0"] * sum(p.default is p.empty and p.kind == p.POSITIONAL_OR_KEYWORD
                                          for p in api.declared(name).parameters.values() if p.name != "self")
            with pytest.raises(EngineError, match="was closed; connect again"):
                out = fn(*args)
                if asyncio.iscoroutine(out):
                    asyncio.run(out)
                elif hasattr(out, "__enter__"):
                    out.__enter__()


def test_an_sae_is_named_by_its_folder_on_the_server(targets, saes):
    """A readout or a feature steer names the server's SAE by its folder inside --sae-dir (it was refused on
    the client unless the same path existed there) and gives what the library gives with the path."""
    from engine import Readout, SAEFeatures, Steer
    remote, local = targets("remote-eager"), targets("eager")
    path = str(saes / "sae")
    got = remote.run_with_cache("The quick brown fox", readouts=[Readout("resid_post.1", SAEFeatures("sae", k=4), "f")],
                                steer=[Steer("resid_post.0", "feature_add", sae="sae", feature=3, coeff=2.0)])[1]
    ref = local.run_with_cache("The quick brown fox", readouts=[Readout("resid_post.1", SAEFeatures(path, k=4), "f")],
                               steer=[Steer("resid_post.0", "feature_add", sae=path, feature=3, coeff=2.0)])[1]
    assert torch.equal(got.readouts["f"].indices, ref.readouts["f"].indices)
    torch.testing.assert_close(got.readouts["f"].values, ref.readouts["f"].values, rtol=1e-5, atol=1e-5)
    assert got.receipts[0].rows == ref.receipts[0].rows > 0
