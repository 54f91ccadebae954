"""Feature readouts and feature steering on an SAE: pure functions on tensors, the one implementation
the readouts (eager hooks, vLLM workers) and the steering ops call.

Sparse outputs, so a 65k-feature SAE does not ship dense rows:
    topk(feats, k)          -> (indices, values), each [..., k], largest first
    above(feats, threshold) -> (indices, values): COO coordinates [nnz, feats.dim()] and values [nnz]
    dense(indices, values, d_sae): a topk result back to dense rows (zeros elsewhere)

Steering, keeping what the SAE does not explain (its reconstruction error):
    x' = x + (decode(f') - decode(f)),  f = encode(source),  f' = f with the edit applied
where `source` is the activation encoded (x itself for an SAE; a transcoder's input-point activation,
with x its output point's). So x' - decode(f') = x - decode(f): the error term is unchanged.
    clamp_feature(sae, x, index, value)   f'[index] = value
    scale_feature(sae, x, index, factor)  f'[index] = factor * f[index]
    add_feature_direction(sae, x, index, coeff)   x + coeff * sae.direction(index) (no encode)
`index` is one feature or a sequence of distinct ones (value / factor then one number or one per index).

What the SAE does not explain, at the point it writes (a transcoder: encoded at its input point, compared
with the activation at its output point):
    reconstruction_error(sae, x, source=None)   x - forward(source), source defaulting to x for an SAE
clamp and scale read only the edited features' decoder rows (SAE.decode_change: the decoder is affine
per row, so the unedited features cancel); edit_features(sae, x, edit) takes any edit of f.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from engine.core.errors import SAEError
from engine.core.integers import as_int, is_int
from engine.core.sae import SAE

Tensor = torch.Tensor


def topk(feats: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest features of each row: (indices int64 [..., k], values [..., k]), largest first."""
    n = as_int(k)
    if n is None or not 1 <= n <= feats.shape[-1]:
        raise SAEError(f"topk k={k!r}; give an integer from 1 to the number of features ({feats.shape[-1]}).")
    top = feats.topk(n, dim=-1, sorted=True)
    return top.indices, top.values


def above(feats: Tensor, threshold: float = 0.0) -> tuple[Tensor, Tensor]:
    """The features above `threshold`, as COO: (indices int64 [nnz, feats.dim()], values [nnz]), in row-major
    order (the last index column is the feature)."""
    mask = feats > threshold
    return mask.nonzero(), feats[mask]


def dense(indices: Tensor, values: Tensor, d_sae: int) -> Tensor:
    """Rows of `d_sae` features from a topk result (zeros where no index names a feature)."""
    return torch.zeros(*values.shape[:-1], d_sae, dtype=values.dtype, device=values.device).scatter(
        -1, indices, values)


def _indices(sae: SAE, index: "int | Sequence[int]") -> list[int]:
    given: list = [index] if is_int(index) else list(index)  # type: ignore[arg-type]
    if not given:
        raise SAEError("no feature index given; name at least one feature.")
    for i in given:
        sae.direction(i)  # validates the index, naming the SAE and its d_sae
    idx = [n for n in map(as_int, given) if n is not None]  # every one checked above
    if len(set(idx)) != len(idx):
        raise SAEError(f"feature indices {idx} name a feature twice; name each once.")
    return idx


def _per_index(name: str, value: "float | Sequence[float]", n: int) -> Tensor:
    vals = [value] * n if isinstance(value, (int, float)) and not isinstance(value, bool) else list(value)  # type: ignore[arg-type]
    if len(vals) != n or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in vals):
        raise SAEError(f"{name} {value!r}: give one number, or one per feature index ({n}).")
    if not all(math.isfinite(float(v)) for v in vals):
        raise SAEError(f"{name} {value!r} contains NaN or inf.")
    return torch.tensor([float(v) for v in vals], dtype=torch.float64)


def _source(sae: SAE, x: Tensor, source: Tensor | None) -> Tensor:
    if source is not None:
        return source
    if sae.arch.transcoder:
        raise SAEError(f"{sae.where()}: a {sae.arch.name} encodes its input point and decodes into another; pass "
                       f"source= (the activation at {sae.hook_name or 'the input point'}) with x the activation at "
                       f"{sae.hook_name_out or 'the output point'}.")
    return x


def reconstruction_error(sae: SAE, x: Tensor, source: Tensor | None = None) -> Tensor:
    """x - sae.forward(source): the part of the activation x the SAE (or transcoder) does not predict, in x's
    shape and dtype. For a transcoder `source` is the activation at its input point and x the one at its
    output point (both per position, the same leading shape); for an SAE source defaults to x."""
    src = _source(sae, x, source)
    heads = sae.hook_z and x.dim() >= 2 and x.shape[-1] != sae.d_out  # [..., heads, d_head]
    sae.check_out_width(x.shape[-2] * x.shape[-1] if heads else x.shape[-1], "x")
    pred = sae.forward(src)
    if pred.numel() != x.numel():
        raise SAEError(f"{sae.where()}: source of shape {tuple(src.shape)} predicts {tuple(pred.shape)}, which does "
                       f"not match x of shape {tuple(x.shape)}; pass the two points' activations at the same "
                       f"positions.")
    return x - pred.reshape(x.shape).to(device=x.device, dtype=x.dtype)


def edit_features(sae: SAE, x: Tensor, edit: Callable[[Tensor], Tensor], source: Tensor | None = None) -> Tensor:
    """x + (decode(edit(f)) - decode(f)) with f = encode(source) (source defaults to x): the feature edit with
    the reconstruction error kept. Returns x's shape and dtype; `edit` gets f and returns the edited copy."""
    src = _source(sae, x, source)
    f = sae.encode(src)
    edited = edit(f.clone())
    delta = sae.decode(edited, src) - sae.decode(f, src)
    return x + delta.reshape(x.shape).to(device=x.device, dtype=x.dtype)


def _edit_columns(sae: SAE, x: Tensor, index: "int | Sequence[int]", edit: Callable[[Tensor], Tensor],
                  source: Tensor | None) -> Tensor:
    """edit_features for an edit of the features `index` alone: the same x', computed from those decoder
    rows only (sae.decode_change) instead of two full decodes."""
    idx = _indices(sae, index)
    src = _source(sae, x, source)
    cols = sae.encode(src)[..., idx]
    delta = sae.decode_change(edit(cols) - cols, idx, src)
    return x + delta.reshape(x.shape).to(device=x.device, dtype=x.dtype)


def clamp_feature(sae: SAE, x: Tensor, index: "int | Sequence[int]", value: "float | Sequence[float]",
                  source: Tensor | None = None) -> Tensor:
    """x with feature(s) `index` set to `value` through the SAE, the reconstruction error kept."""
    vals = _per_index("clamp value", value, len(_indices(sae, index)))
    return _edit_columns(sae, x, index, lambda cols: vals.to(cols.dtype).to(cols.device).expand_as(cols), source)


def scale_feature(sae: SAE, x: Tensor, index: "int | Sequence[int]", factor: "float | Sequence[float]",
                  source: Tensor | None = None) -> Tensor:
    """x with feature(s) `index` multiplied by `factor` through the SAE, the reconstruction error kept."""
    facs = _per_index("scale factor", factor, len(_indices(sae, index)))
    return _edit_columns(sae, x, index, lambda cols: cols * facs.to(cols.dtype).to(cols.device), source)


def add_feature_direction(sae: SAE, x: Tensor, index: "int | Sequence[int]",
                          coeff: "float | Sequence[float]") -> Tensor:
    """x + sum_i coeff_i * sae.direction(i): the features' decoder directions added (no encode; x is the
    point the SAE decodes into, in its shape: [..., d_out] or [..., heads, d_head] for a hook_z SAE)."""
    idx = _indices(sae, index)
    coeffs = _per_index("coeff", coeff, len(idx)).to(sae.dtype).to(sae.device)
    vec = coeffs @ torch.stack([sae.direction(i) for i in idx])
    if x.shape[-1] != sae.d_out and not (sae.hook_z and x.dim() >= 2 and x.shape[-2] * x.shape[-1] == sae.d_out):
        raise SAEError(f"{sae.where()}: activation of shape {tuple(x.shape)}; the decoder writes d_out={sae.d_out}.")
    return x + vec.reshape(x.shape[-2:] if x.shape[-1] != sae.d_out else x.shape[-1:]).to(device=x.device, dtype=x.dtype)
