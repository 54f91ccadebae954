"""The validator proves its own power (issue 48): seeded engine bugs, one at a time, each must fail the run
with a row naming the point it breaks. The quick subset runs here on one twin; the full catalogue runs in
`python -m validator selftest` (published to reports/validator/selftest.json)."""
import pytest
import torch

from validator import cli, exits, selftest
from validator.mutations import CATEGORIES, Mutation, Patcher, catalogue

LLAMA = "meta-llama/Llama-3.2-1B"


def test_the_catalogue_spans_every_category_with_25_or_more_distinct_bugs():
    muts = catalogue()
    names = [m.name for m in muts]
    assert len(names) == len(set(names)) and len(names) >= 25
    assert {m.category for m in muts} == set(CATEGORIES)
    assert all(m.expect and m.what for m in muts)
    assert set(selftest.QUICK) <= set(names)


def test_a_patch_is_undone_whatever_happens_inside():
    class Box:
        x = 1
    table = {"a": 1}
    mut = Mutation("t", "capture", "t", (("*", "*"),), lambda p: (p.set(Box, "x", 2), p.item(table, "a", 3),
                                                                   p.item(table, "b", 4)))
    with pytest.raises(RuntimeError):
        with mut.applied():
            assert (Box.x, table) == (2, {"a": 3, "b": 4})
            raise RuntimeError("inside")
    assert Box.x == 1 and table == {"a": 1}
    p = Patcher()
    p.set(Box, "x", 5)
    p.undo()
    p.undo()  # idempotent
    assert Box.x == 1

    class Base:
        @staticmethod
        def f(a):
            return a

    class Child(Base):
        pass
    p.set(Base, "f", staticmethod(lambda a: -a))
    p.set(Child, "f", staticmethod(lambda a: 2 * a))  # inherited: removed again, not pinned on the child
    assert (Base.f(3), Child().f(3)) == (-3, 6)
    p.undo()
    assert Base().f(3) == 3 and "f" not in vars(Child)  # a staticmethod restored as one (not a plain function)


def test_a_row_names_a_bug_by_case_and_address():
    mut = next(m for m in catalogue() if m.name == "project_out-sign")
    row = {"case": "steer", "point": "steer", "layer": 0, "steer": "project_out", "address": "resid_post.0"}
    assert mut.names(row)
    assert not mut.names(dict(row, steer="rescale"))
    assert not mut.names({"case": "short", "point": "resid_post", "layer": 0})


@pytest.fixture(scope="module")
def models():
    with selftest.Models() as kept:  # one prepared twin for every run of this module
        yield kept


@pytest.fixture(scope="module")
def quick(models):
    return selftest.run(selftest.select(None, quick=True), models=models)


def test_the_quick_subset_is_caught_each_naming_the_point(quick):
    outcomes, problems = quick
    assert problems == []  # the clean run passes: a self-test on a failing baseline proves nothing
    assert {o.mutation for o in outcomes} == set(selftest.QUICK)
    missed = [(o.mutation, o.rows, o.error) for o in outcomes if not o.caught]
    assert missed == []
    by = {o.mutation: o for o in outcomes}
    assert by["mlp_out-off-by-5e-4"].rows[0].startswith("short mlp_out.")  # the 5e-4: a failure now
    assert by["negative-layer-early"].rows[0].startswith("address ") and ".-" in by["negative-layer-early"].rows[0]
    assert by["lens-skips-final-norm"].rows[0].startswith("lens resid_post.")
    s = selftest.summary(outcomes)
    assert (s["caught"], s["total"], s["missed"]) == (len(selftest.QUICK), len(selftest.QUICK), [])


def test_a_bug_the_checks_cannot_see_is_reported_missed(models):
    """The self-test can fail: a 'bug' that changes nothing of what the engine computes is not caught."""
    harmless = Mutation("harmless", "capture", "a no-op", (("*", "*"),), lambda p: None)
    outcomes, _ = selftest.run([harmless], models=models)
    assert [(o.mutation, o.failed, o.caught) for o in outcomes] == [("harmless", False, False)]
    assert selftest.summary(outcomes) == {"caught": 0, "total": 1, "missed": ["harmless"]}


def test_a_bug_that_breaks_another_point_is_not_counted_as_named(models):
    """Caught means the run fails AND a failing row names the bug: a failure elsewhere does not count."""
    mut = next(m for m in catalogue() if m.name == "mlp_out-off-by-5e-4")
    elsewhere = Mutation("misnamed", "capture", mut.what, (("short", "resid_pre.*"),), mut.apply)
    (o,), _ = selftest.run([elsewhere], models=models)
    assert o.failed and not o.named and not o.caught


def test_the_cli_refuses_an_unknown_mutation_naming_the_closest(capsys):
    assert cli.main(["selftest", "--mutations", "project_out-sgn"]) == exits.USAGE
    err = capsys.readouterr().err
    assert "unknown mutation 'project_out-sgn'" in err and "project_out-sign" in err
    assert cli.main(["selftest", "--list"]) == exits.OK
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(catalogue()) and listed[0].split()[0] == catalogue()[0].name


def test_the_published_selftest_covers_the_whole_catalogue_and_catches_every_bug():
    data = selftest.read(selftest.RESULT)
    assert data is not None, "publish it: python -m validator selftest"
    names = {m.name for m in catalogue()}
    assert {o["mutation"] for o in data["outcomes"]} == names
    assert data["missed"] == [] and data["caught"] == data["total"] == len(names) and data["problems"] == []


def test_seeded_bugs_leave_the_engine_as_it_was():
    """After the quick subset, the engine computes what it did before (every patch undone)."""
    from engine import load_model
    m = load_model(LLAMA, source="zoo")
    ids = m.to_tokens("The capital of France is")
    before, _ = m.run_with_cache(ids, ["mlp_out.0"])
    for mut in catalogue():
        with mut.applied():
            pass
    after, cache = m.run_with_cache(ids, ["mlp_out.0"])
    torch.testing.assert_close(after, before, rtol=0, atol=0)
