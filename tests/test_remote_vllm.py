"""engine.connect against real vllm and vllm-static servers (slow: a vLLM engine in the server and one in
this process), compared with the library's own model on the same backend and zoo weights, one prompt
per call (the same request on both sides): captures, logits and readouts within 1e-5, greedy tokens and
streams identical, receipts equal; the API conformance tables (tests/api_conformance.py's bad calls,
tests/test_api_results.py's calls) on each server's sync and async sides. Run under `flock /tmp/heavy.lock`."""
from __future__ import annotations

import pytest
import torch

from api_conformance import CASES, Awaited, Env, check, write_sae
from engine import Norm, Readout, Steer, connect
from engine.core.crossing import library_class
from serve_common import LLAMA, ServerProcess
from test_remote import same, same_cache, same_receipts
from test_vllm_common import MAX_LEN, vllm_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
P = "The quick brown fox jumps over the lazy dog"
STATIC = "resid_post,z.0"
BACKENDS = {"vllm": ((), {}, ["resid_post.1", "mlp_out.0", "z.0.head-1"]),
            "vllm-static": (("--static-points", STATIC), {"static_points": STATIC.split(",")}, ["resid_post.1", "z.0"])}


@pytest.fixture(scope="module")
def saes(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    write_sae(root / "sae")
    return root


@pytest.fixture(scope="module", params=list(BACKENDS))
def pair(request, saes):
    backend = request.param
    args, kw, points = BACKENDS[backend]
    srv = ServerProcess(LLAMA, "--backend", backend, "--source", "zoo", "--max-model-len", str(MAX_LEN),
                        "--sae-dir", str(saes), *args)
    try:
        lib = vllm_model(LLAMA, backend, **kw)  # loads while the server starts
        with connect(srv.wait(1200).url, timeout=600) as m:
            yield backend, m, lib, points
    finally:
        srv.close()


def test_forward_generation_and_stream_match_the_library(pair):
    backend, m, lib, points = pair
    assert m.backend == backend and m.points() == lib.points()
    steers = [Steer("resid_post.0", "add", torch.randn(256, generator=torch.Generator().manual_seed(0)), "last")]
    reads = [Readout("resid_post.1", Norm())]
    got, ref = m.run_with_cache(P, points, steers, readouts=reads), lib.run_with_cache(P, points, steers, readouts=reads)
    same(got[0], ref[0], f"{backend} logits")
    same_cache(got[1], ref[1], f"{backend} run_with_cache")
    g, r = m.generate(P, 6, points, steers, readouts=reads), lib.generate(P, 6, points, steers, readouts=reads)
    same(g.new_tokens, r.new_tokens, f"{backend} greedy tokens")
    same(g.logits, r.logits, f"{backend} generation logits")
    assert g.text == r.text
    same_cache(g.requests[0].cache, r.requests[0].cache, f"{backend} generation")
    same_receipts(g.receipts, r.receipts)
    steps, lsteps = list(m.stream(P, 6, points[:1], steers)), list(lib.stream(P, 6, points[:1], steers))
    assert [s.token for s in steps] == [s.token for s in lsteps] == g.new_tokens[0].tolist()
    assert [s.text for s in steps] == [s.text for s in lsteps]
    same_cache(steps[-1].result.cache, lsteps[-1].result.cache, f"{backend} stream result")


BAD = [
    ("layer out of range", lambda mm: mm.run_with_cache(P, ["resid_post.7"])),
    ("steer width", lambda mm: mm.forward(P, [Steer("resid_post.0", "add", torch.ones(7))])),
    ("undeclared or unserved point", lambda mm: mm.run_with_cache(P, ["mlp_out.1" if mm.backend == "vllm-static"
                                                                     else "q_norm_in.0"])),
    ("prompt past max_model_len", lambda mm: mm.run_with_cache([[1] * (MAX_LEN + 4)])),
    ("generation past max_model_len", lambda mm: mm.generate(P, MAX_LEN)),
    ("n=2", lambda mm: mm.generate(P, 2, n=2)),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_the_library_class(pair, case):
    backend, m, lib, _ = pair
    name, call = case
    with pytest.raises(Exception) as local:
        call(lib)
    with pytest.raises(Exception) as remote:
        call(m)
    assert library_class(remote.value) is library_class(local.value), f"{backend} {name}: " \
        f"{type(remote.value).__name__} ({remote.value}) != {type(local.value).__name__} ({local.value})"


# the API conformance tables through the vLLM servers: their static taps are resid_post and z.0 (the local
# vllm-static engine of tests/test_api_errors.py also declares mlp_out.1, which the cases below steer)
STATIC_ONLY = {"a steer of the wrong width, generating", "readouts", "capture"}


@pytest.mark.parametrize("side", ["sync", "async"])
def test_the_conformance_table_raises_the_same_classes_through_the_server(pair, side):
    backend, m, lib, _ = pair
    target = f"remote-{backend}"
    for name, call, exp in CASES:
        if backend == "vllm-static" and name in STATIC_ONLY:
            continue
        check(name, call, exp, Env(m if side == "sync" else Awaited(m.aio), MAX_LEN, "sae"), target)


@pytest.mark.parametrize("side", ["sync", "async"])
def test_the_conformance_calls_give_the_librarys_results_through_the_server(pair, side):
    from test_api_results import CALLS, _flat, compare
    backend, m, lib, _ = pair
    for name, call in CALLS.items():
        if backend == "vllm-static" and name in STATIC_ONLY:
            continue
        got, ref = _flat(call(m if side == "sync" else Awaited(m.aio))), _flat(call(lib))
        if name == "generate seeded":  # the server's engine draws what the library's draws with the same seed
            assert got == ref, f"{backend} seeded tokens {got} != {ref}"
            continue
        compare(got, ref, backend, f"{name} @ remote-{backend} {side}")
