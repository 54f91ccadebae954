"""The server on vllm-static (slow: a compiled engine): declared taps are captured and steered per
request and equal eager's tensors; an undeclared point is a 400 listing what was declared; the
capability table marks exactly the declared taps as served."""
from __future__ import annotations

import httpx
import pytest
import torch

from engine.core.steering import Steer
from serve_common import LLAMA, ServerProcess, close, tensors
from test_vllm_common import eager_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def url():
    srv = ServerProcess(LLAMA, "--backend", "vllm-static", "--source", "zoo", "--max-model-len", "128",
                        "--static-points", "resid_post,z.0")
    try:
        yield srv.wait(1200).url
    finally:
        srv.close()


def test_static_taps_over_http(url):
    em = eager_model(LLAMA)
    v = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with httpx.Client(base_url=url, timeout=300) as c:
        r = c.post("/v1/capture", json={"prompt": PROMPT, "interp": {"capture": ["resid_post.1", "z.0"],
                                                                    "steer": [{"address": "z.0", "value": v.tolist()}]}})
        assert r.status_code == 200, r.text
        _, ref = em.run_with_cache(PROMPT, ["resid_post.1", "z.0"], [Steer("z.0", "add", v)])
        for k, t in tensors(r.json()["data"][0]).items():
            close(t, ref[k][0], k, atol=1e-3, rtol=1e-3)
        r = c.post("/v1/completions", json={"model": LLAMA, "prompt": PROMPT, "interp": {"capture": ["mlp_out.0"]}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "interp.capture.points[0]"
        assert "declared at load: resid_post.0, resid_post.1, z.0" in err["message"]
        served = {p["name"]: p["layers"] for p in c.get("/v1/points").json()["points"] if p["served"]}
        assert served["resid_post"] == [0, 1] and served["z"] == [0] and "mlp_out" not in served
