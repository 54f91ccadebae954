"""Readouts (engine/core/readouts.py) computed where the activation is: each kind against the same
reduction computed independently from a plain capture on eager, the forward left untouched, bad
input refused by name; and vllm / vllm-static against eager under concurrent requests with
different readouts and steers (validator tolerances)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine import Readout, Steer
from engine.core.errors import SAEError
from engine.core.readouts import Last, LensTopK, Max, Mean, Norm, Project, ReadoutError, SAEFeatures, TopK
from engine.core.results import Request
from engine.core.sae_files import load_sae, write_random_sae
from test_vllm_common import STATIC_TAPS, check, eager_model, random_vector, vllm_model

LLAMA = "meta-llama/Llama-3.2-1B"
DECLARED = STATIC_TAPS  # the session's one shared vllm-static engine (tests/test_vllm_common.py): one start, not two
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello world"]


@pytest.fixture(scope="module")
def em():
    return eager_model(LLAMA)


@pytest.fixture(scope="session")
def sae_dirs(tmp_path_factory):
    """Random SAEs in SAELens's on-disk format at the zoo Llama's width (256): {arch: directory}; the
    transcoder's features are its encoding at its input point (what it decodes is read at its output point)."""
    root = tmp_path_factory.mktemp("saes")
    return {arch: str(write_random_sae(root / arch, arch, d_in=256, d_sae=512, seed=i, **kw))
            for i, (arch, kw) in enumerate([("standard", {}), ("topk", {"k": 16}), ("jumprelu", {}),
                                            ("transcoder", {"d_out": 256})])}


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "transcoder"])
def test_sae_features_equal_the_top_k_of_the_saes_encoding_of_a_capture(em, sae_dirs, arch):
    sae = load_sae(sae_dirs[arch])
    rs = [Readout("resid_post.1", SAEFeatures(sae_dirs[arch], k=8), name="f"),
          Readout("resid_post.1", SAEFeatures(sae, k=4, threshold=0.05), name="loaded")]
    _, cache = em.run_with_cache(PROMPTS, ["resid_post.1"], readouts=rs)
    for i, x in enumerate(_rows(cache, "resid_post.1")):
        c = cache.columns[i]
        f = sae.encode(x)
        ref = f.topk(8)
        got = cache.readouts["f"]
        assert torch.equal(got.indices[i, c], ref.indices) and torch.allclose(got.values[i, c], ref.values, atol=1e-6)
        small = cache.readouts["loaded"]
        top4 = f.topk(4)
        keep = top4.values > 0.05
        assert torch.equal(small.indices[i, c], torch.where(keep, top4.indices, -1))
        assert torch.allclose(small.values[i, c], torch.where(keep, top4.values, 0.0), atol=1e-6)
        assert torch.allclose(got.dense(512)[i, c], ref.values.new_zeros(len(c), 512).scatter(-1, ref.indices,
                                                                                               ref.values), atol=1e-6)
    with pytest.raises(Exception, match="k=600 exceeds the SAE's 512 latents"):
        em.run_with_cache("hi", readouts=[Readout("resid_post.1", SAEFeatures(sae_dirs[arch], k=600))])
    with pytest.raises(Exception, match="d_in is 256"):
        em.run_with_cache("hi", readouts=[Readout("mlp_act.1", SAEFeatures(sae, k=4))])


def _rows(cache, key):
    """Each sequence's own rows of a padded capture."""
    return [cache[key][i, c] for i, c in enumerate(cache.columns)]


def test_position_kinds_equal_the_reduction_of_a_capture(em):
    rs = [Readout("resid_post.1", Mean()), Readout("resid_post.1", Max()), Readout("mlp_out.0", Last()),
          Readout("z.1.head-2", Mean(), name="zmean")]
    _, cache = em.run_with_cache(PROMPTS, ["resid_post.1", "mlp_out.0", "z.1"], readouts=rs)
    for i, x in enumerate(_rows(cache, "resid_post.1")):
        assert torch.allclose(cache.readouts["resid_post.1:mean"][i], x.mean(0), atol=1e-6)
        assert torch.equal(cache.readouts["resid_post.1:max"][i], x.amax(0))
    for i, x in enumerate(_rows(cache, "mlp_out.0")):
        assert torch.equal(cache.readouts["mlp_out.0:last"][i], x[-1])
    for i, x in enumerate(_rows(cache, "z.1")):
        assert torch.allclose(cache.readouts["zmean"][i], x[:, 2].mean(0), atol=1e-6)
    assert cache.readouts["resid_post.1:mean"].shape == (2, em.d_model)


def test_per_position_kinds_equal_their_maths_on_a_capture(em):
    W, b = random_vector((3, em.d_model), 1, 1.0), random_vector((3,), 2, 1.0)
    u = random_vector((em.d_model,), 3, 1.0)
    rs = [Readout("resid_post.0", Norm()), Readout("resid_post.1", Project(W, b, act="sigmoid"), name="probe"),
          Readout("resid_post.1", Project(u), name="dir")]
    _, cache = em.run_with_cache(PROMPTS, ["resid_post.0", "resid_post.1"], readouts=rs)
    cols = cache.columns
    for i, (x0, x1) in enumerate(zip(_rows(cache, "resid_post.0"), _rows(cache, "resid_post.1"))):
        assert torch.allclose(cache.readouts["resid_post.0:norm"][i, cols[i]], x0.norm(dim=-1), rtol=1e-6)
        assert torch.allclose(cache.readouts["probe"][i, cols[i]], torch.sigmoid(x1 @ W.T + b), atol=1e-6)
        assert torch.allclose(cache.readouts["dir"][i, cols[i]], x1 @ u, atol=1e-5)
    pad = [c for c in range(cache["resid_post.0"].shape[1]) if c not in cols[1].tolist()]
    assert bool((cache.readouts["probe"][1, pad] == 0).all())  # padded positions hold 0, like a capture


def test_lens_topk_equals_the_logit_lens_of_a_capture(em):
    rs = [Readout("resid_post.-1", LensTopK(4), name="lens"), Readout("final_norm", LensTopK(2), name="head")]
    logits, cache = em.run_with_cache(PROMPTS, ["resid_post.-1"], readouts=rs)
    ref = torch.log_softmax(em.logit_lens((cache, "resid_post.-1")).float(), -1).topk(4)
    got = cache.readouts["lens"]
    assert isinstance(got, TopK) and got.shape == (2, cache["resid_post.-1"].shape[1], 4)
    for i, c in enumerate(cache.columns):
        assert torch.equal(got.indices[i, c], ref.indices[i, c])
        assert torch.allclose(got.values[i, c], ref.values[i, c], atol=1e-5)
        head = torch.log_softmax(logits[i, c].float(), -1).topk(2)  # final_norm lensed without a second norm
        assert torch.equal(cache.readouts["head"].indices[i, c], head.indices)
    assert bool((got.indices[1, :cache.columns[1][0]] == -1).all())  # pad slots: index -1


def test_readouts_leave_the_forward_and_other_captures_untouched(em):
    """A readout only reads; a lens readout runs the final norm and head inside the forward, and the
    captures at those very points must not see its rows."""
    rs = [Readout("resid_post.0", LensTopK(3)), Readout("resid_post.1", Mean())]
    points = ["final_norm", "lm_head", "resid_post.1"]
    l0, c0 = em.run_with_cache(PROMPTS, points)
    l1, c1 = em.run_with_cache(PROMPTS, points, readouts=rs)
    assert torch.equal(l0, l1)
    for p in points:
        assert torch.equal(c0[p], c1[p]), p


def test_generate_and_stream_readouts_cover_the_captured_positions(em):
    W = random_vector((2, em.d_model), 4, 1.0)
    rs = [Readout("resid_post.1", Project(W), name="p"), Readout("resid_post.1", Mean()),
          Readout("resid_post.-1", LensTopK(2), name="lens")]
    st = [Steer("resid_post.0", "add", random_vector((em.d_model,), 5))]
    out = em.generate(PROMPTS, 4, points=["resid_post.1"], steer=st, readouts=rs)
    for i, x in enumerate(_rows(out.cache, "resid_post.1")):  # prompt + each fed-back token, as captured
        c = out.cache.columns[i]
        # the readout's product runs over every row of the step at once, the reference over one sequence's:
        # float32 sums of 256 products of magnitude ~30 round apart by up to ~2e-5 as the kernel's blocking
        # differs (seen on an Intel Xeon; an AMD EPYC agreed to 1e-5)
        torch.testing.assert_close(out.cache.readouts["p"][i, c], x @ W.T, rtol=1e-5, atol=1e-4)
        assert torch.allclose(out.cache.readouts["resid_post.1:mean"][i], x.mean(0), atol=1e-6)
    # the lens of the last layer's output picks the next token (greedy) at every generated step
    assert torch.equal(out.cache.readouts["lens"].indices[:, -3:, 0], out.new_tokens[:, 1:])
    steps = list(em.stream(PROMPTS[0], 4, steer=st, readouts=rs))
    assert [s.token for s in steps] == out.requests[0].new_tokens.tolist()
    assert steps[0].readouts["p"].shape[0] == out.requests[0].prompt_ids.shape[0]
    assert all(s.readouts["p"].shape[0] == 1 for s in steps[1:])
    assert "resid_post.1:mean" not in steps[0].readouts  # reductions only in the result
    per_step = torch.cat([s.readouts["p"] for s in steps])  # the prompt, then each token fed back
    assert torch.allclose(per_step, steps[-1].result.cache.readouts["p"], atol=1e-6)


def test_a_generations_sae_readout_encodes_its_decode_rows_together_and_equals_the_capture(em, sae_dirs, monkeypatch):
    """A per-position readout's decode rows wait (Accumulator.defer) and are encoded together: generating
    6 tokens calls the SAE's encoder once for the prompts and once per sequence for its 5 fed-back tokens
    (not 5 more times for the batch), and the top-k equals the SAE's encoding of the captured rows."""
    from engine.core import features
    sae = load_sae(sae_dirs["standard"])
    calls = []
    real = features.topk
    monkeypatch.setattr(features, "topk", lambda f, k: calls.append(f.shape[0]) or real(f, k))  # once per encode
    out = em.generate(PROMPTS, 6, points=["resid_post.1"], readouts=[Readout("resid_post.1", SAEFeatures(sae, k=8), name="f")])
    monkeypatch.undo()
    # the prompts' rows in one call, then each sequence's 5 fed-back rows in one call (its own readout)
    assert calls == [sum(len(c) - 5 for c in out.cache.columns), 5, 5]
    for i, x in enumerate(_rows(out.cache, "resid_post.1")):
        ref = sae.encode(x).topk(8)
        got = out.cache.readouts["f"]
        c = out.cache.columns[i]
        assert torch.equal(got.indices[i, c], ref.indices)
        torch.testing.assert_close(got.values[i, c], ref.values, rtol=1e-5, atol=1e-5)


def _accumulator(kind=None, fn=None):
    from engine.core.readouts import Accumulator
    r = Readout("resid_post.1", kind or Project(torch.ones(2, 3)), name="r")
    calls = []

    def counted(x):  # the readout's maths (x @ W.T per row), counting the rows of each call
        calls.append(x.shape[0])
        return (fn or (lambda t: (t @ torch.ones(2, 3).T,)))(x)
    return Accumulator(r, counted), calls


def test_deferred_rows_are_computed_together_in_order_and_read_as_if_computed_at_once():
    """Accumulator.defer: chunks wait until DEFER_ROWS do, a chunk kept after them (a prefill computed by
    the site), or a read; each is then where a direct computation of every chunk would put it."""
    from engine.core.readouts import DEFER_ROWS
    acc, calls = _accumulator()
    rows = torch.randn(DEFER_ROWS + 10, 3, generator=torch.Generator().manual_seed(0))
    want = rows @ torch.ones(2, 3).T
    acc.put(0, 4, (rows[:4] @ torch.ones(2, 3).T,))  # the prompt, computed by the site
    for p in range(4, 4 + DEFER_ROWS - 1):  # a row per step, one short of the cap: nothing computed yet
        acc.defer(p, rows[p:p + 1].clone())
    assert calls == [] and sum(x.shape[0] for _, x in acc.waiting) == DEFER_ROWS - 1
    acc.defer(DEFER_ROWS + 3, rows[DEFER_ROWS + 3:DEFER_ROWS + 4].clone())  # the cap: one call for all
    assert calls == [DEFER_ROWS] and acc.waiting == []
    acc.defer(DEFER_ROWS + 4, rows[DEFER_ROWS + 4:DEFER_ROWS + 6].clone())
    acc.put(DEFER_ROWS + 6, 4, (rows[DEFER_ROWS + 6:] @ torch.ones(2, 3).T,))  # kept after the waiting rows
    assert calls == [DEFER_ROWS, 2]
    torch.testing.assert_close(acc.result(), want)
    acc.defer(DEFER_ROWS + 10, rows[:1].clone())  # a read computes what waits
    assert acc.rows_from(DEFER_ROWS + 9)[0].shape == (2, 2) and calls == [DEFER_ROWS, 2, 1]


def test_deferred_rows_recomputed_after_preemption_replace_the_earlier_ones():
    """The scheduler may recompute a request's positions (vLLM preemption): rows deferred for positions
    already kept, or waiting, are replaced as computed ones are (Accumulator.put)."""
    acc, _ = _accumulator()
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for p in range(6):
        acc.defer(p, x[p:p + 1].clone())
    acc.defer(3, (x[3:6] * 2).clone())  # positions 3..5 again, with other values
    got = acc.result()
    want = torch.cat([x[:3], x[3:6] * 2]) @ torch.ones(2, 3).T
    torch.testing.assert_close(got, want)


def test_a_readout_that_fails_on_deferred_rows_fails_when_read_naming_it():
    """A failure of the deferred call (after the readout ran once) is the readout's error: read, not raised
    from inside a later step (a vLLM worker collects every other request on)."""
    def fn(x):
        if x.shape[0] > 1:
            raise ValueError("out of memory")
        return (x.sum(-1, keepdim=True),)
    acc, _ = _accumulator(fn=fn)
    acc.defer(0, torch.ones(1, 3))
    acc.defer(1, torch.ones(1, 3))
    with pytest.raises(RuntimeError, match="r: ValueError: out of memory"):
        acc.result()


@pytest.mark.parametrize("make, match", [
    (lambda: Readout("resid_post.1", "mean"), "Readout kind must be one of"),
    (lambda: Readout("resid_post.1", Project(torch.ones(2, 2, 2))), "Project W must have 1 or 2 dims"),
    (lambda: Readout("resid_post.1", Project(torch.full((4,), float("nan")))), "non-finite"),
    (lambda: Readout("resid_post.1", Project(torch.ones(3, 4), b=torch.ones(2))), "b has 2 entries"),
    (lambda: Readout("resid_post.1", Project(torch.ones(4), act="gelu")), "act 'gelu' is not one of"),
    (lambda: Readout("resid_post.1", LensTopK(0)), "LensTopK k must be a positive int"),
    (lambda: Readout("resid_post.1", LensTopK(True)), "LensTopK k must be a positive int"),
    (lambda: Readout("mlp_act.1", LensTopK(3)), "not one"),
    (lambda: Readout("attn_probs.1", Mean()), "per-position activation vectors"),
    (lambda: Readout("lm_head", Norm()), "per-position activation vectors"),
    (lambda: Readout("resid_post.1", Mean(), name=""), "non-empty string"),
    (lambda: Readout("resid_post.1", SAEFeatures("")), "sae is empty"),
    (lambda: Readout("resid_post.1", SAEFeatures(torch.ones(3))), "a directory path or a loaded SAE"),
    (lambda: Readout("resid_post.1", SAEFeatures("/tmp", k=2, threshold=float("inf"))), "finite number"),
])
def test_bad_readouts_are_refused_when_made(make, match):
    with pytest.raises(ReadoutError, match=match):
        make()


def test_bad_readouts_are_refused_by_the_call(em):
    r = Readout("resid_post.1", Mean())
    with pytest.raises(ReadoutError, match="two readouts are named 'resid_post.1:mean'"):
        em.run_with_cache("hi", readouts=[r, Readout("resid_post.1", Mean())])
    with pytest.raises(ReadoutError, match="readouts entry 0 is str"):
        em.run_with_cache("hi", readouts=["resid_post.1"])
    with pytest.raises(ReadoutError, match="readouts must be a Readout or a list"):
        em.run_with_cache("hi", readouts="resid_post.1")
    with pytest.raises(ReadoutError, match="without gradients"):
        em.run_with_cache("hi", readouts=[r], grad=True)
    with pytest.raises(SAEError, match="SAEFeatures: '/nonexistent/sae' is not a directory"):
        em.run_with_cache("hi", readouts=[Readout("resid_post.1", SAEFeatures("/nonexistent/sae"))])
    with pytest.raises(ReadoutError, match=rf"Project W reads 7 dims but resid_post.1 has {em.d_model}"):
        em.run_with_cache("hi", readouts=[Readout("resid_post.1", Project(torch.ones(2, 7)))])
    with pytest.raises(Exception, match="out of range"):
        em.run_with_cache("hi", readouts=[Readout("resid_post.40", Mean())])
    vocab = em.config.vocab_size  # a lens's k above it was cut to the vocabulary without a word (the server refused it)
    with pytest.raises(ReadoutError, match=f"LensTopK k={vocab + 1} exceeds the vocabulary's {vocab} tokens; ask "
                                           f"for at most {vocab}"):
        em.run_with_cache("hi", readouts=[Readout("resid_post.1", LensTopK(vocab + 1))])
    _, c = em.run_with_cache("hi", readouts=[Readout("resid_post.1", LensTopK(vocab))])
    assert c.readouts[f"resid_post.1:lens_top{vocab}"].indices.shape[-1] == vocab


# -- vllm and vllm-static against eager ---------------------------------------------------------------
def assert_same(ours, ref, backend: str, what: str) -> None:
    """ours ~ ref at the validator's tolerance (decode tier: generation goes through the KV cache);
    a TopK's indices must agree wherever its values are apart by more than that tolerance."""
    if isinstance(ref, TopK):
        assert isinstance(ours, TopK), what
        assert_same(ours.values, ref.values, backend, what + " values")
        v = ref.values
        gap = torch.minimum(torch.cat([v[..., :1] * 0 + 1e9, (v[..., :-1] - v[..., 1:]).abs()], -1),
                            torch.cat([(v[..., :-1] - v[..., 1:]).abs(), v[..., :1] * 0 + 1e9], -1))
        apart = gap > 1e-3
        assert torch.equal(ours.indices[apart], ref.indices[apart]), what + " indices"
        return
    o, r = ours.float(), ref.float()
    check(o.reshape(1, 1, -1) if o.dim() < 2 else o[None], r.reshape(1, 1, -1) if r.dim() < 2 else r[None],
          "readout", backend, "decode", what)


def _requests(d: int, n: int, saes: dict) -> list[Request]:
    """n requests, each with its own readouts and steers (affine, so vllm-static serves them too)."""
    out = []
    arch = list(saes)
    for i in range(n):
        W = random_vector((3, d), 10 + i, 0.5)
        rs = [Readout("resid_post.1", [Mean(), Max(), Last()][i % 3]),
              Readout(f"resid_post.{i % 2}", SAEFeatures(saes[arch[i % len(arch)]], k=4 + i % 3), name="sae"),
              Readout(f"resid_post.{i % 2}", Project(W, act=["sigmoid", None][i % 2]), name="probe"),
              Readout("resid_post.1", LensTopK(3), name="lens"), Readout("mlp_out.1", Norm()),
              Readout("z.1.head-1", Norm(), name="head")][: 3 + i % 4]
        steer = [Steer(f"resid_post.{i % 2}", "add", random_vector((d,), 20 + i, 2.0))] if i % 2 else []
        out.append(Request(PROMPTS[i % 2] + " and more" * (i % 3), 3, steer=steer, readouts=rs))
    return out


def _engine(backend: str):
    return vllm_model(LLAMA, backend, **({"static_points": DECLARED} if backend == "vllm-static" else {}))


def _concurrent_readouts_match_eager(backend: str, n: int, saes: dict) -> None:
    vm, em = _engine(backend), eager_model(LLAMA)
    reqs = _requests(vm.d_model, n, saes)

    async def run():  # concurrent calls from one loop: one continuous batch, each request its own plan
        return await asyncio.gather(*(vm.aio.generate(r.prompt, r.max_new_tokens, steer=r.steer, readouts=r.readouts)
                                      for r in reqs))
    got = asyncio.run(run())
    for i, (r, g) in enumerate(zip(reqs, got)):
        ref = em.generate(r.prompt, r.max_new_tokens, steer=r.steer, readouts=r.readouts)
        assert torch.equal(g.new_tokens, ref.new_tokens), f"request {i}"
        assert set(g.cache.readouts) == {x.name for x in r.readouts}
        for name, want in ref.cache.readouts.items():
            assert_same(g.cache.readouts[name], want, backend, f"request {i} {name}")


@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_readouts_match_eager_under_concurrent_requests(backend, sae_dirs):
    _concurrent_readouts_match_eager(backend, 4, sae_dirs)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_readouts_match_eager_under_16_concurrent_requests(backend, sae_dirs):
    _concurrent_readouts_match_eager(backend, 16, sae_dirs)


@pytest.mark.vllm
def test_vllm_capture_and_stream_readouts_match_eager():
    vm, em = _engine("vllm"), eager_model(LLAMA)
    W = random_vector((2, vm.d_model), 7, 1.0)
    rs = [Readout("resid_post.1", Project(W), name="p"), Readout("resid_post.0", LensTopK(3), name="lens"),
          Readout("resid_post.1", Mean())]
    _, cv = vm.run_with_cache(PROMPTS, readouts=rs)
    _, ce = em.run_with_cache(PROMPTS, readouts=rs)
    for name in ce.readouts:
        assert_same(cv.readouts[name], ce.readouts[name], "vllm", name)
    sv, se = list(vm.stream(PROMPTS[0], 4, readouts=rs)), list(em.stream(PROMPTS[0], 4, readouts=rs))
    assert [s.token for s in sv] == [s.token for s in se]
    for a, b in zip(sv, se):
        assert set(a.readouts) == set(b.readouts) == {"p", "lens"}, a.index
        for name in b.readouts:
            assert_same(a.readouts[name], b.readouts[name], "vllm", f"step {a.index} {name}")


@pytest.mark.vllm
def test_vllm_static_refuses_readouts_its_taps_cannot_feed():
    vm = _engine("vllm-static")
    with pytest.raises(Exception, match="mlp_out.0"):
        vm.run_with_cache("hi", readouts=[Readout("mlp_out.0", Mean())])
