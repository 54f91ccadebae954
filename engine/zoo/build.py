"""Build the tiny twins: config from an entry, seeded non-degenerate weights, private HF cache layout.

Layout written (an ordinary Hugging Face hub cache, so every library loads the twin by repo id)::

    <root>/hub/models--{org}--{name}/refs/main                  -> "<40-hex>"
    <root>/hub/models--{org}--{name}/snapshots/<40-hex>/        config.json, generation_config.json,
                                                                model.safetensors, tokenizer files,
                                                                zoo_twin.json (provenance marker)

The snapshot hex is derived from ZOO_VERSION, the entry's content and the versions of the libraries
that shape the weights, so changing an entry (or this module's recipe) builds a new snapshot.
A build happens in ``<root>/tmp/<unique>/`` and is renamed into place in one step, so an
interrupted build never leaves a partial snapshot; stale temp dirs are swept on the next build.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from engine.core.files import write_atomic

from .entries import ZOO, ZooEntry
from .names import canonical_name
from .tokenizer import VOCAB_SIZE, build_tokenizer, special_token_ids

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

# Bump when the build recipe (defaults, init, files) changes: every twin gets a new snapshot.
ZOO_VERSION = "1"
MARKER = "zoo_twin.json"

REPO_ROOT = Path(__file__).resolve().parents[2]

# Tiny defaults, in the canonical HF names; translated to each config class's own field names
# through its attribute_map, and skipped where the class has no such field.
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "use_cache": True,
}

# Weight init (chosen so that the residual stream is O(1) and grows across layers, and logits have
# a standard deviation of order 1; see tests/test_zoo.py for the measured bounds).
EMBED_STD = 1.0  # token/position embeddings (untied)
TIED_EMBED_GAIN = 2.0  # tied embeddings: std = gain / sqrt(hidden) so logits stay O(1)
LINEAR_GAIN = 1.0  # matrices: std = gain / sqrt(fan_in)
BIAS_STD = 0.1  # biases initialised at zero get this much noise
NORM_NOISE = 0.05  # norm weights (and other 1-D parameters) get HF init + this much noise


# ----------------------------------------------------------------------------------- paths


def zoo_home() -> Path:
    """The private HF_HOME of the zoo: ``$INTERP_ZOO_HOME`` or ``<repo>/.zoo-cache``."""
    env = os.environ.get("INTERP_ZOO_HOME")
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".zoo-cache"


def zoo_hub_cache(root: Path | str | None = None) -> Path:
    """The hub cache inside the zoo home (usable as ``cache_dir=`` or ``HF_HUB_CACHE``)."""
    return (Path(root) if root is not None else zoo_home()) / "hub"


def get_entry(name: str) -> ZooEntry:
    if name in ZOO:
        return ZOO[name]
    return ZOO[canonical_name(name)]  # raises a ValueError naming the closest entries


def _lib_versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__.split("+")[0],
    }


@functools.lru_cache(maxsize=1)
def _recipe_digest() -> str:
    """Digest of the build recipe's source (this file and the tokenizer), so editing the recipe
    rebuilds every twin even if ZOO_VERSION was not bumped."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in ("build.py", "tokenizer.py"):
        h.update((here / f).read_bytes())
    return h.hexdigest()


def snapshot_hash(entry: ZooEntry) -> str:
    """40-hex revision of the entry's snapshot: ZOO_VERSION, the entry's content, the recipe source
    and the versions of transformers / tokenizers / torch (deterministic)."""
    text = json.dumps(
        {
            "zoo_version": ZOO_VERSION,
            "entry": entry.canonical(),
            "recipe": _recipe_digest(),
            "libs": _lib_versions(),
        },
        sort_keys=True,
    )
    return hashlib.sha1(text.encode()).hexdigest()


def snapshot_dir(name: str, root: Path | str | None = None) -> Path:
    entry = get_entry(name)
    return zoo_hub_cache(root) / entry.repo_folder / "snapshots" / snapshot_hash(entry)


def is_complete(snap: Path) -> bool:
    """True when a snapshot dir holds a finished build (marker written last, before the rename)."""
    return (
        (snap / "config.json").is_file()
        and (snap / "model.safetensors").is_file()
        and (snap / "tokenizer.json").is_file()
        and (snap / MARKER).is_file()
    )


# ----------------------------------------------------------------------------------- config


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(("zoo:" + name).encode()).digest()[:4], "little")


def build_config(entry: ZooEntry) -> PretrainedConfig:
    """The tiny ``PretrainedConfig`` of an entry: tiny defaults, the entry's overrides on top."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[entry.model_type]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    amap = dict(getattr(cls, "attribute_map", {}) or {})

    def canon(key: str) -> str:
        if key in fields:
            return key
        return amap.get(key, key)

    base = dict(TINY_DEFAULTS)
    base["num_hidden_layers"] = entry.layers
    base.update(special_token_ids())
    base.pop("unk_token_id")
    kwargs: dict[str, Any] = {}
    for key, value in base.items():
        key = canon(key)
        if key in fields:
            kwargs[key] = value
    for key, value in entry.overrides.items():
        kwargs[canon(key)] = json.loads(json.dumps(value))  # deep copy
    cfg = AutoConfig.for_model(entry.model_type, **kwargs)
    n_layers = getattr(cfg, "num_hidden_layers", None)
    if n_layers != entry.layers:
        raise ValueError(f"{entry.name}: config has {n_layers} layers, entry says {entry.layers}")
    return cfg


def attention_head_dims(cfg: PretrainedConfig) -> dict[str, int]:
    """Per-head widths an attention kernel sees: ``{"head_dim": d}``, or for MLA (DeepSeek V2/V3)
    ``{"qk_head_dim", "v_head_dim", "mla_latent"}`` (vLLM's MLA cache width kv_lora_rank + rope)."""
    if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_rope_head_dim", None):
        return {
            "qk_head_dim": int(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
            "v_head_dim": int(cfg.v_head_dim),
            "mla_latent": int(cfg.kv_lora_rank + cfg.qk_rope_head_dim),
        }
    head_dim = getattr(cfg, "head_dim", None)
    if not head_dim:
        head_dim = cfg.hidden_size // cfg.num_attention_heads
    return {"head_dim": int(head_dim)}


# ----------------------------------------------------------------------------------- weights


def reinit_weights(model: PreTrainedModel, seed: int) -> None:
    """Seeded re-initialisation that keeps activations non-degenerate (in place)."""
    import torch
    from torch import nn

    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover
        Conv1D = ()  # type: ignore[assignment]

    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    hidden = int(getattr(cfg, "hidden_size", 128) or 128)
    in_emb = model.get_input_embeddings()
    out_emb = model.get_output_embeddings()
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight

    def normal(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    seen: set[int] = set()
    with torch.no_grad():
        for _mod_name, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen or not p.dtype.is_floating_point:
                    continue
                seen.add(id(p))
                data = p.data
                flat = data.detach().float()
                constant = flat.numel() > 0 and bool((flat == flat.reshape(-1)[0]).all())
                if isinstance(module, nn.Embedding) and pname == "weight":
                    std = TIED_EMBED_GAIN / hidden**0.5 if (tied and p is in_emb.weight) else EMBED_STD
                    new = normal(data.shape, std)
                elif isinstance(module, nn.Linear) and pname == "weight":
                    new = normal(data.shape, LINEAR_GAIN / data.shape[1] ** 0.5)
                elif Conv1D and isinstance(module, Conv1D) and pname == "weight":
                    new = normal(data.shape, LINEAR_GAIN / data.shape[0] ** 0.5)
                elif isinstance(module, nn.Conv1d) and pname == "weight":
                    fan_in = data.shape[1] * data.shape[2]
                    new = normal(data.shape, LINEAR_GAIN / fan_in**0.5)
                elif pname.endswith("bias") and constant and float(flat.reshape(-1)[0]) == 0.0:
                    new = normal(data.shape, BIAS_STD)
                elif data.dim() >= 2 and not constant:
                    # raw matrices (stacked experts, hyper-connection maps): F.linear layout
                    # (..., out, in) unless the experts module declares transposed (..., in, out)
                    transposed = bool(getattr(module, "is_transposed", False)) and data.dim() == 3
                    fan_in = data.shape[-2] if transposed else data.shape[-1]
                    new = normal(data.shape, LINEAR_GAIN / fan_in**0.5)
                else:
                    # norm weights (ones, or zeros for (1 + w) norms), scalars, mamba A_log/D/dt_bias,
                    # attention sinks, router correction biases: keep the HF init, add small noise
                    new = flat + normal(data.shape, NORM_NOISE)
                data.copy_(new.to(data.dtype))


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the sorted tensors of a state dict (names, shapes, dtypes and bytes)."""
    import torch

    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().cpu().contiguous()
        h.update(key.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


CALIBRATION_TEXT = "The capital of France is Paris, and the quick brown fox jumps over the lazy dog."


def _pow2(x: float) -> float:
    """Nearest power of two (exact to multiply by, and robust to last-bit differences across CPUs)."""
    return float(2.0 ** round(math.log2(x)))


_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm")


def _final_norm_weight(model):
    """The weight of the norm that feeds the lm_head, when it is a plain (ones-initialised) scale."""
    base = getattr(model, "base_model", model)
    for name in _FINAL_NORM_NAMES:
        mod = getattr(base, name, None)
        w = getattr(mod, "weight", None)
        if w is not None and w.dim() == 1 and 0.8 < float(w.detach().float().mean()) < 1.2:
            return w
    return None


def calibrate_scales(model: PreTrainedModel, max_rounds: int = 6) -> dict[str, float]:
    """Rescale by powers of two where a family's multipliers would otherwise make the twin
    degenerate (Falcon-H1 embedding_multiplier 5.7 and lm_head_multiplier 1/25.6, Cohere logit_scale
    1/16, Granite logits_scaling 8-16), as trained checkpoints' weights compensate their
    multipliers: the embedding output RMS is brought into [0.05, 3] (scaling the input embedding)
    and the logits std into [0.5, 20] (scaling the lm_head, or for tied embeddings the final norm's
    weight). Returns the factors applied."""
    import torch

    tok = build_tokenizer()
    ids = tok(CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
    in_emb = model.get_input_embeddings()
    out_emb = model.get_output_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    final_w = _final_norm_weight(model) if tied else None
    applied = {"embedding": 1.0, "lm_head": 1.0, "final_norm": 1.0}
    with torch.no_grad():
        for _ in range(max_rounds):
            out = model(ids, output_hidden_states=True)
            r0 = float(out.hidden_states[0].float().pow(2).mean().sqrt())
            s = float(out.logits.float().std())
            if not 0.05 <= r0 <= 3.0:
                f = _pow2(1.0 / r0)
                in_emb.weight.mul_(f)  # type: ignore[operator]  # nn.Module.__getattr__ is typed Tensor | Module
                applied["embedding"] *= f
                continue
            if out_emb is not None and not 0.5 <= s <= 20.0:
                f = _pow2(1.0 / s)
                if not tied:
                    out_emb.weight.mul_(f)
                    applied["lm_head"] *= f
                elif final_w is not None:
                    final_w.mul_(f)
                    applied["final_norm"] *= f
                else:
                    break  # tied without a plain final norm: leave as is (the tests will say)
                continue
            break
    return applied


def make_model(entry: ZooEntry) -> PreTrainedModel:
    """Instantiate the twin in memory (float32, eval mode), seeded by the entry's name."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = build_config(entry)
    seed = _seed(entry.name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    reinit_weights(model, seed)
    model.eval()
    calibrate_scales(model)
    ids = special_token_ids()
    model.generation_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )
    return model.eval()


# ----------------------------------------------------------------------------------- writing


def _sweep_tmp(tmp_root: Path, max_age_s: float = 3600.0) -> None:
    """Remove leftover temp build dirs whose builder is gone (dead pid, or older than max_age)."""
    if not tmp_root.is_dir():
        return
    now = time.time()
    for d in tmp_root.iterdir():
        pid = None
        parts = d.name.rsplit(".", 2)
        if len(parts) == 3 and parts[1].isdigit():
            pid = int(parts[1])
        alive = pid == os.getpid()  # this process's own builds clean up after themselves
        if pid is not None and not alive:
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        try:
            old = now - d.stat().st_mtime > max_age_s
        except FileNotFoundError:
            continue
        if not alive or old:
            shutil.rmtree(d, ignore_errors=True)


def install_snapshot(work: Path, repo: Path, rev: str, tmp_root: Path) -> None:
    """Make the finished build directory `work` the repo's snapshot `rev`, atomically, point
    refs/main at it and drop older revisions (the tiny and the real-size builders share this)."""
    snap = repo / "snapshots" / rev
    snap.parent.mkdir(parents=True, exist_ok=True)
    if snap.exists():
        # force, or a damaged snapshot: move it aside first (rename is atomic), then drop it
        trash = tmp_root / f"trash-{rev[:12]}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(snap, trash)
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(work, snap)
    except OSError:
        # another process finished the same snapshot first: keep theirs
        if not is_complete(snap):
            raise
        shutil.rmtree(work, ignore_errors=True)
    ref = repo / "refs" / "main"
    write_atomic(ref, rev)
    for other in snap.parent.iterdir():  # older revisions of this repo
        if other.name != rev and other.is_dir():
            shutil.rmtree(other, ignore_errors=True)


def build_twin(name: str, root: Path | str | None = None, force: bool = False) -> Path:
    """Build (if missing, or always with ``force``) the twin of ``name``; return its snapshot dir."""
    entry = get_entry(name)
    hub = zoo_hub_cache(root)
    rev = snapshot_hash(entry)
    repo = hub / entry.repo_folder
    snap = repo / "snapshots" / rev
    ref = repo / "refs" / "main"
    if not force and is_complete(snap):
        if not ref.is_file() or ref.read_text().strip() != rev:
            write_atomic(ref, rev)
        return snap

    tmp_root = hub.parent / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    _sweep_tmp(tmp_root)
    work = tmp_root / f"{entry.repo_folder}-{rev[:12]}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    work.mkdir()
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = make_model(entry)
        model.save_pretrained(work)
        build_tokenizer().save_pretrained(work)
        digest = weights_digest(model.state_dict())
        marker = {
            "synthetic_twin": True,
            "name": entry.name,
            "model_type": entry.model_type,
            "revision": rev,
            "zoo_version": ZOO_VERSION,
            "seed": _seed(entry.name),
            "weights_sha256": digest,
            "entry": json.loads(entry.canonical()),
            "notes": entry.notes,
            "libs": _lib_versions(),
        }
        (work / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True, default=repr))
        install_snapshot(work, repo, rev, tmp_root)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return snap


def read_marker(snap: Path) -> dict:
    return json.loads((Path(snap) / MARKER).read_text())
