"""Dense family adapters end to end through EagerModel, one zoo twin per HF model_type (plus the
config-dependent layouts: sequential GPT-NeoX, Phi with QK LayerNorm, post-LN OPT, the three
Falcon block kinds, parallel StableLM).

Every point a model reports in `m.points()` is compared with a reference computed WITHOUT the
engine's family tables: HF's own hidden states and attention probabilities, raw forward hooks on
modules named in `REF` below, and q/k/value recomputed by hand from the projections, the QK-norm
modules and the modeling file's own `apply_rotary_pos_emb`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import zoo
from engine.backends.hf.eager import EagerModel
from engine.core.errors import UnsupportedPointError
from engine.core.points import get_point
from engine.core.steering import Steer
from engine.families import family_for
from engine.loading import load_hf

TOL = 1e-5  # fp32 relative error (norm of the difference over the norm of the reference)
SEQ, BATCH = 24, 2  # longer than the twins' sliding windows (16)


@dataclass(frozen=True)
class Ref:
    """Where HF keeps things, written here independently of engine/families (paths are relative to
    a decoder layer unless said otherwise)."""
    layers: str = "model.layers"
    attn: str = "self_attn"
    mlp: str | None = "mlp"  # None: fc1/fc2 sit on the layer (mlp_in = gate input, mlp_out = down output)
    o: str = "self_attn.o_proj"
    gate: str | tuple = "mlp.gate_proj"  # (path, chunk) for fused gate_up
    up: str | tuple | None = "mlp.up_proj"
    down: str = "mlp.down_proj"
    mid_reader: str | None = "post_attention_layernorm"  # module whose input is resid_mid
    final: str | None = "model.norm"  # trunk: final norm
    final_in: str = "model.norm"  # trunk: module whose input is the last block's output
    qkv: str | None = "sep"  # sep | neox | bigcode | phi3 | None (attention not via the interface)
    qn: str | None = None
    kn: str | None = None
    qk_stage: str = "heads"  # flat (before the head view) | pos ([b,s,h,d]) | heads ([b,h,s,d]) | after_rope
    rope: object = True  # bool, or fn(attn module) -> bool for NoPE layers
    softcap: bool = False
    attn_post: str | None = None
    mlp_post: str | None = None
    parallel: bool = False
    adds_residual: bool = False  # BLOOM: attention and MLP modules add their second argument
    flat_mlp: bool = False  # OPT: MLP sees [b*s, d]
    post_ln: str | None = None  # OPT-350m: resid_mid = this norm(resid_pre + attn_out)
    q_prescaled: bool = False  # OPT multiplies the query by attn.scaling before the product
    clip: bool = False  # OLMo clip_qkv
    # attention computed inline (qkv=None): the projection that holds the values and how they sit in it:
    # "per_head3" [h, (q,k,v), hd] (BLOOM, Falcon MHA), "mqa" [q(h*hd) | k(hd) | v(hd)] (Falcon multi-query),
    # "groups" [kvh, (h/kvh queries, k, v), hd] (Falcon new architecture), "plain" (a v projection, GPT-J)
    inline_v: tuple | None = None  # (projection path relative to the attention module, layout)
    rotary_inline: bool = True  # q / k rotated inline (no reference for them from the projection)


GPT = dict(layers="transformer.h", attn="attn", o="attn.c_proj", gate="mlp.c_fc", up=None, down="mlp.c_proj",
           mid_reader="ln_2", final="transformer.ln_f", final_in="transformer.ln_f")
OLD = dict(layers="transformer.h", attn="self_attention", o="self_attention.dense", gate="mlp.dense_h_to_4h", up=None,
           down="mlp.dense_4h_to_h", final="transformer.ln_f", final_in="transformer.ln_f", qkv=None)
NEOX = dict(layers="gpt_neox.layers", attn="attention", o="attention.dense", gate="mlp.dense_h_to_4h", up=None,
            down="mlp.dense_4h_to_h", final="gpt_neox.final_layer_norm", final_in="gpt_neox.final_layer_norm",
            qkv="neox", parallel=True, mid_reader=None)
OPT = dict(layers="model.decoder.layers", mlp=None, o="self_attn.out_proj", gate="fc1", up=None, down="fc2",
           mid_reader="final_layer_norm", final="model.decoder.final_layer_norm",
           final_in="model.decoder.final_layer_norm", rope=False, flat_mlp=True, q_prescaled=True)
POSTNORM = dict(mid_reader="mlp", attn_post="post_attention_layernorm", mlp_post="post_feedforward_layernorm")
SANDWICH = dict(mid_reader="pre_feedforward_layernorm", attn_post="post_attention_layernorm",
                mlp_post="post_feedforward_layernorm")
QKN = dict(qn="self_attn.q_norm", kn="self_attn.k_norm")

# case -> (zoo name, config overrides or None, Ref)
CASES = {
    "gpt_bigcode": ("bigcode/gpt_bigcode-santacoder", None, Ref(**GPT, qkv="bigcode", rope=False)),
    "gpt_neox": ("EleutherAI/pythia-70m-deduped", None, Ref(**NEOX)),
    "gpt_neox-sequential": ("EleutherAI/pythia-160m", {"use_parallel_residual": False},
                            Ref(**{**NEOX, "parallel": False, "mid_reader": "post_attention_layernorm"})),
    "gptj": ("EleutherAI/gpt-j-6b", None, Ref(**{**GPT, "o": "attn.out_proj", "gate": "mlp.fc_in",
                                                 "down": "mlp.fc_out", "mid_reader": None}, qkv=None, parallel=True,
                                              inline_v=("v_proj", "plain"))),
    "phi": ("microsoft/phi-2", None, Ref(o="self_attn.dense", gate="mlp.fc1", up=None, down="mlp.fc2", mid_reader=None,
                                         final="model.final_layernorm", final_in="model.final_layernorm",
                                         parallel=True)),
    "phi-qk-layernorm": ("microsoft/phi-1_5", {"qk_layernorm": True},
                         Ref(o="self_attn.dense", gate="mlp.fc1", up=None, down="mlp.fc2", mid_reader=None,
                             final="model.final_layernorm", final_in="model.final_layernorm", parallel=True,
                             qn="self_attn.q_layernorm", kn="self_attn.k_layernorm")),
    "opt": ("facebook/opt-125m", None, Ref(**OPT)),
    "opt-post-ln": ("facebook/opt-350m", None,
                    Ref(**{**OPT, "mid_reader": "fc1", "final": None, "final_in": "model.decoder.project_out"},
                        post_ln="self_attn_layer_norm")),
    "bloom": ("bigscience/bloom-560m", None, Ref(**OLD, adds_residual=True, inline_v=("query_key_value", "per_head3"),
                                                 rotary_inline=False)),
    "falcon-parallel-mqa": ("tiiuae/falcon-7b", None, Ref(**OLD, parallel=True, mid_reader=None,
                                                           inline_v=("query_key_value", "mqa"))),
    "falcon-sequential-alibi": ("tiiuae/falcon-rw-1b", None, Ref(**OLD, inline_v=("query_key_value", "per_head3"),
                                                                  rotary_inline=False)),
    "falcon-new-arch": ("tiiuae/falcon-11B", None, Ref(**OLD, parallel=True, mid_reader=None,
                                                       inline_v=("query_key_value", "groups"))),
    "stablelm": ("stabilityai/stablelm-2-1_6b", None, Ref()),
    "stablelm-parallel-qk-norm": ("stabilityai/stablelm-2-12b", None,
                                  Ref(parallel=True, mid_reader=None, qn="self_attn.q_layernorm",
                                      kn="self_attn.k_layernorm")),
    "mistral": ("mistralai/Mistral-7B-v0.1", None, Ref()),
    "qwen2": ("Qwen/Qwen2.5-0.5B", None, Ref()),
    "smollm3": ("HuggingFaceTB/SmolLM3-3B", None, Ref(rope=lambda attn: attn.use_rope)),
    "granite": ("ibm-granite/granite-3.0-2b-base", None, Ref()),
    "starcoder2": ("bigcode/starcoder2-3b", None, Ref(gate="mlp.c_fc", up=None, down="mlp.c_proj")),
    "phi3": ("microsoft/Phi-4-mini-instruct", None,
             Ref(qkv="phi3", gate=("mlp.gate_up_proj", 0), up=("mlp.gate_up_proj", 1))),
    "cohere": ("CohereForAI/c4ai-command-r-plus", None, Ref(**QKN, qk_stage="pos", parallel=True, mid_reader=None)),
    "olmo": ("allenai/OLMo-7B-0424-hf", None, Ref(clip=True)),
    "olmo2": ("allenai/OLMo-2-0425-1B", None, Ref(**POSTNORM, **QKN, qk_stage="flat")),
    "olmo3": ("allenai/Olmo-3-1025-7B", None, Ref(**POSTNORM, **QKN, qk_stage="flat")),
    "gemma": ("google/gemma-2b", None, Ref()),
    "gemma2": ("google/gemma-2-2b", None, Ref(**SANDWICH, softcap=True)),
    "gemma3_text": ("google/gemma-3-1b-pt", None, Ref(**SANDWICH, **QKN)),
    "glm4": ("zai-org/GLM-4-9B-0414", None,
             Ref(mid_reader="post_attention_layernorm", attn_post="post_self_attn_layernorm",
                 mlp_post="post_mlp_layernorm", gate=("mlp.gate_up_proj", 0), up=("mlp.gate_up_proj", 1))),
    "exaone4": ("LGAI-EXAONE/EXAONE-4.0-32B", None,
                Ref(**POSTNORM, **QKN, rope=lambda attn: attn.sliding_window is None or attn.is_sliding)),
    "apertus": ("swiss-ai/Apertus-8B-2509", None,
                Ref(**QKN, gate="mlp.up_proj", up=None, mid_reader="feedforward_layernorm")),
    "ernie4_5": ("baidu/ERNIE-4.5-0.3B-PT", None, Ref()),
    "seed_oss": ("ByteDance-Seed/Seed-OSS-36B-Base", None, Ref()),
    "hunyuan_v1_dense": ("tencent/Hunyuan-1.8B-Pretrain", None,
                         Ref(qn="self_attn.query_layernorm", kn="self_attn.key_layernorm", qk_stage="after_rope")),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is faster and does not fight other processes for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- building ------------------------------------------------------------------------------------
def _hf(name, overrides):
    if overrides is None:  # eager: the reference reads HF's attention weights (output_attentions)
        hf, _, _ = load_hf(name, source="zoo", attention="eager")
        return hf
    cfg = zoo.build_config(zoo.ZOO[name])
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _get(root, path):
    """The submodule at `path`, or None where the path is empty or absent (or set to None by HF)."""
    try:
        return root.get_submodule(path) if path else None
    except AttributeError:
        return None


def _first_arg(args, kwargs, key="hidden_states"):
    return args[0] if args else kwargs.get(key, kwargs.get("input"))


def _record(hf, r: Ref, n_layers):
    """Raw forward hooks on the modules `r` names; returns (store, handles)."""
    store, handles = {}, []

    def keep(x):  # HF edits some outputs in place after the hook (Falcon adds attn into mlp_out)
        return x.detach().clone() if isinstance(x, torch.Tensor) else x

    def put(key):
        return lambda value: store.__setitem__(key, keep(value))

    def pre(mod, fn):
        handles.append(mod.register_forward_pre_hook(lambda m, a, k: fn(a, k), with_kwargs=True))

    def post(mod, fn):
        handles.append(mod.register_forward_hook(lambda m, a, k, o: fn(a, k, o), with_kwargs=True))

    out0 = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    for L in range(n_layers):
        blk = hf.get_submodule(f"{r.layers}.{L}")
        attn = _get(blk, r.attn)
        pre(attn, lambda a, k, L=L: store.update({("attn_in", L): keep(_first_arg(a, k)), ("attn_kw", L): k,
                                                   ("attn_res", L): keep(a[1] if len(a) > 1 else k.get("residual"))}))
        post(attn, lambda a, k, o, L=L: put(("attn_raw", L))(out0(o)))
        pre(_get(blk, r.o), lambda a, k, L=L: put(("z", L))(_first_arg(a, k)))
        pre(_get(blk, r.down), lambda a, k, L=L: put(("mlp_act", L))(_first_arg(a, k)))
        for key, spec in (("mlp_pre", r.gate), ("mlp_pre_linear", r.up)):
            if spec is not None:
                path, chunk = spec if isinstance(spec, tuple) else (spec, None)
                post(_get(blk, path), lambda a, k, o, key=key, chunk=chunk, L=L: put((key, L))(
                    o if chunk is None else o.chunk(2, dim=-1)[chunk]))
        mlp_mod = _get(blk, r.mlp) if r.mlp else None
        pre(mlp_mod or _get(blk, r.gate if isinstance(r.gate, str) else r.gate[0]),
            lambda a, k, L=L: store.update({("mlp_in", L): keep(_first_arg(a, k)),
                                            ("mlp_res", L): keep(a[1] if len(a) > 1 else None)}))
        post(mlp_mod or _get(blk, r.down), lambda a, k, o, L=L: put(("mlp_raw", L))(out0(o)))
        if r.mid_reader:
            pre(_get(blk, r.mid_reader), lambda a, k, L=L: put(("mid_reader", L))(_first_arg(a, k)))
        for key, path in (("q_norm", r.qn), ("k_norm", r.kn)):
            if _get(blk, path) is not None:
                post(_get(blk, path), lambda a, k, o, key=key, L=L: store.update(
                    {(key + "_in", L): keep(_first_arg(a, k)), (key + "_out", L): keep(o)}))
        for key, path in (("attn_out_post", r.attn_post), ("mlp_out_post", r.mlp_post)):
            if path:
                post(_get(blk, path), lambda a, k, o, key=key, L=L: put((key, L))(o))
        if r.inline_v:
            post(_get(attn, r.inline_v[0]), lambda a, k, o, L=L: put(("qkv_raw", L))(o))
    if r.final:
        post(hf.get_submodule(r.final), lambda a, k, o: put("final_norm")(o))
    post(hf.get_output_embeddings(), lambda a, k, o: put("lm_head_raw")(o))
    pre(hf.get_submodule(r.final_in), lambda a, k: put("final_in")(_first_arg(a, k)))
    return store, handles


# -- the reference values, per point ---------------------------------------------------------------
def _per_head(t, heads_first=False, hd=None):
    if t.dim() == 3:
        return t.reshape(*t.shape[:2], -1, hd)
    return t.transpose(1, 2) if heads_first else t


def _qkv(attn, x, r: Ref, cfg, L, kw):
    """q, k (after norm and rotary) and value, [b, s, heads, hd], recomputed from HF modules."""
    b, s, _ = x.shape
    hd = getattr(attn, "head_dim", None) or getattr(attn, "head_size", None)
    if r.qkv == "sep":
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    elif r.qkv == "neox":
        q, k, v = attn.query_key_value(x).view(b, s, -1, 3 * hd).chunk(3, dim=-1)
    elif r.qkv == "phi3":
        qkv = attn.qkv_proj(x)
        nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
    else:  # bigcode
        out = attn.c_attn(x)
        if cfg.multi_query:
            q, k, v = out.split((cfg.hidden_size, hd, hd), dim=-1)
        else:
            q, k, v = out.view(b, s, -1, 3 * hd).split(hd, dim=-1)
    if r.q_prescaled:
        q = q * attn.scaling
    if r.clip and cfg.clip_qkv is not None:
        q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    qn, kn = (getattr(attn, p.split(".")[-1], None) if p else None for p in (r.qn, r.kn))
    if qn is not None and r.qk_stage == "flat":
        q, k = qn(q), kn(k)
    q, k, v = (t.reshape(b, s, -1, hd) for t in (q, k, v))
    if qn is not None and r.qk_stage == "pos":
        q, k = qn(q), kn(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # heads first, as HF rotates them
    if qn is not None and r.qk_stage == "heads":
        q, k = qn(q), kn(k)
    if r.rope is True or (callable(r.rope) and r.rope(attn)):
        cos, sin = kw["position_embeddings"]
        rot = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        rd = cos.shape[-1]
        qr, kr = rot(q[..., :rd], k[..., :rd], cos, sin)
        q, k = torch.cat([qr, q[..., rd:]], -1), torch.cat([kr, k[..., rd:]], -1)
    if qn is not None and r.qk_stage == "after_rope":
        q, k = qn(q), kn(k)
    return q.transpose(1, 2), k.transpose(1, 2), v


def _references(m, r: Ref, rec, hs, attentions, logits):
    """point.L -> reference tensor, for every point this test knows how to reference."""
    cfg, n, (b, s) = m.config, m.n_layers, hs[0].shape[:2]
    unflat = (lambda t: t.reshape(b, s, *t.shape[1:])) if r.flat_mlp else (lambda t: t)
    mult = getattr(cfg, "residual_multiplier", None) or 1.0
    ref = {"embeddings": hs[0], "lm_head": logits, "lm_head_raw": rec["lm_head_raw"]}
    if "final_norm" in rec:
        ref["final_norm"] = rec["final_norm"]
    for L in range(n):
        blk = m.hf.get_submodule(f"{r.layers}.{L}")
        attn = _get(blk, r.attn)
        ref[f"resid_pre.{L}"] = hs[L]
        ref[f"resid_post.{L}"] = hs[L + 1] if L < n - 1 else rec["final_in"]
        ref[f"attn_in.{L}"] = rec["attn_in", L]
        attn_out = rec["attn_raw", L] - (rec["attn_res", L] if r.adds_residual else 0)
        ref[f"attn_out.{L}"] = attn_out
        mlp_out = unflat(rec["mlp_raw", L]) - (rec["mlp_res", L] if r.adds_residual else 0)
        ref[f"mlp_out.{L}"] = mlp_out
        ref[f"mlp_in.{L}"] = unflat(rec["mlp_in", L])
        ref[f"mlp_act.{L}"] = unflat(rec["mlp_act", L])
        for key in ("mlp_pre", "mlp_pre_linear"):
            if (key, L) in rec:
                ref[f"{key}.{L}"] = unflat(rec[key, L])
        hd = getattr(attn, "head_dim", None) or getattr(attn, "head_size", None) or cfg.hidden_size // cfg.num_attention_heads
        ref[f"z.{L}"] = rec["z", L].reshape(b, s, -1, hd)
        for key in ("attn_out_post", "mlp_out_post"):
            if (key, L) in rec:
                ref[f"{key}.{L}"] = rec[key, L]
        for key in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"):
            if (key, L) in rec:
                ref[f"{key}.{L}"] = _per_head(rec[key, L], r.qk_stage in ("heads", "after_rope"), hd)
        if not r.parallel:
            write = rec["attn_out_post", L] if r.attn_post else attn_out
            mid = hs[L] + mult * write
            ref[f"resid_mid.{L}"] = _get(blk, r.post_ln)(mid) if r.post_ln else mid
        if r.qkv:
            q, k, v = _qkv(attn, rec["attn_in", L], r, cfg, L, rec["attn_kw", L])
            ref.update({f"q.{L}": q, f"k.{L}": k, f"value.{L}": v})
            ref[f"attn_probs.{L}"] = attentions[L].transpose(1, 2)
        elif r.inline_v:
            q, k, v = _inline_qkv(rec["qkv_raw", L], r.inline_v[1], cfg, hd)
            ref[f"value.{L}"] = v
            ref[f"attn_probs.{L}"] = attentions[L].transpose(1, 2)
            if not r.rotary_inline:
                ref.update({f"q.{L}": q, f"k.{L}": k})
    return ref


def _inline_qkv(x, layout, cfg, hd):
    """q, k, v [b, s, heads, hd] cut out of an inline attention's projection output, by its layout."""
    b, s, _ = x.shape
    h = cfg.num_attention_heads
    if layout == "plain":
        return None, None, x.reshape(b, s, -1, hd)
    if layout == "per_head3":
        t = x.reshape(b, s, h, 3, hd)
        return t[..., 0, :], t[..., 1, :], t[..., 2, :]
    if layout == "mqa":
        return (x[..., : h * hd].reshape(b, s, h, hd), x[..., h * hd: h * hd + hd].reshape(b, s, 1, hd),
                x[..., h * hd + hd:].reshape(b, s, 1, hd))
    kvh = cfg.num_kv_heads
    t = x.reshape(b, s, kvh, h // kvh + 2, hd)
    return t[..., :-2, :].reshape(b, s, h, hd), t[..., -2, :], t[..., -1, :]


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


_BUNDLES: dict = {}


def bundle(case):
    """(model, Ref, inputs, HF reference dict, engine cache, engine logits), built once per case."""
    if case in _BUNDLES:
        return _BUNDLES[case]
    name, overrides, r = CASES[case]
    hf = _hf(name, overrides)
    cfg = hf.config
    n = len(hf.get_submodule(r.layers))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g)
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    rec, handles = _record(hf, r, n)
    try:
        with torch.no_grad():
            out = hf(**enc, output_hidden_states=True, output_attentions=bool(r.qkv or r.inline_v), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    m = EagerModel(name, hf, None, family_for(cfg.model_type), "zoo")
    with torch.no_grad():
        ref = _references(m, r, rec, out.hidden_states, out.attentions, out.logits)
    logits, cache = m.run_with_cache(enc, m.points())
    _BUNDLES[case] = (m, r, enc, ref, cache, logits)
    return _BUNDLES[case]


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_resid_post_equals_hf_hidden_states(case):
    m, r, enc, ref, cache, logits = bundle(case)
    for L in range(m.n_layers):
        assert _rel(cache[f"resid_post.{L}"], ref[f"resid_post.{L}"]) < TOL, f"resid_post.{L}"
    assert _rel(logits, ref["lm_head"]) < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_every_reported_point_matches_its_independent_reference(case):
    m, r, enc, ref, cache, logits = bundle(case)
    assert set(cache) == {f"{p}.{L}" if L >= 0 else p for p in m.points() for L in m.point_layers(p)}
    unchecked = sorted(k for k in cache if k not in ref and not k.startswith("attn_scores"))
    assert not unchecked, f"points with no reference in this test: {unchecked}"
    for key, want in ref.items():
        assert key in cache, f"{key} has a reference but the model does not report it"
        got = cache[key]
        assert got.shape == want.shape, (key, tuple(got.shape), tuple(want.shape))
        assert _rel(got, want) < TOL, f"{key}: rel err {_rel(got, want):.2e}"
    for L in m.point_layers("attn_scores"):
        _check_scores(m, r, cache, ref, L)


def _check_scores(m, r, cache, ref, L):
    scores, probs = cache[f"attn_scores.{L}"], ref[f"attn_probs.{L}"]
    assert _rel(scores.softmax(-1), probs) < TOL, f"softmax(attn_scores.{L}) != HF attentions"
    attn = m.hf.get_submodule(f"{r.layers}.{L}.{r.attn}")
    q, k = ref[f"q.{L}"], ref[f"k.{L}"]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    hand = torch.einsum("bqhd,bkhd->bqhk", q, k) * (1.0 if r.q_prescaled else attn.scaling)
    if r.softcap:
        cap = m.config.attn_logit_softcapping
        hand = torch.tanh(hand / cap) * cap
    live = probs > 0
    assert _rel(scores[live], hand[live]) < TOL, f"attn_scores.{L} vs q.k recomputed by hand"
    assert (scores[~live] < -1e4).all(), f"masked attn_scores.{L} entries are not very negative"


@pytest.mark.parametrize("case", list(CASES))
def test_logit_lens_at_last_layer_equals_logits(case):
    m, r, enc, ref, cache, logits = bundle(case)
    assert _rel(m.logit_lens(cache["resid_post.-1"]), logits) < TOL
    assert _rel(m.logit_lens((cache, "resid_post.-1")), logits) < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_steering_shifts_exactly_the_steered_tensor(case):
    m, r, enc, ref, cache, logits = bundle(case)
    torch.manual_seed(2)
    v = torch.randn(m.d_model)
    L = m.n_layers // 2
    mult = getattr(m.config, "residual_multiplier", None) or 1.0  # Granite scales sublayer writes
    got_logits, st = m.run_with_cache(enc, ["resid_post", "resid_mid"] if not r.parallel else ["resid_post"],
                                      [Steer(f"resid_post.{L}", "add", v)])
    for i in range(L):
        assert _rel(st[f"resid_post.{i}"], cache[f"resid_post.{i}"]) < TOL
    assert _rel(st[f"resid_post.{L}"], cache[f"resid_post.{L}"] + v) < TOL
    assert _rel(got_logits, logits) > 1e-4  # the steer reached the output
    if not r.post_ln:  # the MLP write moves resid_post by exactly v (through a sandwich norm's output)
        mw = "mlp_out_post" if r.mlp_post else "mlp_out"
        _, st = m.run_with_cache(enc, [f"resid_post.{L}"], [Steer(f"{mw}.{L}", "add", v)])
        assert _rel(st[f"resid_post.{L}"], cache[f"resid_post.{L}"] + mult * v) < TOL, mw
    # the attention write: the residual right after it moves by exactly v
    if r.parallel:
        _, st = m.run_with_cache(enc, [f"resid_post.{L}"], [Steer(f"attn_out.{L}", "add", v)])
        assert _rel(st[f"resid_post.{L}"], cache[f"resid_post.{L}"] + v) < TOL
        return
    write = "attn_out_post" if r.attn_post else "attn_out"
    _, st = m.run_with_cache(enc, [f"resid_mid.{L}"], [Steer(f"{write}.{L}", "add", v)])
    blk = m.hf.get_submodule(f"{r.layers}.{L}")
    want = cache[f"resid_pre.{L}"] + mult * (cache[f"{write}.{L}"] + v)
    want = _get(blk, r.post_ln)(want) if r.post_ln else want
    assert _rel(st[f"resid_mid.{L}"], want) < TOL
    # steering resid_mid itself: the module that reads the mid residual sees the new value
    seen = {}
    h = _get(blk, r.mid_reader).register_forward_pre_hook(
        lambda mod, a, k: seen.__setitem__("x", _first_arg(a, k)), with_kwargs=True)
    try:
        _, st = m.run_with_cache(enc, [f"resid_mid.{L}"], [Steer(f"resid_mid.{L}", "add", v)])
    finally:
        h.remove()
    assert _rel(st[f"resid_mid.{L}"], cache[f"resid_mid.{L}"] + v) < TOL
    assert _rel(seen["x"].reshape(st[f"resid_mid.{L}"].shape), cache[f"resid_mid.{L}"] + v) < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_left_padded_batch_equals_unpadded_rows(case):
    m, r, enc, ref, cache, logits = bundle(case)
    ids = enc["input_ids"]
    short = SEQ - 7
    padded = ids.clone()
    padded[1, :SEQ - short] = 0
    mask = torch.ones_like(ids)
    mask[1, :SEQ - short] = 0
    pl, pc = m.run_with_cache({"input_ids": padded, "attention_mask": mask}, ["resid_post", "attn_out"])
    sl, sc = m.run_with_cache(ids[1:, SEQ - short:], ["resid_post", "attn_out"])
    for key in sc:
        assert _rel(pc[key][1, SEQ - short:], sc[key][0]) < TOL, key
    assert _rel(pl[1, SEQ - short:], sl[0]) < TOL
    for key in sc:  # the unpadded row is untouched by its neighbour's padding
        assert _rel(pc[key][0], cache[key][0]) < TOL, key


# -- what each family must have, and what it must refuse by name -------------------------------------
HAS = {
    "gpt_bigcode": ("q", "k", "attn_probs", "resid_mid"), "gpt_neox": ("q", "attn_probs"),
    "gpt_neox-sequential": ("resid_mid",), "phi-qk-layernorm": ("q_norm_in", "k_norm_out"),
    "opt": ("q", "resid_mid", "mlp_in", "final_norm"), "opt-post-ln": ("resid_mid",),
    "bloom": ("resid_mid", "z", "q", "k", "value", "attn_probs"), "gptj": ("value", "attn_probs"),
    "falcon-parallel-mqa": ("value", "attn_probs"), "falcon-new-arch": ("value", "attn_probs"),
    "falcon-sequential-alibi": ("resid_mid", "q", "k", "value", "attn_probs"), "phi3": ("mlp_pre_linear",),
    "stablelm-parallel-qk-norm": ("q_norm_in",), "cohere": ("q_norm_out",), "olmo2": ("q_norm_in", "attn_out_post"),
    "gemma2": ("attn_out_post", "mlp_out_post", "attn_scores"), "gemma3_text": ("k_norm_in", "mlp_out_post"),
    "glm4": ("attn_out_post", "mlp_pre_linear"), "exaone4": ("q_norm_in", "mlp_out_post"),
    "apertus": ("q_norm_in", "mlp_pre"), "hunyuan_v1_dense": ("q_norm_in",), "granite": ("resid_mid",),
}

REFUSED = [
    ("gptj", "q", "GPTJAttention"), ("gptj", "attn_scores", "_attn"), ("gptj", "resid_mid", "parallel"),
    ("bloom", "attn_scores", "BloomAttention"), ("falcon-parallel-mqa", "attn_scores", "FalconAttention"),
    ("falcon-parallel-mqa", "k", "FalconAttention"), ("falcon-parallel-mqa", "resid_mid", "parallel"),
    ("falcon-sequential-alibi", "attn_scores", "FalconAttention"), ("falcon-new-arch", "resid_mid", "parallel"),
    ("gpt_neox", "resid_mid", "parallel"), ("stablelm-parallel-qk-norm", "resid_mid", "parallel"),
    ("phi", "q_norm_in", "no QK-norm"), ("cohere", "resid_mid", "parallel"),
    ("opt-post-ln", "final_norm", "no final norm"), ("opt", "mlp_pre_linear", "not gated"),
    ("gpt_bigcode", "attn_out_post", "sandwich"), ("starcoder2", "mlp_pre_linear", "not gated"),
    ("apertus", "mlp_pre_linear", "not gated"), ("olmo", "q_norm_out", "no QK-norm"),
]


@pytest.mark.parametrize("case", list(HAS))
def test_family_reports_its_points(case):
    m = bundle(case)[0]
    missing = [p for p in HAS[case] if p not in m.points()]
    assert not missing, f"{case} should report {missing}"


@pytest.mark.parametrize("case,point,fragment", REFUSED)
def test_refusals_name_the_reason(case, point, fragment):
    m = bundle(case)[0]
    assert point not in m.points()
    with pytest.raises(UnsupportedPointError, match=fragment) as e:
        m.run_with_cache(bundle(case)[2], [point if get_point(point).scope == "trunk" else f"{point}.0"])
    assert point in str(e.value)


@pytest.mark.parametrize("case", ["gemma3_text", "phi-qk-layernorm", "olmo2", "cohere"])
def test_qk_norm_head_steer_reaches_only_that_heads_query(case):
    """Heads-first, flat and [pos, heads] QK-norm layouts all write back to the right head."""
    m, r, enc, ref, cache, logits = bundle(case)
    _, st = m.run_with_cache(enc, ["q.1"], [Steer("q_norm_out.1.head-1", "add", torch.ones(cache["q.1"].shape[-1]))])
    moved = (st["q.1"] - cache["q.1"]).abs().amax(dim=(0, 1, 3)) > 1e-4
    assert moved.tolist() == [i == 1 for i in range(moved.numel())]


def test_grad_mode_capture_is_not_edited_in_place_by_hf():
    """Falcon's parallel block does `mlp_output += attention_output` after the MLP returns."""
    m, r, enc, ref, cache, logits = bundle("falcon-parallel-mqa")
    _, c = m.run_with_cache(enc, ["mlp_out.0", "resid_post.0"], grad=True)
    assert _rel(c["mlp_out.0"].detach(), ref["mlp_out.0"]) < TOL
    c["mlp_out.0"].sum().backward()
    assert any(p.grad is not None for p in m.hf.parameters())
    m.hf.zero_grad(set_to_none=True)


def test_variants_follow_the_config():
    """The same model_type resolves to different block layouts by config flag."""
    fam = family_for("falcon")
    assert not fam.for_config(zoo.build_config(zoo.ZOO["tiiuae/falcon-rw-1b"])).parallel
    assert fam.for_config(zoo.build_config(zoo.ZOO["tiiuae/falcon-11B"])).parallel
    opt = family_for("opt").for_config(zoo.build_config(zoo.ZOO["facebook/opt-350m"]))
    assert opt.final_norm is None and opt.resid_mid_out == "self_attn_layer_norm"
    assert family_for("opt") is family_for("opt").for_config(zoo.build_config(zoo.ZOO["facebook/opt-125m"]))
