"""Readouts, readout stops and feature steers over HTTP (eager server subprocess, --sae-dir): a streamed
completion carries each token's readouts in its own chunk and stops at the first token whose probe
score crosses the threshold, as the library computes that probe; readouts and feature steers equal
the library's; SAEs are named inside --sae-dir only; bad requests are 400s naming the field."""
from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest
import torch

from engine import LensTopK, Mean, Project, Readout, SAEFeatures, Steer
from engine.core.sae_files import write_random_sae
from engine.serve import encoding
from serve_common import LLAMA, close, eager_server, probe_stop_matches_library
from test_vllm_common import eager_model

PROMPT = "The quick brown fox jumps over the lazy dog"
SAE_DIR = Path(tempfile.mkdtemp(prefix="serve-saes-"))
SAE = str(write_random_sae(SAE_DIR / "res1", "standard", 256, 512, seed=5))
U = torch.randn(256, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def client():
    with eager_server("--sae-dir", str(SAE_DIR)) as url, httpx.Client(base_url=url, timeout=300) as c:
        yield c


def _probe() -> dict:
    return {"address": "resid_post.1", "kind": "Project", "W": encoding.encode(U), "name": "probe"}


def test_a_streamed_completion_stops_at_the_first_token_whose_probe_crosses(client):
    probe_stop_matches_library(client, eager_model(LLAMA), U)


def test_readouts_and_feature_steers_equal_the_library(client):
    em = eager_model(LLAMA)
    st = Steer("resid_post.0", "feature_clamp", sae=SAE, feature=[3, 8], coeff=4.0)
    rs = [Readout("resid_post.1", SAEFeatures(SAE, k=4), name="feats"), Readout("resid_post.1", Mean(), name="mean"),
          Readout("resid_post.-1", LensTopK(3), name="lens")]
    ref = em.generate(PROMPT, 4, steer=[st], readouts=rs)
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "interp": {
        "steer": [{"address": "resid_post.0", "op": "feature_clamp", "sae": "res1", "feature": [3, 8], "coeff": 4.0}],
        "capture": {"readouts": [{"address": "resid_post.1", "kind": "SAEFeatures", "sae": "res1", "k": 4,
                                  "name": "feats"},
                                 {"address": "resid_post.1", "kind": "Mean", "name": "mean"},
                                 {"address": "resid_post.-1", "kind": "LensTopK", "k": 3, "name": "lens"}]}}}
    ch = client.post("/v1/completions", json=body).json()["choices"][0]
    assert ch["interp"]["token_ids"] == ref.new_tokens[0].tolist()
    got = ch["interp"]["readouts"]
    for name in ("feats", "lens"):
        assert torch.equal(encoding.decode(got[name]["indices"]), ref.cache.readouts[name].indices[0])
        close(encoding.decode(got[name]["values"]), ref.cache.readouts[name].values[0], name, atol=1e-5)
    close(encoding.decode(got["mean"]), ref.cache.readouts["mean"][0], "mean", atol=1e-5)
    assert ch["interp"]["receipts"][0]["op"] == "feature_clamp" and ch["interp"]["receipts"][0]["rows"] > 0
    cap = client.post("/v1/capture", json={"model": LLAMA, "prompt": PROMPT, "interp": {
        "capture": {"readouts": [_probe()]}}}).json()["data"][0]
    _, c = em.run_with_cache(PROMPT, readouts=[Readout("resid_post.1", Project(U), name="probe")])
    close(encoding.decode(cap["readouts"]["probe"]), c.readouts["probe"][0], "capture probe", atol=1e-5)


@pytest.mark.parametrize("interp, field, fragment", [
    ({"capture": {"readouts": [{"address": "resid_post.1", "kind": "SAEFeatures", "sae": "../", "k": 2}]}},
     "sae", "no SAE folder '../' inside this server's --sae-dir"),
    ({"capture": {"readouts": [{"address": "resid_post.1", "kind": "Mean", "k": 2}]}}, "readouts",
     "readout kind 'Mean' takes no k"),
    ({"capture": {"readouts": [{"address": "resid_post.1", "kind": "mean"}]}}, "kind", ""),
    ({"capture": {"readouts": [{"address": "resid_post.1", "kind": "Project", "W": [[1.0] * 3]}]}},
     "interp.capture.readouts[0]", "Project W reads 3 dims"),
    ({"capture": {"readouts": [{"address": "resid_post.1", "kind": "Mean"}]}, "stop": {"readout": "x", "above": 1}},
     "interp", "names no readout"),
    ({"capture": {"readouts": [{"address": "resid_post.1", "kind": "Project", "W": [[1.0] * 256] * 2, "name": "p"}]},
      "stop": {"readout": "p", "above": 1}}, "interp.stop", "give index 0..1"),
    ({"steer": [{"address": "resid_post.1", "op": "feature_add", "sae": "res1", "feature": 9999, "coeff": 1.0}]},
     "interp.steer[0]", "feature 9999 is out of range"),
    # issue 34: each of these was a 500 (the SAE is loaded only inside the forward)
    ({"capture": {"readouts": [{"address": "resid_post.1", "kind": "SAEFeatures", "sae": "res1", "k": 513}]}},
     "interp.capture.readouts[0]", "k=513 exceeds the SAE's 512 latents"),  # the engine's own check, up front
    ({"steer": [{"address": "resid_post.1", "op": "feature_scale", "sae": "res1", "feature": [3, 512],
                 "coeff": 2.0}]}, "interp.steer[0].feature", "feature 512 is out of range; its SAE has 512"),
    ({"capture": {"readouts": [{"address": "resid_post.1", "kind": "SAEFeatures", "sae": "res1", "k": 4,
                                "name": "f"}]}, "stop": {"readout": "f", "above": 0.5, "index": 512}},
     "interp.stop.index", "gives 512 features; give index 0..511"),
])
def test_bad_readout_requests_are_400s_naming_the_field(client, interp, field, fragment):
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 2, "stream": "stop" in interp, "interp": interp}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in (err.get("param") or "") + err["message"] and fragment in err["message"], err


def test_a_stop_needs_a_stream(client):
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": 2, "interp": {
        "capture": {"readouts": [_probe()]}, "stop": {"readout": "probe", "above": 0.0}}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and "stream: true" in r.json()["error"]["message"]
