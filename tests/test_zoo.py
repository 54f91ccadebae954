"""The synthetic offline zoo: every twin builds, loads by repo id offline, runs, and keeps its quirks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import zoo
from engine.zoo import ZOO
from engine.zoo import build as zbuild
from engine.zoo.tokenizer import build_tokenizer

PROMPT = (
    "The capital of France is Paris, and the capital of Germany is Berlin. Interpretability research "
    "studies the internal activations of neural networks, one layer at a time."
)

REQUIRED_TYPES = {
    "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "phi", "opt", "bloom", "llama", "mistral", "qwen2", "qwen3",
    "smollm3", "granite", "olmo2", "starcoder2", "phi3", "cohere", "gemma", "gemma2", "gemma3_text", "mixtral",
    "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "gpt_oss", "deepseek_v2", "deepseek_v3",
    "qwen3_next", "lfm2", "deepseek_v4",
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest single-threaded (and far faster when the 2 cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory):
    """A private, empty zoo home for this module's tests (the default cache is never touched)."""
    root = tmp_path_factory.mktemp("zoo-home")
    old = os.environ.get("INTERP_ZOO_HOME")
    os.environ["INTERP_ZOO_HOME"] = str(root)
    yield root
    if old is None:
        os.environ.pop("INTERP_ZOO_HOME", None)
    else:
        os.environ["INTERP_ZOO_HOME"] = old


@pytest.fixture(scope="session")
def prompt_ids():
    ids = build_tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    assert ids.shape[1] >= 40  # longer than every sliding window in the zoo (16 / 31)
    return ids


def _rms(t: torch.Tensor) -> float:
    return float(t.float().pow(2).mean().sqrt())


# ------------------------------------------------------------------------------------- the table


def test_table_size_and_required_model_types():
    assert len(ZOO) >= 55
    types = {e.model_type for e in ZOO.values()}
    missing = REQUIRED_TYPES - types
    assert not missing, f"model_types without an entry: {missing}"
    for name, e in ZOO.items():
        assert name == e.name and name.count("/") == 1, name
        assert e.notes.strip() and "\n" not in e.notes
        assert 2 <= e.layers <= 6


def test_every_config_builds_with_its_layer_count_and_tiny_sizes():
    for name, e in ZOO.items():
        cfg = zbuild.build_config(e)
        assert cfg.model_type == e.model_type, name
        assert cfg.num_hidden_layers == e.layers, name
        assert cfg.vocab_size == 512, name
        assert cfg.hidden_size <= 512, name
        assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2), name
        dims = zbuild.attention_head_dims(cfg)
        assert all(d != 16 for d in dims.values()), name
        if getattr(cfg, "sliding_window", None):
            assert cfg.sliding_window <= 32, name
        if getattr(cfg, "max_position_embeddings", None):
            assert cfg.max_position_embeddings == 512, name


def test_vllm_entries_have_cpu_attention_head_dims():
    vllm_entries = [e for e in ZOO.values() if e.vllm]
    assert len(vllm_entries) >= 45
    for e in vllm_entries:
        dims = zbuild.attention_head_dims(zbuild.build_config(e))
        if "mla_latent" in dims:  # vLLM's CPU MLA kernel only compiles kv_lora_rank 512 + rope 64
            assert dims["mla_latent"] == 576, e.name
            assert dims["qk_head_dim"] in {32, 64, 128} and dims["v_head_dim"] in {32, 64, 128}, e.name
        else:
            assert dims["head_dim"] in {32, 64, 128}, (e.name, dims)
    exotic = {e.model_type for e in ZOO.values() if not e.vllm}
    assert {"qwen3_next", "lfm2", "deepseek_v4"} <= exotic


def _gqa(cfg) -> float:
    return cfg.num_attention_heads / cfg.num_key_value_heads


def test_quirks_are_in_the_configs():
    cfg = {n: zbuild.build_config(e) for n, e in ZOO.items()}

    g2 = cfg["google/gemma-2-2b"]
    assert g2.attn_logit_softcapping == 50.0 and g2.final_logit_softcapping == 30.0
    assert g2.layer_types == ["sliding_attention", "full_attention"] * 2
    assert g2.sliding_window == 16 and _gqa(g2) == 2 and g2.head_dim * g2.num_attention_heads != g2.hidden_size
    assert cfg["google/gemma-2-27b"].query_pre_attn_scalar != cfg["google/gemma-2-27b"].head_dim
    g3 = cfg["google/gemma-3-1b-pt"]
    assert g3.layer_types.count("sliding_attention") == 5 and g3.layer_types[-1] == "full_attention"
    assert g3.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert g3.rope_parameters["full_attention"]["rope_theta"] == 1000000.0

    py = cfg["EleutherAI/pythia-70m-deduped"]
    assert py.rope_parameters["partial_rotary_factor"] == 0.25 and py.use_parallel_residual is True
    assert py.tie_word_embeddings is False
    assert cfg["microsoft/phi-2"].rope_parameters["partial_rotary_factor"] == 0.4
    assert cfg["EleutherAI/gpt-j-6b"].rotary_dim == 8
    assert cfg["bigcode/gpt_bigcode-santacoder"].multi_query is True
    assert cfg["bigscience/bloom-560m"].model_type == "bloom"  # ALiBi family
    assert cfg["facebook/opt-350m"].do_layer_norm_before is False
    assert cfg["facebook/opt-350m"].word_embed_proj_dim != cfg["facebook/opt-350m"].hidden_size

    l8 = cfg["meta-llama/Llama-3.1-8B"]
    assert _gqa(l8) == 4 and l8.num_key_value_heads == 2 and l8.tie_word_embeddings is False
    assert l8.rope_parameters["rope_type"] == "llama3" and l8.rope_parameters["rope_theta"] == 500000.0
    l1 = cfg["meta-llama/Llama-3.2-1B"]
    assert _gqa(l1) == 4 and l1.tie_word_embeddings is True and l1.rope_parameters["factor"] == 32.0
    assert _gqa(cfg["TinyLlama/TinyLlama-1.1B-Chat-v1.0"]) == 8
    assert _gqa(cfg["HuggingFaceTB/SmolLM2-135M"]) == 3
    assert _gqa(cfg["Qwen/Qwen2.5-0.5B"]) == 7 and _gqa(cfg["Qwen/Qwen2.5-7B-Instruct"]) == 7
    assert _gqa(cfg["bigcode/starcoder2-3b"]) == 12 and cfg["bigcode/starcoder2-3b"].use_bias is True
    assert _gqa(cfg["THUDM/glm-4-9b-chat-hf"]) == 16

    assert cfg["Qwen/Qwen3-0.6B"].tie_word_embeddings is True
    assert cfg["Qwen/Qwen3-8B"].tie_word_embeddings is False
    q06 = cfg["Qwen/Qwen3-0.6B"]
    assert q06.head_dim * q06.num_attention_heads == 2 * q06.hidden_size  # like 16*128 vs 1024
    assert cfg["mistralai/Mistral-7B-v0.1"].sliding_window == 16
    assert cfg["mistralai/Mistral-7B-Instruct-v0.3"].sliding_window is None
    assert cfg["HuggingFaceTB/SmolLM3-3B"].no_rope_layers == [1, 1, 1, 0]
    assert cfg["ibm-granite/granite-3.0-2b-base"].residual_multiplier == 0.22
    assert cfg["CohereForAI/c4ai-command-r-v01"].logit_scale == 0.0625
    assert cfg["CohereForAI/c4ai-command-r-plus"].use_qk_norm is True
    assert cfg["allenai/OLMo-7B-0424-hf"].clip_qkv == 8.0
    assert cfg["stabilityai/stablelm-2-12b"].qk_layernorm and cfg["stabilityai/stablelm-2-12b"].use_parallel_residual

    # mixture of experts: expert count reduced, top-k strictly inside it
    moe = {
        "mistralai/Mixtral-8x7B-v0.1": ("num_local_experts", 8, 2),
        "Qwen/Qwen1.5-MoE-A2.7B": ("num_experts", 8, 4),
        "Qwen/Qwen3-30B-A3B": ("num_experts", 8, 4),
        "allenai/OLMoE-1B-7B-0924": ("num_experts", 8, 4),
        "ibm-granite/granite-3.0-1b-a400m-base": ("num_local_experts", 8, 4),
        "microsoft/Phi-3.5-MoE-instruct": ("num_local_experts", 8, 2),
        "openai/gpt-oss-20b": ("num_local_experts", 8, 4),
        "deepseek-ai/DeepSeek-V2-Lite": ("n_routed_experts", 8, 2),
        "deepseek-ai/DeepSeek-V3": ("n_routed_experts", 8, 4),
        "Qwen/Qwen3-Next-80B-A3B-Instruct": ("num_experts", 8, 4),
    }
    for name, (field, n_exp, k) in moe.items():
        assert getattr(cfg[name], field) == n_exp and cfg[name].num_experts_per_tok == k, name
        assert k < n_exp
    assert cfg["Qwen/Qwen1.5-MoE-A2.7B"].shared_expert_intermediate_size > 0
    assert cfg["Qwen/Qwen3-30B-A3B"].norm_topk_prob is True
    v2, v3 = cfg["deepseek-ai/DeepSeek-V2-Lite"], cfg["deepseek-ai/DeepSeek-V3"]
    assert v2.q_lora_rank is None and v2.n_shared_experts == 2 and v2.first_k_dense_replace == 1
    assert v3.q_lora_rank == 64 and v3.n_group == 4 and v3.topk_group == 2 and v3.routed_scaling_factor == 2.5
    oss = cfg["openai/gpt-oss-20b"]
    assert oss.layer_types == ["sliding_attention", "full_attention"] * 2 and oss.rope_parameters["rope_type"] == "yarn"

    nxt = cfg["Qwen/Qwen3-Next-80B-A3B-Instruct"]
    assert set(nxt.layer_types) == {"linear_attention", "full_attention"} and _gqa(nxt) == 8
    lfm = cfg["LiquidAI/LFM2-350M"]
    assert set(lfm.layer_types) == {"conv", "full_attention"}
    v4 = cfg["deepseek-ai/DeepSeek-V4-Flash"]
    assert v4.hc_mult == 4 > 1
    assert set(v4.layer_types) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert v4.mlp_layer_types[0] == "hash_moe"
    assert cfg["google/gemma-3-4b-it"].model_type == "gemma3_text"


# ------------------------------------------------------------------------------------- building


def test_resolve_globs_and_errors():
    assert zoo.resolve("Qwen/Qwen3-8B") == ["Qwen/Qwen3-8B"]
    assert zoo.resolve("qwen/qwen3-8b") == ["Qwen/Qwen3-8B"]
    qwen = zoo.resolve("Qwen/*")
    assert "Qwen/Qwen3-8B" in qwen and all(n.startswith("Qwen/") for n in qwen) and len(qwen) >= 8
    assert set(zoo.resolve("google/gemma-2-*")) == {"google/gemma-2-2b", "google/gemma-2-9b", "google/gemma-2-27b"}
    assert zoo.resolve("all") == list(ZOO)
    with pytest.raises(ValueError, match="google/gemma-2-2b"):
        zoo.resolve("google/gema-2-2b")
    with pytest.raises(ValueError, match="meta-llama/Llama-3.1-8B"):
        zoo.resolve("meta-llama/Llama-3.1-8b-instruct")
    with pytest.raises(ValueError, match="matches no entry"):
        zoo.resolve("nosuchorg/*")
    with pytest.raises(ValueError, match="did you mean"):
        zoo.ensure_twin("Qwen/Qwen3-9B")


@pytest.mark.parametrize("name", list(ZOO))
def test_twin_builds_loads_and_runs(name, zoo_root, prompt_ids):
    entry = ZOO[name]
    snap = zoo.ensure_twin(name)
    # private HF cache layout under the repo id
    repo = zoo_root / "hub" / ("models--" + name.replace("/", "--"))
    assert snap.parent.parent == repo and len(snap.name) == 40
    assert (repo / "refs" / "main").read_text() == snap.name
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "zoo_twin.json"):
        assert (snap / f).is_file(), f
    marker = json.loads((snap / "zoo_twin.json").read_text())
    assert marker["synthetic_twin"] is True and marker["name"] == name
    gen = json.loads((snap / "generation_config.json").read_text())
    assert gen.get("do_sample", False) is False and gen["eos_token_id"] == 2 and gen["pad_token_id"] == 0

    model, tok = zoo.load_twin(name)  # by repo id, from the private cache, local_files_only
    assert not model.training and model.config.model_type == entry.model_type
    assert next(model.parameters()).dtype == torch.float32
    # what was loaded is exactly what was built (tied weights included)
    assert zbuild.weights_digest(model.state_dict()) == marker["weights_sha256"]
    assert tok(PROMPT, return_tensors="pt")["input_ids"].tolist() == prompt_ids.tolist()

    with torch.no_grad():
        out = model(prompt_ids, output_hidden_states=True)
    logits = out.logits
    assert logits.shape == (1, prompt_ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    assert float(logits.std()) > 0.3, "logits nearly constant"
    # different positions predict different distributions
    assert float((logits[0, 1:] - logits[0, :-1]).abs().max()) > 0.1
    hs = out.hidden_states
    assert len(hs) >= entry.layers
    for i, h in enumerate(hs):
        assert torch.isfinite(h).all(), i
        assert 0.02 < _rms(h) < 50.0, (i, _rms(h))
        assert float(h[0].std(dim=0).mean()) > 1e-2, f"hidden state {i} equal across positions"
    # every block writes something: consecutive residual states differ
    for i in range(1, len(hs) - 1):
        rel = _rms(hs[i] - hs[i - 1]) / _rms(hs[i - 1])
        assert rel > 1e-2, (i, rel)


def test_residual_stream_grows_across_layers(zoo_root, prompt_ids):
    for name in ("meta-llama/Llama-3.1-8B", "google/gemma-2-2b", "Qwen/Qwen3-30B-A3B", "allenai/Olmo-3-1025-7B"):
        model, _ = zoo.load_twin(name)
        with torch.no_grad():
            hs = model(prompt_ids, output_hidden_states=True).hidden_states
        raw = [_rms(h) for h in hs[:-1]]  # the last entry is after the final norm
        assert raw[-1] > raw[0] * 1.1, (name, raw)
        assert all(0.1 < r < 20 for r in raw), (name, raw)


def test_loaded_twin_keeps_module_level_quirks(zoo_root):
    m, _ = zoo.load_twin("microsoft/Phi-3.5-MoE-instruct")
    assert m.lm_head.bias is not None and m.model.layers[0].self_attn.q_proj.bias is not None
    assert float(m.lm_head.bias.detach().abs().mean()) > 0.01  # bias path exercised
    m, _ = zoo.load_twin("Qwen/Qwen3-0.6B")
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert m.model.layers[0].self_attn.q_norm is not None
    m, _ = zoo.load_twin("Qwen/Qwen3-8B")
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    m, _ = zoo.load_twin("Qwen/Qwen2.5-0.5B")
    attn = m.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert float(attn.k_proj.bias.detach().abs().mean()) > 0.01
    m, _ = zoo.load_twin("deepseek-ai/DeepSeek-V4-Flash")
    assert m.config.hc_mult == 4
    assert any("hc" in n for n, _ in m.named_parameters())


def test_snapshot_is_deterministic_and_rebuild_identical(tmp_path):
    name = "Qwen/Qwen3-30B-A3B"
    a = zbuild.build_twin(name, root=tmp_path / "a")
    b = zbuild.build_twin(name, root=tmp_path / "b")
    assert a.name == b.name == zbuild.snapshot_hash(ZOO[name])
    ma, mb = zbuild.read_marker(a), zbuild.read_marker(b)
    assert ma["weights_sha256"] == mb["weights_sha256"]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    # forced rebuild in place: same revision, same bytes
    c = zbuild.build_twin(name, root=tmp_path / "a", force=True)
    assert c == a and zbuild.read_marker(c)["weights_sha256"] == ma["weights_sha256"]
    # different entries get different seeds (gpt2 and distilgpt2 share a config)
    d1 = zbuild.weights_digest(zbuild.make_model(ZOO["openai-community/gpt2"]).state_dict())
    d2 = zbuild.weights_digest(zbuild.make_model(ZOO["distilbert/distilgpt2"]).state_dict())
    assert d1 != d2


def test_changing_an_entry_changes_the_revision():
    import dataclasses

    e = ZOO["Qwen/Qwen3-8B"]
    e2 = dataclasses.replace(e, overrides={**e.overrides, "rope_theta": 10000.0})
    assert zbuild.snapshot_hash(e) != zbuild.snapshot_hash(e2)
    assert zbuild.snapshot_hash(e) == zbuild.snapshot_hash(dataclasses.replace(e))


def test_atomic_write_interrupted_build_and_leftovers(tmp_path, monkeypatch):
    name = "openai-community/gpt2"
    hub = tmp_path / "hub"
    snap = hub / ZOO[name].repo_folder / "snapshots" / zbuild.snapshot_hash(ZOO[name])

    # an interrupted build leaves neither a snapshot nor refs/main nor its temp dir
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(zbuild, "weights_digest", boom)
    with pytest.raises(KeyboardInterrupt):
        zbuild.build_twin(name, root=tmp_path)
    monkeypatch.undo()
    assert not snap.exists()
    assert not (hub / ZOO[name].repo_folder / "refs" / "main").exists()
    assert list((tmp_path / "tmp").iterdir()) == []

    # a leftover temp dir of a dead builder, and a half-written snapshot without its marker
    dead = tmp_path / "tmp" / f"{ZOO[name].repo_folder}-abc.999999999.deadbeef"
    (dead / "junk").mkdir(parents=True)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert not zbuild.is_complete(snap)
    out = zbuild.build_twin(name, root=tmp_path)
    assert out == snap and zbuild.is_complete(snap)
    assert not dead.exists()
    assert json.loads((snap / "config.json").read_text())["model_type"] == "gpt2"
    # a temp dir of a live builder (this process) is left alone
    live = tmp_path / "tmp" / f"x.{os.getpid()}.cafe"
    live.mkdir()
    zbuild.build_twin("distilbert/distilgpt2", root=tmp_path)
    assert live.exists()


def test_tokenizer_round_trip_and_determinism():
    from engine.zoo import tokenizer as ztok

    tok = build_tokenizer()
    assert len(tok) == 512 and tok.vocab_size == 512
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    for text in (PROMPT, "Über naïve café — 🙂 tabs\tand\nnewlines", "def f(x):\n    return x ** 2"):
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        assert all(0 <= i < 512 for i in ids)
    first = tok(PROMPT)["input_ids"]
    ztok._tokenizer_json.cache_clear()
    ztok._cached_tokenizer.cache_clear()
    again = build_tokenizer()
    assert again is not tok and again(PROMPT)["input_ids"] == first
    assert len(first) < len(PROMPT.encode()) / 2  # merges were learned


def test_offline_env_lets_plain_transformers_load_by_name(zoo_root):
    name = "meta-llama/Llama-3.2-1B"
    snap = zoo.ensure_twin(name)
    env = zoo.offline_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert Path(env["HF_HUB_CACHE"]) == zoo_root / "hub" == zoo.zoo_hub_cache()
    code = textwrap.dedent(f"""
        import json
        from transformers import AutoConfig, AutoTokenizer
        cfg = AutoConfig.from_pretrained({name!r})
        tok = AutoTokenizer.from_pretrained({name!r})
        print(json.dumps([cfg.model_type, cfg.num_key_value_heads, tok("Paris")["input_ids"]]))
    """)
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                         capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    model_type, kv, ids = json.loads(res.stdout.strip().splitlines()[-1])
    assert model_type == "llama" and kv == 1 and ids == build_tokenizer()("Paris")["input_ids"]
    assert snap.is_dir()


def test_offline_session_patches_and_restores_hub_constants(zoo_root):
    from huggingface_hub import constants
    from transformers import AutoConfig

    zoo.ensure_twin("google/gemma-2-2b")
    before = constants.HF_HUB_CACHE
    with zoo.offline_session():
        assert constants.HF_HUB_CACHE == str(zoo.zoo_hub_cache())
        cfg = AutoConfig.from_pretrained("google/gemma-2-2b")  # no cache_dir: by name only
        assert cfg.final_logit_softcapping == 30.0
        # the zoo is never mistaken for the real checkpoint, even while it is the active cache
        assert zoo.real_checkpoint_available("google/gemma-2-2b") is False
    assert constants.HF_HUB_CACHE == before


def test_real_checkpoint_available_uses_only_the_user_cache(tmp_path, monkeypatch, zoo_root):
    from huggingface_hub import constants

    user = tmp_path / "user-hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(user))
    zoo.ensure_twin("openai-community/gpt2")  # present in the zoo only
    assert zoo.real_checkpoint_available("openai-community/gpt2") is False
    # a real-looking checkpoint in the user's cache
    rev = "0" * 40
    snap = user / "models--openai-community--gpt2" / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "gpt2"}')
    (user / "models--openai-community--gpt2" / "refs").mkdir()
    (user / "models--openai-community--gpt2" / "refs" / "main").write_text(rev)
    assert zoo.real_checkpoint_available("openai-community/gpt2") is True
    # a twin copied into the user's cache is still not a real checkpoint
    (snap / "zoo_twin.json").write_text("{}")
    assert zoo.real_checkpoint_available("openai-community/gpt2") is False


def test_zoo_home_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("INTERP_ZOO_HOME", raising=False)
    assert zoo.zoo_home() == Path(zbuild.REPO_ROOT) / ".zoo-cache"
    monkeypatch.setenv("INTERP_ZOO_HOME", str(tmp_path))
    assert zoo.zoo_home() == tmp_path.resolve() and zoo.zoo_hub_cache() == tmp_path.resolve() / "hub"


def test_cli_list_and_build(capsys, zoo_root):
    from engine.zoo.__main__ import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name, e in ZOO.items():
        assert name in out
    assert "deepseek_v4" in out and f"{len(ZOO)} entries" in out
    assert main(["build", "distilbert/distilgpt2"]) == 0
    assert "distilbert/distilgpt2" in capsys.readouterr().out
    assert main(["build", "google/gema-2-2b"]) == 2
    assert "google/gemma-2-2b" in capsys.readouterr().err


def test_names_are_matched_case_insensitively_but_loaded_canonically(zoo_root):
    assert zoo.canonical_name("qwen/qwen3-0.6b") == "Qwen/Qwen3-0.6B"
    with pytest.raises(ValueError, match="pattern"):
        zoo.canonical_name("Qwen/*")
    model, _ = zoo.load_twin("qwen/qwen3-0.6b")
    assert model.config.model_type == "qwen3"
    assert (zoo_root / "hub" / "models--Qwen--Qwen3-0.6B").is_dir()
    assert not (zoo_root / "hub" / "models--qwen--qwen3-0.6b").exists()
