"""The interp-engine column: its alignment rules are pure re-layouts, the adapter hands back our tensors
for the same address strings on Llama and GPT-2, and every declared definitional difference
(validator/known_gaps.py, kind "definition") is re-measured here on the zoo twin named in its evidence
(slow: one model load each)."""
import pytest
import torch

from validator import known_gaps, prompts
from validator.engines.base import Missing, ModelContext
from validator.engines.interp_align import RULES, Dims, align
from validator.engines.interp_engine_ref import InterpEngineReference


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# -- the rules ----------------------------------------------------------------------------------------
THEIRS = {  # point -> a tensor in interp-engine's layout for b=1, pos=5, h=4, kvh=2, hd=8
    "attn_probs": (1, 4, 5, 5), "attn_scores": (1, 4, 5, 5), "z": (1, 5, 32), "attn_gate": (1, 5, 32),
    "value": (1, 5, 16), "q_norm_in": (1, 5, 32), "q_norm_out": (1, 5, 32), "k_norm_in": (1, 5, 16),
    "k_norm_out": (1, 5, 16), "mlp_stream_write": (1, 5, 4, 1), "attn_stream_write": (1, 5, 4, 1)}
OURS = {"attn_probs": (1, 5, 4, 5), "attn_scores": (1, 5, 4, 5), "z": (1, 5, 4, 8), "attn_gate": (1, 5, 4, 8),
        "value": (1, 5, 2, 8), "q_norm_in": (1, 5, 4, 8), "q_norm_out": (1, 5, 4, 8), "k_norm_in": (1, 5, 2, 8),
        "k_norm_out": (1, 5, 2, 8), "mlp_stream_write": (1, 5, 4), "attn_stream_write": (1, 5, 4)}


@pytest.mark.parametrize("point", sorted(RULES))
def test_each_rule_is_a_pure_relayout(point):
    d = Dims(batch=1, pos=5, heads=4, kv_heads=2, head_dim=8)
    t = torch.randn(THEIRS[point])
    out = align(point, t, d)
    assert tuple(out.shape) == OURS[point]
    assert torch.equal(out.flatten().sort().values, t.flatten().sort().values)  # same values, moved only
    assert torch.equal(align(point, out, d), out)  # already ours: unchanged


def test_grouped_heads_rule_reads_deepseek_v4_o_groups():
    t = torch.arange(1 * 3 * 2 * 128.0).reshape(1, 3, 2, 128)  # [b, pos, o_groups, h*hd/o_groups]
    out = align("z", t, Dims(1, 3, heads=4, kv_heads=1, head_dim=64))
    assert out.shape == (1, 3, 4, 64) and torch.equal(out.reshape(1, 3, -1), t.reshape(1, 3, -1))


# -- the adapter against our engine ---------------------------------------------------------------------
_LOADED: dict = {}


def _load(name):
    """(our model, HF reference, interp-engine adapter, the short case), once per model."""
    if name not in _LOADED:
        from engine.loading import load_model
        from validator.models import zoo_spec
        hf, tok = zoo_spec(name).load_reference()
        ours = load_model(name, source="zoo")
        ctx = ModelContext(name, hf, tok, "zoo")
        _LOADED[name] = (ours, hf, InterpEngineReference(ctx), prompts.build_cases(tok, ctx.config))
    return _LOADED[name]


def _ours(m, case, addresses):
    from validator.subject import Subject
    return Subject(m).capture(case, addresses)


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-1B", "openai-community/gpt2"])
def test_same_address_same_tensor(name):
    m, _, ie, cases = _load(name)
    addrs = ["resid_pre.1", "attn_in.0", "value.1", "attn_scores.1", "attn_probs.1", "z.1", "attn_out.1",
             "mlp_in.0", "mlp_act.1", "mlp_out.1", "resid_post.1", "final_norm", "lm_head"]
    for case in cases:  # short, and the left-padded batch (real tokens only)
        ours, theirs = _ours(m, case, addrs), ie.capture(case, addrs)
        for a in addrs:
            o, t = ours[a], theirs[a]
            assert o.shape == t.shape, (a, o.shape, t.shape)
            keep = case.valid.bool()
            o, t = o[keep], t[keep]
            if a.startswith("attn_scores"):
                live = t > -1e4
                assert torch.equal(o > -1e4, live), a
                o, t = o[live], t[live]
            assert rel(o, t) < 1e-5, (a, case.name, rel(o, t))


def test_points_it_does_not_name_or_serve_are_missing_with_its_reason():
    _, _, ie, cases = _load("openai-community/gpt2")
    got = ie.capture(cases[0], ["q.0", "k.1"])
    assert isinstance(got["q.0"], Missing) and got["q.0"].reason.startswith("interp-engine names no point 'q'")
    assert known_gaps.explain_missing("interp-engine", "gpt2", "q", got["q.0"].reason).id == "ie-no-point"


def test_steering_parity_on_llama():
    m, _, ie, cases = _load("meta-llama/Llama-3.2-1B")
    from engine.core.steering import Steer
    from validator.subject import Subject
    s = Subject(m)
    _, cache = m.run_with_cache(cases[0].input_ids, ["resid_post.1"])
    v = torch.randn(m.d_model, generator=torch.Generator().manual_seed(0))
    v = v / v.norm() * cache["resid_post.1"].norm(dim=-1).mean() * 2  # twice a token's norm
    ours = s.logits(cases[0], [Steer("resid_post.1", "add", v)])
    assert rel(ie.steer_logits(cases[0], 1, v), ours) < 1e-5
    assert rel(ours, s.logits(cases[0])) > 1e-3  # the steer moved the logits


# -- evidence of every declared definitional difference (slow) ----------------------------------------
def _hook(module, store, key):
    def fn(mod, args, out):
        store[key] = (out[0] if isinstance(out, tuple) else out).detach().clone()
    return module.register_forward_hook(fn)


def _evidence_embeddings():
    for name in ("openai-community/gpt2", "bigscience/bloom-560m", "ibm-granite/granite-3.0-2b-base"):
        m, hf, ie, cases = _load(name)
        ids = cases[0].input_ids
        theirs = ie.capture(cases[0], ["embeddings"])["embeddings"]
        with torch.no_grad():
            token = hf.get_input_embeddings()(ids)
            first = hf(ids, output_hidden_states=True).hidden_states[0]
        assert rel(theirs, token) == 0.0, name
        assert rel(_ours(m, cases[0], ["embeddings"])["embeddings"], first) < 1e-6 and rel(theirs, first) > 0.1


def _evidence_logits():
    for name in ("google/gemma-2-2b", "CohereForAI/c4ai-command-r-v01"):
        m, hf, ie, cases = _load(name)
        store = {}
        h = _hook(hf.lm_head, store, "lm_head")
        try:
            with torch.no_grad():
                logits = hf(cases[0].input_ids).logits
        finally:
            h.remove()
        theirs = ie.capture(cases[0], ["lm_head"])["lm_head"]
        assert rel(theirs, store["lm_head"]) < 1e-6 and rel(theirs, logits) > 1e-2, name
        assert rel(_ours(m, cases[0], ["lm_head"])["lm_head"], logits) < 1e-6


def _evidence_routed_only():
    m, hf, ie, cases = _load("ibm-granite/granite-4.0-h-tiny")
    store = {}
    layer = hf.model.layers[0]
    hs = [_hook(layer.block_sparse_moe, store, "moe"), _hook(layer.shared_mlp, store, "shared")]
    try:
        with torch.no_grad():
            hf(cases[0].input_ids)
    finally:
        for h in hs:
            h.remove()
    theirs = ie.capture(cases[0], ["mlp_out.0"])["mlp_out.0"]
    assert rel(theirs, store["moe"]) < 1e-6
    assert rel(_ours(m, cases[0], ["mlp_out.0"])["mlp_out.0"], store["moe"] + store["shared"]) < 1e-6


def _evidence_gate():
    m, _, ie, cases = _load("Qwen/Qwen3-Next-80B-A3B-Instruct")
    ours = _ours(m, cases[0], ["z.3", "attn_gate.3"])
    theirs = ie.capture(cases[0], ["z.3", "attn_gate.3"])
    assert rel(theirs["z.3"], ours["z.3"] * ours["attn_gate.3"]) < 1e-6
    hd = ours["attn_gate.3"].shape[-1]
    assert theirs["attn_gate.3"].shape[-1] == 2 * hd
    assert rel(torch.sigmoid(theirs["attn_gate.3"][..., hd:]), ours["attn_gate.3"]) < 1e-6


def _evidence_mqa_value():
    for name in ("tiiuae/falcon-7b", "tiiuae/falcon-11B"):
        m, _, ie, cases = _load(name)
        ours, theirs = _ours(m, cases[0], ["value.0"])["value.0"], ie.capture(cases[0], ["value.0"])["value.0"]
        assert ours.shape[-2:] == (1, m.hf.config.hidden_size // m.hf.config.num_attention_heads), name
        assert theirs.shape[-2] == m.hf.config.num_attention_heads and theirs.shape != ours.shape, name
        assert torch.equal(theirs.reshape(ours.shape), ours), name


EVIDENCE = {"ie-embeddings-token-only": _evidence_embeddings, "ie-logits-before-scaling": _evidence_logits,
            "ie-mlp-out-routed-only": _evidence_routed_only, "ie-z-after-gate": _evidence_gate,
            "ie-attn-gate-raw": _evidence_gate, "ie-mqa-value-split": _evidence_mqa_value}


def test_every_definition_has_its_evidence_here():
    declared = {k.id for k in known_gaps.KNOWN if k.kind == "definition"}
    assert declared == set(EVIDENCE)


@pytest.mark.slow
@pytest.mark.parametrize("kid", sorted(EVIDENCE))
def test_declared_definition_reproduces(kid):
    EVIDENCE[kid]()


@pytest.mark.slow
def test_deepseek_v4_z_and_stream_collapse_are_drop_in():
    """Once declared differences, now the same definition as interp-engine's: z after V4's inverse
    rotation (o_a_proj's input) and *_stream_collapse as the collapsed d_model vector."""
    m, _, ie, cases = _load("deepseek-ai/DeepSeek-V4-Flash")
    points = ["z.1", "attn_stream_collapse.1", "mlp_stream_collapse.1"]
    ours, theirs = _ours(m, cases[0], points), ie.capture(cases[0], points)
    for p in points:
        assert ours[p].shape == theirs[p].shape, p
        assert rel(theirs[p], ours[p]) < 1e-6, p
