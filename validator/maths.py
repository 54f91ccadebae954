"""The validator's own maths for what the engine computes beyond a capture: which positions a spec
touches, each steering op, each readout's reduction, an SAE's encode and decode, and the SAE file.

Written from the definitions the README and the op table's docs state, never by calling engine/ (a
check built from the engine's own code shares its bugs). Everything works on float64 copies so that
rounding here is far below any tolerance; results are cast back to the caller's dtype.

Positions are a sequence's own absolute token positions (0 = its first real token); a spec is
resolved against the prompt length P and the number of positions a call processes (P for a forward;
P + new - 1 for a generation, which feeds back every new token but the last).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

Tensor = torch.Tensor


# -- positions -------------------------------------------------------------------------------------
def touched(spec, prompt_len: int, n: int) -> Tensor:
    """Bool [n]: the absolute positions 0..n-1 that `spec` touches. Specs: "all", "last" (the last prompt
    token and every fed-back one), "generated" (fed-back tokens only), an int (negative: from the end of
    the prompt), a list of ints, a (start, stop) tuple (negative bounds from the end of the prompt, stop
    None: to the end of the call)."""
    pos = torch.arange(n)
    if spec == "all":
        return torch.ones(n, dtype=torch.bool)
    if spec == "last":
        return pos >= prompt_len - 1
    if spec == "generated":
        return pos >= prompt_len
    if isinstance(spec, int):
        return pos == (spec + prompt_len if spec < 0 else spec)
    if isinstance(spec, list):
        want = {p + prompt_len if p < 0 else p for p in spec}
        return torch.tensor([p in want for p in range(n)], dtype=torch.bool)
    if isinstance(spec, tuple):
        start, stop = spec
        start = 0 if start is None else (start + prompt_len if start < 0 else start)
        stop = n if stop is None else (stop + prompt_len if stop < 0 else stop)
        return (pos >= start) & (pos < stop)
    raise ValueError(f"the validator has no position spec {spec!r}")


# -- steering ops ----------------------------------------------------------------------------------
def _unit(v: Tensor) -> Tensor:
    flat = v.reshape(-1).double()
    return flat / flat.norm()


def apply_op(op: str, x: Tensor, value=None, coeff: float | None = None, bounds=None, sae: "SAEWeights | None" = None,
             feature: int | None = None, positions: Tensor | None = None) -> Tensor:
    """The op applied to rows x [m, *shape] (each row one touched token), on the host in float64; the value is
    first cast to x's dtype, as the engine casts a steer's value where it applies it. `positions` [m] are
    the rows' absolute positions, for `swap`, whose value [P, *shape] holds one activation per position."""
    m = x.shape[0]
    value = None if value is None else value.detach().to("cpu").to(x.dtype)
    shape = x.shape[1:]
    xd = x.double()
    flat = xd.reshape(m, -1)
    if op == "add":
        out = xd + value.double()
    elif op in ("set", "mean_ablate"):
        out = value.double().expand_as(xd).clone()
    elif op == "scale":
        out = xd * value.double()
    elif op == "ablate":
        out = torch.zeros_like(xd)
    elif op == "swap":
        out = value.double()[positions]
    elif op in ("project_out", "rescale", "projection_cap", "norm_scaled_add"):
        u = _unit(value)
        along = flat @ u  # [m]
        if op == "project_out":
            new = flat - along[:, None] * u
        elif op == "rescale":
            new = flat + (coeff - 1.0) * along[:, None] * u
        elif op == "projection_cap":
            lo, hi = bounds
            capped = along.clamp(min=lo, max=hi)
            new = flat + (capped - along)[:, None] * u
        else:
            new = flat + coeff * flat.norm(dim=1, keepdim=True) * u
        out = new.reshape(m, *shape)
    elif op in ("feature_clamp", "feature_scale", "feature_add"):
        assert sae is not None and feature is not None
        d = sae.W_dec[feature].double()
        if op == "feature_add":
            new = flat + coeff * d
        else:
            f = sae.encode(flat)[:, feature]
            target = torch.full_like(f, coeff) if op == "feature_clamp" else f * coeff
            new = flat + (target - f)[:, None] * d  # decode is affine per feature: only this row moves
        out = new.reshape(m, *shape)
    else:
        raise ValueError(f"the validator has no maths for op {op!r}")
    return out.to(x.dtype)


def steer_rows(t: Tensor, op: str, mask: Tensor, pos0: int = 0, **params) -> Tensor:
    """A canonical [b, q, *shape] tensor whose positions pos0..pos0+q-1 are steered where `mask` (over
    absolute positions) is True; the same positions in every row of the batch."""
    q = t.shape[1]
    sel = mask[pos0:pos0 + q]
    if not bool(sel.any()):
        return t
    host = t.detach().to("cpu")  # the maths runs on the host; the result goes back where t lives, in one move
    idx = torch.nonzero(sel).flatten()
    for b in range(host.shape[0]):
        host[b, idx] = apply_op(op, host[b, idx], positions=idx + pos0, **params).to(host.dtype)
    return to_device(host, t)


def to_device(host: Tensor, like: Tensor) -> Tensor:
    """`host` on `like`'s device (the one move from the validator's host maths back into a forward)."""
    return host.to(like.device)


# -- readouts --------------------------------------------------------------------------------------
def reduce(kind: str, x: Tensor, W: Tensor | None = None, b: Tensor | None = None, act: str | None = None) -> Tensor:
    """A readout of rows x [pos, *shape]: mean / max / last over positions, or per position norm and project."""
    xd = x.double()
    flat = xd.reshape(xd.shape[0], -1)
    if kind == "mean":
        return xd.mean(0)
    if kind == "max":
        return xd.max(0).values
    if kind == "last":
        return xd[-1]
    if kind == "norm":
        return flat.pow(2).sum(1).sqrt()
    if kind == "project":
        assert W is not None
        y = flat @ W.double().T
        if b is not None:
            y = y + b.double()
        return {None: y, "sigmoid": torch.sigmoid(y), "relu": torch.relu(y), "tanh": torch.tanh(y)}[act]
    raise ValueError(f"the validator has no reduction {kind!r}")


def top_k(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(indices, values) of the k largest entries of each row, largest first."""
    v, i = scores.double().sort(dim=-1, descending=True)
    return i[..., :k], v[..., :k]


def log_softmax(logits: Tensor) -> Tensor:
    x = logits.double()
    return x - x.logsumexp(dim=-1, keepdim=True)


# -- SAEs ------------------------------------------------------------------------------------------
class SAEWeights:
    """A standard (ReLU) SAE in SAELens's layout: f = relu((x - b_dec) W_enc + b_enc), x_hat = f W_dec + b_dec."""

    def __init__(self, W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor):
        self.W_enc, self.b_enc, self.W_dec, self.b_dec = W_enc, b_enc, W_dec, b_dec

    @classmethod
    def random(cls, d_in: int, d_sae: int, seed: int, scale: float = 1.0) -> "SAEWeights":
        g = torch.Generator().manual_seed(seed)
        W_enc = torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5
        W_dec = torch.randn(d_sae, d_in, generator=g) * scale / d_in ** 0.5
        return cls(W_enc, torch.randn(d_sae, generator=g) * 0.1, W_dec, torch.randn(d_in, generator=g) * 0.01)

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    def encode(self, x: Tensor) -> Tensor:
        return torch.relu((x.double() - self.b_dec.double()) @ self.W_enc.double() + self.b_enc.double())

    def write(self, folder: Path, hook_name: str) -> Path:
        """The SAE as SAELens 6 writes one: cfg.json and sae_weights.safetensors in `folder`."""
        from safetensors.torch import save_file
        folder.mkdir(parents=True, exist_ok=True)
        cfg = {"architecture": "standard", "d_in": self.W_enc.shape[0], "d_sae": self.d_sae, "dtype": "float32",
               "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
               "reshape_activations": "none", "metadata": {"hook_name": hook_name, "sae_lens_version": "6.0.0"}}
        (folder / "cfg.json").write_text(json.dumps(cfg))
        save_file({k: getattr(self, k).float().contiguous() for k in ("W_enc", "b_enc", "W_dec", "b_dec")},
                  str(folder / "sae_weights.safetensors"))
        return folder
