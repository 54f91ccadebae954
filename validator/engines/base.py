"""What a reference engine adapter is: load once per model, capture a case in one forward, steer.

Every adapter returns canonical tensors (`[batch, pos, ...]`, heads as `[b, pos, h, hd]`,
attention patterns as `[b, pos, h, kpos]`) on the CPU, keyed by address string ("resid_post.3",
"final_norm"). What goes the other way (a case's token ids, mask and positions, a steer vector) is
moved to the device of the model that reads it by `on_device`, the one place the validator does
that: cases are built on the CPU (their digest and the scoring read them there) and a model may run
on cuda. A point the reference cannot produce is a `Missing` with the reason (the runner
turns it into a declared gap, or a failure when no gap is declared for it). Each adapter keeps a
`TENSORS` table saying exactly which of its tensors stands for each of our points, because the
same name often means a different tensor across libraries.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class Missing:
    """The reference has no such tensor (or could not produce it); `reason` is the evidence."""
    reason: str


class EngineUnavailable(Exception):
    """The reference cannot run this model at all (e.g. TransformerLens has no adapter for the
    architecture); every row of the cell becomes a gap or failure with this text as evidence.
    `versions`: what the reference ran before it gave up, where that is not this process's packages
    (an engine in a child process on its own versions: validator/engines/child.py)."""

    def __init__(self, message: str, versions: dict | None = None):
        super().__init__(message)
        self.versions = dict(versions or {})


def on_device(x, device, dtype: torch.dtype | None = None):
    """`x` with every tensor in it on `device` (and floating tensors cast to `dtype` when given): a
    tensor, a `Case`, or a dict / list / tuple of them (other values pass through). The validator moves
    what it builds to a model only through here, so a harness tensor never meets a model on another
    device (on cuda: "Expected all tensors to be on the same device ... index is on cpu")."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype if x.is_floating_point() else None)
    if isinstance(x, Case):
        return dataclasses.replace(x, input_ids=on_device(x.input_ids, device),
                                   attention_mask=on_device(x.attention_mask, device),
                                   valid=on_device(x.valid, device))
    if isinstance(x, dict):
        return {k: on_device(v, device, dtype) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(on_device(v, device, dtype) for v in x)
    return x


@dataclass
class Case:
    """One prompt case, identical token ids for every engine.

    `valid` marks the positions compared ([b, pos] bool; padding excluded)."""
    name: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    valid: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counted over real tokens only, so a left-padded row sees the same positions
        as the prompt run alone."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)


@dataclass
class ModelContext:
    """Everything an adapter may use about one model: a pristine HF model (eager attention, never
    touched by the engine), its tokenizer and config. Adapters that modify or wrap a model call
    `fresh_hf()` for their own copy."""
    name: str
    hf: torch.nn.Module
    tokenizer: object
    source: str  # "zoo" | "real" | "config" (built in memory, tests)
    dtype: torch.dtype = torch.float32
    attention: str | None = None  # the attention implementation adapters run (None: the one `hf` was loaded with)
    vllm_parallel: tuple[int, int] = (1, 1)  # (tensor, pipeline) parallel sizes a vLLM column loads with (the plan's)

    @property
    def config(self):
        cfg = self.hf.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def model_type(self) -> str:
        return self.hf.config.model_type

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        """Where the reference model runs (an adapter's copies are made on it)."""
        return model_device(self.hf)

    def fresh_hf(self) -> torch.nn.Module:
        """A copy of the pristine model, switched to `attention` when that is set."""
        hf = copy.deepcopy(self.hf).eval()
        if self.attention is not None and hf.config._attn_implementation != self.attention:
            hf.set_attn_implementation(self.attention)
        return hf

    def with_attention(self, attention: str) -> "ModelContext":
        """The same model whose adapters run `attention` (a second configuration: eager patterns)."""
        return dataclasses.replace(self, attention=attention)


class Reference:
    """Base class of the adapters. Subclasses set `name`, `TENSORS` and implement `capture`."""
    name = "?"
    TENSORS: dict[str, str] = {}
    steers = True  # supports the steering-parity check

    def __init__(self, ctx: ModelContext):
        self.ctx = ctx

    @property
    def device(self) -> torch.device:
        """The device of the model this adapter runs (its inputs are moved there by `place`)."""
        return self.ctx.device

    def place(self, x, dtype: torch.dtype | None = None):
        """A case, a steer vector, or a dict of inputs on this adapter's model device (`on_device`)."""
        return on_device(x, self.device, dtype)

    def capture(self, case: Case, addresses: list[str]) -> dict:
        """{address: canonical tensor or Missing} for every address, from one forward."""
        raise NotImplementedError

    def steer_logits(self, case: Case, layer: int, vector: torch.Tensor) -> torch.Tensor:
        """Logits [b, pos, vocab] with `vector` added to resid_post at `layer` on every position."""
        raise NotImplementedError

    def versions(self) -> dict:
        return {}

    def close(self) -> None:
        """Release the model copies (the runner keeps one reference alive at a time)."""


def model_device(module: torch.nn.Module) -> torch.device:
    """Where a module's inputs go: the main device of a model placed across devices (its first GPU), else
    the device of its first parameter (CPU for a module without any)."""
    if getattr(module, "hf_device_map", None):
        from engine.backends.hf.eager import main_device
        return main_device(module)  # type: ignore[arg-type]
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def split_address(address: str) -> tuple[str, int | None]:
    parts = address.split(".")
    return parts[0], (int(parts[1]) if len(parts) > 1 else None)


def first(x):
    """The first element of a module output that may be a tuple or a ModelOutput."""
    if isinstance(x, (tuple, list)):
        return x[0]
    return x


def to_heads(t: torch.Tensor, batch: int, pos: int, head_dim: int) -> torch.Tensor:
    """A per-head tensor in any of the layouts libraries use ([b, pos, h*hd], [b, pos, h, hd],
    [b, h, pos, hd], [b*pos, h*hd]) as canonical [b, pos, h, hd]."""
    if t.dim() == 2 and t.shape[0] == batch * pos:
        t = t.reshape(batch, pos, -1)
    if t.dim() == 3:
        return t.reshape(batch, pos, -1, head_dim)
    if t.dim() == 4 and t.shape[-1] == head_dim:
        if t.shape[1] == pos and t.shape[2] != pos:
            return t
        if t.shape[2] == pos and t.shape[1] != pos:
            return t.transpose(1, 2)
        if t.shape[1] == pos == t.shape[2]:
            raise ValueError(f"ambiguous per-head layout {tuple(t.shape)}: heads == positions ({pos}); "
                             f"use a prompt length different from the head count.")
    raise ValueError(f"cannot read a [b={batch}, pos={pos}, heads, hd={head_dim}] tensor from shape "
                     f"{tuple(t.shape)}.")


def scores_from_qk(q: torch.Tensor, k: torch.Tensor, mask, scaling: float, softcap=None) -> torch.Tensor:
    """Pre-softmax attention logits from heads-first q [b, h, q, d] and k [b, kvh, k, d], the way
    the eager attention functions of transformers form them (scale, softcap, add/fill the mask).
    Written here, not imported from engine/, so the check is not circular. Returns [b, q, h, k]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is None:  # HF's sdpa path passes no mask where a plain causal one suffices (is_causal)
        q_len, k_len = s.shape[-2], s.shape[-1]
        mask = (torch.arange(k_len, device=s.device)[None, :] <= torch.arange(k_len - q_len, k_len,
                                                                               device=s.device)[:, None])[None, None]
    m = mask[:, :, :, : k.shape[-2]]
    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    return s.transpose(1, 2)


def probs_from_scores(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities [b, q, h, k] from pre-softmax logits [b, q, h, k] (float32), the way eager
    attention forms them: a softmax over keys, with each head's sink logit in the normalizer where the
    family has sinks (gpt-oss); a query row with every key masked gets zeros."""
    s = scores.float()
    if sinks is not None:
        sink = sinks.float().reshape(1, 1, -1, 1).expand(s.shape[0], s.shape[1], -1, 1).to(s.device)
        s = torch.cat([s, sink], dim=-1)
    top = s.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
    e = torch.exp(s - top)
    p = e / e.sum(dim=-1, keepdim=True)
    p = torch.nan_to_num(p, nan=0.0)
    return p[..., :scores.shape[-1]] if sinks is not None else p
