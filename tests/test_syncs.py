"""Host reads of device values on the hot path (engine/core/syncs.py): the engine's own count per eager call
stays a small constant (at most 16, input checks and result assembly included) that does not grow with the
batch, the number of layers captured or steered, or the number of steers or readouts; every steering op,
every readout kind and generation are covered. The vLLM worker's count per step is in test_vllm_syncs.py.
On CPU these reads cost nothing, so they are counted by what they would cost on a GPU (a TorchFunctionMode);
tests marked gpu check the real ones with torch.cuda.set_sync_debug_mode."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import load_model
from engine.core.readouts import Last, LensTopK, Max, Mean, Norm, Project, Readout, SAEFeatures
from engine.core.sae_files import write_random_sae
from engine.core.steering import OPS, Steer
from engine.core.syncs import SyncCounter

LLAMA = "meta-llama/Llama-3.2-1B"
BUDGET = 16


@pytest.fixture(scope="module")
def m():
    return load_model(LLAMA, source="zoo")


@pytest.fixture(scope="module")
def sae(m, tmp_path_factory):
    return str(write_random_sae(tmp_path_factory.mktemp("sae") / "s", "standard", m.d_model, 64, seed=1))


def _ids(b: int, n: int = 12) -> dict:
    ids = torch.randint(3, 200, (b, n), generator=torch.Generator().manual_seed(b))
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1:, :3] = 0  # padded rows (left)
    return {"input_ids": ids, "attention_mask": mask}


def _count(fn) -> SyncCounter:
    fn()  # warm: SAEs loaded, sites resolved once per model
    with SyncCounter() as c:
        fn()
    return c


def _steer(m, op: str, layer: int, sae: str, seed: int = 0) -> Steer:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(m.d_model, generator=g)
    kind = OPS[op].value
    kw: dict = {}
    if "coeff" in OPS[op].params:
        kw["coeff"] = 0.5
    if "bounds" in OPS[op].params:
        kw["bounds"] = (-1.0, 1.0)
    if "sae" in OPS[op].params:
        kw.update(sae=sae, feature=3)
    value = {"none": None, "vector": v, "scale": 1.5, "direction": v,
             "activation": torch.randn(12, m.d_model, generator=g)}[kind]
    return Steer(f"resid_post.{layer}", op, value, **kw)


def test_the_counter_counts_the_engines_reads_and_not_the_callers():
    t = torch.ones(3)
    with SyncCounter() as c:
        float(t.sum()), t.tolist(), bool(t.any())  # from a test file: not the engine's
    assert c.count == 0
    from engine.core import ledger
    led = ledger.Ledger()
    import numpy as np
    led.record(np.array([led.code(1)]), np.array([0]), np.array([0]), torch.ones(1))
    with SyncCounter() as c:
        led.read()
    assert c.count == 1 and list(c.sites) == [next(iter(c.sites))] and "ledger.py" in next(iter(c.sites))


@pytest.mark.parametrize("op", list(OPS))
def test_each_steering_op_reads_back_a_constant(m, sae, op):
    counts = {}
    for b, layers in ((2, 1), (6, 1), (6, m.n_layers)):
        steers = [_steer(m, op, L, sae) for L in range(layers)]
        enc = _ids(b)
        counts[b, layers] = _count(lambda: m.run_with_cache(enc, ["resid_post.0"], steer=steers)).count
    assert len(set(counts.values())) == 1 and counts[2, 1] <= BUDGET, counts


@pytest.mark.parametrize("kind", ["mean", "max", "last", "norm", "project", "lens", "sae"])
def test_each_readout_kind_reads_back_a_constant(m, sae, kind):
    def readouts(n):
        make = {"mean": Mean, "max": Max, "last": Last, "norm": Norm,
                "project": lambda: Project(torch.randn(3, m.d_model, generator=torch.Generator().manual_seed(2))),
                "lens": lambda: LensTopK(4), "sae": lambda: SAEFeatures(sae, k=4)}[kind]
        return [Readout(f"resid_post.{L}", make()) for L in range(n)]
    counts = {}
    for b, n in ((2, 1), (6, 1), (6, m.n_layers)):
        enc, reads = _ids(b), readouts(n)  # made (and checked) before the call, as a user makes them
        counts[b, n] = _count(lambda: m.run_with_cache(enc, readouts=reads)).count
    assert len(set(counts.values())) == 1 and counts[2, 1] <= BUDGET, counts


def test_capture_reads_back_a_constant(m):
    every = [f"resid_post.{L}" for L in range(m.n_layers)]
    counts = {(b, n): _count(lambda: m.run_with_cache(_ids(b), every[:n])).count for b, n in ((2, 1), (8, len(every)))}
    assert len(set(counts.values())) == 1 and counts[2, 1] <= BUDGET, counts
    everything = m.expand(m.points())  # every point at every layer, attention patterns included
    counts = {b: _count(lambda: m.run_with_cache(_ids(b), everything)).count for b in (2, 6)}
    # a pattern's keys are aligned per row after the forward: by host-made indices, not a boolean mask
    # (which cost one read per row, layer and pattern until 2026-12-05)
    assert counts[2] == counts[6] <= BUDGET, counts


def _engine_code(src: str) -> SyncCounter:
    """Run src as if from a file of engine/ (the counter counts only the engine's own calls)."""
    import engine
    code = compile(src, str(Path(engine.__file__).parent / "probe_of_the_test.py"), "exec")
    t, mask = torch.arange(6.0), torch.tensor([True, False, True, False, True, False])
    with SyncCounter() as c:
        exec(code, {"torch": torch, "t": t, "mask": mask})
    return c


@pytest.mark.parametrize("src", [
    "t[mask]", "t[mask] = 0.0", "t[:, None][mask]", "t.masked_select(mask)", "torch.where(mask)",
    "torch.argwhere(mask)", "t.unique()", "torch.unique_consecutive(t)", "t.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]))",
    "t.nonzero()", "t.sum().item()", "float(t[0])", "t.tolist()", "t.to('cpu')"])
def test_calls_sized_by_a_device_value_count_as_reads(src):
    """CUDA reads a count back before it can allocate these outputs (set_sync_debug_mode reports them)."""
    c = _engine_code(src)
    assert c.count == 1 and next(iter(c.sites)).startswith("engine/probe_of_the_test.py:"), (src, c.sites)


@pytest.mark.parametrize("src", [
    "t[torch.tensor([0, 2])]", "t[torch.tensor([0, 2])] = 1.0", "t.index_select(0, torch.tensor([0, 2]))",
    "t.masked_fill(mask, 0)", "torch.where(mask, t, 0)", "t[2:4]", "t.repeat_interleave(2)",
    "t.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]), output_size=6)"])
def test_calls_sized_by_the_host_do_not(src):
    assert _engine_code(src).count == 0, src


def test_generation_reads_back_a_constant_however_many_tokens(m):
    """The engine's reads in a generation do not grow with its steps, rows or steers (HF's own loop syncs
    once per step to test its stopping criteria: not counted, not the engine's)."""
    counts = {}
    for b, new, layers in ((2, 3, 1), (4, 9, m.n_layers)):
        steers = [Steer(f"resid_post.{L}", "add", torch.randn(m.d_model), positions="all") for L in range(layers)]
        enc = _ids(b)
        counts[b, new, layers] = _count(lambda: m.generate(enc, new, points=["resid_post.0"], steer=steers,
                                                           readouts=[Readout("resid_post.0", Mean())])).count
    assert len(set(counts.values())) == 1 and counts[2, 3, 1] <= BUDGET, counts


def test_a_failed_steer_is_read_once_and_named(m):
    """The guard is folded into the same single read: an overflowing steer still fails its call, naming it."""
    from engine.core.steering import NonFiniteSteer
    st = Steer("resid_post.0", "scale", 3e38)
    with SyncCounter() as c, pytest.raises(NonFiniteSteer, match=r"'scale' at resid_post\.0 produced inf or NaN"):
        m.run_with_cache(_ids(2), steer=[st])
    assert c.count <= BUDGET


def _cuda_syncs(fn) -> list[str]:
    """The sync warnings torch's own detector raises during one call of fn (warm it first): where, and what."""
    import warnings
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if "synchroniz" in str(w.message).lower()]


@pytest.mark.gpu
def test_no_device_sync_inside_an_eager_call_on_cuda():
    """On CUDA, torch's own sync detector: a capture and a steered forward at every layer raise no sync
    warning between the call's input copy and its one ledger read."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = load_model(LLAMA, source="zoo", device="cuda")
    enc = {k: v.cuda() for k, v in _ids(4).items()}
    steers = [Steer(f"resid_post.{L}", "add", torch.randn(m.d_model, device="cuda")) for L in range(m.n_layers)]
    m.run_with_cache(enc, ["resid_post.0"], steer=steers)
    syncs = _cuda_syncs(lambda: m.run_with_cache(enc, [f"resid_post.{L}" for L in range(m.n_layers)], steer=steers))
    assert len(syncs) <= BUDGET, syncs


@pytest.mark.gpu
def test_cuda_syncs_do_not_grow_with_the_batch_for_patterns_and_generation():
    """Every point (attention patterns too) and a steered generation: the same syncs at batch 2 and 6, the
    model library's own included (HF reads its stopping criteria once per step). A pattern's keys were
    aligned by a boolean mask, one sync per row, layer and pattern, until 2026-12-05."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = load_model(LLAMA, source="zoo", device="cuda")
    everything = m.expand(m.points())
    steers = [Steer(f"resid_post.{L}", "add", torch.randn(m.d_model, device="cuda"), positions="all")
              for L in range(m.n_layers)]
    for call in (lambda enc: m.run_with_cache(enc, everything),
                 lambda enc: m.generate(enc, 4, points=["resid_post.0"], steer=steers)):
        counts = {}
        for b in (2, 6):
            enc = {k: v.cuda() for k, v in _ids(b).items()}
            call(enc)  # warm
            counts[b] = _cuda_syncs(lambda: call(enc))
        assert len(counts[2]) == len(counts[6]), counts


def test_the_cache_moves_to_the_host_whole(m):
    """Captures stay on the model's device; ActivationCache.cpu() moves every capture and readout in one
    go (one wait at the end), keeping receipts, columns and which readouts are per position."""
    st = Steer("resid_post.0", "add", torch.ones(m.d_model))
    _, cache = m.run_with_cache(_ids(2), ["resid_post.0", "attn_probs.0"], steer=[st],
                                readouts=[Readout("resid_post.0", Mean()), Readout("resid_post.1", LensTopK(2))])
    host = cache.cpu()
    assert set(host) == set(cache) and all(torch.equal(host[k], cache[k]) for k in cache)
    assert all(t.device.type == "cpu" for t in host.values())
    assert host.receipts == cache.receipts and host.positional == cache.positional
    assert [c.tolist() for c in host.columns] == [c.tolist() for c in cache.columns]
    assert torch.equal(host.readouts["resid_post.0:mean"], cache.readouts["resid_post.0:mean"])
    assert torch.equal(host.readouts["resid_post.1:lens_top2"].indices, cache.readouts["resid_post.1:lens_top2"].indices)
    assert torch.equal(host.entry("resid_post.0").rows[1], cache.entry("resid_post.0").rows[1])


@pytest.mark.gpu
def test_captures_stay_on_cuda_until_asked():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = load_model(LLAMA, source="zoo", device="cuda")
    _, cache = m.run_with_cache("Hello there", ["resid_post.0"], readouts=[Readout("resid_post.0", Mean())])
    assert cache["resid_post.0"].device.type == "cuda" and cache.readouts["resid_post.0:mean"].device.type == "cuda"
    host = cache.cpu()
    assert host["resid_post.0"].device.type == "cpu" and torch.equal(host["resid_post.0"], cache["resid_post.0"].cpu())
