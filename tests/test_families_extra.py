"""More family adapters end to end through EagerModel (cohere2, glm, arcee, nemotron, gpt_neo, mpt,
zamba2), with the five checks of tests/test_families_dense.py reused by import: resid_post against HF
hidden states, every reported point against a reference built without engine/families, the logit
lens, steering, and a left-padded batch.

The references come from the helpers of test_families_dense (raw hooks on the modules named in each
`Ref` here, q/k/value recomputed by hand) plus, where those helpers have no branch: MPT's fused Wqkv
and its MLP that adds the residual itself, and Zamba2's hybrid trunk (Mamba-2 layers and a shared
transformer block), referenced by hooks named in `ZAMBA` below.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import test_families_dense as dense
from engine import zoo
from engine.backends.hf.eager import EagerModel
from engine.core.errors import SteeringError, UnsupportedPointError
from engine.core.steering import Steer
from engine.families import family_for
from engine.loading import load_hf
from test_families_dense import BATCH, SEQ, TOL, Ref, _rel

_GPT_NEO = dict(layers="transformer.h", attn="attn.attention", o="attn.attention.out_proj", gate="mlp.c_fc",
                up=None, down="mlp.c_proj", mid_reader="ln_2", final="transformer.ln_f", final_in="transformer.ln_f",
                qkv="sep", rope=False)  # the real attention sits one level down; no rotary, no scaling
_MPT = dict(layers="transformer.blocks", attn="attn", mlp="ffn", o="attn.out_proj", gate="ffn.up_proj", up=None,
            down="ffn.down_proj", mid_reader="norm_2", final="transformer.norm_f", final_in="transformer.norm_f",
            qkv=None, rope=False)  # q/k/value: Wqkv chunks, added in `bundle`
_UNGATED = dict(gate="mlp.up_proj", up=None)

# case -> (zoo name, config overrides or None, Ref)
CASES = {
    "cohere2": ("CohereForAI/c4ai-command-r7b-12-2024", None,
                Ref(parallel=True, mid_reader=None, rope=lambda attn: attn.sliding_window is not None)),
    "glm": ("THUDM/glm-4-9b-chat-hf", None, Ref(gate=("mlp.gate_up_proj", 0), up=("mlp.gate_up_proj", 1))),
    "arcee": ("arcee-ai/AFM-4.5B-Base", None, Ref(**_UNGATED)),
    "nemotron": ("nvidia/Minitron-4B-Base", None, Ref(**_UNGATED)),
    "gpt_neo": ("EleutherAI/gpt-neo-125m", None, Ref(**_GPT_NEO)),
    "gpt_neo-tinystories": ("roneneldan/TinyStories-33M", None, Ref(**_GPT_NEO)),
    "mpt": ("mosaicml/mpt-7b", None, Ref(**_MPT)),
}
ZAMBA = "Zyphra/Zamba2-1.2B"
ZAMBA_REF = Ref(attn="shared_transformer.self_attn", final="model.final_layernorm", mid_reader=None)
ALL = list(CASES) + ["zamba2"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is faster and does not fight other processes for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _inputs(cfg):
    ids = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def bundle(case):
    """dense.bundle for the cases here: the same (model, Ref, inputs, reference, cache, logits) tuple,
    stored in dense._BUNDLES so that the dense test bodies run on it unchanged."""
    if case in dense._BUNDLES:
        return dense._BUNDLES[case]
    if case == "zamba2":
        return _zamba_bundle()
    name, overrides, r = CASES[case]
    hf = dense._hf(name, overrides)
    n = len(hf.get_submodule(r.layers))
    enc = _inputs(hf.config)
    rec, handles = dense._record(hf, r, n)
    try:
        with torch.no_grad():
            out = hf(**enc, output_hidden_states=True, output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    m = EagerModel(name, hf, None, family_for(hf.config.model_type), "zoo")
    with torch.no_grad():
        ref = dense._references(m, r, rec, out.hidden_states, out.attentions, out.logits)
        if hf.config.model_type == "mpt":
            _mpt_refs(m, r, rec, out.attentions, ref)
    logits, cache = m.run_with_cache(enc, m.points())
    dense._BUNDLES[case] = (m, r, enc, ref, cache, logits)
    return dense._BUNDLES[case]


def _mpt_refs(m, r, rec, attentions, ref):
    """MPT: q/k/value are Wqkv(attn_in) cut in three and viewed per head; the MLP module returns
    down_proj(...) + its second argument (the residual)."""
    hd = m.config.hidden_size // m.config.n_heads
    for L in range(m.n_layers):
        attn = m.hf.get_submodule(f"{r.layers}.{L}.{r.attn}")
        x = rec["attn_in", L]
        for point, t in zip(("q", "k", "value"), attn.Wqkv(x).chunk(3, dim=-1)):
            ref[f"{point}.{L}"] = t.reshape(*x.shape[:2], -1, hd)
        ref[f"attn_probs.{L}"] = attentions[L].transpose(1, 2)
        ref[f"mlp_out.{L}"] = rec["mlp_raw", L] - rec["mlp_res", L]


# -- Zamba2: its own reference (hybrid trunk) --------------------------------------------------------
def _zamba_kinds(cfg):
    """Layer -> "hybrid" | "mamba", from the config (hybrid_layer_ids lists the shared-block layers)."""
    return ["hybrid" if L in cfg.hybrid_layer_ids else "mamba" for L in range(cfg.num_hidden_layers)]


def _zamba_refs(hf, enc):
    """Every point from HF alone: hidden states, attentions, and raw hooks on named modules; q/k/value
    recomputed from the projections (plus the LoRA adapters and rotary where the config enables them)."""
    cfg, store, handles = hf.config, {}, []
    kinds = _zamba_kinds(cfg)

    def pre(mod, key):
        handles.append(mod.register_forward_pre_hook(
            lambda _m, a, k: store.__setitem__(key, (a[0] if a else k["hidden_states"], k)), with_kwargs=True))

    def post(mod, key):
        handles.append(mod.register_forward_hook(
            lambda _m, a, o: store.__setitem__(key, o[0] if isinstance(o, tuple) else o)))

    for L, kind in enumerate(kinds):
        blk = hf.model.layers[L]
        if kind == "mamba":
            pre(blk.mamba, ("attn_in", L))
            post(blk.mamba, ("attn_out", L))
            continue
        st = blk.shared_transformer
        pre(st.self_attn, ("attn_in", L))
        post(st.self_attn, ("attn_out", L))
        pre(st.self_attn.o_proj, ("z", L))
        pre(st.feed_forward, ("mlp_in", L))
        post(st.feed_forward, ("mlp_out", L))
        pre(st.feed_forward.down_proj, ("mlp_act", L))
    post(hf.model.final_layernorm, "final_norm")
    pre(hf.model.final_layernorm, "final_in")
    post(hf.get_output_embeddings(), "lm_head_raw")
    try:
        with torch.no_grad():
            out = hf(**enc, output_hidden_states=True, output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    hs, n = out.hidden_states, len(kinds)
    ref = {"embeddings": hs[0], "lm_head": out.logits, "final_norm": store["final_norm"], "lm_head_raw": store["lm_head_raw"]}
    hybrid = [L for L, k in enumerate(kinds) if k == "hybrid"]
    for L, kind in enumerate(kinds):
        ref[f"resid_pre.{L}"] = hs[L]
        ref[f"resid_post.{L}"] = hs[L + 1] if L < n - 1 else store["final_in"][0]
        ref[f"attn_in.{L}"] = store["attn_in", L][0]
        ref[f"attn_out.{L}"] = store["attn_out", L]
        if kind == "mamba":
            continue
        attn = hf.model.layers[L].shared_transformer.self_attn
        x, kw = store["attn_in", L]
        hd = attn.head_dim
        with torch.no_grad():
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            if cfg.use_shared_attention_adapter:
                i = attn.layer_dic[L]
                q = q + attn.linear_q_adapter_list[i](x)
                k = k + attn.linear_k_adapter_list[i](x)
                v = v + attn.linear_v_adapter_list[i](x)
            q, k, v = (t.reshape(*x.shape[:2], -1, hd) for t in (q, k, v))
            if cfg.use_mem_rope:
                cos, sin = kw["position_embeddings"]
                qr, kr = type(attn).forward.__globals__["apply_rotary_pos_emb"](q.transpose(1, 2), k.transpose(1, 2),
                                                                                 cos, sin)
                q, k = qr.transpose(1, 2), kr.transpose(1, 2)
        ref.update({f"q.{L}": q, f"k.{L}": k, f"value.{L}": v,
                    f"attn_probs.{L}": out.attentions[hybrid.index(L)].transpose(1, 2),
                    f"z.{L}": store["z", L][0].reshape(*x.shape[:2], -1, hd),
                    f"mlp_in.{L}": store["mlp_in", L][0], f"mlp_out.{L}": store["mlp_out", L],
                    f"mlp_act.{L}": store["mlp_act", L][0]})
    return ref


def _zamba_bundle():
    hf, _, _ = load_hf(ZAMBA, source="zoo", attention="eager")  # the reference reads HF's attention weights
    enc = _inputs(hf.config)
    ref = _zamba_refs(hf, enc)
    m = EagerModel(ZAMBA, hf, None, family_for("zamba2"), "zoo")
    logits, cache = m.run_with_cache(enc, m.points())
    dense._BUNDLES["zamba2"] = (m, ZAMBA_REF, enc, ref, cache, logits)
    return dense._BUNDLES["zamba2"]


# -- the five checks, shared with test_families_dense ----------------------------------------------------
@pytest.mark.parametrize("case", ALL)
def test_resid_post_equals_hf_hidden_states(case):
    bundle(case)
    dense.test_resid_post_equals_hf_hidden_states(case)


@pytest.mark.parametrize("case", ALL)
def test_every_reported_point_matches_its_independent_reference(case):
    bundle(case)
    dense.test_every_reported_point_matches_its_independent_reference(case)


@pytest.mark.parametrize("case", ALL)
def test_logit_lens_at_last_layer_equals_logits(case):
    bundle(case)
    dense.test_logit_lens_at_last_layer_equals_logits(case)


@pytest.mark.parametrize("case", list(CASES))
def test_steering_shifts_exactly_the_steered_tensor(case):
    bundle(case)
    dense.test_steering_shifts_exactly_the_steered_tensor(case)


@pytest.mark.parametrize("case", ALL)
def test_left_padded_batch_equals_unpadded_rows(case):
    bundle(case)
    dense.test_left_padded_batch_equals_unpadded_rows(case)


def _hf_with_hook(m, enc, module, fn):
    """HF logits and hidden states with a raw forward hook editing `module`'s output (the reference
    for a steer)."""
    h = module.register_forward_hook(lambda _m, a, o: fn(o))
    try:
        with torch.no_grad():
            return m.hf(**enc, output_hidden_states=True, use_cache=False)
    finally:
        h.remove()


def _add_first(v):
    return lambda o: (o[0] + v, *o[1:]) if isinstance(o, tuple) else o + v


def test_zamba2_steering():
    """resid_post moves by exactly v; attn_out of a Mamba layer is its residual write; on a hybrid
    layer, steering the shared block's attention or MLP output equals HF with that output edited."""
    m, r, enc, ref, cache, logits = bundle("zamba2")
    kinds = _zamba_kinds(m.config)
    torch.manual_seed(2)
    v = torch.randn(m.d_model)
    L = kinds.index("hybrid")
    got_logits, st = m.run_with_cache(enc, ["resid_post"], [Steer(f"resid_post.{L}", "add", v)])
    for i in range(L):
        assert _rel(st[f"resid_post.{i}"], cache[f"resid_post.{i}"]) < TOL
    assert _rel(st[f"resid_post.{L}"], cache[f"resid_post.{L}"] + v) < TOL
    assert _rel(got_logits, logits) > 1e-4
    M = kinds.index("mamba")
    _, st = m.run_with_cache(enc, [f"resid_post.{M}"], [Steer(f"attn_out.{M}", "add", v)])
    assert _rel(st[f"resid_post.{M}"], cache[f"resid_post.{M}"] + v) < TOL
    st_mod = m.hf.model.layers[L].shared_transformer
    for point, module in (("attn_out", st_mod.self_attn), ("mlp_out", st_mod.feed_forward)):
        got_logits, st = m.run_with_cache(enc, [f"resid_post.{L}"], [Steer(f"{point}.{L}", "add", v)])
        want = _hf_with_hook(m, enc, module, _add_first(v))
        assert _rel(st[f"resid_post.{L}"], want.hidden_states[L + 1]) < TOL, point
        assert _rel(got_logits, want.logits) < TOL, point
        assert _rel(got_logits, logits) > 1e-4, point


def test_zamba2_points_follow_the_layer_kinds():
    """Attention and MLP points exist at the hybrid layers only; attn_in/attn_out everywhere (the
    Mamba-2 mixer on the other layers); the shared attention reads [x, embeddings], 2 * hidden wide."""
    m, r, enc, ref, cache, logits = bundle("zamba2")
    hybrid = list(m.config.hybrid_layer_ids)
    assert hybrid and len(hybrid) < m.n_layers
    for p in ("q", "k", "value", "attn_scores", "attn_probs", "z", "mlp_in", "mlp_act", "mlp_out"):
        assert m.point_layers(p) == hybrid, p
    assert m.point_layers("attn_in") == list(range(m.n_layers)) == m.point_layers("attn_out")
    assert cache[f"attn_in.{hybrid[0]}"].shape[-1] == 2 * m.d_model
    with pytest.raises(UnsupportedPointError, match=r"no softmax attention module.*It exists at layers"):
        m.run_with_cache(enc, [f"q.{(set(range(m.n_layers)) - set(hybrid)).pop()}"])


# -- inline attention served at module boundaries (GPT-Neo, MPT) ---------------------------------------------
@pytest.mark.parametrize("case,proj,chunk", [("gpt_neo", "attn.attention.q_proj", None), ("mpt", "attn.Wqkv", 2)])
def test_inline_qkv_steer_equals_hf_with_the_projection_edited(case, proj, chunk):
    """Steering q (GPT-Neo's q_proj) or value (MPT's third Wqkv chunk) edits exactly that projection."""
    m, r, enc, ref, cache, logits = bundle(case)
    point = "q" if chunk is None else "value"
    L = m.n_layers - 1
    v = torch.randn(cache[f"{point}.{L}"].shape[-1], generator=torch.Generator().manual_seed(3))
    got_logits, st = m.run_with_cache(enc, [f"{point}.{L}"], [Steer(f"{point}.{L}.head-1", "add", v)])
    heads = cache[f"{point}.{L}"].shape[2]
    flat = torch.zeros(heads, v.numel())
    flat[1] = v
    flat = flat.reshape(-1)
    if chunk is not None:
        flat = torch.cat([torch.zeros_like(flat)] * chunk + [flat] + [torch.zeros_like(flat)] * (2 - chunk))
    want = _hf_with_hook(m, enc, m.hf.get_submodule(f"{r.layers}.{L}.{proj}"), lambda o: o + flat)
    assert _rel(got_logits, want.logits) < TOL
    assert _rel(got_logits, logits) > 1e-4
    moved = (st[f"{point}.{L}"] - cache[f"{point}.{L}"]).abs().amax(dim=(0, 1, 3)) > 1e-6
    assert moved.tolist() == [h == 1 for h in range(heads)]


@pytest.mark.parametrize("case", ["gpt_neo", "mpt"])
def test_inline_attn_probs_are_capture_only(case):
    m, r, enc, ref, cache, logits = bundle(case)
    with pytest.raises(SteeringError, match="captured but not steered.*probabilities inline"):
        m.run_with_cache(enc, ["resid_post.0"], [Steer("attn_probs.0", "scale", 2.0)])


def test_mpt_clip_qkv_refuses_qkv():
    """With attn_config.clip_qkv the Wqkv output is clamped after the module returns: q/k/value refused."""
    cfg = zoo.build_config(zoo.ZOO["mosaicml/mpt-7b"])
    assert family_for("mpt").for_config(cfg).refused.keys() == {"attn_scores"}
    cfg.attn_config.clip_qkv = 0.5
    torch.manual_seed(0)
    m = EagerModel("mpt-clip", AutoModelForCausalLM.from_config(cfg).eval(), None, family_for("mpt"), "zoo")
    assert not {"q", "k", "value", "attn_scores"} & set(m.points())
    assert {"attn_probs", "z", "resid_mid"} <= set(m.points())
    with pytest.raises(UnsupportedPointError, match="clip_qkv clamps"):
        m.run_with_cache(_inputs(cfg), ["k.0"])


# -- what each family must have, and what it must refuse by name -------------------------------------
HAS = {
    "cohere2": ("q", "attn_scores", "attn_probs"), "glm": ("mlp_pre", "mlp_pre_linear", "resid_mid"),
    "arcee": ("mlp_pre", "resid_mid"), "nemotron": ("mlp_pre", "q"),
    "gpt_neo": ("q", "k", "value", "attn_probs", "z", "resid_mid"), "mpt": ("q", "value", "attn_probs", "resid_mid"),
    "zamba2": ("q", "attn_scores", "z", "mlp_in", "mlp_act", "mlp_out", "final_norm"),
}

REFUSED = [
    ("cohere2", "resid_mid", "parallel"), ("cohere2", "q_norm_in", "no QK-norm"),
    ("arcee", "mlp_pre_linear", "not gated"), ("nemotron", "mlp_pre_linear", "not gated"),
    ("gpt_neo", "attn_scores", "inline in _attn"), ("gpt_neo", "mlp_pre_linear", "not gated"),
    ("mpt", "attn_scores", "ALiBi"), ("mpt", "attn_out_post", "sandwich"),
    ("zamba2", "resid_mid", "ONE write to the residual"), ("zamba2", "mlp_pre", "LoRA adapter"),
    ("zamba2", "mlp_pre_linear", "LoRA adapter"),
]


@pytest.mark.parametrize("case", list(HAS))
def test_family_reports_its_points(case):
    m = bundle(case)[0]
    missing = [p for p in HAS[case] if p not in m.points()]
    assert not missing, f"{case} should report {missing}"


@pytest.mark.parametrize("case,point,fragment", REFUSED)
def test_refusals_name_the_reason(case, point, fragment):
    bundle(case)
    dense.test_refusals_name_the_reason(case, point, fragment)


@pytest.mark.parametrize("case", ["gpt_neo", "mpt"])
def test_validator_hf_reference_reads_inline_attention_like_the_engine(case):
    """validator/engines/hf_layouts.py maps the same tensors independently (inline_qkv, probs_out,
    mlp_adds_residual): its HF reference agrees with the engine on the validator's short prompt."""
    from validator import prompts
    from validator.engines import adapter_class
    from validator.engines.base import ModelContext
    m = bundle(case)[0]
    name = CASES[case][0]
    hf, tok = zoo.load_twin(name)
    ctx = ModelContext(name, hf, tok, "zoo")
    short = next(c for c in prompts.build_cases(tok, ctx.config) if c.name == "short")
    addrs = [f"{p}.{L}" for L in range(m.n_layers) for p in ("q", "k", "value", "attn_probs", "mlp_out")]
    got = adapter_class("hf")(ctx).capture(short, addrs)
    _, ours = m.run_with_cache({"input_ids": short.input_ids, "attention_mask": short.attention_mask}, addrs)
    for a in addrs:
        assert not isinstance(got[a], Exception) and hasattr(got[a], "shape"), (a, got[a])
        assert _rel(ours[a], got[a]) < TOL, a
