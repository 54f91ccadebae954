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
from serve_common import LLAMA, close, eager_server, stream_lines
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
    em, n = eager_model(LLAMA), 10
    ref = em.generate(PROMPT, n, readouts=[Readout("resid_post.1", Project(U), name="probe")])
    p = ref.requests[0].prompt_ids.shape[0]
    scores = ref.cache.readouts["probe"][0, p - 1:p - 1 + n]  # token i is predicted from position p - 1 + i
    j = int(scores.argmax())
    side = "above"
    if j == 0:
        j, side = int(scores.argmin()), "below"
    earlier = scores[:j]
    edge = (earlier.max() if side == "above" else earlier.min()) if j else scores[j] - (1 if side == "above" else -1)
    threshold = float((edge + scores[j]) / 2)
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True,
            "interp": {"capture": {"readouts": [_probe()]}, "stop": {"readout": "probe", side: threshold}}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = stream_lines(r)
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "interp.stop"
    assert last["interp"]["token_ids"] == ref.new_tokens[0, :j + 1].tolist()
    assert last["interp"]["stopped"]["token"] == j
    assert abs(last["interp"]["stopped"]["score"] - float(scores[j])) < 1e-4
    # every token's chunk carried its forward's probe rows as computed: the prompt's, then one per token
    rows = [encoding.decode(c["choices"][0]["interp"]["readouts"]["probe"]) for c in chunks
            if "interp" in c["choices"][0] and "readouts" in c["choices"][0]["interp"]]
    assert len(rows) == j + 1 and rows[0].shape[0] == p and all(r.shape[0] == 1 for r in rows[1:])
    close(torch.cat(rows), ref.cache.readouts["probe"][0, :p + j], "probe rows", atol=1e-5)
    text = em.tokenizer.decode(ref.new_tokens[0, :j + 1], skip_special_tokens=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text.rstrip("\ufffd")  # whole characters only


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
