"""engine.connect against a real eager server (a subprocess on the Llama zoo twin) compared with the
library's own EagerModel on the same weights: every public method of the remote model gives what the
local one gives (captures, logits and readouts within 1e-5, tokens identical, receipts equal), and a
table of bad inputs raises the same exception class on both."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from engine import LensTopK, Mean, Norm, Project, Readout, Request, Steer, StrictSteerError, connect
from engine.core.crossing import library_class
from engine.core.errors import ModelNotFoundError, OptionError
from engine.core.readouts import TopK
from serve_common import LLAMA, eager_server
from test_vllm_common import eager_model

P = "The quick brown fox jumps over the lazy dog"
PROMPTS = [P, "Hello there"]
D = 256  # the twin's d_model


def vec(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def url():
    with eager_server() as u:
        yield u


@pytest.fixture(scope="module")
def lib(url):
    return eager_model(LLAMA)


@pytest.fixture(scope="module")
def m(url):
    with connect(url, model=LLAMA) as mm:
        yield mm


def same(a, b, what=""):
    """Equal within 1e-5 + 1e-5 |b| elementwise, with the same shape, dtype and device. The server may run
    a call's prompts as separate requests (a batch of one each) where the library pads them into one batch:
    float32 sums then round apart in proportion to the values (1.1e-5 where entries reach 16 on an Intel Xeon)."""
    assert isinstance(a, torch.Tensor), f"{what}: {type(a).__name__}"
    assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), \
        f"{what}: {(a.shape, a.dtype, a.device)} != {(b.shape, b.dtype, b.device)}"
    if a.is_floating_point():
        excess = ((a - b).abs() - 1e-5 * b.abs()).max().item() if a.numel() else 0.0
        assert excess <= 1e-5, f"{what}: max abs diff {(a - b).abs().max().item():.3g} beyond 1e-5 |b| by {excess:.3g}"
    else:
        assert torch.equal(a, b), what


def same_receipts(got, ref):
    assert [(r.index, r.address, r.op, r.rows) for r in got] == [(r.index, r.address, r.op, r.rows) for r in ref]
    for g, r in zip(got, ref):
        assert g.change_norm == pytest.approx(r.change_norm, rel=1e-5, abs=1e-6), (g, r)


def same_cache(got, ref, what=""):
    assert set(got) == set(ref), f"{what}: {sorted(got)} != {sorted(ref)}"
    for k in ref:
        same(got[k], ref[k], f"{what} {k}")
    assert set(got.readouts) == set(ref.readouts) and got.positional == ref.positional
    for k, v in ref.readouts.items():
        if isinstance(v, TopK):
            same(got.readouts[k].indices, v.indices, f"{what} readout {k} indices")
            same(got.readouts[k].values, v.values, f"{what} readout {k} values")
        else:
            same(got.readouts[k], v, f"{what} readout {k}")
    same_receipts(got.receipts, ref.receipts)


def readouts():
    return [Readout("resid_post.1", Mean()), Readout("resid_post.0", Norm()), Readout("resid_post.1", LensTopK(3)),
            Readout("mlp_out.0", Project(vec(3, D, seed=5), act="tanh"), name="probe")]


def test_forward_matches_library(m, lib):
    points = ["resid_post", "attn_probs.0", "z.1.head-0", "lm_head", "mlp_act.-1"]
    steers = [Steer("resid_post.0", "add", vec(D), "last"), Steer("mlp_act.1", "scale", 0.5, (1, 4))]
    got = m.run_with_cache(PROMPTS, points, steers, readouts=readouts())
    ref = lib.run_with_cache(PROMPTS, points, steers, readouts=readouts())
    same(got[0], ref[0], "logits")
    same_cache(got[1], ref[1], "run_with_cache")
    assert got[1].receipts[0].rows == 2 and got[1].columns is not None
    same(m.forward(PROMPTS, steers), lib.forward(PROMPTS, steers), "forward")
    none, cache = m.run_with_cache(P, ["resid_post.0"], return_logits=False)
    assert none is None and set(cache) == {"resid_post.0"}
    # a steering() block applies to the calls inside it, before steer= (receipt indices), as locally
    block = Steer("resid_mid.0", "ablate", positions=[0, 2])
    with m.steering(block), lib.steering(block):
        same_cache(m.run_with_cache(P, ["resid_post.1"], steers[:1])[1],
                   lib.run_with_cache(P, ["resid_post.1"], steers[:1])[1], "steering block")
    # the layout of a given attention mask (right padding) is kept
    enc = lib.to_tokens(PROMPTS, padding_side="right")
    got, ref = m.run_with_cache(enc, ["resid_post.0"]), lib.run_with_cache(enc, ["resid_post.0"])
    same(got[0], ref[0], "right-padded logits")
    same_cache(got[1], ref[1], "right-padded")


def test_generation_matches_library(m, lib):
    points = ["resid_post.1", "attn_probs.1", "lm_head"]
    steers = [Steer("resid_post.0", "add", vec(D, seed=1), "generated")]
    got = m.generate(PROMPTS, 5, points, steers, readouts=readouts())
    ref = lib.generate(PROMPTS, 5, points, steers, readouts=readouts())
    for f in ("tokens", "new_tokens", "attention_mask", "logits"):
        same(getattr(got, f), getattr(ref, f), f)
    assert got.text == ref.text
    same_cache(got.cache, ref.cache, "generate")
    same_receipts(got.receipts, ref.receipts)
    for g, r in zip(got.requests, ref.requests):
        same(g.prompt_ids, r.prompt_ids, "prompt ids")
        same(g.new_tokens, r.new_tokens, "new tokens")
        same(g.logits, r.logits, "request logits")
        assert g.text == r.text
        same_cache(g.cache, r.cache, "request")
    # seeded sampling of one prompt repeats the library's draw (eager seeds the call's generator)
    a = m.generate(P, 6, temperature=0.9, top_k=50, seed=11)
    b = lib.generate(P, 6, temperature=0.9, top_k=50, seed=11)
    same(a.new_tokens, b.new_tokens, "seeded tokens")


def test_generate_batch_matches_each_request_alone(m, lib):
    reqs = [Request(P, 4, ["resid_post.1"], [Steer("resid_post.0", "scale", 2.0, "last")]),
            Request("Hello there", 6, (), (), {"temperature": 0.0}, [Readout("resid_post.0", Norm())])]
    got = m.generate_batch(reqs)
    for g, r in zip(got, reqs):
        ref = lib.generate(r.prompt, r.max_new_tokens, r.points, r.steer, readouts=r.readouts, **r.sampling)
        rr = ref.requests[0]
        same(g.new_tokens, rr.new_tokens, "tokens")
        same(g.logits, rr.logits, "logits")
        same_cache(g.cache, rr.cache, "generate_batch")
        assert g.text == rr.text


def test_stream_matches_library(m, lib):
    points = ["resid_post.0", "attn_probs.1"]
    steers = [Steer("resid_post.1", "add", vec(D, seed=2), "all")]
    reads = [Readout("resid_post.0", Norm()), Readout("resid_post.1", LensTopK(2))]
    got = list(m.stream(P, 6, points, steers, readouts=reads))
    ref = list(lib.stream(P, 6, points, steers, readouts=reads))
    assert [s.token for s in got] == [s.token for s in ref] and [s.text for s in got] == [s.text for s in ref]
    assert [s.index for s in got] == list(range(6))
    for g, r in zip(got, ref):
        assert set(g.rows) == set(r.rows), g.index
        for k in r.rows:
            same(g.rows[k], r.rows[k], f"step {g.index} rows {k}")
        assert set(g.readouts or {}) == set(r.readouts or {}), g.index
        for k, v in (r.readouts or {}).items():
            parts = ("indices", "values") if isinstance(v, TopK) else (None,)
            for part in parts:
                a, b = (x if part is None else getattr(x, part) for x in (g.readouts[k], v))
                same(a, b, f"step {g.index} readout {k} {part or ''}")
        assert (g.result is None) == (r.result is None)
    res, lres = got[-1].result, ref[-1].result
    same(res.new_tokens, lres.new_tokens, "stream tokens")
    same(res.logits, lres.logits, "stream logits")
    same_cache(res.cache, lres.cache, "stream result")
    assert res.text == lres.text
    # without rows, the same tokens (steps are not held for rows)
    plain = list(m.stream(P, 6, points, steers, rows=False, return_logits=False))
    assert [s.token for s in plain] == [s.token for s in ref] and all(s.rows is None for s in plain)
    assert plain[-1].result.logits is None


def test_steers_with_a_row_per_prompt_match_library(m, lib):
    """A [batch, pos, d] value, a [batch, pos] mask and a patch from another call's cache (each
    prompt gets its own row: sent as one request per prompt)."""
    _, clean = lib.run_with_cache(PROMPTS, ["resid_post.0"])
    _, rclean = m.run_with_cache(PROMPTS, ["resid_post.0"])
    n = max(lib.to_tokens(PROMPTS)["attention_mask"].sum(1)).item()
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, 1], mask[1, 0] = True, True
    cases = [([Steer("resid_post.0", "add", vec(2, n, D, seed=3))], [Steer("resid_post.0", "add", vec(2, n, D, seed=3))]),
             ([Steer("resid_post.1", "scale", 3.0, mask)], [Steer("resid_post.1", "scale", 3.0, mask)]),
             ([Steer("resid_post.0", "set", (rclean, "resid_post.0"), "last")],
              [Steer("resid_post.0", "set", (clean, "resid_post.0"), "last")])]
    for remote, local in cases:
        got, ref = m.run_with_cache(PROMPTS, ["resid_post.1"], remote), lib.run_with_cache(PROMPTS, ["resid_post.1"], local)
        same(got[0], ref[0], "per-row logits")
        same_cache(got[1], ref[1], "per-row")
        out = []  # generating: a value over the prompt's positions alone is refused alike (it touches more)
        for mm, st in ((lib, local), (m, remote)):
            try:
                out.append(mm.generate(PROMPTS, 3, (), st))
            except Exception as e:  # noqa: BLE001  (the class is compared)
                out.append(e)
        r, g = out
        if isinstance(r, Exception):
            assert library_class(g) is library_class(r), (g, r)
            continue
        same(g.new_tokens, r.new_tokens, "per-row generation")
        same_receipts(g.receipts, r.receipts)


def test_catalogue_tokens_and_lens_match_library(m, lib):
    assert (m.name, m.backend, m.n_layers, m.d_model) == (LLAMA, "eager", lib.n_layers, lib.d_model)
    assert m.points() == lib.points()
    for p in ("resid_post", "attn_probs", "lm_head", "logits", "final_norm", "q_norm_in"):
        assert m.point_layers(p) == lib.point_layers(p), p
    for kw in ({}, {"padding_side": "right"}, {"prepend_bos": False}, {"prepend_bos": True}):
        got, ref = m.to_tokens(PROMPTS, **kw), lib.to_tokens(PROMPTS, **kw)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), kw
    ids = lib.to_tokens(PROMPTS)["input_ids"]
    for t in (ids, ids[0], ids[0].tolist(), [[1, 2], [3]], torch.tensor(7)):
        assert m.to_string(t) == lib.to_string(t)
    assert m.to_string(ids, skip_special_tokens=True) == lib.to_string(ids, skip_special_tokens=True)
    _, cache = lib.run_with_cache(PROMPTS, ["resid_post.0", "final_norm"])
    x = cache["resid_post.0"]
    same(m.logit_lens(x), lib.logit_lens(x), "lens of a tensor")
    same(m.logit_lens((cache, "resid_post.0")), lib.logit_lens((cache, "resid_post.0")), "lens of a capture")
    same(m.logit_lens(cache["final_norm"], "final_norm"), lib.logit_lens(cache["final_norm"], "final_norm"), "final_norm")


def _bad_inputs():
    v = vec(D)
    return [
        ("unknown point", lambda mm: mm.run_with_cache(P, ["resid_psot.0"])),
        ("layer out of range", lambda mm: mm.run_with_cache(P, ["resid_post.7"])),
        ("point the family lacks", lambda mm: mm.run_with_cache(P, ["q_norm_in.0"])),
        ("head out of range", lambda mm: mm.run_with_cache(P, ["z.0.head-99"])),
        ("steer at a bad layer", lambda mm: mm.forward(P, [Steer("resid_post.9", "add", v)])),
        ("steer width", lambda mm: mm.forward(P, [Steer("resid_post.0", "add", vec(7))])),
        ("steer position past the prompt", lambda mm: mm.forward(P, [Steer("resid_post.0", "add", v, 40)])),
        ("steer value too short", lambda mm: mm.forward(P, [Steer("resid_post.0", "add", vec(2, D), "all")])),
        ("steer batch of 3 for 2 prompts", lambda mm: mm.forward(PROMPTS, [Steer("resid_post.0", "add", vec(3, 2, D))])),
        ("not a Steer", lambda mm: mm.forward(P, ["resid_post.0"])),
        ("no prompts", lambda mm: mm.run_with_cache([])),
        ("mixed batch", lambda mm: mm.run_with_cache(["a", [1, 2]])),
        ("token id out of range", lambda mm: mm.run_with_cache([[1, 99999]])),
        ("float token ids", lambda mm: mm.run_with_cache([[1.5, 2.0]])),
        ("prompt longer than the model", lambda mm: mm.run_with_cache([[1] * 600])),
        ("generation past the model", lambda mm: mm.generate(P, 600)),
        ("max_new_tokens 0", lambda mm: mm.generate(P, 0)),
        ("max_new_tokens 1.5", lambda mm: mm.generate(P, 1.5)),
        ("temperature -1", lambda mm: mm.generate(P, 2, temperature=-1)),
        ("temperature NaN", lambda mm: mm.generate(P, 2, temperature=float("nan"))),  # the client's JSON failed on it
        ("temperature inf", lambda mm: mm.generate(P, 2, temperature=float("inf"))),
        ("seed past int64", lambda mm: mm.generate(P, 2, temperature=1.0, seed=2 ** 64)),
        ("an address giving a coordinate twice", lambda mm: mm.run_with_cache(P, ["z.0.head-1.head-2"])),
        ("to_tokens of an int", lambda mm: mm.to_tokens(5)),
        ("top_p when greedy", lambda mm: mm.generate(P, 2, top_p=0.5)),
        ("do_sample", lambda mm: mm.generate(P, 2, do_sample=True)),
        ("eager's unknown sampling option", lambda mm: mm.generate(P, 2, stop=["x"])),
        ("probe of the wrong width", lambda mm: mm.run_with_cache(P, readouts=[Readout("resid_post.0", Project(vec(7)))])),
        ("readouts not Readouts", lambda mm: mm.run_with_cache(P, readouts=["resid_post.0"])),
        ("two readouts with one name", lambda mm: mm.run_with_cache(P, readouts=[Readout("resid_post.0", Mean(), "a"),
                                                                                 Readout("resid_post.1", Mean(), "a")])),
        ("strict steer that touched nothing", lambda mm: mm.generate(P, 3, steer=[
            Steer("lm_head", "add", vec(512), 0)], strict=True)),
        ("lens of a non-residual capture", lambda mm: mm.logit_lens((mm.run_with_cache(P, ["attn_out.0"])[1],
                                                                      "attn_out.0"))),
        ("lens of the wrong width", lambda mm: mm.logit_lens(vec(3, 7))),
        ("to_string of floats", lambda mm: mm.to_string(torch.zeros(3))),
        ("to_string past the vocabulary", lambda mm: mm.to_string([99999])),
        ("stream of a batch", lambda mm: mm.stream(PROMPTS, 2)),
        ("mask with a hole", lambda mm: mm.run_with_cache({"input_ids": torch.tensor([[1, 2, 3]]),
                                                           "attention_mask": torch.tensor([[1, 0, 1]])})),
    ]


BAD = _bad_inputs()


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_the_library_class(m, lib, case):
    name, call = case
    with pytest.raises(Exception) as local:
        call(lib)
    with pytest.raises(Exception) as remote:
        call(m)
    assert library_class(remote.value) is library_class(local.value), \
        f"{name}: {type(remote.value).__name__} ({remote.value}) != {type(local.value).__name__} ({local.value})"


def test_what_the_server_cannot_do_is_refused_by_name(m, url):
    with pytest.raises(OptionError, match="gradients cannot cross HTTP"):
        m.run_with_cache(P, ["resid_post.0"], grad=True)
    with pytest.raises(OptionError, match="stop_at_layer"):
        m.run_with_cache(P, stop_at_layer=1)
    with pytest.raises(OptionError, match="log-probabilities"):
        m.stream(P, 2, logprobs=3)
    with pytest.raises(OptionError, match="sink"):
        m.generate_batch([Request(P, 2)], sink="/dev/shm/x")
    with pytest.raises(ModelNotFoundError, match=r"serves 'meta-llama/Llama-3.2-1B' \(backend 'eager'"):
        connect(url, model="gpt2")
    with pytest.raises(OptionError, match="the server's URL"):
        connect("gpu-box:8000")
    assert "backend 'eager'" in repr(m) and m.served.backend == "eager" and m.served.points["lm_head"]["served"]
    assert m.served.sampling_extras == () and m.served.lens is None


def test_results_land_on_the_named_device(url, lib):
    with connect(url, device="cpu") as mm:
        logits, cache = mm.run_with_cache(P, ["resid_post.0"])
        assert logits.device.type == "cpu" and cache["resid_post.0"].device.type == "cpu"
    with pytest.raises(OptionError, match="unknown device 'nonsense'"):  # refused up front, as load_model does
        connect(url, device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(OptionError, match="needs CUDA"):  # was accepted, then torch's AssertionError per call
            connect(url, device="cuda")


def test_async_api_from_the_callers_loop(m, lib):
    async def main():
        gen, (logits, cache) = await asyncio.gather(m.aio.generate(PROMPTS, 4), m.aio.run_with_cache(P, ["resid_post.0"]))
        steps = [s async for s in m.aio.stream(P, 4)]
        text = await m.aio.to_string([1, 2, 3])
        return gen, logits, cache, steps, text
    gen, logits, cache, steps, text = asyncio.run(main())
    ref = lib.generate(PROMPTS, 4)
    same(gen.new_tokens, ref.new_tokens, "async generate")
    same(logits, lib.run_with_cache(P)[0], "async logits")
    assert [s.token for s in steps] == ref.new_tokens[0].tolist() and text == lib.to_string([1, 2, 3])


def test_receipts_travel_as_the_librarys(m, lib):
    st = [Steer("resid_post.0", "add", vec(D, seed=9) * 1e3, "all"), Steer("resid_post.1", "ablate", positions=-1)]
    got, ref = m.generate(P, 3, steer=st).receipts, lib.generate(P, 3, steer=st).receipts
    same_receipts(got, ref)
    assert all(isinstance(r.change_norm, float) and math.isfinite(r.change_norm) for r in got)
    lm = [Steer("lm_head", "add", vec(512), 0)]  # HF computes only the last prompt token's logits while generating
    same_receipts(m.generate(P, 3, steer=lm).receipts, lib.generate(P, 3, steer=lm).receipts)
    with pytest.raises(StrictSteerError, match=r"steer 0 \('add' at lm_head\) touched no row"):
        m.generate(P, 3, steer=lm, strict=True)


def test_frames_hold_what_base64_holds(url):
    """The same request answered as JSON (base64 tensors) and, with Accept: the frame type, as a frame
    (raw bytes): the same tensors bit for bit; a stream stays server-sent events either way."""
    import httpx

    from engine.serve import encoding, wire
    body = {"model": LLAMA, "prompt": PROMPTS, "return_logits": True, "interp": {"capture": {
        "points": ["resid_post.0", "attn_probs.1"], "readouts": [{"address": "resid_post.1", "kind": "LensTopK", "k": 2}]}}}
    gen = {"model": LLAMA, "prompt": P, "max_tokens": 3, "temperature": 0, "interp": {"capture": ["lm_head"]}}
    with httpx.Client(base_url=url, timeout=300) as c:
        for path, b in ((wire.CAPTURE, body), (wire.COMPLETIONS, gen)):
            plain = c.post(path, json=b)
            framed = c.post(path, json=b, headers={"accept": wire.FRAME_TYPE})
            assert plain.headers["content-type"] == "application/json", plain.text[:200]
            assert framed.headers["content-type"] == wire.FRAME_TYPE and len(framed.content) < len(plain.content)
            a, f = plain.json(), encoding.unframe(framed.content)

            def tensors(x, out, at=""):
                if isinstance(x, dict) and {"dtype", "shape", "data"} <= set(x):
                    out[at] = encoding.decode({k: v for k, v in x.items() if k != "positions"})
                elif isinstance(x, dict):
                    for k, v in x.items():
                        tensors(v, out, f"{at}.{k}")
                elif isinstance(x, list):
                    for i, v in enumerate(x):
                        tensors(v, out, f"{at}[{i}]")
                return out
            ta, tf = tensors(a, {}), tensors(f, {})
            assert ta.keys() == tf.keys() and len(ta) >= (6 if path == wire.CAPTURE else 1), path
            assert all(ta[k].dtype == tf[k].dtype and torch.equal(ta[k], tf[k]) for k in ta), path
        with c.stream("POST", wire.COMPLETIONS, json={**gen, "stream": True}, headers={"accept": wire.FRAME_TYPE}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")


def test_readme_example_runs_as_written(url, monkeypatch, capsys):
    """The `engine.connect` example (docs/serving.md, block serve-connect), pointed at the test server by the
    variable a reader sets (its default, 127.0.0.1:8000, is the README's server command)."""
    from scripts import readme_blocks
    block = readme_blocks.get("serve-connect").code()
    assert 'os.environ.get("INTERP_URL", "http://127.0.0.1:8000")' in block
    monkeypatch.setenv("INTERP_URL", url)
    exec(compile(block, "docs/serving.md", "exec"), {})
    out = capsys.readouterr().out
    assert "backend 'eager'" in out and "layer 99 is out of range" in out
    assert "torch.Size([2, " in out and "Receipt(index=0, address='resid_post.0', op='add', rows=2" in out
