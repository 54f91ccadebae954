"""The plan's numbers (validator/budget.py) and the placement path on the CPU.

Parameters against counts made without the plan (by hand from the config, and the published totals);
GPUs against the arithmetic of the copies; placement with stated device lists; the copies against a run
that counts the models alive at each column's peak; and a model placed by the plan's own device map
(its two "GPUs" stood for by host memory and disk offload) giving results bit-equal to a single device."""
import gc
import weakref

import pytest
import torch

from validator import budget
from validator.budget import Devices, GiB

H100 = Devices(1, 80 * GiB, "stated")
LLAMA8 = "meta-llama/Llama-3.1-8B"


def _llama8_by_hand() -> int:
    d, layers, vocab, inter, heads, kv, hd = 4096, 32, 128256, 14336, 32, 8, 128
    attn = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    return 2 * vocab * d + layers * (attn + 3 * d * inter + 2 * d) + d  # embed + head (untied), layers, final norm


@pytest.fixture(scope="module")
def llama8():
    return budget.needs(LLAMA8, ("hf", "nnsight", "vllm"), "bfloat16", H100, real=True)


def test_parameters_match_a_count_by_hand_and_the_published_totals(llama8):
    shape, _ = llama8
    assert shape.params == _llama8_by_hand() == 8_030_261_248
    assert shape.config_from.startswith("the real-size table")
    from engine.zoo.real import REAL
    for name in ("mistralai/Mixtral-8x7B-v0.1", "google/gemma-2-27b", "Qwen/Qwen3-30B-A3B"):
        cfg, source = budget.config_of(name, real=True)
        got = budget.shape_of(name, cfg, budget.meta_model(cfg), source).params
        assert got == pytest.approx(REAL[name].params_b * 1e9, rel=0.02), name


def test_copies_and_gpus_follow_from_the_weights(llama8):
    shape, needs = llama8
    w = shape.params * 2
    assert needs["hf"].copies == 4 and needs["nnsight"].copies == 4  # engine, reference, eager, own
    assert needs["vllm"].copies == 3 and needs["vllm"].vllm  # its own engine is on GPUs of its own
    assert needs["hf"].weight_bytes == w
    # 4 x 15.0 GiB fits 90% of one 80 GiB GPU; a fifth copy would not (it takes two), 141 GiB holds five
    assert 4 * w < 0.9 * 80 * GiB < 5 * w and needs["hf"].gpus == 1
    assert (needs["vllm"].tp, needs["vllm"].pp) == (1, 1) and needs["vllm"].all_gpus == needs["vllm"].gpus + 1
    model = budget._cached_model(LLAMA8, True, "tiny")[1]
    assert budget.gpus_for(model, shape, 5, "bfloat16", H100) == 2
    assert budget.gpus_for(model, shape, 5, "bfloat16", Devices(1, 141 * GiB, "stated")) == 1


def test_placement_with_stated_device_lists(llama8):
    shape, _ = llama8
    model = budget._cached_model(LLAMA8, True, "tiny")[1]
    sizes = budget._module_bytes(model, "bfloat16")
    maps = budget.place(model, 1, 0, "bfloat16", [9 * GiB, 9 * GiB])
    assert maps is not None
    (dm,) = maps
    used = {d: sum(sizes[m] for m, dd in dm.items() if dd == d) for d in set(dm.values())}
    assert set(used) == {0, 1} and all(b <= 9 * GiB for b in used.values())
    assert sum(used.values()) == sizes[""] == pytest.approx(shape.params * 2, abs=2 ** 20)  # + rotary buffers
    order = [dm[f"model.layers.{i}"] for i in range(32)]
    assert order == sorted(order) and dm["model.embed_tokens"] == 0 and dm["lm_head"] == 1  # layers in order
    assert budget.place(model, 1, 0, "bfloat16", [7 * GiB, 7 * GiB]) is None  # 14 GiB < 15 GiB of weights
    assert budget.place(model, 2, 0, "bfloat16", [9 * GiB] * 4) is not None  # a second copy after the first
    assert budget.place(model, 1, 10 * GiB, "bfloat16", [9 * GiB, 9 * GiB]) is None  # the activations' reserve


def test_vllm_columns_split_by_tensor_then_pipeline_parallelism():
    for name, want in (("CohereForAI/c4ai-command-r-plus", (4, 1)), ("deepseek-ai/DeepSeek-V3", (8, 3))):
        cfg, src = budget.config_of(name, real=True)
        shape = budget.shape_of(name, cfg, budget.meta_model(cfg), src)
        tp, pp = budget.vllm_gpus(shape, "bfloat16", H100)
        assert (tp, pp) == want, name
        assert shape.heads % tp == 0 and tp * pp * 0.92 * 80 * GiB >= shape.params * 2


def test_a_cell_that_does_not_fit_is_a_gap_saying_what_it_needs():
    from validator.schedule import gap_reason
    small = Devices(1, 40 * GiB, "stated")  # 4 x 15.0 GiB of weights do not fit one 40 GiB GPU
    _, needs = budget.needs(LLAMA8, ("hf",), "bfloat16", small, real=True)
    why = gap_reason(needs["hf"], small)
    assert why.startswith("needs 2 x 40 GiB GPUs on one node (4 x 15.0 GiB") and "run it with a cluster" in why
    assert gap_reason(needs["hf"], Devices(2, 40 * GiB, "stated")) == ""


def test_stated_devices_are_checked():
    assert budget.devices_at_hand(4, 141).describe().startswith("4 x 141 GiB (stated (--gpus, --gpu-memory)")
    with pytest.raises(ValueError, match="--gpus must be 0 or more"):
        budget.devices_at_hand(-1, None)
    with pytest.raises(ValueError, match="--gpu-memory must be a positive"):
        budget.devices_at_hand(None, 0)


def test_the_copies_are_those_a_run_holds_at_each_columns_peak(tmp_path, monkeypatch):
    """Count the causal-LM models alive (in this process) each time one is made, per column: the most equals
    budget.copies for that column."""
    from transformers import GenerationMixin, PreTrainedModel

    from validator import runner
    from validator.engines.base import ModelContext
    from validator.models import zoo_spec
    live: weakref.WeakSet = weakref.WeakSet()
    peak: dict[str, int] = {}
    current = {"engine": "load"}

    def made(model):
        if isinstance(model, GenerationMixin):
            live.add(model)
            gc.collect()
            peak[current["engine"]] = max(peak.get(current["engine"], 0), len(live))
        return model

    real_init, real_copy = PreTrainedModel.__init__, ModelContext.fresh_hf
    monkeypatch.setattr(PreTrainedModel, "__init__", lambda self, *a, **kw: (real_init(self, *a, **kw), made(self))[0])
    monkeypatch.setattr(ModelContext, "fresh_hf", lambda self: made(real_copy(self)))  # deep copies skip __init__
    engines = ("hf", "nnsight")
    opts = runner.Options(engines=engines, out=tmp_path, points=["resid_post", "attn_probs"], steer=False, decode=False,
                          progress=lambda m, e: current.update(engine=e))
    runner.run_model(zoo_spec("openai-community/gpt2"), opts)
    # copies made while loading count against every column: the peak of a column is its own plus what stayed
    base = peak["load"]
    assert base == len(budget.BASE_COPIES) + 1  # engine, reference, hf adapter, and the eager engine
    for e in engines:
        assert max(base, peak.get(e, 0)) == budget.copies(e, engines), (e, peak)


INTERLEAVED = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "disk",
               "model.rotary_emb": "cpu", "lm_head": "cpu"}  # the tied head stays with the embedding


@pytest.mark.parametrize("stated", [None, INTERLEAVED], ids=["the-plans-map", "interleaved"])
def test_a_model_placed_across_devices_gives_single_device_results(stated):
    """The real-size path on the CPU: the plan's placement of the twin over two stated devices (device 0 as host
    memory, device 1 as disk offload: accelerate's dispatch), or a stated map that alternates layers between
    them, loaded by load_model(device=map): captures, steered captures and steered generation bit-equal."""
    from engine import Steer, zoo
    from engine.loading import load_model
    name = "meta-llama/Llama-3.2-1B"
    zoo.ensure_twin(name)
    cfg, _ = budget.config_of(name, real=False)
    meta = budget.meta_model(cfg)
    total = budget._module_bytes(meta, "float32")[""]
    (dm,) = budget.place(meta, 1, 0, "float32", [total * 3 // 4, total])  # accelerate keeps a layer's room on 0
    assert dm["model.embed_tokens"] == dm["lm_head"] == 0 and dm["model.layers"] == 1
    device_map = stated or {m: {0: "cpu", 1: "disk"}[d] for m, d in dm.items()}
    one = load_model(name, source="zoo")
    split = load_model(name, source="zoo", device=device_map)
    assert split.hf.hf_device_map == device_map and split.device == torch.device("cpu")
    assert any(p.device.type == "meta" for p in split.hf.parameters())  # offloaded: loaded per forward
    points = ["resid_post.0", "resid_post.1", "attn_probs.1", "mlp_out.0", "final_norm"]
    prompts = ["The capital of France is", "Hello there, general"]
    (la, ca), (lb, cb) = one.run_with_cache(prompts, points), split.run_with_cache(prompts, points)
    assert torch.equal(la, lb) and all(torch.equal(ca[p], cb[p]) for p in points)
    v = torch.randn(one.d_model, generator=torch.Generator().manual_seed(0))
    steer = [Steer("mlp_out.0", "add", v)]
    (sa, ka), (sb, kb) = (m.run_with_cache(prompts, ["resid_post.1"], steer=steer) for m in (one, split))
    assert torch.equal(sa, sb) and torch.equal(ka["resid_post.1"], kb["resid_post.1"])
    assert not torch.equal(ka["resid_post.1"], ca["resid_post.1"])  # the steer did something
    with one.steering(Steer("resid_post.0", "add", v)):
        ga = one.generate(prompts[0], max_new_tokens=4)
    with split.steering(Steer("resid_post.0", "add", v)):
        gb = split.generate(prompts[0], max_new_tokens=4)
    assert torch.equal(ga.tokens, gb.tokens)


def test_bad_placements_are_refused_by_name():
    from engine.core.errors import OptionError
    from engine.model.options import parse_placement
    assert parse_placement("auto") == "auto"
    assert parse_placement({"model": 0 if False else "cpu", "lm_head": "disk"}) == {"model": "cpu", "lm_head": "disk"}
    with pytest.raises(OptionError, match="vLLM splits a model with tensor_parallel_size"):
        parse_placement("auto", "vllm")
    with pytest.raises(OptionError, match="non-empty dict"):
        parse_placement({})
    with pytest.raises(OptionError, match="did you mean 'cuda'"):
        parse_placement({"model": "gpu"})
    with pytest.raises(OptionError, match="needs CUDA"):
        parse_placement({"model": 0})
    with pytest.raises(OptionError, match="not a module name"):
        parse_placement({3: "cpu"})


def test_a_model_specified_auto_gives_the_cells_of_a_single_device(tmp_path):
    """What a run does for a model its plan spreads over several GPUs (the engine and reference copies loaded
    with device "auto", accelerate's device map), on the CPU, where the map is the host alone: the same cells as
    a plain run (timings aside). What it shows on several GPUs is not tested here (docs/validator-scale.md)."""
    from validator import cells, runner
    from validator.models import zoo_spec
    from validator.shards import comparable
    name, got = "meta-llama/Llama-3.2-1B", {}
    for device in ("cpu", "auto"):
        opts = runner.Options(engines=("hf",), out=tmp_path / device, points=["resid_post"], steer=False,
                              decode=False)
        runner.run_model(zoo_spec(name, "float32", device), opts)
        got[device] = [comparable(c) for c in cells.load_all(tmp_path / device)]
    assert len(got["cpu"]) == 1 and got["cpu"][0]["status"] == "ok"
    assert got["auto"] == got["cpu"]


def test_a_cell_that_does_not_fit_is_written_as_a_declared_gap_and_computed_once_it_fits(tmp_path):
    """The run's gap cells (cli_scale.declare_gaps): skipped, saying what they need, never an error cell; up to
    date while nothing changes; removed (so computed) once the devices at hand hold them."""
    from validator import cells, cli_scale, runner, schedule
    from validator.models import zoo_spec
    name = "openai-community/gpt2"
    opts = runner.Options(engines=("hf",), out=tmp_path, points=["resid_post"], steer=False, decode=False)
    specs = {name: zoo_spec(name)}
    none_here = schedule.build([name], ("hf",), "float32", "", Devices(0, 80 * GiB, "stated"), False, True, [])
    assert cli_scale.declare_gaps(none_here, specs, opts) == 1
    cell = cells.read(runner.path_of(specs[name], "hf", opts))
    assert cell["status"] == "skipped" and cell["reason"].startswith("needs 1 x 80 GiB GPUs on one node (4 x 0.0 GiB")
    assert cell[schedule.UNPLACED]["gpus"] == 1 and runner.pending(specs[name], opts) == []
    assert cli_scale.declare_gaps(none_here, specs, opts) == 0  # the same gap is not written again
    one_here = schedule.build([name], ("hf",), "float32", "", Devices(1, 80 * GiB, "stated"), False, True, [])
    assert one_here.gaps() == [] and cli_scale.declare_gaps(one_here, specs, opts) == 0
    assert runner.pending(specs[name], opts) == ["hf"]  # it fits now: computed by the next run


def test_a_gpu_plan_places_the_specs_and_the_vllm_columns_load_with_its_parallel_sizes(monkeypatch):
    """What `run` does with a GPU plan (cli_scale.place_specs): a model needing several GPUs is specified "auto",
    and its vLLM columns load with the plan's tensor and pipeline sizes (validator/engines/vllm_ref.py)."""
    from types import SimpleNamespace

    import engine.loading
    from validator import cli_scale, schedule
    from validator.engines.base import ModelContext
    from validator.engines.vllm_ref import VllmEngine
    name = "mistralai/Mixtral-8x7B-v0.1"  # 87 GiB a copy in bf16
    monkeypatch.setattr(cli_scale, "spec_of", lambda n, real, dtype, device: SimpleNamespace(device=device))
    nodes = Devices(16, 80 * GiB, "stated")
    plan = schedule.build([name], ("hf", "vllm"), "bfloat16", "", nodes, True, True, [])
    assert plan.placement(name) == "auto" and plan.vllm_parallel(name) == (2, 1)
    specs = cli_scale.place_specs(plan, {name: SimpleNamespace(device="cuda")}, True, "bfloat16")
    assert specs[name].device == "auto" and specs[name].vllm_parallel == (2, 1)
    cpu = schedule.build([name], ("hf",), "bfloat16", "", nodes, True, False, [])
    assert cli_scale.place_specs(cpu, {name: "unchanged"}, True, "bfloat16") == {name: "unchanged"}
    seen = []
    monkeypatch.setattr(engine.loading, "load_model", lambda *a, **kw: seen.append(kw))
    for parallel, want in (((1, 1), {}), ((4, 2), {"tensor_parallel_size": 4, "pipeline_parallel_size": 2})):
        ctx = ModelContext(name, torch.nn.Linear(1, 1), None, "zoo", vllm_parallel=parallel)
        VllmEngine(ctx)._load()
        assert {k: v for k, v in seen[-1].items() if "parallel" in k} == want
