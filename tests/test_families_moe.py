"""MoE, hybrid and hyper-connection families on their zoo twins, checked against HF itself:
`output_hidden_states`, raw forward hooks on modules named in this file (never read from the
engine's family tables), routing recomputed here from the captured router logits, and identities
that hold between tensors HF computes (e.g. o_proj input = z * gate)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

from engine import zoo
from engine.backends.hf.eager import EagerModel
from engine.core.errors import AddressError, SteeringError, UnsupportedPointError
from engine.core.steering import Steer
from engine.families import family_for

# model_type -> zoo twin, router path in a decoder layer, index of (logits, weights, indices) in its
# output, MLP-slot module path, final norm path, and the routing rule expert_indices must follow.
SPECS = {
    "mixtral": dict(zoo="mistralai/Mixtral-8x7B-v0.1", router="mlp.gate", out=(0, 1, 2), rule="topk"),
    "qwen2_moe": dict(zoo="Qwen/Qwen1.5-MoE-A2.7B", router="mlp.gate", out=(0, 1, 2), rule="topk"),
    "qwen3_moe": dict(zoo="Qwen/Qwen3-30B-A3B", router="mlp.gate", out=(0, 1, 2), rule="topk"),
    "olmoe": dict(zoo="allenai/OLMoE-1B-7B-0924", router="mlp.gate", out=(0, 1, 2), rule="topk"),
    "granitemoe": dict(zoo="ibm-granite/granite-3.0-1b-a400m-base", router="block_sparse_moe.router",
                       out=(2, 1, 0), mlp="block_sparse_moe", rule="topk"),
    "phimoe": dict(zoo="microsoft/Phi-3.5-MoE-instruct", router="mlp.router", out=(0, 1, 2), rule="topk"),
    "gpt_oss": dict(zoo="openai/gpt-oss-20b", router="mlp.router", out=(0, 1, 2), rule="topk"),
    "deepseek_v2": dict(zoo="deepseek-ai/DeepSeek-V2-Lite", router="mlp.gate", out=(0, 1, 2), rule="topk"),
    "deepseek_v3": dict(zoo="deepseek-ai/DeepSeek-V3", router="mlp.gate", out=(0, 1, 2), rule="v3_groups"),
    "deepseek_v4": dict(zoo="deepseek-ai/DeepSeek-V4-Flash", router="mlp.gate", out=(0, 1, 2), rule="v4"),
    "qwen3_next": dict(zoo="Qwen/Qwen3-Next-80B-A3B-Instruct", router="mlp.gate", out=(0, 1, 2), rule="topk"),
    "lfm2": dict(zoo="LiquidAI/LFM2-350M", router=None, mlp="feed_forward", norm="model.embedding_norm"),
    "granitemoehybrid": dict(zoo="ibm-granite/granite-4.0-h-tiny", router="block_sparse_moe.router", out=(2, 1, 0),
                             mlp="block_sparse_moe", mlp_plus="shared_mlp", rule="topk"),
    "glm4_moe": dict(zoo="zai-org/GLM-4.5-Air", router="mlp.gate", out=(0, 1, 2), rule="v3_groups"),
    "dots1": dict(zoo="rednote-hilab/dots.llm1.base", router="mlp.gate", out=(0, 1, 2), rule="v3_groups"),
    "ernie4_5_moe": dict(zoo="baidu/ERNIE-4.5-21B-A3B-PT", router="mlp.gate", out=(0, 1, 2), rule="ernie"),
    "hunyuan_v1_moe": dict(zoo="tencent/Hunyuan-A13B-Instruct", router="mlp.gate", out=(0, 1, 2), rule="topk"),
    "lfm2_moe": dict(zoo="LiquidAI/LFM2-8B-A1B", router="feed_forward.gate", out=(0, 1, 2), mlp="feed_forward",
                     norm="model.embedding_norm", rule="lfm2_moe"),
    "bamba": dict(zoo="ibm-ai-platform/Bamba-9B", router=None, mlp="feed_forward", norm="model.final_layernorm"),
    "jamba": dict(zoo="ai21labs/AI21-Jamba-Mini-1.5", router="feed_forward.router", out=(0, None, None),
                  mlp="feed_forward", norm="model.final_layernorm"),  # a bare Linear router: logits only
    "falcon_h1": dict(zoo="tiiuae/Falcon-H1-0.5B-Base", router=None, mlp="feed_forward", norm="model.final_layernorm"),
    # one sublayer per block, named `mixer` whatever its kind (MLP kinds: "mlp", "moe")
    "nemotron_h": dict(zoo="nvidia/NVIDIA-Nemotron-Nano-9B-v2", router=None, mlp="mixer", norm="model.norm_f"),
}
MOE = [mt for mt, s in SPECS.items() if s["router"]]
ROUTED = [mt for mt in MOE if "rule" in SPECS[mt]]  # routers that return expert indices
T = 24  # longer than the twins' sliding windows (16) and V4's compression rates


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is faster and does not fight other processes for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _sub(blk, path):
    try:
        return blk.get_submodule(path)
    except AttributeError:
        return None


def _setup(mt, hf):
    """Give buffers the zoo leaves at their init value something to route by (test-local model)."""
    g = torch.Generator().manual_seed(1)
    for blk in hf.model.layers:
        gate = _sub(blk, "mlp.gate")
        if gate is not None and hasattr(gate, "tid2eid"):  # V4 hash routing: token id -> experts
            n, k = gate.tid2eid.shape[0], gate.tid2eid.shape[1]
            gate.tid2eid.copy_(torch.stack([torch.randperm(gate.num_experts, generator=g)[:k] for _ in range(n)]))
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.copy_(torch.randn(gate.num_experts, generator=g) * 0.05)
        ffn = _sub(blk, "feed_forward")
        if ffn is not None and hasattr(ffn, "expert_bias"):  # lfm2_moe: selection bias kept on the block
            ffn.expert_bias.copy_(torch.randn(ffn.expert_bias.shape[0], generator=g) * 0.05)


_BUNDLES = {}


def bundle(mt):
    """One HF reference forward with raw hooks and one engine capture per family, shared by tests."""
    if mt in _BUNDLES:
        return _BUNDLES[mt]
    spec = SPECS[mt]
    hf, tok = zoo.load_twin(spec["zoo"])
    _setup(mt, hf)
    m = EagerModel(spec["zoo"], hf, tok, family_for(mt), "zoo")
    ids = torch.randint(0, hf.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    raw, hooks = {}, []
    for L, blk in enumerate(hf.model.layers):
        mods = {"router": _sub(blk, spec["router"]) if spec["router"] else None,
                "mlp": _sub(blk, spec.get("mlp", "mlp")), "attn_hc": _sub(blk, "attn_hc"),
                "mlp_plus": _sub(blk, spec["mlp_plus"]) if "mlp_plus" in spec else None,
                "ffn_hc": _sub(blk, "ffn_hc"), "q_proj": _sub(blk, "self_attn.q_proj"),
                "o_proj": _sub(blk, "self_attn.o_proj"), "down": _sub(blk, "mlp.down_proj"),
                "o_a_proj": _sub(blk, "self_attn.o_a_proj"),
                "gate_proj": _sub(blk, "mlp.gate_proj"), "up_proj": _sub(blk, "mlp.up_proj")}
        for name, mod in mods.items():
            if mod is None:
                continue
            if name in ("o_proj", "down", "o_a_proj"):
                hooks.append(mod.register_forward_pre_hook(lambda _m, a, L=L, n=name: raw.__setitem__((n, L), a[0])))
            else:
                hooks.append(mod.register_forward_hook(
                    lambda _m, a, o, L=L, n=name: raw.__setitem__((n, L), (a, o))))
    try:
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    wanted = ["embeddings", "final_norm", "resid_post", "resid_mid", "resid_streams", "attn_out", "mlp_out", "router_logits",
              "expert_weights", "expert_indices", "attn_gate", "z", "mlp_act", "mlp_pre", "mlp_pre_linear",
              "attn_stream_collapse", "attn_stream_write", "attn_stream_mix", "mlp_stream_collapse",
              "mlp_stream_write", "mlp_stream_mix", "attn_stream_collapse_weights", "mlp_stream_collapse_weights"]
    logits, cache = m.run_with_cache(ids, [p for p in wanted if m.point_layers(p)])
    _BUNDLES[mt] = b = dict(m=m, hf=hf, ids=ids, ref=ref, raw=raw, logits=logits, cache=cache)
    return b


@pytest.mark.parametrize("mt", [mt for mt in SPECS if mt != "deepseek_v4"])
def test_resid_post_equals_hf_hidden_states(mt):
    b = bundle(mt)
    m, hs, c = b["m"], b["ref"].hidden_states, b["cache"]
    assert len(hs) == m.n_layers + 1
    assert rel(c["embeddings"], hs[0]) < 1e-6
    for L in range(m.n_layers - 1):
        assert c[f"resid_post.{L}"].shape == (2, T, m.d_model)
        assert rel(c[f"resid_post.{L}"], hs[L + 1]) < 1e-5, L
    final_norm = b["hf"].get_submodule(SPECS[mt].get("norm", "model.norm"))  # HF stores norm(last) last
    with torch.no_grad():
        assert rel(final_norm(c["resid_post.-1"]), hs[-1]) < 1e-5
    assert rel(c["final_norm"], hs[-1]) < 1e-6
    assert rel(b["logits"], b["ref"].logits) < 1e-6


@pytest.mark.parametrize("mt", list(SPECS))
def test_logit_lens_at_last_layer_equals_logits(mt):
    b = bundle(mt)
    point = "resid_streams" if mt == "deepseek_v4" else "resid_post"
    lensed = b["m"].logit_lens((b["cache"], f"{point}.-1"))
    assert lensed.shape == b["logits"].shape
    assert rel(lensed, b["logits"]) < 1e-5


@pytest.mark.parametrize("mt", MOE)
def test_router_points_match_raw_router_hook(mt):
    b = bundle(mt)
    m, raw, c = b["m"], b["raw"], b["cache"]
    moe_layers = [L for L in range(m.n_layers) if ("router", L) in raw]
    assert moe_layers and m.point_layers("router_logits") == moe_layers
    li, wi, ii = SPECS[mt]["out"]
    for L in moe_layers:
        out = raw[("router", L)][1]
        out = out if isinstance(out, tuple) else (out,)
        logits = c[f"router_logits.{L}"]
        assert logits.shape[:2] == (2, T)
        torch.testing.assert_close(logits, out[li].reshape(2, T, -1), rtol=1e-6, atol=1e-7)
        if wi is None:  # jamba routes in a block method: no module returns weights or indices
            assert m.point_layers("expert_weights") == m.point_layers("expert_indices") == []
            continue
        weights, idx = c[f"expert_weights.{L}"], c[f"expert_indices.{L}"]
        assert weights.shape[:2] == idx.shape[:2] == (2, T)
        torch.testing.assert_close(weights, out[wi].reshape(2, T, -1), rtol=1e-6, atol=1e-7)
        assert torch.equal(idx, out[ii].reshape(2, T, -1))
        assert not torch.is_floating_point(idx)


def _expected_indices(mt, b, L, logits):
    """The experts the family's routing rule picks, recomputed from the captured logits."""
    router = b["hf"].model.layers[L].get_submodule(SPECS[mt]["router"])
    k = b["cache"][f"expert_indices.{L}"].shape[-1]
    rule = SPECS[mt]["rule"]
    if rule == "v4" and hasattr(router, "tid2eid"):
        return router.tid2eid[b["ids"]]
    if rule == "v4":
        return torch.topk(router.score_fn(logits) + router.e_score_correction_bias, k).indices
    if rule == "ernie":  # softmax probabilities plus moe_statics' correction bias choose
        return torch.topk(router.moe_statics(logits.softmax(-1)), k).indices
    if rule == "lfm2_moe":  # sigmoid scores plus the block's expert_bias choose
        return torch.topk(logits.sigmoid() + b["hf"].model.layers[L].feed_forward.expert_bias, k).indices
    if rule == "v3_groups":
        s = logits.sigmoid() + router.e_score_correction_bias
        g = router.n_group if hasattr(router, "n_group") else router.num_group
        grouped = s.reshape(*s.shape[:-1], g, -1)
        keep = grouped.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
        mask = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(-1, keep, True)
        s = s.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=-1), float("-inf"))
        return torch.topk(s, k).indices
    return torch.topk(logits, k).indices  # softmax / sigmoid / sparsemixer keep the order of the logits


@pytest.mark.parametrize("mt", ROUTED)
def test_expert_indices_follow_the_routing_rule(mt):
    b = bundle(mt)
    for L in b["m"].point_layers("expert_indices"):
        got = b["cache"][f"expert_indices.{L}"]
        want = _expected_indices(mt, b, L, b["cache"][f"router_logits.{L}"].float())
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), L
        assert got.unique().numel() > 1  # routing is not degenerate on this prompt


@pytest.mark.parametrize("mt", list(SPECS))
def test_mlp_out_matches_raw_module_hook(mt):
    b = bundle(mt)
    kinds = getattr(b["hf"].config, "layers_block_type", None) if mt == "nemotron_h" else None
    want_layers = [L for L, k in enumerate(kinds) if k in ("mlp", "moe")] if kinds else list(range(b["m"].n_layers))
    assert b["m"].point_layers("mlp_out") == want_layers
    for L in want_layers:
        out = b["raw"][("mlp", L)][1]
        out = out[0] if isinstance(out, tuple) else out  # gpt_oss returns (output, router scores)
        if "mlp_plus" in SPECS[mt]:  # granite-4 adds a shared MLP's output to the routed experts'
            out = out + b["raw"][("mlp_plus", L)][1]
        assert rel(b["cache"][f"mlp_out.{L}"], out) < 1e-6, L


@pytest.mark.parametrize("mt", ["deepseek_v2", "deepseek_v3", "glm4_moe", "dots1"])
def test_first_dense_layer_serves_mlp_activations_and_moe_layers_refuse_them(mt):
    b = bundle(mt)
    m, raw, c = b["m"], b["raw"], b["cache"]
    dense = list(range(b["hf"].config.first_k_dense_replace))
    assert m.point_layers("mlp_act") == m.point_layers("mlp_pre") == dense == [0]
    assert rel(c["mlp_act.0"], raw[("down", 0)]) < 1e-6
    assert rel(c["mlp_pre.0"], raw[("gate_proj", 0)][1]) < 1e-6
    assert rel(c["mlp_pre_linear.0"], raw[("up_proj", 0)][1]) < 1e-6
    with pytest.raises(UnsupportedPointError, match=r"fused batched module.*It exists at layers \[0\]"):
        m.address("mlp_act.1")


def test_qwen2_moe_dense_layers_by_sparse_step():
    """decoder_sparse_step=2: MoE on odd layers only, dense MLP activations on the others."""
    cfg = Qwen2MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                         shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         decoder_sparse_step=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    m = EagerModel("tiny-qwen2-moe", hf, None, family_for("qwen2_moe"), "zoo")
    assert m.point_layers("router_logits") == [1] and m.point_layers("mlp_act") == [0, 2]
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    got = {}
    h = hf.model.layers[2].mlp.down_proj.register_forward_pre_hook(lambda _m, a: got.__setitem__("act", a[0]))
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        h.remove()
    _, c = m.run_with_cache(ids, ["mlp_act.2", "expert_indices.1"])
    assert rel(c["mlp_act.2"], got["act"]) < 1e-6 and c["expert_indices.1"].shape == (2, 7, 2)


def test_decode_capture_on_a_hybrid_moe_equals_a_full_forward():
    """generate() feeds one token per step through DeltaNet state, attention cache and the router:
    every captured point, expert indices included, equals one forward over the final sequence."""
    m = bundle("qwen3_next")["m"]
    pts = ["expert_indices.0", "attn_out.0", "attn_gate.3", "resid_post.3"]
    r = m.generate("The quick brown fox", max_new_tokens=4, points=pts)
    _, full = m.run_with_cache(r.tokens, pts)
    n = r.cache["resid_post.3"].shape[1]
    assert n == r.tokens.shape[1] - 1  # the last token is sampled, never fed back
    assert torch.equal(r.cache["expert_indices.0"], full["expert_indices.0"][:, :n])
    for p in pts[1:]:
        assert rel(r.cache[p], full[p][:, :n]) < 1e-5, p


@pytest.mark.parametrize("mt,mixer_kind", [("qwen3_next", "linear_attention"), ("lfm2", "conv"), ("lfm2_moe", "conv"),
                                           ("granitemoehybrid", "linear_attention"), ("bamba", "linear_attention"),
                                           ("jamba", "linear_attention")])
def test_hybrid_point_layers_follow_layer_types(mt, mixer_kind):
    b = bundle(mt)
    m, types = b["m"], b["hf"].config.layer_types
    attn_layers = [L for L, t in enumerate(types) if t == "full_attention"]
    other = [L for L, t in enumerate(types) if t == mixer_kind]
    assert attn_layers and other
    qk_norm = mt in ("qwen3_next", "lfm2", "lfm2_moe")
    for p in ("q", "k", "value", "attn_scores", "attn_probs", "z") + (("q_norm_in", "k_norm_out") if qk_norm else ()):
        assert m.point_layers(p) == attn_layers, p
    for p in ("attn_in", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post"):
        assert m.point_layers(p) == list(range(m.n_layers)), p
    with pytest.raises(UnsupportedPointError, match=rf"'q' is not available at layer {other[0]}.*"
                                                    rf"It exists at layers \{attn_layers}"):
        m.address(f"q.{other[0]}")
    if qk_norm:
        _, c = m.run_with_cache(b["ids"], [f"q_norm_in.{attn_layers[0]}", f"q.{attn_layers[0]}"])
        n_heads = b["hf"].config.num_attention_heads
        assert c[f"q_norm_in.{attn_layers[0]}"].shape[2] == c[f"q.{attn_layers[0]}"].shape[2] == n_heads


def test_qwen3_next_attn_gate_is_the_sigmoid_gate_multiplied_into_z():
    b = bundle("qwen3_next")
    m, raw, c, cfg = b["m"], b["raw"], b["cache"], b["hf"].config
    L = m.point_layers("attn_gate")[0]
    assert m.point_layers("attn_gate") == [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    q_out = raw[("q_proj", L)][1]  # per head: [query (head_dim) | gate (head_dim)]
    gate = torch.sigmoid(q_out.view(2, T, cfg.num_attention_heads, 2 * cfg.head_dim)[..., cfg.head_dim:])
    assert c[f"attn_gate.{L}"].shape == (2, T, cfg.num_attention_heads, cfg.head_dim)
    assert rel(c[f"attn_gate.{L}"], gate) < 1e-6
    assert rel((c[f"z.{L}"] * c[f"attn_gate.{L}"]).reshape(2, T, -1), raw[("o_proj", L)]) < 1e-6
    # doubling the gate doubles what o_proj (no bias) writes; ablating it silences attention
    _, s = m.run_with_cache(b["ids"], [f"attn_out.{L}", f"z.{L}"], steer=[Steer(f"attn_gate.{L}", "scale", 2.0)])
    assert rel(s[f"attn_out.{L}"], 2 * c[f"attn_out.{L}"]) < 1e-5
    assert rel(s[f"z.{L}"], c[f"z.{L}"]) < 1e-7
    _, s = m.run_with_cache(b["ids"], [f"attn_out.{L}"], steer=[Steer(f"attn_gate.{L}", "ablate")])
    assert s[f"attn_out.{L}"].abs().max().item() == 0.0


def test_hunyuan_qk_norm_runs_after_rope():
    """HunYuan normalizes the rotated q/k heads-first, so q is the norm's output and q_norm_in the
    rotated projection, both [b, pos, heads, hd]."""
    b = bundle("hunyuan_v1_moe")
    attn = b["hf"].model.layers[0].self_attn
    _, c = b["m"].run_with_cache(b["ids"], ["q.0", "k.0", "q_norm_in.0", "q_norm_out.0", "k_norm_out.0"])
    assert c["q_norm_in.0"].shape == c["q.0"].shape == (2, T, b["hf"].config.num_attention_heads, 32)
    with torch.no_grad():
        assert rel(attn.query_layernorm(c["q_norm_in.0"].transpose(1, 2)).transpose(1, 2), c["q.0"]) < 1e-6
    assert rel(c["q_norm_out.0"], c["q.0"]) < 1e-7 and rel(c["k_norm_out.0"], c["k.0"]) < 1e-7


@pytest.mark.parametrize("mt", [mt for mt in SPECS if mt != "deepseek_v4"])
def test_steering_resid_post_shifts_that_layer_only(mt):
    b = bundle(mt)
    m, c = b["m"], b["cache"]
    L = 1 if m.n_layers >= 3 else 0
    v = torch.randn(m.d_model, generator=torch.Generator().manual_seed(2)) * c[f"resid_post.{L}"].std()
    logits, s = m.run_with_cache(b["ids"], ["resid_post"], steer=[Steer(f"resid_post.{L}", "add", v)])
    for i in range(L):
        assert rel(s[f"resid_post.{i}"], c[f"resid_post.{i}"]) < 1e-7
    assert rel(s[f"resid_post.{L}"], c[f"resid_post.{L}"] + v) < 1e-6
    assert rel(s[f"resid_post.{L + 1}"], c[f"resid_post.{L + 1}"]) > 1e-3
    assert rel(logits, b["logits"]) > 1e-3


@pytest.mark.parametrize("mt,point", [("granitemoe", "resid_mid"), ("qwen3_next", "resid_mid"), ("lfm2", "resid_mid"),
                                      ("granitemoehybrid", "resid_mid"), ("granitemoehybrid", "mlp_out")])
def test_steering_mid_and_mlp_write_reach_the_residual(mt, point):
    """Through a residual multiplier (granite), non-attention mixers (DeltaNet, conv, Mamba-2 at
    layer 0) and a two-module MLP slot (granite-4: routed experts + shared MLP): the residual itself
    carries the edit, so resid_post = resid_mid + residual_multiplier * mlp_out still holds."""
    b = bundle(mt)
    m, base, L = b["m"], b["cache"], 0
    mult = getattr(b["hf"].config, "residual_multiplier", 1.0)
    pts = [f"resid_mid.{L}", f"mlp_out.{L}", f"resid_post.{L}"]
    v = torch.randn(m.d_model, generator=torch.Generator().manual_seed(3)) * base[f"{point}.{L}"].std()
    _, s = m.run_with_cache(b["ids"], pts, steer=[Steer(f"{point}.{L}", "add", v)])
    assert rel(s[f"{point}.{L}"], base[f"{point}.{L}"] + v) < 1e-6
    assert rel(s[pts[2]], s[pts[0]] + mult * s[pts[1]]) < 1e-6
    assert rel(s[pts[2]], base[pts[2]]) > 1e-3


def test_expert_indices_capture_is_integer_and_steering_it_is_refused():
    b = bundle("mixtral")
    m, c = b["m"], b["cache"]
    assert c["expert_indices.0"].dtype == torch.int64
    with pytest.raises(SteeringError, match=r"integer expert indices and cannot be steered"):
        Steer("expert_indices.0", "add", torch.ones(2))
    with pytest.raises(SteeringError, match=r"router_logits.0 can be captured but not steered.*discards"):
        m.run_with_cache(b["ids"], [], steer=[Steer("router_logits.0", "add", torch.ones(8))])
    with pytest.raises(SteeringError, match=r"per-position shape is \(2,\)"):
        m.run_with_cache(b["ids"], [], steer=[Steer("expert_weights.0", "add", torch.ones(5))])
    # the mixing weights are what the experts use: zeroing them zeroes the routed MLP output
    _, s = m.run_with_cache(b["ids"], ["mlp_out.0"], steer=[Steer("expert_weights.0", "scale", 0.0)])
    assert s["mlp_out.0"].abs().max().item() == 0.0


def test_jamba_router_logits_are_steerable_because_its_block_routes_from_them():
    b = bundle("jamba")
    m, c, L = b["m"], b["cache"], b["m"].point_layers("router_logits")[0]
    n = c[f"router_logits.{L}"].shape[-1]
    logits = torch.full((n,), -30.0)
    logits[:2] = 30.0  # every token must now route to experts 0 and 1, weighted 1/2 each by the softmax
    _, s = m.run_with_cache(b["ids"], [f"mlp_out.{L}", f"mlp_in.{L}"], steer=[Steer(f"router_logits.{L}", "set", logits)])
    experts = b["hf"].model.layers[L].feed_forward.experts  # reference: the two experts run by hand
    x = s[f"mlp_in.{L}"].reshape(-1, m.d_model)
    with torch.no_grad():
        want = sum(0.5 * experts(x, torch.full((x.shape[0], 1), e), torch.ones(x.shape[0], 1)) for e in (0, 1))
    assert rel(s[f"mlp_out.{L}"], want.reshape(2, T, -1)) < 1e-5


def test_moe_layers_refuse_expert_hidden_points():
    m = bundle("mixtral")["m"]
    for p in ("mlp_pre", "mlp_pre_linear", "mlp_act"):
        assert m.point_layers(p) == []
        with pytest.raises(UnsupportedPointError, match=rf"{p!r} does not exist in the mixtral family.*fused batched"):
            m.address(f"{p}.0")
    with pytest.raises(UnsupportedPointError, match=r"'resid_streams' does not exist in the mixtral family.*single "
                                                    r"residual stream"):
        m.address("resid_streams.0")


def test_falcon_h1_parallel_mamba_attention_mid_is_capture_only():
    """Falcon-H1 adds scaled attention AND a parallel Mamba-2 branch to the residual: resid_mid is read
    at the MLP norm's input (= resid_post - mlp_out) but no module write can carry a steer of it."""
    b = bundle("falcon_h1")
    m, c = b["m"], b["cache"]
    for L in range(m.n_layers):
        assert rel(c[f"resid_mid.{L}"], c[f"resid_post.{L}"] - c[f"mlp_out.{L}"]) < 1e-6
    with pytest.raises(SteeringError, match=r"resid_mid.0 can be captured but not steered.*parallel Mamba-2"):
        m.run_with_cache(b["ids"], [], steer=[Steer("resid_mid.0", "add", torch.ones(m.d_model))])


def test_nemotron_h_points_follow_the_block_kinds():
    """Nemotron-H blocks hold one mixer each: attention points on attention blocks, MLP points on
    MLP/MoE blocks, attn_in/attn_out on Mamba and attention blocks, and no resid_mid anywhere. A
    block list with an MoE block (built here) routes like deepseek_v3 and refuses expert hiddens."""
    from transformers import AutoConfig
    kinds = ["linear_attention", "moe", "full_attention", "mlp"]
    cfg = AutoConfig.for_model("nemotron_h", vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                               head_dim=32, intermediate_size=128, layers_block_type=kinds, mamba_num_heads=8,
                               mamba_head_dim=32, n_groups=1, ssm_state_size=16, n_routed_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1,
                               max_position_embeddings=64, use_mamba_kernels=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    m = EagerModel("tiny-nemotron-h", hf, None, family_for("nemotron_h"), "zoo")
    assert m.point_layers("q") == m.point_layers("z") == [2]
    assert m.point_layers("attn_in") == m.point_layers("attn_out") == [0, 2]
    assert m.point_layers("mlp_in") == m.point_layers("mlp_out") == [1, 3]
    assert m.point_layers("mlp_act") == [3] and m.point_layers("router_logits") == [1]
    assert m.point_layers("resid_mid") == [] and m.point_layers("resid_post") == [0, 1, 2, 3]
    with pytest.raises(UnsupportedPointError, match=r"'resid_mid' does not exist in the nemotron_h family.*ONE sublayer"):
        m.address("resid_mid.1")
    with pytest.raises(UnsupportedPointError, match=r"'mlp_act' is not available at layer 1.*fused.*layers \[3\]"):
        m.address("mlp_act.1")
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    got = {}
    hooks = [hf.model.layers[1].mixer.gate.register_forward_hook(lambda _m, a, o: got.__setitem__("router", o)),
             hf.model.layers[1].mixer.register_forward_hook(lambda _m, a, o: got.__setitem__("moe", o)),
             hf.model.layers[3].mixer.down_proj.register_forward_pre_hook(lambda _m, a: got.__setitem__("act", a[0]))]
    try:
        with torch.no_grad():
            ref = hf(ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    _, c = m.run_with_cache(ids, ["resid_post", "router_logits.1", "expert_indices.1", "mlp_out.1", "mlp_act.3"])
    for L in range(3):
        assert rel(c[f"resid_post.{L}"], ref.hidden_states[L + 1]) < 1e-5
    assert rel(c["router_logits.1"], got["router"][0].reshape(2, 9, -1)) < 1e-6
    assert torch.equal(c["expert_indices.1"], got["router"][2].reshape(2, 9, -1))
    assert rel(c["mlp_out.1"], got["moe"]) < 1e-6 and rel(c["mlp_act.3"], got["act"]) < 1e-6


# -- hyper-connections (DeepSeek-V4) ----------------------------------------------------------------
def test_v4_resid_streams_equal_hf_hidden_states_and_collapse_like_hf():
    b = bundle("deepseek_v4")
    m, hf, hs, c = b["m"], b["hf"], b["ref"].hidden_states, b["cache"]
    s = hf.config.hc_mult
    assert hs[1].shape == (2, T, s, m.d_model)  # HF's per-layer hidden states are the streams
    emb = hf.model.embed_tokens(b["ids"])
    assert rel(c["embeddings"], emb) < 1e-7 and rel(hs[0], emb[:, :, None].expand(-1, -1, s, -1)) < 1e-7
    for L in range(m.n_layers - 1):
        assert rel(c[f"resid_streams.{L}"], hs[L + 1]) < 1e-5, L
    with torch.no_grad():  # HF's last entry is norm(hc_head(streams))
        assert rel(hf.model.norm(hf.model.hc_head(c["resid_streams.-1"])), hs[-1]) < 1e-5
    assert rel(c["final_norm"], hs[-1]) < 1e-6
    _, one = m.run_with_cache(b["ids"], ["resid_streams.1.stream-2"])
    assert rel(one["resid_streams.1.stream-2"], c["resid_streams.1"][:, :, 2]) == 0.0
    with pytest.raises(AddressError, match="drop the coordinate"):
        m.logit_lens((one, "resid_streams.1.stream-2"))


def test_v4_stream_points_match_the_hyper_connection_modules():
    b = bundle("deepseek_v4")
    m, raw, c, s = b["m"], b["raw"], b["cache"], b["hf"].config.hc_mult
    for L in range(m.n_layers):
        streams_in = c[f"resid_streams.{L - 1}"] if L else c["embeddings"][:, :, None].expand(-1, -1, s, -1)
        for side, name in (("attn", "attn_hc"), ("mlp", "ffn_hc")):
            (x,), (post, comb, collapsed) = raw[(name, L)]
            w, mix = c[f"{side}_stream_write.{L}"], c[f"{side}_stream_mix.{L}"]
            col = c[f"{side}_stream_collapse_weights.{L}"]
            assert w.shape == col.shape == (2, T, s) and mix.shape == (2, T, s, s)
            assert rel(w, post) < 1e-7 and rel(mix, comb) < 1e-7
            assert rel((col[..., None] * x).sum(2), collapsed) < 1e-6
            # the collapse point is the collapsed vector the sublayer reads (before its norm)
            assert c[f"{side}_stream_collapse.{L}"].shape == (2, T, m.d_model)
            assert rel(c[f"{side}_stream_collapse.{L}"], collapsed) == 0.0
        assert rel(raw[("attn_hc", L)][0][0], streams_in) < 1e-6
        # new_streams[k] = write[k] * sublayer_out + sum_j mix[j, k] * streams[j], around each sublayer
        mid = (c[f"attn_stream_write.{L}"][..., None] * c[f"attn_out.{L}"][:, :, None]
               + c[f"attn_stream_mix.{L}"].transpose(-1, -2) @ streams_in)
        out = (c[f"mlp_stream_write.{L}"][..., None] * c[f"mlp_out.{L}"][:, :, None]
               + c[f"mlp_stream_mix.{L}"].transpose(-1, -2) @ mid)
        assert rel(out, c[f"resid_streams.{L}"]) < 1e-5, L


def test_v4_steering_streams_and_collapse_weights():
    b = bundle("deepseek_v4")
    m, hf, c, s = b["m"], b["hf"], b["cache"], b["hf"].config.hc_mult
    v = torch.randn(s, m.d_model, generator=torch.Generator().manual_seed(4)) * c["resid_streams.1"].std()
    _, st = m.run_with_cache(b["ids"], ["resid_streams"], steer=[Steer("resid_streams.1", "add", v)])
    assert rel(st["resid_streams.0"], c["resid_streams.0"]) < 1e-7
    assert rel(st["resid_streams.1"], c["resid_streams.1"] + v) < 1e-6
    assert rel(st["resid_streams.2"], c["resid_streams.2"]) > 1e-3
    got = {}
    norm = hf.model.layers[1].input_layernorm  # its input is the collapsed streams
    h = norm.register_forward_pre_hook(lambda _m, a: got.__setitem__("collapsed", a[0]))
    try:  # collapsing with a one-hot weight feeds stream 0 alone to the attention
        m.run_with_cache(b["ids"], [], steer=[Steer("attn_stream_collapse_weights.1", "set",
                                                    torch.tensor([1.0, 0, 0, 0]))])
        assert rel(got["collapsed"], c["resid_streams.0"][:, :, 0]) < 1e-7
        x = torch.randn(m.d_model)  # setting the collapsed vector itself replaces the attention's input
        m.run_with_cache(b["ids"], [], steer=[Steer("attn_stream_collapse.1", "set", x)])
        assert rel(got["collapsed"], x.expand_as(got["collapsed"])) < 1e-7
    finally:
        h.remove()


def test_v4_z_is_what_the_grouped_output_projection_reads():
    """z on DeepSeek-V4 is after the inverse rotation HF applies to the product's rope slice: o_a_proj's
    input, regrouped per head (the attention call's own output differs on that slice)."""
    b = bundle("deepseek_v4")
    m, raw, c = b["m"], b["raw"], b["cache"]
    for L in range(m.n_layers):
        z, x = c[f"z.{L}"], raw[("o_a_proj", L)]
        assert z.shape[-1] == m.config.head_dim and rel(z, x.reshape(z.shape)) == 0.0


def test_v4_compressed_layers_keep_their_key_axis_in_a_batch():
    """attn_probs on V4's compressed layers: the key axis (window then compressor entries) is not the
    sequence's positions; a [2, T] batch keeps it as HF's output_attentions have it."""
    b = bundle("deepseek_v4")
    m, hf, ids = b["m"], b["hf"], b["ids"]
    pts = [f"attn_probs.{L}" for L in m.point_layers("attn_probs")]
    _, c = m.run_with_cache(ids, pts)
    with torch.no_grad():
        att = hf(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True, use_cache=False).attentions
    wider = 0
    for p in pts:
        L = int(p.split(".")[1])
        ref = att[L].transpose(1, 2)  # [b, pos, h, keys]
        assert c[p].shape == ref.shape and rel(c[p], ref) < 1e-5, p
        wider += ref.shape[-1] > T
    assert wider, "no compressed layer: the test proves nothing"


def test_v4_refuses_single_residual_points_with_the_stream_alternative():
    m = bundle("deepseek_v4")["m"]
    for p in ("resid_post", "resid_pre", "resid_mid"):
        assert m.point_layers(p) == []
        with pytest.raises(UnsupportedPointError, match=rf"{p!r} does not exist in the deepseek_v4 family.*hc_mult "
                                                        rf"residual streams.*use resid_streams"):
            m.address(f"{p}.0")
    with pytest.raises(UnsupportedPointError, match=r"'k' does not exist in the deepseek_v4 family.*one shared head"):
        m.address("k.1")
    with pytest.raises(AddressError, match=r"stream 4 is out of range.*4 streams"):
        m.address("resid_streams.0.stream-4")
    with pytest.raises(ValueError, match=r"needs \[\.\.\., 4, 128\] \(all streams\)"):
        m.logit_lens(torch.zeros(1, 3, 128), point="resid_streams")
