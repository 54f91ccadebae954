"""The validator on a model that runs on another device than the tensors it builds (issue 35: on cuda
every `hf`, `transformer_lens` and `nnsight` row failed with "index is on cpu", and the steer rows with
"found at least two devices"). A CPU-only machine has no second device, so the cases are made
`Elsewhere` (tests/other_device.py: CPU data that says cuda:0 and fails any op with a CPU tensor, as
torch does) while the model stays on the CPU: whatever reaches the model without going through
`validator.engines.base.on_device` fails here as it did on the GPU."""
import pytest
import torch

from other_device import DEVICE, Elsewhere, elsewhere
from validator import cells, prompts, runner
from validator.engines import adapter_class, availability
from validator.engines.base import Case, Missing, ModelContext, on_device
from validator.models import zoo_spec

NAME = "meta-llama/Llama-3.2-1B"
_SLOW = pytest.mark.slow
ENGINES = ("hf", pytest.param("transformer_lens", marks=_SLOW), pytest.param("nnsight", marks=_SLOW),
           pytest.param("nnterp", marks=_SLOW), pytest.param("interp-engine", marks=_SLOW))
ADDRESSES = ["embeddings", "resid_post.0", "resid_post.1", "attn_out.1", "lm_head"]


def test_the_fake_device_fails_as_torch_does_across_devices():
    emb = torch.nn.Embedding(10, 4)
    ids = Elsewhere(torch.tensor([[1, 2, 3]]))
    assert ids.device == DEVICE
    with pytest.raises(RuntimeError, match="found at least two devices, cuda:0 and cpu"):
        emb(ids)
    with pytest.raises(RuntimeError, match="found at least two devices, cuda:0 and cpu"):
        torch.randn(4) * Elsewhere(torch.tensor(2.0))  # a CPU vector times a cuda 0-dim scale
    assert isinstance(ids.cumsum(-1), Elsewhere)  # ops among its own tensors stay there
    torch.testing.assert_close(emb(ids.to("cpu")), emb(torch.tensor([[1, 2, 3]])))


def test_on_device_moves_every_tensor_of_a_case_and_of_a_tree():
    case = elsewhere(Case("c", torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.long),
                          torch.ones(1, 2, dtype=torch.bool), meta={"k": 1}))
    assert case.input_ids.device == DEVICE
    moved = on_device(case, "cpu")
    for t in (moved.input_ids, moved.attention_mask, moved.valid, moved.position_ids):
        assert type(t) is torch.Tensor and t.device.type == "cpu"
    assert moved.meta == {"k": 1} and moved.valid.dtype == torch.bool
    tree = on_device({"a": [Elsewhere(torch.ones(2)), 3], "b": (Elsewhere(torch.ones(1, dtype=torch.long)),)},
                     "cpu", torch.float64)
    assert tree["a"][0].dtype == torch.float64 and tree["a"][1] == 3  # floats cast, the rest kept
    assert tree["b"][0].dtype == torch.long and type(tree["b"][0]) is torch.Tensor


@pytest.fixture(scope="module")
def ctx():
    hf, tok = zoo_spec(NAME).load_reference()
    return ModelContext(NAME, hf, tok, "zoo")


@pytest.mark.parametrize("engine", ENGINES)
def test_an_adapter_moves_cases_and_steer_vectors_to_its_model(engine, ctx):
    """The same rows from a case on the model's device and from one elsewhere (today's adapters raised
    inside the reference forward); the steer vector likewise."""
    ok, why = availability(engine)
    if not ok:  # nnterp without its side directory
        pytest.skip(why)
    cases = prompts.build_cases(ctx.tokenizer, ctx.config)
    ref = adapter_class(engine)(ctx)
    try:
        for case in cases:
            here, there = ref.capture(case, ADDRESSES), ref.capture(elsewhere(case), ADDRESSES)
            for a in ADDRESSES:
                assert not isinstance(there[a], Missing), (a, there[a])
                assert type(there[a]) is torch.Tensor and there[a].device.type == "cpu"
                torch.testing.assert_close(there[a], here[a], rtol=0, atol=0)
        v = torch.randn(ctx.config.hidden_size, generator=torch.Generator().manual_seed(0))
        plain = ref.steer_logits(cases[0], 1, v)
        torch.testing.assert_close(ref.steer_logits(elsewhere(cases[0]), 1, Elsewhere(v)), plain, rtol=0, atol=0)
        assert not torch.equal(plain, ref.capture(cases[0], ["lm_head"])["lm_head"])  # the steer did something
    finally:
        ref.close()


def test_the_validators_steering_maths_never_mixes_devices_and_lands_on_the_model(monkeypatch):
    """Issue 35's steer rows: a CPU direction times a cuda activation raised "found at least two devices". The
    validator's maths runs on the host and hands the reference its tensor back where it came from (the one
    move, maths.to_device, lands an `Elsewhere` here: this machine has no second device to move to)."""
    from validator import maths
    from validator.plan import SteerCase
    from validator.sides import steer_fn
    moved = []
    monkeypatch.setattr(maths, "to_device", lambda host, like: moved.append(like.device) or Elsewhere(host))
    t = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(0))
    v = torch.randn(8, generator=torch.Generator().manual_seed(1))
    sc = SteerCase("project_out", "project_out", "resid_post", 0, (1, 3), value=v)
    there = steer_fn(sc, 5, 5)(Elsewhere(t.clone()), 0)
    assert isinstance(there, Elsewhere) and moved == [DEVICE]
    monkeypatch.undo()
    here = steer_fn(sc, 5, 5)(t.clone(), 0)
    torch.testing.assert_close(there.to("cpu"), here, rtol=0, atol=0)
    u = v / v.norm()
    assert float((here[0, 1:3] @ u).abs().max()) < 1e-5  # removed at the touched positions
    torch.testing.assert_close(here[0, [0, 3, 4]], t[0, [0, 3, 4]], rtol=0, atol=0)  # untouched elsewhere


@pytest.mark.parametrize("engines", [("hf",), pytest.param(("hf", "transformer_lens", "nnsight", "nnterp",
                                                             "interp-engine"), marks=_SLOW)])
def test_a_run_whose_cases_are_elsewhere_passes_every_row(engines, tmp_path, monkeypatch):
    """The whole runner (engine side, decode, steering parity, every reference) with its cases built on
    another device than the model: every row passes or is a declared gap, as with CPU cases."""
    build = prompts.build_cases
    monkeypatch.setattr(prompts, "build_cases", lambda tok, cfg: elsewhere(build(tok, cfg)))
    opts = runner.Options(engines=engines, out=tmp_path, points=["resid_post", "attn_out", "lm_head"])
    written = runner.run_model(zoo_spec(NAME), opts)
    assert len(written) == len(engines)
    for path in written:
        cell = cells.read(path)
        assert cell["status"] == "ok", cell.get("error")
        bad = [r for r in cell["rows"] if r["verdict"] == "fail"]
        assert not bad, bad[:3]
        steers = [r for r in cell["rows"] if r["case"] == "steer"]
        assert steers and all(r["verdict"] in ("pass", "gap") for r in steers)
        assert all(r["effect"] > 1e-3 for r in steers if r["verdict"] == "pass")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("engine", ["hf", pytest.param("transformer_lens", marks=_SLOW),
                                    pytest.param("nnsight", marks=_SLOW), pytest.param("nnterp", marks=_SLOW)])
def test_references_on_the_same_kernels_are_bit_exact(engine, dtype, tmp_path):
    """validator/tolerances.py: same weights, inputs, dtype, device and kernels give the same bits; the
    tier only bounds what is computed differently (decode, leak, recomputed scores)."""
    from validator.tolerances import exactness
    opts = runner.Options(engines=(engine,), out=tmp_path, dtype=dtype)
    cell = cells.read(runner.run_model(zoo_spec(NAME), opts)[0])
    ex = exactness(engine, cell["rows"], cell["configuration"])
    assert ex["inexact"] == [], ex["inexact"][:3]
    assert ex["expected"] >= 0.5 * ex["compared"] and ex["exact"] >= ex["expected"]
    steer = next(r for r in cell["rows"] if r.get("steer") == "add@'all'")
    assert steer["max_abs"] == 0  # the same add on the same logits


def test_exactness_names_the_rows_that_should_be_exact_and_are_not():
    from validator.tolerances import exact_expected, exactness
    rows = [{"case": "short", "point": "resid_post", "max_abs": 0.0},
            {"case": "short", "point": "resid_post", "max_abs": 1e-3},  # a finding
            {"case": "decode", "point": "resid_post", "max_abs": 1e-3},  # computed differently
            {"case": "short", "point": "attn_scores", "max_abs": 1e-3},  # hf recomputes them
            {"case": "short", "point": "q", "verdict": "gap"}]  # not compared
    ex = exactness("hf", rows, "eager")
    assert (ex["compared"], ex["exact"], ex["expected"]) == (4, 1, 2)
    assert ex["inexact"] == [rows[1]]
    declared = [dict(rows[1], inexact_known="tl-layernorm-recompute")]  # a declared, measured reason excuses it
    assert exactness("hf", declared)["inexact"] == []
    assert exact_expected("transformer_lens", "short", "attn_scores")  # TL reads the hook, no recompute
    assert not exact_expected("interp-engine", "short", "resid_post") and exactness("vllm", rows)["inexact"] == []
