"""Synthetic offline model zoo: tiny twins of real HF checkpoints, loadable by repo id offline.

Each entry of :data:`ZOO` is named after a real checkpoint (``"Qwen/Qwen3-8B"``) and is built as a
tiny model with that checkpoint's architecture and quirks and seeded random weights, written into a
private Hugging Face cache (never the user's own), so that HF, TransformerLens, nnsight and vLLM all
load it by name::

    from engine import zoo
    model, tok = zoo.load_twin("google/gemma-2-2b")        # HF model (float32, eval) + tokenizer
    zoo.ensure_twin("Qwen/Qwen3-8B")                       # build only; returns the snapshot dir
    subprocess.run(cmd, env={**os.environ, **zoo.offline_env()})   # other processes load by name
    with zoo.offline_session():                            # this process: TL bridge, nnsight, vLLM
        TransformerBridge.boot_transformers("google/gemma-2-2b", device="cpu")

``offline_env()`` only takes effect in a process that has not imported huggingface_hub yet (it reads
the environment at import); ``offline_session()`` also patches the already-imported constants.
The zoo home is ``$INTERP_ZOO_HOME`` or ``<repo>/.zoo-cache``; a twin's snapshot carries a
``zoo_twin.json`` marker, and :func:`real_checkpoint_available` never mistakes a twin for real weights.

Sizes: every entry also builds at the checkpoint's real dimensions (engine/zoo/real.py, seeded random
weights, for real-shape throughput). ``$INTERP_ZOO_SIZE=real`` (or ``--size real`` on the CLI) makes
this process's ``ensure_twin`` / ``load_twin`` / ``zoo_hub_cache`` / ``offline_env`` use the real-size
twins, which live in their own hub cache (engine/zoo/sizes.py); tiny stays the default.

CLI: ``python -m engine.zoo list [PATTERNS]``, ``python -m engine.zoo build [--all | NAMES...] [--force]``,
``python -m engine.zoo path NAME``, ``python -m engine.zoo env`` (each with ``--size tiny|real``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from . import build, sizes
from .build import (
    MARKER,
    ZOO_VERSION,
    build_config,
    build_twin,
    is_complete,
    read_marker,
    snapshot_hash,
    zoo_home,
)
from .entries import DROPPED, ZOO, ZooEntry
from .names import canonical_name, hub_id, resolve
from .real import REAL
from .sizes import SIZE_ENV, SIZES, current_size
from .tokenizer import build_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ZOO",
    "ZooEntry",
    "DROPPED",
    "ZOO_VERSION",
    "zoo_home",
    "zoo_hub_cache",
    "ensure_twin",
    "canonical_name",
    "hub_id",
    "load_twin",
    "resolve",
    "offline_env",
    "offline_session",
    "real_checkpoint_available",
    "is_twin",
    "build_config",
    "build_twin",
    "build_tokenizer",
    "snapshot_dir",
    "REAL",
    "SIZES",
    "SIZE_ENV",
    "current_size",
    "is_complete",
    "read_marker",
    "snapshot_hash",
]

def ensure_twin(name: str, size: str | None = None) -> Path:
    """Build the twin of ``name`` in the zoo cache if it is missing; return its snapshot dir.
    ``size`` defaults to this process's (``$INTERP_ZOO_SIZE``, else tiny)."""
    return sizes.ensure(canonical_name(name), size)


def zoo_hub_cache(root: Path | str | None = None, size: str | None = None) -> Path:
    """The hub cache of this process's twin size (``root`` given: that zoo home's tiny hub)."""
    if root is not None:
        return build.zoo_hub_cache(root)
    return sizes.hub_cache(size)


def snapshot_dir(name: str, root: Path | str | None = None, size: str | None = None) -> Path:
    """The snapshot dir of the twin of ``name`` at this process's size (``root`` given: tiny there)."""
    if root is not None:
        return build.snapshot_dir(name, root)
    return sizes.snapshot_dir(canonical_name(name), size)


def load_twin(name: str, dtype: torch.dtype = torch.float32,
              **from_pretrained_kwargs: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(hf_model, tokenizer) of the twin, loaded by repo id from the zoo cache offline, eval mode.

    Builds the twin first if it is missing. Extra keyword arguments (``attn_implementation=...``,
    ``device_map=...``) go to ``AutoModelForCausalLM.from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = canonical_name(name)
    ensure_twin(name)
    cache = zoo_hub_cache()
    model = AutoModelForCausalLM.from_pretrained(
        name, cache_dir=cache, local_files_only=True, dtype=dtype, **from_pretrained_kwargs
    )
    tok = AutoTokenizer.from_pretrained(name, cache_dir=cache, local_files_only=True)
    return model.eval(), tok


def offline_env(size: str | None = None) -> dict[str, str]:
    """Environment that makes any HF-based library load twins by repo id from the zoo, offline.

    ``HF_HUB_CACHE`` points at the zoo hub (of ``size``, default this process's); ``HF_HOME`` at the
    zoo home so that nothing from the user's own HF home (token, real weights) is seen either. Set it
    before importing the library (huggingface_hub reads these at import time) or pass it to a
    subprocess. A real size is passed on as ``$INTERP_ZOO_SIZE`` so the subprocess builds that size.
    """
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(zoo_home()),
        "HF_HUB_CACHE": str(zoo_hub_cache(size=size)),
    }
    size = size or current_size()
    if size != "tiny":
        env[SIZE_ENV] = size
    return env


@contextlib.contextmanager
def offline_session() -> Iterator[dict[str, str]]:
    """Context manager: apply :func:`offline_env` to ``os.environ`` *and* to an already-imported
    ``huggingface_hub.constants`` (which read the environment only at import), so that libraries
    in this process (TransformerLens bridge, nnsight, transformers) load twins by repo id.
    Everything is restored on exit."""
    env = offline_env()
    saved_env = {k: os.environ.get(k) for k in env}
    patched: dict[str, object] = {}
    os.environ.update(env)
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover
        constants = None  # type: ignore[assignment]
    if constants is not None:
        for attr, value in (
            ("HF_HUB_CACHE", env["HF_HUB_CACHE"]),
            ("HUGGINGFACE_HUB_CACHE", env["HF_HUB_CACHE"]),
            ("HF_HOME", env["HF_HOME"]),
            ("HF_HUB_OFFLINE", True),
        ):
            if hasattr(constants, attr):
                patched[attr] = getattr(constants, attr)
                setattr(constants, attr, value)
    try:
        yield env
    finally:
        for attr, old in patched.items():
            setattr(constants, attr, old)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _user_hub_cache() -> Path:
    """The user's normal hub cache, never the zoo's (even when offline_env() is in os.environ)."""
    from huggingface_hub import constants

    zoo = zoo_home().resolve()
    candidate = Path(constants.HF_HUB_CACHE).expanduser()
    try:
        inside_zoo = candidate.resolve().is_relative_to(zoo)
    except OSError:
        inside_zoo = False
    if not inside_zoo:
        return candidate
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def is_twin(path: str | os.PathLike) -> bool:
    """True when ``path`` (a snapshot dir or a file in one) is a zoo twin (has the zoo marker)."""
    p = Path(path)
    d = p if p.is_dir() else p.parent
    return (d / MARKER).is_file()


def real_checkpoint_available(name: str) -> bool:
    """True when the real checkpoint's config.json is in the user's normal HF cache (never the zoo)."""
    from huggingface_hub import try_to_load_from_cache

    cache = _user_hub_cache()
    try:
        found = try_to_load_from_cache(repo_id=name, filename="config.json", cache_dir=str(cache))
    except Exception:
        return False
    if not isinstance(found, str):
        return False
    try:
        if Path(found).resolve().is_relative_to(zoo_home().resolve()):
            return False
    except OSError:
        return False
    return not is_twin(found)
