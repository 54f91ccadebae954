"""Activation patching (engine/workflows/patching.py) and steer values with position / batch axes, against
independent references: TransformerLens TransformerBridge hooks for whole sweeps, raw HF module
hooks for single patches. Two families in the default run, the rest of the kinds marked slow."""
from __future__ import annotations

import pytest
import torch

from engine.core.errors import InputError, SteeringError
from engine.core.steering import Steer
from engine.workflows.patching import logit_diff, patch_sweep
from test_vllm_common import eager_model

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
LLAMA = "meta-llama/Llama-3.2-1B"
def model(name):  # eager models are shared across the session's test modules
    return eager_model(name)


def _ids(m, text):
    return m._inputs(text)["input_ids"][0].tolist()


def _tl_sweep(name, m, positions):
    """The same sweep with TransformerLens bridge hooks: patch blocks.L.hook_resid_pre at one position."""
    from transformer_lens.model_bridge import TransformerBridge

    from engine.zoo import offline_session
    with offline_session():
        bridge = TransformerBridge.boot_transformers(name, device="cpu")
    cid, xid = torch.tensor([_ids(m, CLEAN)]), torch.tensor([_ids(m, CORRUPT)])
    out = torch.zeros(m.n_layers, len(positions))
    with torch.no_grad():
        logits, clean = bridge.run_with_cache(cid)
        top = int(logits[0, -1].argmax())
        for layer in range(m.n_layers):
            name_ = f"blocks.{layer}.hook_resid_pre"
            for j, p in enumerate(positions):
                def hook(act, hook, p=p):
                    act = act.clone()
                    act[:, p] = clean[name_][:, p]
                    return act
                out[layer, j] = bridge.run_with_hooks(xid, fwd_hooks=[(name_, hook)])[0, -1, top]
    return out


def _check_sweep(name):
    m = model(name)
    n = len(_ids(m, CLEAN))
    positions = [0, 11, n - 2, n - 1]  # 11: the token that differs
    res = patch_sweep(m, CLEAN, CORRUPT, "resid_pre", positions=positions, batch_size=5)
    ref = _tl_sweep(name, m, positions)
    assert res.values.shape == (m.n_layers, len(positions)) and res.positions == positions
    torch.testing.assert_close(res.values, ref, rtol=0, atol=1e-5)
    assert float(res.values.max() - res.values.min()) > 1e-3, "the sweep moved nothing: the test proves nothing"
    torch.testing.assert_close(res.values[0, 1], torch.tensor(res.clean), rtol=0, atol=1e-5)  # patching the diff token at layer 0
    torch.testing.assert_close(res.values[:, 0], torch.full((m.n_layers,), res.corrupted), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["openai-community/gpt2", LLAMA])
def test_patch_sweep_matches_transformer_lens(name):
    _check_sweep(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["google/gemma-2-2b", "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B",
                                  "LiquidAI/LFM2-350M", "bigscience/bloom-560m", "tiiuae/falcon-7b",
                                  "EleutherAI/gpt-j-6b"])
def test_patch_sweep_matches_transformer_lens_more_families(name):
    _check_sweep(name)


def test_patch_sweep_heads_all_positions_metric_and_plot(tmp_path):
    m = model(LLAMA)
    metric = logit_diff(m, 370, 374)  # " John" vs " Mary" token ids of the zoo tokenizer
    res = patch_sweep(m, CLEAN, CORRUPT, ["z.0.head-1", "z.1.head-3", "mlp_out.1"], metric, positions="all")
    assert res.values.shape == (3, 1) and res.positions == [-1]
    for a, v in zip(res.addresses, res.values[:, 0]):  # every position patched at once = one steer
        _, c = m.run_with_cache(CLEAN, [a])
        ref = metric(m.run_with_cache(CORRUPT, (), [Steer(a, "set", c.entry(a))])[0])
        torch.testing.assert_close(v, ref[0], rtol=0, atol=1e-5)
    norm = res.normalized()
    assert norm.shape == (3, 1)
    import matplotlib
    matplotlib.use("Agg")
    ax = res.plot()
    ax.figure.savefig(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 1000


def test_patch_sweep_bad_input():
    m = model(LLAMA)
    with pytest.raises(InputError, match="same number of tokens.*clean has 19, corrupted 7"):
        patch_sweep(m, CLEAN, "The quick brown fox", "resid_pre")
    with pytest.raises(InputError, match=r"patch positions \[40\] are outside the 19-token prompt"):
        patch_sweep(m, CLEAN, CORRUPT, "resid_pre", positions=[40])
    with pytest.raises(ValueError, match="one value per batch row"):
        patch_sweep(m, CLEAN, CORRUPT, "resid_pre.0", metric=lambda logits: logits.sum(), positions=[1, 2])
    with pytest.raises(InputError, match="is 2 tokens"):
        logit_diff(m, " Mary and", " John")


# -- value forms, against raw HF hooks ------------------------------------------------------------------
def _hf_patched(m, ids, layer, values: dict):
    """Logits of one unpadded sequence with resid_pre of `layer` set to values[p] at positions p,
    through a forward pre-hook on the decoder layer written here."""
    blk = m.hf.model.layers[layer]

    def pre(module, args, kwargs):
        h = (args[0] if args else kwargs["hidden_states"]).clone()
        for p, v in values.items():
            h[0, p] = v
        if args:
            return (h, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h}
    handle = blk.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            return m.hf(torch.tensor([ids])).logits[0]
    finally:
        handle.remove()


def test_set_from_a_padded_cache_aligns_each_row_by_its_own_positions():
    """A cache of a left-padded batch, patched into another batch padded differently: each sequence
    gets its own rows at its own positions (never padded columns)."""
    m = model(LLAMA)
    donors = ["The quick brown fox jumps over the lazy dog.", "Water boils at 100 degrees"]
    targets = ["Water boils at sea level, they said", "The capital of France is Paris, and the capital"]
    _, cache = m.run_with_cache(donors, ["resid_pre.1"])
    entry = cache.entry("resid_pre.1")
    lens = [len(r) for r in entry.rows]
    assert lens[0] != lens[1]
    logits, _ = m.run_with_cache(m.to_tokens(targets, padding_side="right"), (),
                                 [Steer("resid_pre.1", "set", (cache, "resid_pre.1"), positions=(1, 4))])
    for r, text in enumerate(targets):
        ids = _ids(m, text)
        ref = _hf_patched(m, ids, 1, {p: entry.rows[r][p] for p in (1, 2, 3)})
        torch.testing.assert_close(logits[r, : len(ids)], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["vector", "pos", "batch_pos"])
def test_add_value_forms(form):
    m = model(LLAMA)
    texts = ["The quick brown fox jumps over", "Water boils at 100 degrees Celsius"]
    n = [len(_ids(m, t)) for t in texts]
    g = torch.Generator().manual_seed(0)
    v = {"vector": torch.randn(m.d_model, generator=g), "pos": torch.randn(max(n), m.d_model, generator=g),
         "batch_pos": torch.randn(2, max(n), m.d_model, generator=g)}[form]
    enc = m.to_tokens(texts)
    _, base = m.run_with_cache(enc, ["resid_pre.1"])
    _, got = m.run_with_cache(enc, ["resid_pre.1"], [Steer("resid_pre.1", "add", v, positions=slice(0, 5))])
    for r in range(2):
        cols = enc["attention_mask"][r].nonzero().flatten()
        diff = got["resid_pre.1"][r, cols] - base["resid_pre.1"][r, cols]
        want = v.expand(5, -1) if form == "vector" else v[:5] if form == "pos" else v[r, :5]
        torch.testing.assert_close(diff[:5], want, rtol=1e-5, atol=1e-5)
        assert diff[5:].abs().max() == 0


def test_scale_value_shapes():
    m = model(LLAMA)
    _, base = m.run_with_cache(CLEAN, ["mlp_out.0"])
    w = torch.linspace(0, 2, m.d_model)
    _, got = m.run_with_cache(CLEAN, ["mlp_out.0"], [Steer("mlp_out.0", "scale", w)])
    torch.testing.assert_close(got["mlp_out.0"], base["mlp_out.0"] * w)
    _, got = m.run_with_cache(CLEAN, ["mlp_out.0"], [Steer("mlp_out.0", "scale", 0.5)])
    torch.testing.assert_close(got["mlp_out.0"], base["mlp_out.0"] * 0.5)
    with pytest.raises(SteeringError, match=r"shape \(5,\) but the point's per-position shape is \(256,\)"):
        m.run_with_cache(CLEAN, (), [Steer("mlp_out.0", "scale", torch.ones(5))])


@pytest.mark.parametrize("make,fragment", [
    (lambda d, n: Steer("resid_pre.1", "set", torch.ones(n, d + 1)),
     r"shape \(19, 257\) \(after 1 leading pos axis\) but the point's per-position shape is \(256,\)"),
    (lambda d, n: Steer("resid_pre.1", "set", torch.ones(4, d)),
     r"covers positions 0..3 but the steer touches position 18"),
    (lambda d, n: Steer("resid_pre.1", "set", torch.ones(3, n, d)), "a batch axis of 3 for a call of 1 sequence"),
    (lambda d, n: Steer("resid_pre.1", "set", torch.ones(2, 3, n, d)), r"does not fit the point's 1 per-position dim"),
    (lambda d, n: Steer("z.1", "set", torch.ones(n, d)), r"shape \(19, 256\) but the point's per-position shape is "
                                                          r"\(4, 64\)"),
    (lambda d, n: Steer("resid_pre.1", "swap", torch.ones(d)), "give that capture"),
    (lambda d, n: Steer("resid_pre.1", "add", torch.ones(d), positions=torch.ones(2, n, dtype=torch.bool)),
     r"has shape \(2, 19\): 2 rows for a call of 1 sequences"),
    (lambda d, n: Steer("resid_pre.1", "add", torch.ones(d), positions=torch.zeros(n, dtype=torch.bool)),
     "selects no position"),
    (lambda d, n: Steer("resid_pre.1", "add", torch.ones(d), positions=torch.ones(n + 3, dtype=torch.bool)),
     "selects position 19, past the 19 tokens"),
])
def test_bad_value_forms_name_both_shapes(make, fragment):
    m = model(LLAMA)
    with pytest.raises(SteeringError, match=fragment):
        m.run_with_cache(CLEAN, (), [make(m.d_model, len(_ids(m, CLEAN)))])
