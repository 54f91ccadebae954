"""The eager backend's core semantics on tiny models: capture, steering ops and positions, padding,
generation, gradients, lens, and every kind of bad input. References are HF itself (hidden states,
raw module hooks, HF generate), never the engine's own tables."""
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from engine.backends.hf.eager import EagerModel
from engine.core.errors import AddressError, SteeringError, UnsupportedPointError
from engine.core.steering import Steer
from engine.families import family_for
from engine.zoo.tokenizer import build_tokenizer

CONFIGS = {
    "llama": lambda: LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=256),
    "gpt2": lambda: GPT2Config(n_embd=128, n_layer=3, n_head=4, vocab_size=512, n_positions=256),
}


def _model(kind):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="eager").eval()
    tok = build_tokenizer()
    hf.config.pad_token_id = tok.pad_token_id
    return EagerModel(f"tiny-{kind}", hf, tok, family_for(hf.config.model_type), "zoo")


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return _model(request.param)


@pytest.fixture(scope="module")
def llama():
    return _model("llama")


PROMPT = "The quick brown fox jumps over the lazy dog."


def _hf_hidden(m, enc):
    with torch.no_grad():
        return m.hf(**enc, output_hidden_states=True)


def test_resid_post_matches_hf_hidden_states(model):
    enc = model.to_tokens(PROMPT)
    ref = _hf_hidden(model, enc)
    logits, cache = model.run_with_cache(enc, ["resid_post", "embeddings"])
    for layer in range(model.n_layers - 1):
        torch.testing.assert_close(cache[f"resid_post.{layer}"], ref.hidden_states[layer + 1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache["embeddings"], ref.hidden_states[0])
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert cache["resid_post.-1"].shape == (1, enc["input_ids"].shape[1], model.d_model)


def test_points_against_raw_module_hooks(model):
    """attn_in/attn_out/mlp_in/mlp_act/mlp_out/z read with hooks written here by module name."""
    names = {"llama": dict(attn="self_attn", mlp="mlp", down="mlp.down_proj", o="self_attn.o_proj", layers="model.layers"),
             "gpt2": dict(attn="attn", mlp="mlp", down="mlp.c_proj", o="attn.c_proj", layers="transformer.h")}
    n = names[model.hf.config.model_type]
    layer = 1
    blk = model.hf.get_submodule(f"{n['layers']}.{layer}")
    got = {}
    hooks = [blk.get_submodule(n["attn"]).register_forward_pre_hook(
                 lambda m, a, k: got.__setitem__("attn_in", k.get("hidden_states", a[0] if a else None)), with_kwargs=True),
             blk.get_submodule(n["attn"]).register_forward_hook(lambda m, a, o: got.__setitem__("attn_out", o[0])),
             blk.get_submodule(n["mlp"]).register_forward_pre_hook(lambda m, a: got.__setitem__("mlp_in", a[0])),
             blk.get_submodule(n["mlp"]).register_forward_hook(lambda m, a, o: got.__setitem__("mlp_out", o)),
             blk.get_submodule(n["down"]).register_forward_pre_hook(lambda m, a: got.__setitem__("mlp_act", a[0])),
             blk.get_submodule(n["o"]).register_forward_pre_hook(lambda m, a: got.__setitem__("z", a[0]))]
    enc = model.to_tokens(PROMPT)
    try:
        _hf_hidden(model, enc)
    finally:
        for h in hooks:
            h.remove()
    _, cache = model.run_with_cache(enc, [f"{p}.{layer}" for p in ("attn_in", "attn_out", "mlp_in", "mlp_out", "mlp_act", "z")])
    for p in ("attn_in", "attn_out", "mlp_in", "mlp_out", "mlp_act"):
        torch.testing.assert_close(cache[f"{p}.{layer}"], got[p], msg=p)
    z = cache[f"z.{layer}"]
    assert z.shape[-2:] == (4, 32)
    torch.testing.assert_close(z.flatten(-2), got["z"])


def test_attention_pattern_matches_hf_output_attentions(model):
    enc = model.to_tokens(PROMPT)
    with torch.no_grad():
        ref = model.hf(**enc, output_attentions=True)
    _, cache = model.run_with_cache(enc, ["attn_probs.2", "attn_scores.2", "q.2", "k.2"])
    torch.testing.assert_close(cache["attn_probs.2"], ref.attentions[2].transpose(1, 2))
    torch.testing.assert_close(cache["attn_scores.2"].softmax(-1), cache["attn_probs.2"])
    # scores recomputed by hand from captured q and k (causal mask, 1/sqrt(hd) scaling, GQA repeat)
    q, k = cache["q.2"], cache["k.2"]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bqhk", q, k) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    real = causal[:, None, :].expand(-1, q.shape[2], -1)[None]
    torch.testing.assert_close(cache["attn_scores.2"][real], scores[real], rtol=1e-5, atol=1e-5)


def test_resid_mid_is_pre_plus_attention_write(model):
    enc = model.to_tokens(PROMPT)
    _, c = model.run_with_cache(enc, ["resid_pre.1", "attn_out.1", "resid_mid.1", "mlp_out.1", "resid_post.1"])
    torch.testing.assert_close(c["resid_mid.1"], c["resid_pre.1"] + c["attn_out.1"])
    torch.testing.assert_close(c["resid_post.1"], c["resid_mid.1"] + c["mlp_out.1"])


# -- steering ----------------------------------------------------------------------------------------
def _run(m, points, steer=(), text=PROMPT):
    return m.run_with_cache(m.to_tokens(text), points, steer)


def test_add_shifts_exactly_that_layer(model):
    v = torch.randn(model.d_model)
    _, base = _run(model, ["resid_post"])
    _, st = _run(model, ["resid_post"], [Steer("resid_post.1", "add", v)])
    torch.testing.assert_close(st["resid_post.0"], base["resid_post.0"])
    torch.testing.assert_close(st["resid_post.1"], base["resid_post.1"] + v)
    assert not torch.allclose(st["resid_post.2"], base["resid_post.2"])


@pytest.mark.parametrize("op", ["set", "scale", "ablate", "mean_ablate", "project_out"])
def test_each_op_does_what_it_says(llama, op):
    torch.manual_seed(1)
    v = torch.randn(llama.d_model)
    value = {"set": v, "scale": 3.0, "ablate": None, "mean_ablate": v, "project_out": v}[op]
    _, base = _run(llama, ["mlp_out.1"])
    _, st = _run(llama, ["mlp_out.1"], [Steer("mlp_out.1", op, value)])
    x, y = base["mlp_out.1"], st["mlp_out.1"]
    if op in ("set", "mean_ablate"):
        torch.testing.assert_close(y, v.expand_as(x))
    elif op == "scale":
        torch.testing.assert_close(y, 3.0 * x)
    elif op == "ablate":
        assert torch.count_nonzero(y) == 0
    else:
        u = v / v.norm()
        torch.testing.assert_close(y @ u, torch.zeros(x.shape[:2]), atol=1e-5, rtol=0)
        torch.testing.assert_close(y + (x @ u)[..., None] * u, x)


@pytest.mark.parametrize("positions,touched", [("last", [-1]), (2, [2]), (slice(1, 3), [1, 2]), ((0, 2), [0, 1])])
def test_positions(llama, positions, touched):
    v = torch.randn(llama.d_model)
    _, base = _run(llama, ["resid_pre.1"])
    _, st = _run(llama, ["resid_pre.1"], [Steer("resid_pre.1", "add", v, positions=positions)])
    diff = st["resid_pre.1"] - base["resid_pre.1"]
    n = diff.shape[1]
    want = {t % n for t in touched}
    for pos in range(n):
        if pos in want:
            torch.testing.assert_close(diff[0, pos], v)
        else:
            assert diff[0, pos].abs().max() == 0


def test_head_coordinate_steers_one_head(llama):
    v = torch.randn(32)
    _, base = _run(llama, ["z.1"])
    _, st = _run(llama, ["z.1"], [Steer("z.1.head-2", "add", v)])
    diff = st["z.1"] - base["z.1"]
    torch.testing.assert_close(diff[:, :, 2], v.expand_as(diff[:, :, 2]))
    assert diff[:, :, [0, 1, 3]].abs().max() == 0


def test_resid_mid_steer_changes_the_residual_itself(llama):
    v = torch.randn(llama.d_model)
    _, base = _run(llama, ["resid_mid.1", "resid_post.1", "mlp_out.1"])
    _, st = _run(llama, ["resid_mid.1", "resid_post.1", "mlp_out.1"], [Steer("resid_mid.1", "set", v)])
    torch.testing.assert_close(st["resid_mid.1"], v.expand_as(base["resid_mid.1"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st["resid_post.1"], st["resid_mid.1"] + st["mlp_out.1"])


def test_steers_compose_and_context_leaves_model_unchanged(llama):
    a, b = torch.randn(llama.d_model), torch.randn(llama.d_model)
    enc = llama.to_tokens(PROMPT)
    logits0, base = llama.run_with_cache(enc, ["resid_post.0"])
    with llama.steering(Steer("resid_post.0", "add", a)), llama.steering(Steer("resid_post.0", "add", b)):
        _, st = llama.run_with_cache(enc, ["resid_post.0"])
    torch.testing.assert_close(st["resid_post.0"], base["resid_post.0"] + a + b)
    logits1, after = llama.run_with_cache(enc, ["resid_post.0"])
    assert torch.equal(logits0, logits1) and torch.equal(after["resid_post.0"], base["resid_post.0"])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in llama.hf.modules())


# -- padding, generation, gradients, lens ------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_unpadded_rows(model, side):
    texts = [PROMPT, "Water boils."]
    enc = model.to_tokens(texts, padding_side=side)
    _, cache = model.run_with_cache(enc, ["resid_post.2", "z.1"])
    for row, text in enumerate(texts):
        solo = model.to_tokens(text)
        _, ref = model.run_with_cache(solo, ["resid_post.2", "z.1"])
        real = enc["attention_mask"][row].bool()
        for key in ("resid_post.2", "z.1"):
            torch.testing.assert_close(cache[key][row][real], ref[key][0], rtol=1e-4, atol=1e-5)


def test_right_padded_rows_share_one_position_row_and_left_padded_count_from_their_first_token(model):
    """Right padding (or none) passes one 0..width-1 row (HF then builds its rotary tables once, not per
    row: 3% of a tiny model's forward); a left-padded row counts from its first real token. Either way
    the logits of real tokens equal the row run alone, and padded positions are 0."""
    right = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    left = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    assert torch.equal(EagerModel._position_ids(right), torch.arange(4)[None])
    assert torch.equal(EagerModel._position_ids(left), torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1]]))
    ids = model.to_tokens(PROMPT)["input_ids"][:, :4]
    solo, _ = model.run_with_cache({"input_ids": ids[:, :2], "attention_mask": torch.ones(1, 2, dtype=torch.long)})
    for mask in (right, left):
        row1 = torch.zeros(4, dtype=torch.long)
        row1[mask[1].bool()] = ids[0, :2]  # the same two tokens, after or before two pads
        batch = {"input_ids": torch.stack([ids[0], row1]), "attention_mask": mask}
        logits, _ = model.run_with_cache(batch)
        real = mask[1].bool()
        torch.testing.assert_close(logits[1][real], solo[0], rtol=1e-4, atol=1e-5)
        assert not logits[1][~real].any()


def test_generate_matches_hf_and_captures_every_step(model):
    enc = model.to_tokens(PROMPT)
    with torch.no_grad():
        ref = model.hf.generate(**enc, max_new_tokens=5, do_sample=False, min_new_tokens=5,
                                pad_token_id=model.tokenizer.pad_token_id)
    out = model.generate(enc, max_new_tokens=5, points=["resid_post.1", "lm_head"])
    assert torch.equal(out.tokens, ref)
    n_prompt = enc["input_ids"].shape[1]
    cap = out.cache["resid_post.1"]
    assert cap.shape == (1, n_prompt + 4, model.d_model)  # the last new token is never fed back
    _, full = model.run_with_cache(out.tokens[:, :-1], ["resid_post.1"])
    torch.testing.assert_close(cap, full["resid_post.1"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.logits[:, 0], model.run_with_cache(enc)[0][:, -1], rtol=1e-4, atol=1e-4)


def test_generated_only_steer_leaves_prefill_alone(llama):
    enc = llama.to_tokens(PROMPT)
    v = 5 * torch.randn(llama.d_model)
    base = llama.generate(enc, max_new_tokens=4, points=["resid_post.0"])
    st = llama.generate(enc, max_new_tokens=4, points=["resid_post.0"], steer=[Steer("resid_post.0", "add", v, "generated")])
    n = enc["input_ids"].shape[1]
    torch.testing.assert_close(st.cache["resid_post.0"][:, :n], base.cache["resid_post.0"][:, :n])
    assert torch.equal(st.tokens[:, n], base.tokens[:, n])  # prefill untouched, so the first token is too
    torch.testing.assert_close(st.cache["resid_post.0"][:, n], base.cache["resid_post.0"][:, n] + v)


def test_gradients_flow_through_captures(llama):
    enc = llama.to_tokens(PROMPT)
    logits, cache = llama.run_with_cache(enc, ["resid_post.1"], grad=True)
    x = cache["resid_post.1"]
    assert x.requires_grad
    (g,) = torch.autograd.grad(logits[0, -1].logsumexp(-1), x)
    assert g.shape == x.shape and g.abs().sum() > 0
    assert g[0, :-1].abs().max() < g[0, -1].abs().max() * 10  # earlier positions feed the last via attention


def test_logit_lens_last_layer_equals_logits(model):
    logits, cache = _run(model, ["resid_post.-1", "final_norm"])
    torch.testing.assert_close(model.logit_lens(cache["resid_post.-1"]), logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.logit_lens((cache, "final_norm")), logits, rtol=1e-5, atol=1e-5)
    early = model.logit_lens((cache, "resid_post.-1"))
    assert early.shape == logits.shape


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,err,fragment", [
    (lambda d: Steer("resid_post.1", "add", torch.randn(d + 1)), SteeringError, r"shape \(129,\) but the point's per-position shape is \(128,\)"),
    (lambda d: Steer("resid_post.1", "add", torch.full((d,), float("nan"))), SteeringError, "NaN or inf"),
    (lambda d: Steer("resid_post.1", "add", torch.ones(d, dtype=torch.long)), SteeringError, "floating tensor"),
    (lambda d: Steer("resid_post.1", "shift", torch.ones(d)), SteeringError, "unknown steering op 'shift'"),
    (lambda d: Steer("resid_post.1", "add"), SteeringError, "needs a value"),
    (lambda d: Steer("resid_post.1", "ablate", torch.ones(d)), SteeringError, "takes no value"),
    (lambda d: Steer("resid_post.1", "add", torch.ones(d), positions="first"), SteeringError, "positions 'first'"),
    (lambda d: Steer("expert_indices.1", "add", torch.ones(2)), SteeringError, "integer expert indices"),
    # recomputed beside the attention, which forms its own logits: a steer there changed nothing, silently
    (lambda d: Steer("attn_scores.1", "scale", 2.0), SteeringError,
     r"attn_scores.1 can be captured but not steered.*steer attn_probs"),
    (lambda d: Steer("resid_postt.1", "add", torch.ones(d)), AddressError, "Did you mean 'resid_post'"),
    (lambda d: Steer("resid_post.7", "add", torch.ones(d)), AddressError, "out of range"),
    (lambda d: Steer("resid_post.1", "add", torch.ones(d, device="meta")), SteeringError, "is on meta"),
])
def test_bad_steering_input(llama, make, err, fragment):
    with pytest.raises(err, match=fragment):
        _run(llama, [], [make(llama.d_model)])


def test_point_absent_from_family(llama):
    with pytest.raises(UnsupportedPointError, match=r"'q_norm_in' does not exist in the llama family.*This model has"):
        llama.address("q_norm_in.0")
    with pytest.raises(UnsupportedPointError, match="does not exist"):
        llama.address("router_logits.0")
    with pytest.raises(AddressError, match="head 4 is out of range"):
        llama.address("z.0.head-4")
    with pytest.raises(AddressError, match="logit lens reads the residual stream"):
        llama.logit_lens(torch.zeros(1, 1, 128), point="mlp_out")
    with pytest.raises(KeyError, match="was not captured"):
        _run(llama, ["resid_post.0"])[1]["resid_post.1"]


def test_points_listing(llama):
    pts = llama.points()
    assert "resid_post" in pts and "q" in pts and "mlp_pre_linear" in pts
    assert "q_norm_in" not in pts and "router_logits" not in pts and "resid_streams" not in pts
    assert llama.point_layers("resid_post") == [0, 1, 2] and llama.point_layers("final_norm") == [-1]
    assert llama.point_layers("logits") == llama.point_layers("lm_head")  # an alias names its point
    # an unknown name is an AddressError with the closest names, as in an address (a bare KeyError before)
    with pytest.raises(AddressError, match=r"unknown point 'resid_pots'\. Did you mean 'resid_post'"):
        llama.point_layers("resid_pots")
    with pytest.raises(AddressError, match="unknown point 5"):
        llama.point_layers(5)


def test_negative_layer_steer_and_duplicate_addresses(llama):
    v = torch.randn(llama.d_model)
    _, base = _run(llama, ["resid_post.2"])
    _, st = _run(llama, ["resid_post.-1", "resid_post.2"], [Steer("resid_post.-1", "add", v)])
    assert list(st) == ["resid_post.2"]
    torch.testing.assert_close(st["resid_post.-1"], base["resid_post.2"] + v)


def test_a_call_frees_its_captured_grids_without_the_cyclic_collector(llama):
    """A call's steps pointed back at their layout and each layout at the call, so every call's captured
    grids waited for Python's cyclic collector (which runs on object counts, not bytes): a harvest's
    resident memory grew with its dataset. Now nothing of a finished call is left for it to find."""
    import gc

    from engine.backends.hf.grid import Call, GridStep
    gc.collect()
    gc.disable()
    try:
        for n in (5, 6, 7):
            ids = torch.randint(1, 100, (2, n))
            llama.run_with_cache({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                 ["resid_post.0", "attn_probs.0"], steer=[Steer("resid_post.0", "add", torch.ones(128))])
            llama.generate(ids, max_new_tokens=2, points=["resid_post.0"])
        left = [type(o).__name__ for o in gc.get_objects() if isinstance(o, (Call, GridStep))]
    finally:
        gc.enable()
    assert left == []
