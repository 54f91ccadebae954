"""Intervention receipts (engine.core.results.Receipt): per steer, the rows it touched and the norm of its
change, checked against an independent computation (the steered capture minus an unsteered forward
over the same tokens), and strict=True failing a steer that touched no row. Here: the shared
routine (plan.steer_span / run_site, preemption and recomputation counted once) and the eager
backend, library and stream; vLLM and vllm-static in test_vllm_interventions.py, the servers in
test_serve_eager.py and test_serve.py."""
from __future__ import annotations

import math

import pytest
import torch

from engine.core.ledger import Ledger
from engine.core.plan import Plan, Span, site_work
from engine.core.results import Receipt, StrictSteerError, check_strict, combine
from engine.core.site import run_site
from engine.core.steering import Steer
from engine.core.step import Step
from test_vllm_common import PROMPT, eager_model, random_vector

LLAMA = "meta-llama/Llama-3.2-1B"


def independent(model, steered, tokens: torch.Tensor, key: str) -> tuple[int, float]:
    """(rows, norm) of a steer's change at `key`, from outside the engine's tally: the steered run's
    capture there minus an unsteered forward over the same tokens (the steer is the only write at or
    before `key`, so every row before it is what the unsteered forward computes)."""
    _, ref = model.run_with_cache(tokens, [key])
    d = (steered.float() - ref[key].float()).reshape(tokens.shape[0], tokens.shape[1], -1)
    changed = d.norm(dim=-1) > 1e-4 * max(1.0, float(ref[key].abs().max()))
    return int(changed.sum()), float(d.norm())


def steered_cases(m, n_prompt: int) -> dict:
    """One steer per case, each at a point the unsteered forward reads at the same place; every op
    family and position form (vllm-static declares resid_post, mlp_out.1 and z.1)."""
    d = m.d_model
    hd = getattr(m.config, "head_dim", None) or d // m.config.num_attention_heads
    return {
        "add_last": Steer("resid_post.0", "add", random_vector((d,), 1), positions="last"),
        "scale_list": Steer("mlp_out.1", "scale", 3.0, positions=[1, 2, -1]),
        "set_head_range": Steer("z.1.head-2", "set", random_vector((n_prompt, hd), 3), positions=(0, 3)),
        "add_exclude": Steer("resid_post.1", "add", random_vector((d,), 4), exclude=[0, 3]),
        "project_out": Steer("resid_post.1", "project_out", random_vector((d,), 5)),
    }


CASES = ["add_last", "scale_list", "set_head_range", "add_exclude", "project_out"]


def check_receipt(model, res_cache, tokens, st, receipt: Receipt, rel: float = 1e-4) -> None:
    rows, norm = independent(model, res_cache[str(st.address.base)], tokens, str(st.address.base))
    assert receipt.rows == rows > 0, (receipt, rows)
    assert receipt.change_norm == pytest.approx(norm, rel=rel, abs=1e-5), (receipt, norm)
    assert (receipt.index, receipt.op) == (0, st.op) and receipt.address == str(st.address)


# -- the shared routine ---------------------------------------------------------------------------
def test_each_steer_is_measured_from_what_it_received_and_recomputed_rows_count_once():
    add = Steer("resid_post.0", "add", torch.tensor([3.0, 4.0]), positions=[0, 2])
    scale = Steer("resid_post.0", "scale", 2.0, positions=[2, 3])
    plan, other = Plan(4, [], [add, scale]), Plan(4, [], [Steer("resid_post.0", "ablate", positions=9)])
    work = site_work([plan, other], lambda a: "s")["s"]
    t = torch.ones(8, 2)
    ledger = Ledger(unique=False)  # the vLLM worker's: a recomputed position counts once

    def receipts(p):
        return p.receipts(ledger.read([p.key])[p.key])
    out = run_site(t, Step([Span(plan, 0, 4, 0), Span(other, 4, 8, 0)], 8, ledger=ledger), work)
    assert torch.equal(out[:4], torch.tensor([[4.0, 5], [1, 1], [8, 10], [2, 2]]))
    a, s = receipts(plan)
    assert (a.rows, a.change_norm) == (2, pytest.approx(math.sqrt(2) * 5))  # |(3, 4)| at rows 0 and 2
    # scale sees row 2 after the add: (4, 5) -> (8, 10), and row 3 (1, 1) -> (2, 2)
    assert (s.rows, s.change_norm) == (2, pytest.approx(math.sqrt(16 + 25 + 1 + 1)))
    assert receipts(other) == [Receipt(0, "resid_post.0", "ablate", 0, 0.0)]
    # the scheduler recomputes positions 2..3 (preemption): each position counts once, as last computed
    run_site(torch.full((2, 2), 10.0), Step([Span(plan, 0, 2, 2)], 2, ledger=ledger), work)
    a, s = receipts(plan)
    assert (a.rows, a.change_norm) == (2, pytest.approx(math.sqrt(2) * 5))
    # position 2: (10, 10) + (3, 4) = (13, 14), doubled; position 3: (10, 10) doubled
    assert (s.rows, s.change_norm) == (2, pytest.approx(math.sqrt(13 ** 2 + 14 ** 2 + 2 * 10 ** 2)))


def test_a_worker_ledger_collects_each_request_alone_and_forgets_it():
    """The vLLM worker's ledger holds every registered request's rows, each step's records mixing them:
    collecting one (read, then drop) returns exactly its own tallies, leaves the others' intact, and
    the ledger is empty once all are collected (a dropped request's rows stay in mixed entries until
    every request of the entry is dropped: no read may count them)."""
    import numpy as np
    led = Ledger(unique=False)
    keys = ["a", "b", "c"]
    codes = np.array([led.code(k) for k in keys])
    norms = torch.rand(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for step in range(5):
        led.record(codes, np.zeros(3, dtype=np.int64), np.full(3, step), norms[step])
    # "a" recomputes position 4 (a preempted request): its last record counts
    led.record(codes[:1], np.zeros(1, dtype=np.int64), np.array([4]), torch.tensor([9.0], dtype=torch.float64))
    sq = (norms ** 2).sum(0).tolist()
    want = {"a": [sq[0] - norms[4, 0].item() ** 2 + 81.0, 5], "b": [sq[1], 5], "c": [sq[2], 5]}
    left = set(keys)
    for k in ("b", "a", "c"):
        o = led.read([k])[k]
        assert o.rows == {0: want[k][1]} and o.sumsq[0] == pytest.approx(want[k][0]) and o.failed is None
        led.drop([k])
        left.discard(k)
        assert set(led.read()) == left
        for other in left:
            assert led.read([other])[other].sumsq[0] == pytest.approx(want[other][0])
    assert not led


@pytest.mark.parametrize("huge", [False, True])
def test_one_key_is_equal_exactly_where_every_column_is(huge):
    """The ledger's dedupe key (a recomputed position counts once): the same key for the same (plan,
    steer, position) and a different one otherwise, by the spans of the columns' values, or by their ranks
    where the spans' product would overflow int64 (plan codes are never reused, so they may be far apart)."""
    import numpy as np

    from engine.core.ledger import _one_key
    rng = np.random.default_rng(0)
    cols = [rng.integers(0, 5, 400), rng.integers(-1, 4, 400), rng.integers(0, 30, 400)]
    if huge:
        cols[0] = cols[0] * (1 << 40)  # spans 4 * 2^40 * 5 * 30: past 2^62
    key = _one_key(*cols)
    rows = list(zip(*(c.tolist() for c in cols)))
    for i in range(0, 400, 7):
        for j in range(400):
            assert (key[i] == key[j]) == (rows[i] == rows[j]), (i, j)
    assert len(_one_key(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))) == 0


def _static_and_hooked(steers, plans: int = 1):
    """The same steers through vllm-static's taps (one tap at resid_post.0 on an identity module) and
    through the hooked backends' routine (run_site) on the same rows; returns both plans' receipts per
    plan (each plan 5 rows at positions 0..4, after 2 rows of no plan)."""
    from engine.backends.vllm.worker.static import StaticTaps
    from engine.backends.vllm.worker.tree import VSite
    from engine.core.address import Address
    site = VSite(torch.nn.Identity(), "post", "out", lambda o: o, lambda o, n: n)
    taps = StaticTaps()
    taps.install([(Address("resid_post", 0), True)], lambda a: site, 8, 32, torch.device("cpu"), torch.float32, {},
                 site.module)
    static, hooked = [Plan(5, [], steers) for _ in range(plans)], [Plan(5, [], steers) for _ in range(plans)]
    n = 2 + 5 * plans
    x = torch.randn(n, 8)
    step = Step([Span(p, 2 + 5 * i, 7 + 5 * i, 0) for i, p in enumerate(static)], n)
    work = site_work(static, lambda a: str(a))
    taps.attach(work)
    taps.before(step, work)
    got = site.module(x)
    taps.after(step, work)
    other = Step([Span(p, 2 + 5 * i, 7 + 5 * i, 0) for i, p in enumerate(hooked)], n)
    want = run_site(x, other, site_work(hooked, lambda a: "s")["s"])
    torch.testing.assert_close(got, want)
    a = [p.receipts(step.ledger.read()[p.key]) for p in static]
    b = [p.receipts(other.ledger.read()[p.key]) for p in hooked]
    return a, b


def test_static_taps_tally_in_the_graph():
    """vllm-static applies each tap's steers as one affine map inside the graph, and the graph leaves each
    row's change norm in the tally; one gather after the step records them: the same receipts as the
    hooked path (run_site) on the same rows, up to the rounding of the graph's affine arithmetic
    (the norm of y - x there, of the op's own result on the hooked path)."""
    v = torch.randn(8)
    for steers in ([Steer("resid_post.0", "add", v, [1, 3])], [Steer("resid_post.0", "project_out", v)],
                   [Steer("resid_post.0", "scale", 3.0, [3, 4])], [Steer("resid_post.0", "set", v)]):
        (a,), (b,) = _static_and_hooked(steers)
        assert [r.rows for r in a] == [r.rows for r in b] and a[0].rows > 0
        assert a[0].change_norm == pytest.approx(b[0].change_norm, rel=1e-6) and a[0].change_norm > 0
    a, b = _static_and_hooked([Steer("resid_post.0", "add", v, [1, 3])], plans=3)  # three requests, one gather
    assert [[(r.rows, pytest.approx(r.change_norm)) for r in x] for x in a] == \
        [[(r.rows, r.change_norm) for r in x] for x in b]


def test_static_taps_replay_composed_steers_from_the_pre_write_buffer():
    """Several steers of one request at one tap: the graph applies their composition, and each steer's
    own receipt is replayed on the tap's pre-write rows through the shared routine, each measured from
    what it received."""
    steers = [Steer("resid_post.0", "project_out", torch.randn(8)),
              Steer("resid_post.0", "add", torch.ones(8), [1, 3]), Steer("resid_post.0", "scale", 3.0, [3, 4])]
    (a,), (b,) = _static_and_hooked(steers)
    assert [r.rows for r in a] == [r.rows for r in b] == [5, 2, 2]
    for r, s in zip(a, b):
        assert r.change_norm == pytest.approx(s.change_norm, rel=1e-6) and r.change_norm > 0


def test_combine_strict_and_json():
    seqs = [[Receipt(0, "resid_post.1", "add", 3, 3.0), Receipt(1, "lm_head", "add", 0, 0.0)],
            [Receipt(0, "resid_post.1", "add", 1, 4.0), Receipt(1, "lm_head", "add", 0, 0.0)]]
    call = combine(seqs)
    assert call == [Receipt(0, "resid_post.1", "add", 4, 5.0), Receipt(1, "lm_head", "add", 0, 0.0)]
    with pytest.raises(StrictSteerError, match=r"steer 1 \('add' at lm_head\) touched no row of this call") as e:
        check_strict(call)
    assert e.value.receipt is call[1] and isinstance(e.value, ValueError)
    check_strict(call[:1])
    assert Receipt(2, "z.1.head-0", "set", 1, float("inf")).as_json() == {
        "index": 2, "address": "z.1.head-0", "op": "set", "rows": 1, "change_norm": None}


# -- eager ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def em():
    return eager_model(LLAMA)


@pytest.mark.parametrize("case", CASES)
def test_eager_generate_receipts_match_an_independent_computation(em, case):
    n = len(em.to_tokens(PROMPT)["input_ids"][0])
    st = steered_cases(em, n)[case]
    g = em.generate(PROMPT, 4, points=[str(st.address.base)], steer=[st])
    fed = g.tokens[:, :-1]  # the prompt, then every new token but the last: what the forwards ran on
    (r,) = g.receipts
    assert g.requests[0].receipts == g.receipts
    check_receipt(em, g.cache, fed, st, r)
    _, cache = em.run_with_cache(PROMPT, [str(st.address.base)], [st])  # a forward: its own receipts
    (r,) = cache.receipts
    check_receipt(em, cache, em.to_tokens(PROMPT)["input_ids"], st, r)


def test_eager_batch_receipts_per_sequence_and_for_the_call(em):
    prompts = [PROMPT, "Hello world"]
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, [1, 4]] = True  # the second sequence selects nothing: per-row patching, allowed
    st = Steer("resid_post.0", "add", random_vector((em.d_model,), 7), positions=mask)
    g = em.generate(prompts, 3, points=["resid_post.0"], steer=[st], strict=True)  # the call touched rows
    assert [r.receipts[0].rows for r in g.requests] == [2, 0]
    assert g.receipts[0].rows == 2
    assert g.receipts[0].change_norm == pytest.approx(math.sqrt(2) * float(st.value.norm()), rel=1e-5)
    assert g.requests[1].receipts[0].change_norm == 0.0


def test_eager_strict_fails_a_steer_that_touched_nothing(em):
    """While generating, HF computes the logits of the last prompt token only: a steer of lm_head at
    position 0 passes the position check (position 0 runs) but touches no row."""
    v = random_vector((em.config.vocab_size,), 8)
    steers = [Steer("resid_post.0", "scale", 2.0), Steer("lm_head", "add", v, positions=0)]
    g = em.generate(PROMPT, 3, steer=steers)
    assert [(r.address, r.rows) for r in g.receipts] == [("resid_post.0", len(g.tokens[0]) - 1), ("lm_head", 0)]
    with pytest.raises(StrictSteerError, match=r"steer 1 \('add' at lm_head\) touched no row of this generation"):
        em.generate(PROMPT, 3, steer=steers, strict=True)
    with em.steering(steers[1]):  # a steering() block's steers come first
        with pytest.raises(StrictSteerError, match=r"steer 0 \('add' at lm_head\)"):
            em.generate(PROMPT, 3, steer=steers[:1], strict=True)
    _, cache = em.run_with_cache(PROMPT, (), steers, strict=True)  # a forward computes every logit
    assert [r.rows for r in cache.receipts] == [len(em.to_tokens(PROMPT)["input_ids"][0]), 1]


def test_eager_stream_result_carries_the_receipts(em):
    st = [Steer("resid_post.1", "add", random_vector((em.d_model,), 9), positions="last"),
          Steer("lm_head", "add", random_vector((em.config.vocab_size,), 10), positions=0)]
    steps = list(em.stream(PROMPT, 4, steer=st))
    ref = em.generate(PROMPT, 4, steer=st)
    assert steps[-1].result.receipts == ref.requests[0].receipts and ref.receipts[1].rows == 0
    got = []
    with pytest.raises(StrictSteerError, match=r"steer 1 \('add' at lm_head\)"):
        for step in em.stream(PROMPT, 4, steer=st, strict=True):
            got.append(step.token)
    assert got == ref.new_tokens[0, :-1].tolist()  # every step but the last, which would carry the result


@pytest.mark.parametrize("spelled", [[0, -6], [5, -1], [-1, 0, 5]])
def test_a_token_named_twice_is_steered_and_counted_once(em, spelled):
    """A positions list may name one token twice, as a position and counting back from the end of the prompt;
    the token is steered once, so its receipt counts it once (it counted it twice before)."""
    tokens = em.to_tokens("The capital of France is")["input_ids"]
    assert tokens.shape[1] == 6
    st = Steer("resid_post.0", "add", random_vector((em.d_model,), 10), positions=spelled)
    _, cache = em.run_with_cache(tokens, ["resid_post.0"], [st])
    (r,) = cache.receipts
    check_receipt(em, cache, tokens, st, r)
    assert r.rows == len({p % 6 for p in spelled})
    g = em.generate(tokens, 3, steer=[st])
    assert g.receipts[0].rows == r.rows and g.receipts[0].change_norm == pytest.approx(r.change_norm, rel=1e-5)


def test_positions_offsets_are_ascending_and_once_each():
    from engine.core.positions import normalize, offsets
    assert offsets(normalize([-1, 0, 5, 2]), 0, 6, 6).tolist() == [0, 2, 5]
    assert offsets(normalize([-1, 0]), 3, 3, 6).tolist() == [2]  # positions 3..5 of the call: 5 alone


def test_a_registered_steer_keeps_its_form_while_other_requests_come_and_go():
    """vllm-static makes each registered steer's affine form once (StaticTaps.attach, at every rebuild of
    the sites): a request registering or collected beside it does not make it again (at eight streams each
    registration used to make the seven others' forms again); a steer no longer registered is forgotten."""
    from engine.backends.vllm.worker.static import StaticTaps
    from engine.backends.vllm.worker.tree import VSite
    from engine.core.address import Address
    site = VSite(torch.nn.Identity(), "post", "out", lambda o: o, lambda o, n: n)
    taps = StaticTaps()
    taps.install([(Address("resid_post", 0), True)], lambda a: site, 8, 32, torch.device("cpu"), torch.float32, {},
                 site.module)
    a = Plan(5, [], [Steer("resid_post.0", "add", torch.arange(8.0))])
    b = Plan(5, [], [Steer("resid_post.0", "scale", 2.0)])
    taps.attach(site_work([a], lambda x: str(x)))
    form_a = taps.forms[id(a.steers[0])]
    taps.attach(site_work([a, b], lambda x: str(x)))  # b registers
    assert taps.forms[id(a.steers[0])] is form_a and taps.forms[id(b.steers[0])][0] is b.steers[0]
    assert form_a[1].b[0].tolist() == list(range(8))  # the add's form: y = x * 1 + value
    taps.attach(site_work([b], lambda x: str(x)))  # a is collected
    assert set(taps.forms) == {id(b.steers[0])}
