"""One name resolution for every backend: what a model name means and where its files are.

    src = resolve("meta-llama/llama-3.2-1b")     # repo ids match case-insensitively
    src.path      # the local directory every loader reads (nothing ever downloads)
    src.source    # "local" (a directory the user gave), "real" (the user's HF cache), "zoo" (tiny twin)
    src.name      # canonical name: the repo id as the zoo / HF cache spells it, or the directory

A bare legacy id resolves as the hub redirects it (`gpt2` -> `openai-community/gpt2`). A name is, in
this order: a local model directory (it must hold config.json, weights and a tokenizer;
whatever is missing is named), a repo id of a real checkpoint in the user's HF cache (source "auto"
or "real"), or a zoo entry (source "auto" or "zoo"). Resolution only looks at the local file system:
it never reaches the network, and loaders are handed the directory with local_files_only=True.
The validator and the benchmarks expand their `--models` / `--model` through :func:`expand` and
:func:`resolve` too.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from engine.core.errors import ModelNotFoundError, OptionError

SOURCES = ("auto", "zoo", "real", "local")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
_GLOB = set("*?[")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model name. `path` is always a local directory."""
    name: str  # canonical: repo id as the zoo / HF cache spells it, or the directory's absolute path
    path: str  # directory to load from (local_files_only)
    source: str  # "local" | "real" | "zoo"
    repo_id: str | None  # canonical repo id; None for a local directory
    asked: str  # what the caller passed

    def fingerprint(self) -> str:
        """Identifies the weights: snapshot folder for zoo / real, a digest of the files for a directory."""
        if self.source != "local":
            return f"{self.source}:{Path(self.path).name}"
        h = hashlib.sha256()
        p = Path(self.path)
        h.update((p / "config.json").read_bytes())
        for f in sorted(p.iterdir()):
            if f.is_file() and f.name != "config.json":
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return f"local:{h.hexdigest()[:16]}"


def check_source(source: str) -> str:
    if source not in SOURCES:
        raise OptionError(f"source must be one of {SOURCES}, got {source!r}: 'auto' (a local directory, "
                          f"else the real checkpoint if cached, else its zoo twin), 'zoo', 'real' or 'local'.")
    return source


def looks_like_path(name: str) -> bool:
    """A name that can only be a file-system path (a repo id is 'org/name' or 'name')."""
    return (name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or name in (".", "..")
            or name.count("/") > 1 or "\\" in name or os.path.isdir(name))


def resolve(name: str | os.PathLike, source: str = "auto", build: bool = True) -> ModelSource:
    """Resolve `name` (a directory, or a repo id in any letter case) for `source`; build the zoo twin
    when it is the answer and `build` is set. Raises ModelNotFoundError / OptionError naming the fix."""
    check_source(source)
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name.strip():
        raise ModelNotFoundError(f"a model name must be a non-empty string (a repo id such as "
                                 f"'meta-llama/Llama-3.2-1B' or a model directory), got {name!r}.")
    asked, name = name, name.strip()
    if looks_like_path(name) or source == "local":
        return _local(asked, name, source)
    if _GLOB & set(name):
        raise ModelNotFoundError(f"{name!r} is a pattern; load_model takes one model name (`python -m engine.zoo "
                                 f"list {name!r}` prints the zoo names it matches).")
    from engine import zoo
    # a bare legacy id (`gpt2`) is also looked up as the hub redirects it (`openai-community/gpt2`)
    real = (real_repo_id(name) or real_repo_id(zoo.hub_id(name))) if source in ("auto", "real") else None
    if source == "real" and real is None:
        raise ModelNotFoundError(f"{name!r} is not in the local HF model cache ({zoo._user_hub_cache()}); "
                                 f"download it first (huggingface-cli download {name}) or use source='zoo' "
                                 f"for its tiny twin.")
    if real is not None:
        return ModelSource(real, _real_snapshot(real), "real", real, asked)
    try:
        canon = zoo.canonical_name(name)
    except ValueError as e:
        where = "" if source == "zoo" else (" It is not a local directory or a checkpoint in the local HF "
                                            f"cache ({zoo._user_hub_cache()}) either.")
        raise ModelNotFoundError(f"{str(e).rstrip('.')}.{where}") from None
    path = zoo.ensure_twin(canon) if build else zoo.snapshot_dir(canon)  # this process's twin size
    return ModelSource(canon, str(path), "zoo", canon, asked)


def expand(patterns: Iterable[str]) -> list[str]:
    """Model names for CLIs (`--models`): model directories (as absolute paths), zoo names in any
    case, and zoo globs; every zoo name when `patterns` is empty. Unknown names raise ValueError
    naming the closest zoo names. Nothing is built or loaded."""
    from engine import zoo
    if not patterns:
        return list(zoo.ZOO)
    out: list[str] = []
    for p in patterns:
        if isinstance(p, str) and looks_like_path(p.strip()):
            names = [resolve(p, "local").name]
        else:
            try:
                names = zoo.resolve(p)
            except ValueError as e:
                raise ModelNotFoundError(str(e)) from None
        out += [n for n in names if n not in out]
    return out


def for_cli(name: str, real: bool = False) -> ModelSource:
    """A CLI's `--model NAME` (with `--real`: the cached real checkpoint): a model directory, or the
    canonical repo id of the zoo twin / real checkpoint. Nothing is built or loaded."""
    if isinstance(name, str) and looks_like_path(name.strip()):
        return resolve(name, "local")
    return resolve(name, "real" if real else "zoo", build=False)


# -- local directories ---------------------------------------------------------------------------------
def _local(asked: str, name: str, source: str) -> ModelSource:
    p = Path(name).expanduser()
    if source == "zoo":
        raise OptionError(f"{name!r} is a path, but source='zoo' loads a zoo twin by repo id; use "
                          f"source='auto' (or 'local') to load the directory.")
    if not p.exists():
        raise ModelNotFoundError(f"no model directory at {name!r} ({p.resolve()} does not exist); give the "
                                 f"directory that model.save_pretrained(...) wrote, or a repo id.")
    if not p.is_dir():
        raise ModelNotFoundError(f"{name!r} is a file; give the directory that holds it and config.json "
                                 f"(what model.save_pretrained(...) wrote).")
    p = p.resolve()
    problem = directory_problem(p)
    if problem:
        raise ModelNotFoundError(f"{name!r} is not a loadable model directory: {problem}")
    return ModelSource(str(p), str(p), "local", None, asked)


def directory_problem(p: Path) -> str | None:
    """What a model directory lacks (config.json, weights, tokenizer), with the fix; None if complete."""
    files = sorted(f.name for f in p.iterdir()) if p.is_dir() else []
    if not (p / "config.json").is_file():
        inner = sorted(str(c.parent.relative_to(p)) for c in p.glob("*/config.json"))
        inner += sorted(str(c.parent.relative_to(p)) for c in p.glob("snapshots/*/config.json"))
        if inner:
            return (f"it has no config.json, but these subdirectories hold saved models: "
                    f"{', '.join(inner[:5])}; point at one of them.")
        listing = ", ".join(files[:8]) + (" ..." if len(files) > 8 else "") if files else "nothing"
        return (f"it has no config.json (it holds {listing}); save the model there with "
                f"model.save_pretrained(path) and tokenizer.save_pretrained(path).")
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"its config.json cannot be read as JSON ({e}); write it again with model.save_pretrained(path)."
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        return "its config.json has no model_type; write it with model.save_pretrained(path)."
    if not (any((p / w).is_file() for w in WEIGHT_FILES) or any(p.glob("*.safetensors"))
            or any(p.glob("pytorch_model*.bin"))):
        return (f"it has config.json but no weights ({', '.join(WEIGHT_FILES[::2])} or shards); save them "
                f"with model.save_pretrained(path).")
    if not any((p / t).is_file() for t in TOKENIZER_FILES):
        return (f"it has config.json and weights but no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); "
                f"save the tokenizer next to the model with tokenizer.save_pretrained(path).")
    return None


# -- the user's HF cache ---------------------------------------------------------------------------------
def real_repo_id(name: str) -> str | None:
    """The repo id of a real checkpoint cached under `name` (matched case-insensitively), or None."""
    from engine import zoo
    if zoo.real_checkpoint_available(name):
        return name
    want = "models--" + name.replace("/", "--").lower()
    try:
        folders = [d.name for d in zoo._user_hub_cache().iterdir() if d.name.lower() == want]
    except OSError:
        return None
    for folder in folders:
        repo = folder[len("models--"):].replace("--", "/", 1)
        if repo != name and zoo.real_checkpoint_available(repo):
            return repo
    return None


def _real_snapshot(repo_id: str) -> str:
    from huggingface_hub import try_to_load_from_cache

    from engine import zoo
    found = try_to_load_from_cache(repo_id=repo_id, filename="config.json", cache_dir=str(zoo._user_hub_cache()))
    return str(Path(found).parent)
