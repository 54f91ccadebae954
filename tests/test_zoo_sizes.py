"""Real-size twins: every zoo entry has real dimensions whose parameter count matches the published
one (meta device, no weights), real-size twins live in their own cache beside the untouched tiny
ones, and the size switch reaches every loader through the environment."""
from __future__ import annotations

import json
import os

import pytest

from engine import zoo
from engine.zoo import build, sizes
from engine.zoo.real import REAL

CERTAIN_TOL, UNCERTAIN_TOL = 0.05, 0.10


def test_every_entry_has_a_real_row():
    assert set(REAL) == set(zoo.ZOO)
    for name, d in REAL.items():
        assert d.layers > zoo.ZOO[name].layers or d.layers == zoo.ZOO[name].layers == 4, name


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_parameter_count_matches_the_published_one(name):
    d = REAL[name]
    got = sizes.meta_parameters(name) / 1e9
    if d.params_b is None:
        assert d.uncertain, f"{name}: no published count, so the row must say what is uncertain"
        return
    tol = UNCERTAIN_TOL if d.uncertain else CERTAIN_TOL
    assert abs(got / d.params_b - 1) < tol, f"{name}: {got:.3f}B built, {d.params_b}B published"


def test_real_config_keeps_the_quirks_and_takes_the_real_sizes():
    cfg = sizes.real_config("google/gemma-2-2b")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.sliding_window) == (26, 2304, 8, 4, 256, 256000, 4096)
    assert cfg.final_logit_softcapping == 30.0 and cfg.attn_logit_softcapping == 50.0  # from the tiny entry
    assert cfg.layer_types[:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert len(cfg.layer_types) == 26


def test_tiny_paths_are_unchanged_and_real_has_its_own_cache(monkeypatch):
    monkeypatch.delenv(sizes.SIZE_ENV, raising=False)
    name = "meta-llama/Llama-3.2-1B"
    assert zoo.snapshot_dir(name) == build.snapshot_dir(name)
    assert zoo.zoo_hub_cache() == build.zoo_hub_cache()
    assert sizes.hub_cache("real") == build.zoo_home() / "sizes" / "real" / "hub"
    assert sizes.snapshot_hash(name, "real") != build.snapshot_hash(zoo.ZOO[name])
    assert sizes.SIZE_ENV not in zoo.offline_env()
    monkeypatch.setenv(sizes.SIZE_ENV, "real")
    assert zoo.zoo_hub_cache() == sizes.hub_cache("real")
    env = zoo.offline_env()
    assert env["HF_HUB_CACHE"] == str(sizes.hub_cache("real")) and env[sizes.SIZE_ENV] == "real"


def test_unknown_size_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(sizes.SIZE_ENV, "huge")
    with pytest.raises(ValueError, match=r"zoo size must be one of \('tiny', 'real'\), got 'huge'"):
        zoo.zoo_hub_cache()


def test_build_a_real_twin_beside_the_tiny_one(tmp_path, monkeypatch):
    """pythia-70m at its real 6 x 512 shape in a private zoo home: its own snapshot and marker,
    bfloat16 weights, and the tiny twin of the same name still builds and loads beside it."""
    monkeypatch.setenv("INTERP_ZOO_HOME", str(tmp_path))
    name = "EleutherAI/pythia-70m-deduped"
    real = sizes.ensure(name, "real")
    tiny = sizes.ensure(name, "tiny")
    assert real.parents[2] == tmp_path / "sizes" / "real" / "hub"
    assert tiny.parents[2] == tmp_path / "hub"
    cfg = json.loads((real / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], cfg["dtype"]) == (6, 512, 50304,
                                                                                               "bfloat16")
    marker = json.loads((real / build.MARKER).read_text())
    assert marker["size"] == "real" and abs(marker["parameters"] / 70.4e6 - 1) < 0.01
    assert zoo.is_twin(real) and zoo.is_twin(tiny)
    assert sizes.ensure(name, "real") == real  # present: no rebuild
    monkeypatch.setenv(sizes.SIZE_ENV, "real")
    model, tok = zoo.load_twin(name)
    assert model.config.num_hidden_layers == 6 and len(tok) == 512
    assert os.path.samefile(zoo.ensure_twin(name), real)


def test_cli_lists_real_sizes_with_what_is_uncertain(capsys):
    from engine.zoo.__main__ import main
    assert main(["list", "--size", "real", "Zyphra/*", "google/gemma-2-2b"]) == 0
    out = capsys.readouterr().out
    assert "Zyphra/Zamba2-1.2B" in out and "which layers reuse the shared block" in out
    assert "google/gemma-2-2b       26    2304   2.61B  -" in out


def test_sources_resolve_a_zoo_name_at_this_process_size(monkeypatch):
    """load_model, vLLM and the benchmark workers name twins through engine.model.sources: with
    $INTERP_ZOO_SIZE=real they must get the real-size snapshot, never the tiny one."""
    from engine.model import sources
    name = "HuggingFaceTB/SmolLM2-135M"
    monkeypatch.delenv(sizes.SIZE_ENV, raising=False)
    assert sources.resolve(name, "zoo", build=False).path == str(build.snapshot_dir(name))
    monkeypatch.setenv(sizes.SIZE_ENV, "real")
    src = sources.resolve(name, "zoo", build=False)
    assert src.path == str(sizes.snapshot_dir(name, "real")) and src.source == "zoo"
    assert "/sizes/real/hub/" in src.path
    built = []  # building goes through the size-aware ensure (not the tiny builder)
    monkeypatch.setattr(sizes, "ensure", lambda n, size=None: built.append((n, size)) or sizes.snapshot_dir(n))
    assert sources.resolve(name.lower(), "zoo").path == src.path and built == [(name, None)]
