"""One name resolution for every backend (engine/model/sources.py): a save_pretrained directory loads on
eager and vLLM (and in the validator and the benchmarks), repo ids match the zoo and the user's HF
cache in any letter case, and nothing ever reaches for the network (any attempt fails the test).
One vLLM engine for the module (from the directory)."""
from __future__ import annotations

import shutil
import socket

import pytest
import torch

from engine import load_model
from engine.core.errors import ModelNotFoundError
from engine.model import sources

LLAMA = "meta-llama/Llama-3.2-1B"
PROMPT = "The quick brown fox jumps over the lazy dog"


def _local_host(host) -> bool:
    if not isinstance(host, str):
        return True
    return (host in ("", "localhost", "0.0.0.0", "::", "::1", socket.gethostname()) or host.startswith("127.")
            or host.startswith("/"))


@pytest.fixture
def no_network(monkeypatch):
    """Offline mode, and any connection or name lookup beyond this machine raises and is recorded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    attempts: list = []
    real_connect, real_connect_ex, real_gai = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def guard(host, what):
        if not _local_host(host):
            attempts.append(what)
            raise OSError(f"test_sources: network attempt: {what!r}")

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            guard(address[0], address)
        return real_connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            guard(address[0], address)
        return real_connect_ex(self, address)

    def getaddrinfo(host, *a, **kw):
        guard(host, host)
        return real_gai(host, *a, **kw)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield attempts
    assert not attempts, f"reached for the network: {attempts}"


@pytest.fixture(scope="module")
def twin():
    return load_model(LLAMA)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, twin):
    """What a user's fine-tune looks like on disk: model.save_pretrained + tokenizer.save_pretrained."""
    d = tmp_path_factory.mktemp("finetune") / "my-model"
    twin.hf.save_pretrained(d)
    twin.tokenizer.save_pretrained(d)
    return d


def test_save_pretrained_directory_loads_on_eager(saved, twin, no_network):
    for given in (str(saved), saved):  # a string or a Path
        m = load_model(given)
        assert m.source == "local" and m.name == str(saved.resolve()) and "local" in repr(m)
        torch.testing.assert_close(m.forward(PROMPT), twin.forward(PROMPT), rtol=0, atol=0)


@pytest.mark.vllm
@pytest.mark.slow  # an engine of its own (~30 s with its close): CI's slow step, keeping the default run under 10 min
def test_save_pretrained_directory_loads_on_vllm(saved, twin, no_network):
    vm = load_model(str(saved), backend="vllm", max_model_len=128)
    try:
        assert vm.source == "local" and vm.name == str(saved.resolve()) and vm.path == str(saved.resolve())
        out, ref = vm.generate(PROMPT, 4), twin.generate(PROMPT, 4)
        assert torch.equal(out.new_tokens, ref.new_tokens)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-3, atol=1e-3)
    finally:
        vm.close()


def test_names_resolve_once_for_every_backend(no_network):
    from engine.backends.vllm import runtime as vllm_runtime
    src = sources.resolve("META-LLAMA/llama-3.2-1b")
    assert (src.name, src.source, src.repo_id) == (LLAMA, "zoo", LLAMA)
    assert vllm_runtime.model_path("meta-llama/LLAMA-3.2-1B", "auto") == (src.path, "zoo")
    with pytest.raises(ModelNotFoundError, match="did you mean: meta-llama/Llama-3.2-1B"):
        sources.resolve("meta-llama/Llama-3.2-1")


@pytest.fixture
def hf_cache(tmp_path, saved, monkeypatch):
    """A user HF cache holding one real checkpoint, SomeOrg/Tiny-Model (the twin's files, no zoo marker)."""
    from huggingface_hub import constants
    repo = tmp_path / "hub" / "models--SomeOrg--Tiny-Model"
    snap = repo / "snapshots" / ("a" * 40)
    shutil.copytree(saved, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return snap


def test_real_checkpoints_match_the_hf_cache_in_any_case(hf_cache, twin, no_network):
    src = sources.resolve("someorg/tiny-model")
    assert (src.name, src.source, src.path) == ("SomeOrg/Tiny-Model", "real", str(hf_cache))
    assert sources.resolve("SOMEORG/TINY-MODEL", source="real").name == "SomeOrg/Tiny-Model"
    m = load_model("someorg/TINY-model")
    assert m.source == "real" and m.name == "SomeOrg/Tiny-Model"
    torch.testing.assert_close(m.forward(PROMPT), twin.forward(PROMPT), rtol=0, atol=0)
    with pytest.raises(ModelNotFoundError, match="unknown zoo model 'someorg/tiny-model'"):
        sources.resolve("someorg/tiny-model", source="zoo")


def test_short_names_resolve_as_the_hub_redirects_them(saved, tmp_path, monkeypatch, no_network):
    """`gpt2` was refused everywhere ("unknown zoo model 'gpt2'; did you mean: openai-community/gpt2"); the hub
    redirects its old org-less ids, so every place that takes a model name resolves it the same way: the zoo, the
    validator's --models, the benchmarks' --model, load_model, and a real checkpoint cached under the new id."""
    from huggingface_hub import constants

    from validator.models import resolve_names
    gpt2 = "openai-community/gpt2"
    assert sources.resolve("gpt2", build=False).name == sources.resolve("GPT2", build=False).name == gpt2
    assert sources.resolve("distilgpt2", build=False).name == "distilbert/distilgpt2"
    assert resolve_names(["gpt2", "gpt2-medium"]) == [gpt2, "openai-community/gpt2-medium"]
    assert sources.for_cli("gpt2").name == gpt2  # the benchmarks' --model
    assert load_model("gpt2").name == gpt2
    with pytest.raises(ModelNotFoundError, match="did you mean: openai-community/gpt2"):
        sources.resolve("gpt3")  # only the hub's own redirects, not a guess
    with pytest.raises(ModelNotFoundError):
        sources.resolve("Llama-3.2-1B")  # the hub does not redirect a bare name of an org's model
    repo = tmp_path / "hub" / "models--openai-community--gpt2"
    shutil.copytree(saved, repo / "snapshots" / ("b" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    src = sources.resolve("gpt2", source="real")
    assert (src.name, src.source) == (gpt2, "real")


def test_unknown_names_fail_offline_without_touching_the_network(no_network):
    with pytest.raises(OSError, match="network attempt"):  # the guard is live
        socket.create_connection(("huggingface.co", 443), timeout=1)
    no_network.clear()
    with pytest.raises(ModelNotFoundError, match="not a local directory or a checkpoint in the local HF cache"):
        load_model("nobody/no-such-model-anywhere")
    with pytest.raises(ModelNotFoundError, match="download it first"):
        load_model("nobody/no-such-model-anywhere", source="real")


def test_validator_accepts_a_model_directory(saved, tmp_path, no_network):
    from validator import cells, cli
    from validator.models import resolve_names
    assert resolve_names([str(saved), "META-LLAMA/llama-3.2-1b"]) == [str(saved.resolve()), LLAMA]
    code = cli.main(["run", "--models", str(saved), "--engines", "hf", "--points", "resid_post,lm_head",
                     "--no-steer", "--no-decode", "--out", str(tmp_path)])
    [cell] = cells.load_all(tmp_path)  # an ad-hoc variant (points, no decode/steer): its file name carries the tag
    assert cell["model"] == str(saved.resolve()) and cell["engine"] == "hf"
    assert code == 0 and cell["source"] == "local" and cell["status"] == "ok", cell.get("error")
    assert cell["summary"]["pass"] > 0 and cell["summary"]["fail"] == 0


def test_benchmarks_accept_a_model_directory(saved, monkeypatch, no_network):
    import benchmarks.__main__ as bench
    from benchmarks import sweep
    from benchmarks.variants import get
    got = {}
    monkeypatch.setattr(sweep, "run_sweep", lambda params, *a, **kw: got.setdefault("params", params))
    assert bench.main(["run", "--model", str(saved), "--variants", "eager", "--workloads", "prefill"]) == 0
    p = got["params"]
    assert p.model == str(saved.resolve()) and p.source == "local"
    v = get("eager")
    runner = v.load_runner()(p, v)
    runner.load()
    assert runner.model_info["source"] == "local"
