"""SAELens's on-disk SAE format, read and written without SAELens: a folder holding `cfg.json` and
`sae_weights.safetensors`.

cfg.json (SAELens 6.x): `architecture`, `d_in`, `d_sae`, `dtype`, `apply_b_dec_to_input`,
`normalize_activations`, `reshape_activations`, the architecture's own fields (`k` and
`rescale_acts_by_decoder_norm` for topk, `d_out` for transcoders) and `metadata` (`hook_name`,
`hook_name_out`, `sae_lens_version`, ...). Configs written before 6.0 (no metadata version) keep
the hook and activation fields at the top level under older names; they are read too. Fields this
module does not use (training settings, dataset names) are ignored, as SAELens ignores them.

Every malformed input is refused with the file and the field (or tensor) named. `cached_sae` keeps
loaded SAEs per process (workers and servers reuse them across requests). `random_sae` /
`write_random_sae` make seeded test SAEs of every architecture in the same format.
"""
from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.errors import SAEError, closest
from engine.core.files import write_atomic
from engine.core.sae import ARCHITECTURES, NORMS, REFUSED_ARCHITECTURES, SAE

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
FORMAT_VERSION = "6.0.0"  # the cfg.json layout written here (SAELens reads older layouts by this number)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(value: "str | torch.dtype", where: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return DTYPES[value.removeprefix("torch.")]
    raise SAEError(f"{where} is {value!r}; use one of {', '.join(DTYPES)}.")


def _read_cfg(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SAEError(f"{path}: missing; an SAELens SAE folder holds {CFG_FILE} and {WEIGHTS_FILE}.")
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SAEError(f"{path}: not valid JSON ({e}).") from None
    if not isinstance(cfg, dict):
        raise SAEError(f"{path}: holds a {type(cfg).__name__}; expected a JSON object of SAE settings.")
    return cfg


def _modern(cfg: dict[str, Any]) -> dict[str, Any]:
    """A pre-6.0 cfg.json's fields under their 6.x names (hook names moved into `metadata`)."""
    meta = cfg.get("metadata")
    version = (meta.get("sae_lens_version") if isinstance(meta, dict) else None) or cfg.get("sae_lens_version")
    try:
        major = int(str(version).split(".")[0]) if version else 0
    except ValueError:
        major = 0
    if major >= 6:
        return cfg
    out = dict(cfg)
    for old, new in (("hook_point", "hook_name"), ("activation_fn_str", "activation_fn")):
        if old in out and new not in out:
            out[new] = out.pop(old)
    out.setdefault("architecture", "standard")
    out.setdefault("apply_b_dec_to_input", True)
    kwargs = out.get("activation_fn_kwargs")
    if out.get("activation_fn") == "topk" and isinstance(kwargs, dict) and kwargs.get("k") is not None:
        out["architecture"], out["k"] = "topk", kwargs["k"]
    if isinstance(out.get("normalize_activations"), bool):
        out["normalize_activations"] = "expected_average_only_in" if out["normalize_activations"] else "none"
    return out


class _Fields:
    """Typed reads of one cfg.json, each error naming the file and the field."""

    def __init__(self, cfg: dict[str, Any], path: Path) -> None:
        self.cfg, self.path = cfg, path

    def raw(self, name: str, default: Any = None) -> Any:
        meta = self.cfg.get("metadata")
        if name not in self.cfg and isinstance(meta, dict) and name in meta:
            return meta[name]
        return self.cfg.get(name, default)

    def need(self, name: str) -> Any:
        if self.raw(name) is None:
            raise SAEError(f"{self.path}: field {name!r} is missing.")
        return self.raw(name)

    def int(self, name: str, what: str) -> int:
        v = self.need(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SAEError(f"{self.path}: field {name!r} is {v!r}; expected a positive integer ({what}).")
        return v

    def bool(self, name: str, default: bool) -> bool:
        v = self.raw(name, default)
        if not isinstance(v, bool):
            raise SAEError(f"{self.path}: field {name!r} is {v!r}; expected true or false.")
        return v

    def choice(self, name: str, options: "tuple[str, ...]", default: str) -> str:
        v = self.raw(name, default)
        if v is None:
            v = default
        if v not in options:
            raise SAEError(f"{self.path}: field {name!r} is {v!r}; known values: {', '.join(options)}.")
        return v

    def str(self, name: str) -> str | None:
        v = self.raw(name)
        if v is not None and not isinstance(v, str):
            raise SAEError(f"{self.path}: field {name!r} is {v!r}; expected a hook name (a string).")
        return v


def _read_weights(path: Path, device: "torch.device | str") -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise SAEError(f"{path}: missing; an SAELens SAE folder holds {CFG_FILE} and {WEIGHTS_FILE}.")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise SAEError(f"{path}: not a readable safetensors file ({e}).") from None


def _check_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], path: Path,
                   cfg_path: Path) -> None:
    missing = [k for k in shapes if k not in tensors]
    if missing:
        raise SAEError(f"{path}: tensor(s) {', '.join(missing)} missing; this architecture needs "
                       f"{', '.join(shapes)} (is 'architecture' in {cfg_path.name} right?).")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise SAEError(f"{path}: unexpected tensor(s) {', '.join(extra)} for this architecture (it reads "
                       f"{', '.join(shapes)}); is 'architecture' in {cfg_path.name} right?")
    for name, want in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != want:
            raise SAEError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}; {cfg_path.name} (d_in, d_sae, d_out) "
                           f"says {want}.")
        if not torch.is_floating_point(t):
            raise SAEError(f"{path}: tensor {name!r} has dtype {t.dtype}; expected floating weights.")
        if not torch.isfinite(t).all():
            raise SAEError(f"{path}: tensor {name!r} contains NaN or inf.")


@dataclass(frozen=True)
class SAEHeader:
    """An SAE's facts from its cfg.json alone (no weights read): what a call's feature steers and SAE
    readouts are checked against before anything runs, where the SAE itself is loaded later (a vLLM
    worker)."""
    d_in: int
    d_sae: int
    arch: Any  # engine.core.sae.Arch
    source: str

    def where(self) -> str:
        return self.source


def sae_header(spec: Any, where: str = "sae") -> Any:
    """The facts of the SAE `spec` names: a loaded SAE (itself), or a folder in SAELens's format (an
    SAEHeader from its cfg.json); an SAEError naming `where` when there is no such folder."""
    if not isinstance(spec, (str, Path)):
        return spec
    folder = Path(spec)
    if not folder.is_dir():
        raise SAEError(f"{where}: {str(spec)!r} is not a directory (an SAE in SAELens's format: {CFG_FILE} + "
                       f"{WEIGHTS_FILE}).")
    cfg_path = folder / CFG_FILE
    f = _Fields(_modern(_read_cfg(cfg_path)), cfg_path)
    name = f.need("architecture")
    if name not in ARCHITECTURES:
        raise SAEError(f"{cfg_path}: field 'architecture' is {name!r}, which this loader does not implement; "
                       f"implemented: {', '.join(ARCHITECTURES)}.")
    return SAEHeader(f.int("d_in", "the width of the activation the SAE reads"),
                     f.int("d_sae", "the number of features"), ARCHITECTURES[name], str(folder))


def sae_widths(directory: "str | Path") -> tuple[int, int]:
    """(d_in, d_sae) of an SAELens-format folder from its cfg.json alone (no weights read): what a
    caller checks feature indices and top-k sizes against before anything runs."""
    h = sae_header(directory)
    return h.d_in, h.d_sae


def load_sae(directory: "str | Path", *, device: "torch.device | str" = "cpu",
             dtype: "torch.dtype | str | None" = None, norm_scaling_factor: float | None = None) -> SAE:
    """Load an SAELens-format SAE or transcoder from a local folder.

    dtype: override the cfg.json `dtype` (the weights are cast, as SAELens does). norm_scaling_factor:
    required when `normalize_activations` is expected_average_only_in (the input is multiplied by it and
    the reconstruction divided; 1.0 when the factor is folded into the weights, as SAELens assumes)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise SAEError(f"{folder}: no such folder; give the folder that holds {CFG_FILE} and {WEIGHTS_FILE}.")
    cfg_path, weights_path = folder / CFG_FILE, folder / WEIGHTS_FILE
    cfg = _modern(_read_cfg(cfg_path))
    f = _Fields(cfg, cfg_path)
    name = f.need("architecture")
    if name in REFUSED_ARCHITECTURES:
        raise SAEError(f"{cfg_path}: field 'architecture' is {name!r}, which this loader refuses: "
                       f"{REFUSED_ARCHITECTURES[name]}. Implemented: {', '.join(ARCHITECTURES)}.")
    if name not in ARCHITECTURES:
        raise SAEError(f"{cfg_path}: field 'architecture' is {name!r}, an unknown architecture; "
                       f"implemented: {', '.join(ARCHITECTURES)}.")
    arch = ARCHITECTURES[name]
    d_in = f.int("d_in", "the width of the activation the SAE reads")
    d_sae = f.int("d_sae", "the number of features")
    d_out = f.int("d_out", "the width of the point the transcoder writes") if arch.transcoder else d_in
    k = f.int("k", "how many features stay active") if "k" in arch.fields else None
    if k is not None and k > d_sae:
        raise SAEError(f"{cfg_path}: field 'k' is {k}, more than d_sae={d_sae} features.")
    to = _dtype(dtype, "the dtype argument") if dtype is not None else \
        _dtype(f.raw("dtype", "float32"), f"{cfg_path}: field 'dtype'")
    b_dec_in = f.bool("apply_b_dec_to_input", True)
    if arch.transcoder and b_dec_in:
        raise SAEError(f"{cfg_path}: field 'apply_b_dec_to_input' is true for a {name}; a transcoder's b_dec is "
                       f"d_out wide and cannot be subtracted from its input (SAELens refuses it too): set it false.")
    norm = NORMS[f.choice("normalize_activations", tuple(NORMS), "none")]
    if norm.refused:
        raise SAEError(f"{cfg_path}: field 'normalize_activations' is {norm.name!r}: {norm.refused}.")
    if arch.transcoder and norm.name != "none":
        raise SAEError(f"{cfg_path}: field 'normalize_activations' is {norm.name!r} on a {name}; only 'none' is "
                       f"defined for transcoders (the output point has its own scale).")
    if norm.name == "expected_average_only_in":
        if norm_scaling_factor is None:
            raise SAEError(f"{cfg_path}: field 'normalize_activations' is 'expected_average_only_in', whose factor is "
                           f"not in the folder: pass norm_scaling_factor= (1.0 when it is folded into the weights, "
                           f"as SAELens's own load assumes).")
        if isinstance(norm_scaling_factor, bool) or not isinstance(norm_scaling_factor, (int, float)) \
                or not math.isfinite(norm_scaling_factor) or norm_scaling_factor <= 0:
            raise SAEError(f"norm_scaling_factor is {norm_scaling_factor!r}; give a finite positive number.")
    elif norm_scaling_factor is not None:
        raise SAEError(f"norm_scaling_factor applies to expected_average_only_in SAEs; {cfg_path} field "
                       f"'normalize_activations' is {norm.name!r}.")
    hook_z = f.choice("reshape_activations", ("none", "hook_z"), "none") == "hook_z"
    if hook_z and arch.transcoder:
        raise SAEError(f"{cfg_path}: field 'reshape_activations' is 'hook_z' on a {name}; transcoders read flat rows.")
    rescale = f.bool("rescale_acts_by_decoder_norm", False) if name == "topk" else False

    tensors = _read_weights(weights_path, device)
    scaling = tensors.pop("scaling_factor", None)
    if scaling is not None and not bool((scaling == 1).all()):
        raise SAEError(f"{weights_path}: tensor 'scaling_factor' is not all ones (a pre-6.0 finetuning scale); "
                       f"fold it into W_dec and remove it.")
    vec = (d_sae,)
    shapes = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_out), "b_dec": (d_out,), "b_enc": vec, "threshold": vec,
              "b_gate": vec, "b_mag": vec, "r_mag": vec, "W_skip": (d_out, d_in)}
    shapes = {k_: v for k_, v in shapes.items() if k_ in ("W_enc", "W_dec", "b_dec") or k_ in arch.tensors}
    _check_tensors(tensors, shapes, weights_path, cfg_path)
    tensors = {k_: v.to(to) for k_, v in tensors.items()}
    t = tensors.get
    return SAE(arch=arch, W_enc=tensors["W_enc"], W_dec=tensors["W_dec"], b_dec=tensors["b_dec"], b_enc=t("b_enc"),
               threshold=t("threshold"), b_gate=t("b_gate"), b_mag=t("b_mag"), r_mag=t("r_mag"), W_skip=t("W_skip"), k=k, rescale_acts_by_decoder_norm=rescale, apply_b_dec_to_input=b_dec_in,
               norm=norm, norm_scaling_factor=float(norm_scaling_factor or 1.0), hook_z=hook_z,
               hook_name=f.str("hook_name"), hook_name_out=f.str("hook_name_out"), source=folder)


@dataclasses.dataclass(frozen=True)
class SAEHooks:
    """Where an SAE was trained, from its cfg.json alone: the TransformerLens hook it reads
    (`hook_name`), the one a transcoder writes (`hook_name_out`), and whether it is a transcoder."""
    hook_name: str | None
    hook_name_out: str | None
    transcoder: bool
    source: str


_HOOKS: "dict[tuple, SAEHooks]" = {}


def sae_hooks(sae: "str | Path | SAE") -> SAEHooks:
    """The hooks of a loaded SAE, or of an SAE folder read from its cfg.json only (no weights; kept per
    file size and mtime, so a call that names a folder reads it once)."""
    if isinstance(sae, SAE):
        return SAEHooks(sae.hook_name, sae.hook_name_out, sae.arch.transcoder, sae.where())
    cfg_path = Path(sae).resolve() / CFG_FILE
    st = cfg_path.stat() if cfg_path.is_file() else None
    key = (str(cfg_path), st and (st.st_size, st.st_mtime_ns))
    if key not in _HOOKS:
        f = _Fields(_modern(_read_cfg(cfg_path)), cfg_path)
        arch = ARCHITECTURES.get(f.raw("architecture"))
        _HOOKS[key] = SAEHooks(f.str("hook_name"), f.str("hook_name_out"), bool(arch and arch.transcoder),
                               str(Path(sae)))
    return _HOOKS[key]


_CACHE: "OrderedDict[tuple, SAE]" = OrderedDict()
_CACHE_LOCK = threading.Lock()
CACHE_SIZE = 8  # SAEs kept per process (a 65k x 2304 float32 SAE is about 1.2 GB)


def cached_sae(directory: "str | Path", *, device: "torch.device | str" = "cpu",
               dtype: "torch.dtype | str | None" = None, norm_scaling_factor: float | None = None) -> SAE:
    """load_sae, kept per process for the readouts and steers that name the same folder on every request
    (a vLLM worker, a server): keyed by the resolved folder, both files' size and mtime, and the options,
    so a rewritten folder is read again. The last CACHE_SIZE are kept."""
    folder = Path(directory).resolve()
    stats = tuple((st.st_size, st.st_mtime_ns) for st in
                  ((folder / name).stat() for name in (CFG_FILE, WEIGHTS_FILE) if (folder / name).is_file()))
    key = (str(folder), stats, str(device), str(dtype), norm_scaling_factor)
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    sae = load_sae(folder, device=device, dtype=dtype, norm_scaling_factor=norm_scaling_factor)
    with _CACHE_LOCK:
        _CACHE[key] = sae
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return sae


def sae_config(sae: SAE) -> dict[str, Any]:
    """The cfg.json of `sae` in SAELens 6.x's layout."""
    dtype = next(k for k, v in DTYPES.items() if v == sae.dtype)
    cfg: dict[str, Any] = {"architecture": sae.arch.name, "d_in": sae.d_in, "d_sae": sae.d_sae, "dtype": dtype,
                           "device": "cpu", "apply_b_dec_to_input": sae.apply_b_dec_to_input,
                           "normalize_activations": sae.norm.name,
                           "reshape_activations": "hook_z" if sae.hook_z else "none"}
    if sae.k is not None:
        cfg["k"] = sae.k
        cfg["rescale_acts_by_decoder_norm"] = sae.rescale_acts_by_decoder_norm
    if sae.arch.transcoder:
        cfg["d_out"] = sae.d_out
    meta: dict[str, Any] = {"sae_lens_version": FORMAT_VERSION, "sae_lens_training_version": FORMAT_VERSION}
    if sae.hook_name is not None:
        meta["hook_name"] = sae.hook_name
    if sae.hook_name_out is not None:
        meta["hook_name_out"] = sae.hook_name_out
    cfg["metadata"] = meta
    return cfg


def save_sae(sae: SAE, directory: "str | Path") -> Path:
    """Write `sae` as an SAELens folder (cfg.json + sae_weights.safetensors, each written atomically);
    the folder. The expected_average_only_in factor is not part of the format: pass it again to load_sae."""
    from safetensors.torch import save
    folder = Path(directory)
    tensors = {f.name: getattr(sae, f.name).detach().cpu().contiguous() for f in dataclasses.fields(sae)
               if isinstance(getattr(sae, f.name), torch.Tensor)}
    write_atomic(folder / WEIGHTS_FILE, save(tensors))
    write_atomic(folder / CFG_FILE, json.dumps(sae_config(sae), indent=2) + "\n")
    return folder


@dataclass(frozen=True)
class RandomSAEOptions:
    """random_sae's settings beyond the architecture, sizes and seed (the cfg.json fields it writes)."""
    k: int | None = None  # topk: active latents (default 4)
    d_out: int | None = None  # transcoders: output width (default d_in)
    dtype: "torch.dtype | str" = torch.float32
    apply_b_dec_to_input: bool | None = None  # default: true for SAEs, false for transcoders
    normalize_activations: str = "none"
    norm_scaling_factor: float = 1.0
    rescale_acts_by_decoder_norm: bool = False  # topk only
    hook_z: bool = False  # SAEs on z: rows reshaped from [.., heads, hd]
    hook_name: str | None = None
    hook_name_out: str | None = None

    @classmethod
    def of(cls, **options: Any) -> "RandomSAEOptions":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise SAEError(f"unknown random_sae option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}."
                           f"{closest(unknown[0], names)} The options: {', '.join(names)}.")
        return cls(**options)


def random_sae(arch: str = "standard", d_in: int = 16, d_sae: int = 64, *, seed: int = 0, **options: Any) -> SAE:
    """A seeded random SAE of architecture `arch` (a test fixture: scales chosen so that some features fire
    and some do not); `options`: RandomSAEOptions' fields. Transcoders default to d_out = d_in and
    apply_b_dec_to_input false; topk to k = 4."""
    o = RandomSAEOptions.of(**options)
    k, d_out, normalize_activations, hook_z = o.k, o.d_out, o.normalize_activations, o.hook_z
    rescale_acts_by_decoder_norm = o.rescale_acts_by_decoder_norm
    if arch not in ARCHITECTURES:
        raise SAEError(f"unknown architecture {arch!r}; implemented: {', '.join(ARCHITECTURES)}.")
    a = ARCHITECTURES[arch]
    if normalize_activations not in NORMS or NORMS[normalize_activations].refused:
        raise SAEError(f"normalize_activations {normalize_activations!r}; use one of "
                       f"{', '.join(n for n, v in NORMS.items() if not v.refused)}.")
    if rescale_acts_by_decoder_norm and a.name != "topk":
        raise SAEError(f"rescale_acts_by_decoder_norm is a topk setting; {arch!r} has none.")
    if hook_z and a.transcoder:
        raise SAEError(f"hook_z reshaping is for SAEs; a {arch} reads flat rows.")
    out = (d_out or d_in) if a.transcoder else d_in
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def vec(scale: float = 0.1) -> torch.Tensor:
        return rand(d_sae, scale=scale)

    gated = a.name == "gated"
    sae = SAE(arch=a, W_enc=rand(d_in, d_sae, scale=1 / math.sqrt(d_in)),
              W_dec=rand(d_sae, out, scale=1 / math.sqrt(d_sae)), b_dec=rand(out, scale=0.1),
              b_enc=vec() if "b_enc" in a.tensors else None,
              threshold=torch.rand(d_sae, generator=g) * 0.3 if "threshold" in a.tensors else None,
              b_gate=vec() if gated else None, b_mag=vec() if gated else None, r_mag=vec() if gated else None,
              W_skip=rand(out, d_in, scale=0.1 / math.sqrt(d_in)) if a.skip else None,
              k=(k or 4) if "k" in a.fields else None, rescale_acts_by_decoder_norm=rescale_acts_by_decoder_norm,
              apply_b_dec_to_input=(not a.transcoder) if o.apply_b_dec_to_input is None else o.apply_b_dec_to_input,
              norm=NORMS[normalize_activations], norm_scaling_factor=o.norm_scaling_factor, hook_z=hook_z,
              hook_name=o.hook_name, hook_name_out=o.hook_name_out)
    return sae.to(dtype=_dtype(o.dtype, "dtype"))


def write_random_sae(directory: "str | Path", arch: str = "standard", d_in: int = 16, d_sae: int = 64, *,
                     seed: int = 0, **options: Any) -> Path:
    """random_sae(...) written to `directory` in SAELens's format; the folder (see random_sae for options)."""
    return save_sae(random_sae(arch, d_in, d_sae, seed=seed, **options), directory)
