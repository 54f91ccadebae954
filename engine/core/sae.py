"""Sparse autoencoders and transcoders as plain tensors: the architectures, encode and decode.

An `SAE` holds the weights of one SAELens-format SAE (engine/core/sae_files.py reads and writes
them) and computes features where the activation is: in an eager hook or in a vLLM worker, with
no model library. A transcoder is the same object whose decoder writes to another point (`d_out`,
`hook_name_out`): it encodes the activation at its input point and its decode is read at the
output point.

Each architecture is one `Arch` row in `ARCHITECTURES` (its encoder maths, the tensors and config
fields it needs, whether it is a transcoder); each activation normalization is one `Norm` row in
`NORMS`. Normalizations that depend on the input (constant_norm_rescale, layer_norm) make decode
need the activation that was encoded: `decode(feats, x)`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core.errors import SAEError
from engine.core.integers import as_int

Tensor = torch.Tensor


def _relu_pre(sae: "SAE", x: Tensor) -> Tensor:
    assert sae.b_enc is not None
    return x @ sae.W_enc + sae.b_enc


def _relu(sae: "SAE", x: Tensor) -> Tensor:
    return torch.relu(_relu_pre(sae, x))


def _jumprelu(sae: "SAE", x: Tensor) -> Tensor:
    assert sae.threshold is not None
    pre = _relu_pre(sae, x)
    return torch.where(pre > sae.threshold, torch.relu(pre), torch.zeros_like(pre))


def _topk(sae: "SAE", x: Tensor) -> Tensor:
    assert sae.k is not None
    pre = _relu_pre(sae, x)
    if sae.rescale_acts_by_decoder_norm:
        pre = pre * sae.W_dec.norm(dim=-1)
    top = pre.topk(sae.k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))


def _gated(sae: "SAE", x: Tensor) -> Tensor:
    assert sae.b_gate is not None and sae.b_mag is not None and sae.r_mag is not None
    gate = (x @ sae.W_enc + sae.b_gate) > 0
    magnitude = torch.relu(x @ (sae.W_enc * torch.exp(sae.r_mag)) + sae.b_mag)
    return torch.where(gate, magnitude, torch.zeros_like(magnitude))


@dataclass(frozen=True)
class Arch:
    """One SAELens architecture: `encode(sae, x_in)` maps the prepared input to feature activations."""
    name: str
    encode: Callable[["SAE", Tensor], Tensor]
    tensors: tuple[str, ...]  # the state-dict keys it needs besides W_enc, W_dec, b_dec
    fields: tuple[str, ...] = ()  # the cfg.json fields it needs besides d_in, d_sae
    transcoder: bool = False  # decodes into another point (d_out wide)
    skip: bool = False  # a transcoder with a linear skip path W_skip (added by forward, not decode)

    def __reduce__(self) -> tuple:
        return _arch, (self.name,)  # pickled by name: the row itself on the other side


ARCHITECTURES: dict[str, Arch] = {a.name: a for a in (
    Arch("standard", _relu, ("b_enc",)),
    Arch("topk", _topk, ("b_enc",), ("k",)),
    Arch("jumprelu", _jumprelu, ("b_enc", "threshold")),
    Arch("gated", _gated, ("b_gate", "b_mag", "r_mag")),
    Arch("transcoder", _relu, ("b_enc",), ("d_out",), transcoder=True),
    Arch("skip_transcoder", _relu, ("b_enc", "W_skip"), ("d_out",), transcoder=True, skip=True),
    Arch("jumprelu_transcoder", _jumprelu, ("b_enc", "threshold"), ("d_out",), transcoder=True),
    Arch("jumprelu_skip_transcoder", _jumprelu, ("b_enc", "threshold", "W_skip"), ("d_out",),
         transcoder=True, skip=True),
)}
# SAELens architectures this module knows of and does not implement, with the reason
REFUSED_ARCHITECTURES = {
    "abstopk": "its signed top-k by magnitude is not implemented here",
    "temporal": "its attention over context positions needs more than one activation row",
    "matching_pursuit": "its iterative encoder is not implemented here",
    "batchtopk": "it is a training-time architecture (SAELens saves it as jumprelu for inference)",
    "matryoshka_batchtopk": "it is a training-time architecture (SAELens saves it as jumprelu for inference)",
}


@dataclass(frozen=True)
class Norm:
    """One `normalize_activations` mode: `scale(sae, x)` is the per-row factor the input is multiplied
    by and the reconstruction divided by (None: no per-row factor); layer_norm also centres."""
    name: str
    doc: str
    needs_input: bool = False  # decode needs the activation that was encoded
    refused: str | None = None  # why a directory naming it cannot be used

    def __reduce__(self) -> tuple:
        return _norm, (self.name,)


NORMS: dict[str, Norm] = {n.name: n for n in (
    Norm("none", "no normalization"),
    Norm("expected_average_only_in", "the input times a fixed factor (norm_scaling_factor), the reconstruction "
         "divided by it; SAELens's own load treats the factor as folded into the weights (factor 1)"),
    Norm("constant_norm_rescale", "each row scaled to norm sqrt(d_in); the reconstruction scaled back",
         needs_input=True),
    Norm("layer_norm", "each row centred and divided by (its std + 1e-5); the reconstruction multiplied by the "
         "std and re-centred", needs_input=True),
    Norm("covariance_whitening", "", refused="SAELens folds the whitening into the weights when training ends and "
         "saves 'none'; a directory still naming it holds no whitening matrix to apply"),
)}
LN_EPS = 1e-5


def _arch(name: str) -> Arch:
    return ARCHITECTURES[name]


def _norm(name: str) -> Norm:
    return NORMS[name]


@dataclass(frozen=True, eq=False)
class SAE:
    """One loaded SAE or transcoder. Shapes: W_enc [d_in, d_sae], W_dec [d_sae, d_out], b_dec [d_out]
    (d_out = d_in for an SAE); the architecture's own tensors per its `Arch` row, others None.
    `source` is the directory it came from (named in errors); `hook_name` / `hook_name_out` are the
    points SAELens's cfg.json names (TransformerLens hook names), as given."""
    arch: Arch
    W_enc: Tensor
    W_dec: Tensor
    b_dec: Tensor
    b_enc: Tensor | None = None
    threshold: Tensor | None = None
    b_gate: Tensor | None = None
    b_mag: Tensor | None = None
    r_mag: Tensor | None = None
    W_skip: Tensor | None = None
    k: int | None = None
    rescale_acts_by_decoder_norm: bool = False
    apply_b_dec_to_input: bool = True
    norm: Norm = NORMS["none"]
    norm_scaling_factor: float = 1.0
    hook_z: bool = False  # reshape_activations == "hook_z": [..., heads, d_head] flattened to d_in
    hook_name: str | None = None
    hook_name_out: str | None = None
    source: Path | None = None

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def where(self) -> str:
        return str(self.source) if self.source is not None else f"this {self.arch.name} SAE"

    def to(self, device: "torch.device | str | None" = None, dtype: torch.dtype | None = None) -> "SAE":
        """The same SAE with every tensor moved (a new object; this one is unchanged)."""
        moved = {f.name: getattr(self, f.name).to(device=device, dtype=dtype) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)

    # ---- widths ---------------------------------------------------------------------------------
    def check_width(self, width: int, where: str) -> None:
        """Refuse an input point whose per-position width is not d_in (`where` names the point)."""
        if width != self.d_in:
            raise SAEError(f"{self.where()}: d_in is {self.d_in} (cfg.json field 'd_in') but {where} is {width} "
                           f"wide; attach an SAE trained on this model's {where}.")

    def check_out_width(self, width: int, where: str) -> None:
        """Refuse an output point (a transcoder's decode target) whose width is not d_out."""
        if width != self.d_out:
            field = "d_out" if self.arch.transcoder else "d_in"
            raise SAEError(f"{self.where()}: the decoder writes {self.d_out} values (cfg.json field '{field}') but "
                           f"{where} is {width} wide; read the decode at the point the SAE was trained to write.")

    # ---- encode / decode ------------------------------------------------------------------------
    def _flat(self, x: Tensor) -> Tensor:
        if self.hook_z and x.shape[-1] != self.d_in and x.dim() >= 2 and x.shape[-2] * x.shape[-1] == self.d_in:
            x = x.flatten(-2)
        if x.shape[-1] != self.d_in:
            raise SAEError(f"{self.where()}: input of shape {tuple(x.shape)} has last dim {x.shape[-1]}; "
                           f"the SAE reads d_in={self.d_in}.")
        return x.to(device=self.device, dtype=self.dtype)

    def _row_scale(self, x: Tensor) -> Tensor:
        """constant_norm_rescale's per-row factor sqrt(d_in) / |x| (x already flat)."""
        return math.sqrt(self.d_in) / x.norm(dim=-1, keepdim=True)

    def prepare(self, x: Tensor) -> Tensor:
        """The input as the encoder sees it: flattened (hook_z), cast, normalized, b_dec removed."""
        x = self._flat(x)
        name = self.norm.name
        if name == "expected_average_only_in":
            x = x * self.norm_scaling_factor
        elif name == "constant_norm_rescale":
            x = x * self._row_scale(x)
        elif name == "layer_norm":
            centred = x - x.mean(dim=-1, keepdim=True)
            x = centred / (centred.std(dim=-1, keepdim=True) + LN_EPS)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x

    def encode(self, x: Tensor) -> Tensor:
        """Feature activations [..., d_sae] of activations x [..., d_in] (or [..., heads, d_head] for a
        hook_z SAE), in the SAE's dtype."""
        return self.arch.encode(self, self.prepare(x))

    def decode(self, feats: Tensor, x: Tensor | None = None) -> Tensor:
        """The reconstruction [..., d_out] of feature activations (flat, also for hook_z SAEs). `x`, the
        activation that was encoded, is needed when the normalization depends on it."""
        if feats.shape[-1] != self.d_sae:
            raise SAEError(f"{self.where()}: feature tensor of shape {tuple(feats.shape)}; the SAE has "
                           f"d_sae={self.d_sae} features.")
        return self._output(self._linear(feats, self.W_dec) + self.b_dec, x, shift=True)

    def decode_change(self, change: Tensor, index: "list[int]", x: Tensor | None = None) -> Tensor:
        """decode(f + e) - decode(f), where e holds `change` [..., len(index)] at features `index` and zeros
        elsewhere: only those decoder rows are read (the decoder is affine per row, so f itself drops out).
        `x` as for decode."""
        return self._output(self._linear(change, self.W_dec[index]), x, shift=False)

    def _linear(self, feats: Tensor, rows: Tensor) -> Tensor:
        feats = feats.to(device=self.device, dtype=self.dtype)
        if self.rescale_acts_by_decoder_norm:
            feats = feats / rows.norm(dim=-1)
        return feats @ rows

    def _output(self, out: Tensor, x: Tensor | None, shift: bool) -> Tensor:
        """The decoder's output normalization undone on `out` (shift: add layer_norm's mean back; a
        difference of two outputs has none)."""
        name = self.norm.name
        if self.norm.needs_input:
            if x is None:
                raise SAEError(f"{self.where()}: normalize_activations is {name!r}, so decode needs the activation "
                               f"that was encoded: decode(feats, x).")
            x = self._flat(x)
            if name == "constant_norm_rescale":
                out = out / self._row_scale(x)
            else:  # layer_norm: SAELens multiplies back by the std without the epsilon
                out = out * x.std(dim=-1, keepdim=True)
                if shift:
                    out = out + x.mean(dim=-1, keepdim=True)
        elif name == "expected_average_only_in":
            out = out / self.norm_scaling_factor
        return out

    def skip(self, x: Tensor) -> Tensor:
        """A skip transcoder's linear path x @ W_skip.T (zero for every other architecture)."""
        x = self._flat(x)
        if self.W_skip is None:
            return torch.zeros(*x.shape[:-1], self.d_out, dtype=self.dtype, device=self.device)
        return x @ self.W_skip.T

    def forward(self, x: Tensor) -> Tensor:
        """decode(encode(x)) plus a skip transcoder's skip path: the SAE's output for x ([..., d_out], flat)."""
        return self.decode(self.encode(x), x) + self.skip(x)

    def direction(self, index: int) -> Tensor:
        """What one unit of feature `index` adds to the reconstruction before output normalization:
        W_dec[index] (over its norm when rescale_acts_by_decoder_norm)."""
        i = as_int(index)
        if i is None or not 0 <= i < self.d_sae:
            shown = f"{index!r} is not an integer" if i is None else f"{i} is out of range"
            raise SAEError(f"{self.where()}: feature index {shown}; "
                           f"the SAE has d_sae={self.d_sae} features (0..{self.d_sae - 1}).")
        row = self.W_dec[i]
        return row / row.norm() if self.rescale_acts_by_decoder_norm else row
