"""The ops a vLLM worker dispatches around each step, outside the forward (engine/core/opcount.py: on a GPU
each is a kernel launch the host pays every step, CUDA graph or not), counted in the worker through the
extension (`interp_ops`), for each step of a call: prefill and decode alike.

vllm-static: one fill of the coefficient rows, one of the guard's marks, one reset of each (the reset of
the coefficients only where rows the forward reads held another step's that this one does not rewrite;
none at all at a decode step carried from the one before: it holds the same rows); one read (a stack of every receipt and
flag buffer and one gather of the steered and steering rows); one stack of the captured taps' rows (and at
a step that keeps only some of them, one gather), per bank of stacked buffers (one bank per per-position
width): 3 to 8 a step with steering and 1 or 2 for capture only, the same for one request steering or
capturing one point as for four requests steering or capturing every layer, for every op the taps express
and every value form (the issue's bounds: 12 and 6). The receipts
and flags are each tap's and layer's own buffers, stacked by the read, because a compiled piece that
writes a slice of a buffer shared with other pieces copies the whole buffer back (engine/backends/vllm/
worker/guard.py): one shared buffer saved the stack but cost far more inside the forward. Hooked `vllm`:
nothing outside its hooks; the hooks' own ops grow with the sites they run at, within the bounds below
(docs/performance.md states them).

On the base of issue 52 (c1870ac0) a vllm-static step filled, reset, flagged and replayed every tap in
turn, and copied each capture key's rows alone: 59 to 95 ops a step for four requests steering every write
tap of the d_model bank here (17 for one steer), 7 for capture of every point, 22 to 39 with two readouts."""
from __future__ import annotations

import tempfile

import pytest

from engine.core.readouts import Mean, Norm, Readout
from engine.core.results import Request
from engine.core.sae_files import write_random_sae
from engine.core.steering import Steer
from test_vllm_common import STATIC_TAPS, random_vector, vllm_model

pytestmark = pytest.mark.vllm
LLAMA = "meta-llama/Llama-3.2-1B"
STATIC = STATIC_TAPS  # two banks: d_model 256 (z's 4 x 64 heads among them, final_norm) and mlp_act's 512
STEERING, CAPTURE = 12, 6
PROMPTS = [f"Prompt number {i} says hello to the world" for i in range(4)]


@pytest.fixture(scope="module")
def engines():
    def get(backend):
        return vllm_model(LLAMA, backend, **({"static_points": STATIC} if backend == "vllm-static" else {}))
    return get


def counted(m, call) -> dict:
    """The worker's op report for `call()` run once warm (sites resolved, graphs captured, forms made)."""
    call()
    m.worker_ops(True)
    call()
    (rank,) = m.worker_ops(False)
    assert rank["steps"] == len(rank["per_step"]) >= 1, rank
    return rank


def steps(m, reqs: list) -> list[int]:
    """Each step's op count for one generate_batch of `reqs` (its prefill step and decode steps)."""
    return counted(m, lambda: m.generate_batch(reqs))["per_step"]


def reqs(m, n: int = 1, points=(), steer=(), readouts=(), new: int = 4) -> list:
    return [Request(PROMPTS[i], new, points=list(points), steer=list(steer), readouts=list(readouts)) for i in range(n)]


def d_model_write_taps(m) -> list[str]:
    """Every write tap of the d_model bank (every layer's resid_post and attn_out; the embeddings, attn_in.1,
    resid_mid.1 and mlp_out.1)."""
    every = [f"{kind}.{i}" for kind in ("resid_post", "attn_out") for i in range(m.n_layers)]
    return every + ["embeddings", "attn_in.1", "resid_mid.1", "mlp_out.1"]


# -- vllm-static ----------------------------------------------------------------------------------
def test_a_static_capture_step_is_one_gather_a_bank(engines):
    m = engines("vllm-static")
    one = steps(m, reqs(m, 1, ["resid_post.0"]))
    every = steps(m, reqs(m, 4, [f"resid_post.{i}" for i in range(m.n_layers)] + ["attn_out", "mlp_out.1", "z.1.head-1"]))
    # per bank one stack of the captured taps' own buffers (a decode step keeps its every row: views of it),
    # and at a prefill step, which keeps some rows only (the logits: final_norm's last row), one gather of
    # those: the same for one point of one request as for every point of four (the d_model bank here)
    assert one[1:] == [1] * (len(one) - 1) and every[-1] == 1 and set(one) == set(every) == {1, 2}, (one, every)
    both = steps(m, reqs(m, 4, ["resid_post", "mlp_act.0"]))
    assert both[-1] == 2 and set(both) <= {2, 3, 4}, both  # and the same for mlp_act's bank
    assert max(both) <= CAPTURE


def test_a_static_steering_step_is_one_fill_one_read_one_reset(engines):
    m = engines("vllm-static")
    d = m.d_model
    one = steps(m, reqs(m, 1, steer=[Steer("resid_post.0", "add", random_vector((d,), 1))]))
    every = steps(m, reqs(m, 4, ["resid_post"], [Steer(a, "add", random_vector((d,), i)) for i, a in
                                                 enumerate(d_model_write_taps(m))]))
    # a step that writes: a fill, a clear and a mark, and a reset only of rows it reads that the bank held and
    # it does not rewrite (none here: the warm-up call left the same rows; the first decode step writes each
    # request's row that the prefill held, and leaves the rows past it for a step that reads them); then the
    # read's stack and gather and the captures' stack (and at a prefill step, which keeps the logits' rows only,
    # their gather); a decode step carried from the one before holds its rows: the read and the captures alone
    # (3). The same for one steer of one request as for four requests steering every write tap of the bank.
    # Before the first decode step took its rows from the prefill's (stepio.Fill.first_decode): [8, 7, 3, 3]
    assert one == [7, 6, 3, 3] and every.count(3) >= 1 and set(every) <= {3, 6, 7, 8}, (one, every)
    banks = steps(m, reqs(m, 4, ["resid_post", "mlp_act.0"], [
        Steer("resid_post.1", "add", random_vector((d,), 1)), Steer("z.1.head-1", "scale", 2.0),
        Steer("mlp_act.0", "add", random_vector((512,), 2))]))
    # a fill (and a reset where it is due) and a capture stack more for mlp_act's bank (a carried step: its
    # capture stack alone)
    assert 4 in banks and set(banks) <= {4, 8, 9, 10, 11} and max(banks) <= STEERING, banks


def test_a_static_prefill_step_is_the_same_constant(engines):
    """run_with_cache is one prefill step of every prompt."""
    m = engines("vllm-static")
    d = m.d_model
    steer = [Steer(a, "add", random_vector((d,), i)) for i, a in enumerate(d_model_write_taps(m))]
    one = counted(m, lambda: m.run_with_cache(PROMPTS[0], ["resid_post.1"], steer=steer[:1]))["per_step"]
    every = counted(m, lambda: m.run_with_cache(PROMPTS, ["resid_post", "attn_out"], steer=steer))["per_step"]
    # a fill (and a reset where rows it reads held others': none after the warm-up call of the same prompt), the
    # read's stack and gather, the captures' stack (and gather) and, where the marks are not already the step's
    # rows (the warm-up call's), a clear and a mark: the scheduler may take the four prompts in two steps
    assert set(one) | set(every) <= {4, 5, 6, 7, 8} and max(every) <= STEERING, (one, every)


def _every_op(m) -> list[list[Steer]]:
    d, n = m.d_model, 48
    v, pos_v = random_vector((d,), 3), random_vector((n, d), 4, 1.0)
    sae = str(write_random_sae(tempfile.mkdtemp(prefix="ops-sae-"), "standard", d, 16, seed=0))
    return [[Steer("resid_post.1", "add", v)], [Steer("resid_post.1", "set", v, "last")],
            [Steer("resid_post.1", "scale", 0.5, "generated")], [Steer("resid_post.1", "ablate", positions=slice(2, 5))],
            [Steer("resid_post.1", "mean_ablate", v, positions=[1, 3])], [Steer("resid_post.1", "project_out", v)],
            [Steer("resid_post.1", "rescale", v, coeff=0.0)], [Steer("resid_post.1", "swap", pos_v)],
            [Steer("resid_post.1", "add", pos_v, positions=(0, n), exclude=[0])],
            [Steer("resid_post.1", "scale", pos_v.abs())], [Steer("z.1.head-2", "set", random_vector((64,), 5))],
            [Steer("resid_post.1", "feature_add", sae=sae, feature=[1, 3], coeff=2.0)]]


def test_every_op_and_value_form_the_taps_express_costs_the_same(engines):
    m = engines("vllm-static")
    counts = {f"{s[0].op} {s[0].address} {s[0].positions}": steps(m, reqs(m, 2, ["resid_post.1"], s)) for s in _every_op(m)}
    seen = {c for per in counts.values() for c in per}
    # 3: a carried decode step (its rows held); 4 to 6: a decode step that writes its rows without a reset, or
    # a decode or prefill step where the steer touches no row (no fill); 7 and 8: a prefill step that writes,
    # without and with a reset of rows it does not rewrite
    assert max(seen) == 8 and seen <= {3, 4, 5, 6, 7, 8}, counts


def test_readouts_cost_their_own_ops_not_the_requests(engines):
    """A readout group runs its kind once over every row of every request reading it (engine.core.site.readout):
    the same ops for one request as for four."""
    m = engines("vllm-static")
    ro = [Readout("resid_post.1", Mean()), Readout("resid_post.0", Norm())]
    st = [Steer("resid_post.0", "add", random_vector((m.d_model,), 6))]
    one = steps(m, reqs(m, 1, steer=st, readouts=ro))
    four = steps(m, reqs(m, 4, steer=st, readouts=ro))
    # decode steps alike; a step where one request prefills while others decode computes the per-position
    # readout's rows at once rather than deferring them (engine.core.site.readout): one op more
    assert min(one) == min(four) and max(one) <= max(four) <= max(one) + 1 <= STEERING, (one, four)


def test_a_worker_counts_nothing_unless_asked(engines):
    m = engines("vllm-static")
    (rank,) = m.worker_ops(False)
    assert rank == {"steps": 0, "per_step": [], "labels": {}, "ops": {}, "sites": {}}


# -- hooked vllm ----------------------------------------------------------------------------------
HOOK_STEER, HOOK_LAYER, HOOK_CAPTURE = 6, 6, 2  # bounds per step: a steered site, a guarded layer, a captured point


def test_the_hooked_backend_dispatches_nothing_outside_its_hooks(engines):
    """Its per-step work outside HF modules' own hooks is nothing at all (the row map is host work); the
    hooks run the shared routine at each site (engine.core.site.run_site) and the layer guard at each
    decoder layer from the first steered one, within fixed ops per site."""
    m = engines("vllm")
    d, layers = m.d_model, m.n_layers
    one = counted(m, lambda: m.generate_batch(reqs(m, 1, steer=[Steer("resid_post.1", "add", random_vector((d,), 1))])))
    every = counted(m, lambda: m.generate_batch(reqs(m, 4, ["resid_post", "attn_out"], [
        Steer(f"resid_post.{i}", "add", random_vector((d,), i)) for i in range(layers)])))
    for rank in (one, every):
        assert rank["labels"].get("step", 0) == 0 and set(rank["per_step"]) == {0}, rank
    per_step = every["labels"]["hooks"] / every["steps"]
    assert per_step <= HOOK_STEER * layers + HOOK_LAYER * layers + HOOK_CAPTURE * (2 * layers + 1), every["ops"]
    assert one["labels"]["hooks"] / one["steps"] <= HOOK_STEER + HOOK_LAYER + HOOK_CAPTURE, one["ops"]


def test_a_call_is_timed_in_its_steps_and_in_its_registration_and_collect(engines):
    """The worker's timer (benchmarks/step_cost.py) keeps a call's own host work apart from its steps': the
    scheduler hook runs at every step, collect once per batch of finished requests; the timer stopped, nothing
    more is timed."""
    m = engines("vllm-static")
    st = [Steer(f"resid_post.{i}", "add", random_vector((m.d_model,), i)) for i in range(m.n_layers)]
    m.generate_batch(reqs(m, 2, steer=st))  # warm
    m.worker_timing(True)
    m.generate_batch(reqs(m, 2, steer=st))
    (rank,) = m.worker_timing(False)
    assert set(rank["seconds"]) == {"register", "step", "collect"} and min(rank["seconds"].values()) > 0, rank
    assert rank["steps"] >= 4, rank  # 4 new tokens: a prefill step and three decode steps at least
    m.generate_batch(reqs(m, 2, steer=st))
    (rank,) = m.worker_timing(False)
    assert rank == {"steps": 0, "seconds": {}}, rank
