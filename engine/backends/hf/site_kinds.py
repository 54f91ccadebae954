"""Typed sites of an HF module tree: where a point is read and written, and how to attach there.

A site turns what a hook sees into the canonical `[batch, pos, ...]` tensor and back. `install(fn,
writes)` attaches one callable `fn(canonical) -> replacement | None` and returns handles whose
`remove()` detaches it. A callable that returns None only read: the forward then runs exactly as
without it (no tensor is replaced, so a read-only capture never changes the output). `writes` says
whether fn may replace the tensor (some sites read in one place and write through another).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.backends.hf.attention import attach as attach_attention
from engine.core.errors import SteeringError


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _replace_first(x, new):
    return (new, *x[1:]) if isinstance(x, tuple) else new


def _arg0(args, kwargs, name="hidden_states"):
    return args[0] if args else kwargs[name]


@dataclass(eq=False)
class Site:
    """Base: a module and the reason (if any) the point is capture-only here."""
    module: torch.nn.Module
    capture_only: str | None = None
    kind = "site"  # what the site reads, named for the docs and site data (a class attribute)
    how: str = "hook"  # "hook" or "recompute" (derived from tensors around the module)

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        raise NotImplementedError


@dataclass(eq=False)
class OutSite(Site):
    """A module's output (get/put convert raw output <-> canonical). minus_residual: the module adds
    the residual it receives as its second argument (BLOOM), which the point excludes."""
    kind = "out"
    get: Callable = None
    put: Callable = None
    minus_residual: bool = False

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        def hook(module, args, kwargs, output):
            t = self.get(output)
            base = None
            if self.minus_residual:
                base = args[1] if len(args) > 1 else kwargs["residual"]
                t = t - base
            new = fn(t)
            if new is None:
                return None
            return self.put(output, new + base if self.minus_residual else new)
        return [self.module.register_forward_hook(hook, with_kwargs=True)]


@dataclass(eq=False)
class InSite(Site):
    """A module's input (get/put convert (args, kwargs) <-> canonical)."""
    kind = "in"
    get: Callable = None
    put: Callable = None

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        def hook(module, args, kwargs):
            new = fn(self.get((args, kwargs)))
            return None if new is None else self.put((args, kwargs), new)
        return [self.module.register_forward_pre_hook(hook, with_kwargs=True)]


@dataclass(eq=False)
class AttnSite(Site):
    """A tensor inside the attention call (q, k, value, attn_scores, attn_probs, z), reached through
    the "interp" attention implementation (engine/backends/hf/attention.py)."""
    kind = "attn"
    point: str = ""

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        return [attach_attention(self.module, self.point, fn)]


@dataclass(eq=False)
class LogitsSite(Site):
    """The CausalLM output's logits."""
    kind = "logits"

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        def hook(module, args, kwargs, output):
            new = fn(output.logits)
            if new is not None:
                output.logits = new
            return output
        return [self.module.register_forward_hook(hook, with_kwargs=True)]


class _Stash:
    """Per-installation state handed from one hook of a site to the next within one forward."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def put(self, v: torch.Tensor) -> None:
        self.value = v

    def take(self) -> torch.Tensor | None:
        v, self.value = self.value, None
        return v


@dataclass(eq=False)
class ResidMidSite(Site):
    """The residual between attention and MLP. Read where it enters the pre-MLP norm (`module`);
    written through the attention write: new_write = (new_mid - resid_pre) / scale, where the block
    adds scale * write to its input (or the write already includes the residual, BLOOM)."""
    kind = "resid_mid"
    get: Callable = None
    block: torch.nn.Module = None
    write: torch.nn.Module = None
    scale: float = 1.0
    includes_residual: bool = False

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        if not writes:
            def read(module, args, kwargs):
                fn(self.get((args, kwargs)))
            return [self.module.register_forward_pre_hook(read, with_kwargs=True)]
        pre = _Stash()

        def stash(module, args, kwargs):
            pre.put(_arg0(args, kwargs))

        def rewrite(module, args, kwargs, output):
            w = _first(output)
            base = 0 if self.includes_residual else pre.take()
            new = fn(base + w * self.scale)
            if new is None:
                return None
            return _replace_first(output, (new - base) / self.scale)
        return [self.block.register_forward_pre_hook(stash, with_kwargs=True),
                self.write.register_forward_hook(rewrite, with_kwargs=True)]


@dataclass(eq=False)
class GateSite(Site):
    """Gated attention: `module` projects, per head, [query | gate]; the point is sigmoid(gate). A
    steered gate rescales the output projection's input (z * gate) by new / old, elementwise."""
    kind = "gate"
    head_dim: int = 0
    o_proj: torch.nn.Module = None

    def get(self, output: torch.Tensor | tuple) -> torch.Tensor:
        t = _first(output)
        return torch.sigmoid(t.reshape(*t.shape[:-1], -1, 2 * self.head_dim)[..., self.head_dim:])

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        ratio = _Stash()

        def read(module, args, kwargs, output):
            g = self.get(output)
            new = fn(g)
            if new is None:
                return None
            changed = new != g
            if bool((changed & (g == 0)).any()):
                raise SteeringError("attn_gate: the gate underflowed to exactly 0 at a steered position, so z "
                                    "cannot be recovered to apply the new gate; steer z instead.")
            ratio.put(torch.where(changed, new.float() / g.float(), torch.ones_like(g, dtype=torch.float32)))
            return None

        def rescale(module, args, kwargs):
            r = ratio.take()
            if r is None:
                return None
            x = _arg0(args, kwargs, "input")
            new = (x.float() * r.reshape(x.shape)).to(x.dtype)
            return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "input": new})
        handles = [self.module.register_forward_hook(read, with_kwargs=True)]
        if writes:
            handles.append(self.o_proj.register_forward_pre_hook(rescale, with_kwargs=True))
        return handles


@dataclass(eq=False)
class StreamCollapseSite(Site):
    """Hyper-connection collapse weights, recomputed from the module's input streams; a steered set
    re-collapses the streams and replaces the module's collapsed output."""
    kind = "hc_collapse"
    weights: Callable = None
    collapsed: int = 2

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        def hook(module, args, kwargs, output):
            streams = args[0] if args else next(iter(kwargs.values()))
            new = fn(self.weights(module, streams))
            if new is None:
                return None
            c = (new.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
            return tuple(c if i == self.collapsed else o for i, o in enumerate(output))
        return [self.module.register_forward_hook(hook, with_kwargs=True)]


@dataclass(eq=False)
class SumSite(Site):
    """A sublayer made of two modules whose outputs are added (granite-4: routed experts plus a
    shared MLP): the point is first + second (`module` runs second); a steered sum replaces the
    second's output by new - first."""
    kind = "sum"
    first: torch.nn.Module = None

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None], writes: bool) -> list:
        held = _Stash()

        def keep_first(module, args, output):
            held.put(_first(output))

        def hook(module, args, kwargs, output):
            first = held.take()
            new = fn(first + _first(output))
            if new is None:
                return None
            return _replace_first(output, new - first)
        return [self.first.register_forward_hook(keep_first),
                self.module.register_forward_hook(hook, with_kwargs=True)]
