"""engine/interop/mappers.py: every mapped name is checked by comparing the tensor the other engine holds
there with our capture (TransformerLens bridge hooks, nnsight envoys; nnterp accessors in
tests/test_mappers_nnterp.py, which runs nnterp on its own nnsight in a subprocess), on one family of
each kind plus BLOOM; unmapped points say why."""
from __future__ import annotations

import copy

import pytest
import torch

from engine.core.address import parse
from engine.interop.mappers import UnmappedError, from_tl, rotary, to_nnsight, to_nnterp, to_tl
from mapper_checks import FAMILIES, OTHERS, TEXT, close_enough, model, same_layout

# the bridge cannot run these at all (no adapter, or a forward that crashes upstream): nothing to compare
TL_CANNOT = {"facebook/opt-350m": "the bridge's forward crashes on post-LN OPT (ValueError: not enough values to "
                                  "unpack), validator known gap tl-opt-postln-crash"}


def _tl_check(name):
    """(model, bridge, ids, mapped, unmapped, bad): every served address mapped by to_tl, compared with
    the bridge hook's tensor; skips where the bridge has no adapter for the architecture."""
    from transformer_lens.model_bridge import TransformerBridge

    from engine.zoo import offline_session
    if name in TL_CANNOT:
        pytest.skip(TL_CANNOT[name])
    m = model(name)
    try:
        with offline_session():
            bridge = TransformerBridge.boot_transformers(name, device="cpu")
    except ValueError as e:
        if "Could not determine supported architecture" not in str(e):
            raise
        pytest.skip(f"TransformerBridge has no adapter for {m.config.model_type}")
    ids = m._inputs(TEXT)["input_ids"]
    served = [v.address for v in m.describe().served()]
    mapped, unmapped = {}, {}
    for a in served:
        try:
            mapped[a] = to_tl(m, a)
        except UnmappedError as e:
            unmapped[a] = str(e)
    missing = {a: h for a, h in mapped.items() if h not in bridge.hook_dict}
    assert not missing, f"mapped to hooks the bridge does not have: {missing}"
    _, ours = m.run_with_cache(ids, list(mapped))
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(ids, names_filter=lambda n: n in set(mapped.values()))
    bad = {}
    for a, h in mapped.items():
        point = parse(a).point
        if h not in theirs:
            bad[a] = (h, "never fired in the bridge's forward")
            continue
        t = same_layout(ours[a], theirs[h], point)
        if t is None or not close_enough(ours[a], t, point):
            bad[a] = (h, tuple(ours[a].shape), tuple(theirs[h].shape))
        if from_tl(m, h) != (parse("resid_pre.0") if a == "embeddings" else parse(a)):
            bad[a] = (h, "from_tl gives", str(from_tl(m, h)))
    return m, bridge, ids, mapped, unmapped, bad


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_transformer_lens_names_hold_our_tensors(fam):
    m, bridge, ids, mapped, unmapped, bad = _tl_check(FAMILIES[fam])
    assert bad == {}, bad
    assert "lm_head" in unmapped and "returns the logits" in unmapped["lm_head"]
    assert mapped.get("lm_head_raw") == "unembed.hook_out"
    assert {parse(a).point for a in mapped} >= {"resid_pre", "resid_post", "attn_out", "mlp_out", "final_norm",
                                               "embeddings"}
    # block-level aliases: hook_attn_out is our attn_out, or attn_out_post behind a sandwich norm
    mixers = m.block_layout().mixers
    h = f"blocks.{mixers.index('attention') if 'attention' in mixers else 1}.hook_attn_out"
    if fam != "bloom":
        alias = from_tl(m, h)
        assert alias.point == ("attn_out_post" if fam == "gemma2" else "attn_out")
        _, c = m.run_with_cache(ids, [str(alias)])
        with torch.no_grad():
            _, t = bridge.run_with_cache(ids, names_filter=lambda n: n == h)
        torch.testing.assert_close(c[str(alias)], t[h], rtol=1e-4, atol=1e-4)


def test_catalogue_tl_fixes():
    """The issue's list: post-RoPE q/k are hook_rot_q/k, final_norm is ln_final.hook_out, Gemma-2's
    attn_out/mlp_out are the module hooks (its block-level hooks are after the post-norm)."""
    llama, gpt2, gemma = (model(FAMILIES[f]) for f in ("llama", "gpt2", "gemma2"))
    assert to_tl(llama, "q.0") == "blocks.0.attn.hook_rot_q" and to_tl(llama, "k.1") == "blocks.1.attn.hook_rot_k"
    assert rotary(llama) and not rotary(gpt2) and to_tl(gpt2, "q.0") == "blocks.0.attn.hook_q"
    assert to_tl(llama, "final_norm") == "ln_final.hook_out"
    assert to_tl(gemma, "attn_out.1") == "blocks.1.attn.hook_out" and to_tl(gemma, "mlp_out.1") == "blocks.1.mlp.hook_out"
    assert to_tl(llama, "embeddings") == "blocks.0.hook_resid_pre"
    assert to_tl(model(FAMILIES["bloom"]), "attn_out.0") == "blocks.0.attn.o.hook_out"
    with pytest.raises(UnmappedError, match="top-k mixing weights"):
        to_tl(model(FAMILIES["mixtral"]), "expert_weights.0")
    with pytest.raises(UnmappedError, match="holds no tensor of our catalogue"):
        from_tl(llama, "blocks.0.attn.hook_cos")
    # Pythia: the bridge's hook_rot_q/k never fire and its hook_q/k are before RoPE (was mapped to hook_rot_q)
    with pytest.raises(UnmappedError, match="never calls them"):
        to_tl(model(FAMILIES["gpt_neox"]), "q.0")


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHERS)
def test_transformer_lens_names_hold_our_tensors_on_every_twin(name):
    bad = _tl_check(name)[-1]
    assert bad == {}, bad


def _order(m, ids):
    """Execution order of module inputs / outputs in one forward (nnsight requires it in a trace)."""
    names = {mod: n for n, mod in m.hf.named_modules()}
    events, hooks = [], []
    for mod, n in names.items():
        hooks.append(mod.register_forward_pre_hook(lambda mod_, a, n=n: events.append((n, "input"))))
        hooks.append(mod.register_forward_hook(lambda mod_, a, o, n=n: events.append((n, "output"))))
    try:
        with torch.no_grad():
            m.hf(ids)
    finally:
        for h in hooks:
            h.remove()
    return {e: i for i, e in reversed(list(enumerate(events)))}


def _nnsight_check(name):
    """(model, accessors, unmapped, bad): every served address mapped by to_nnsight, read in an nnsight
    trace of a copy of our HF model and compared with our capture."""
    from nnsight import TransformersModel
    m = model(name)
    ids = m._inputs(TEXT)["input_ids"]
    acc, unmapped = {}, {}
    for v in m.describe().served():
        try:
            acc[v.address] = to_nnsight(m, v.address)
        except UnmappedError as e:
            unmapped[v.address] = str(e)
    order = _order(m, ids)
    todo = sorted(acc.items(), key=lambda kv: order[(kv[1].module, kv[1].event)])
    lm = TransformersModel(copy.deepcopy(m.hf), tokenizer=m.tokenizer, task="text-generation")
    saved = {}
    with lm.trace(ids):
        for a, x in todo:
            env = x.envoy(lm)
            saved[a] = (env.input if x.event == "input" else env.output).save()
    _, ours = m.run_with_cache(ids, list(acc))
    bad = {}
    for a, x in acc.items():
        t = saved[a]
        t = t.logits if a == "lm_head" else t[0] if isinstance(t, tuple) else t
        got = same_layout(ours[a], t, parse(a).point)
        if got is None or not close_enough(ours[a], got, parse(a).point):
            bad[a] = (str(x), tuple(ours[a].shape), tuple(t.shape))
    return m, acc, unmapped, bad


@pytest.mark.parametrize("fam", ["gpt2", "llama", "gemma2", "bloom"])
def test_nnsight_accessors_hold_our_tensors(fam):
    m, acc, unmapped, bad = _nnsight_check(FAMILIES[fam])
    assert bad == {}, bad
    assert {parse(a).point for a in acc} >= {"resid_pre", "resid_post", "attn_in", "mlp_in", "mlp_act", "final_norm"}
    if fam == "bloom":
        assert "attn_out.0" in unmapped and "adds the residual" in unmapped["attn_out.0"]
    assert str(to_nnsight(m, "resid_post.1")).endswith("[1].output")


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHERS)
def test_nnsight_accessors_hold_our_tensors_on_every_twin(name):
    bad = _nnsight_check(name)[-1]
    assert bad == {}, bad


def test_nnterp_refuses_falcons_parallel_mlp_out():
    """HF Falcon's parallel block adds the attention output into the MLP's output in place, so nnterp's saved
    mlps_output holds attn + mlp (a mismatch the slow sweep hid while it skipped every twin whose attention
    probabilities nnterp could not find)."""
    m = model("tiiuae/falcon-7b")
    with pytest.raises(UnmappedError, match=r"mlp_out\.0: HF Falcon's parallel block adds the attention output into "
                                            r"the MLP output in place .*clone mlps_output inside the trace"):
        to_nnterp(m, "mlp_out.0")
    assert to_nnterp(m, "mlp_in.0") == "mlps_input[0]"
