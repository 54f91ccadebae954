"""Installing read/write callbacks on sites for the duration of one `with` block.

A callback receives the canonical `[batch, pos, ...]` tensor and returns either None (it only
read) or a replacement (it steered). Writers run before readers on the same site, so a capture
sees the steered value, as it would downstream. Everything is removed on exit, also on error.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from engine.attention import CALLBACKS_ATTR
from engine.errors import SteeringError
from engine.sites import Site


def _chain(fns, t):
    for fn in fns:
        out = fn(t)
        if out is not None:
            t = out
    return t


class HookSet:
    def __init__(self):
        self._entries: list[tuple[Site, str, object, str]] = []  # (site, point, fn, role)
        self._handles = []
        self._attn_modules = []

    def add(self, site: Site, point: str, fn, role: str = "read") -> None:
        assert role in ("read", "write")
        self._entries.append((site, point, fn, role))

    def __enter__(self):
        by_site = defaultdict(list)
        for site, point, fn, role in self._entries:
            by_site[(id(site.module), site.kind, point)].append((site, fn, role))
        try:
            for (_, kind, point), items in by_site.items():
                site = items[0][0]
                fns = [fn for _, fn, r in items if r == "write"] + [fn for _, fn, r in items if r == "read"]
                getattr(self, f"_install_{kind}")(site, point, fns, items)
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self._attn_modules:
            if hasattr(mod, CALLBACKS_ATTR):
                delattr(mod, CALLBACKS_ATTR)
        self._attn_modules.clear()
        return False

    # -- installers, one per site kind ----------------------------------------------------------
    def _install_out(self, site, point, fns, items):
        minus_residual = bool(site.extra and site.extra.get("minus_residual"))

        def hook(module, args, kwargs, output):
            t = site.get(output)
            base = None
            if minus_residual:  # BLOOM: module output includes the residual it was given
                base = args[1] if len(args) > 1 else kwargs["residual"]
                t = t - base
            new = _chain(fns, t)
            if new is t:
                return None
            return site.put(output, new + base if minus_residual else new)

        self._handles.append(site.module.register_forward_hook(hook, with_kwargs=True))

    def _install_in(self, site, point, fns, items):
        def hook(module, args, kwargs):
            t = site.get((args, kwargs))
            new = _chain(fns, t)
            if new is t:
                return None
            return site.put((args, kwargs), new)

        self._handles.append(site.module.register_forward_pre_hook(hook, with_kwargs=True))

    def _install_attn(self, site, point, fns, items):
        cbs = getattr(site.module, CALLBACKS_ATTR, None)
        if cbs is None:
            cbs = {}
            setattr(site.module, CALLBACKS_ATTR, cbs)
            self._attn_modules.append(site.module)
        cbs.setdefault(point, []).extend(fns)

    def _install_logits(self, site, point, fns, items):
        def hook(module, args, kwargs, output):
            t = output.logits
            new = _chain(fns, t)
            if new is not t:
                output.logits = new
            return output

        self._handles.append(site.module.register_forward_hook(hook, with_kwargs=True))

    def _install_resid_mid(self, site, point, fns, items):
        readers = [fn for _, fn, r in items if r == "read"]
        writers = [fn for _, fn, r in items if r == "write"]
        if readers:  # read at the pre-MLP norm's input, which is the mid residual
            def read_hook(module, args, kwargs):
                t = site.get((args, kwargs)) if site.get else (args[0] if args else kwargs["hidden_states"])
                _chain(readers, t)
            self._handles.append(site.module.register_forward_pre_hook(read_hook, with_kwargs=True))
        if writers:  # write through the attention write: new_write = f(resid_pre + write) - resid_pre
            stash = {}

            def stash_hook(module, args, kwargs):
                stash["pre"] = args[0] if args else kwargs["hidden_states"]

            def write_hook(module, args, kwargs, output):
                write = output[0] if isinstance(output, tuple) else output
                base = 0 if includes_residual else stash["pre"]
                mid = base + write * scale
                new = _chain(writers, mid)
                if new is mid:
                    return None
                new_write = (new - base) / scale
                return (new_write, *output[1:]) if isinstance(output, tuple) else new_write

            blk, write_mod = site.extra["block"], site.extra["write"]
            includes_residual = site.extra.get("write_includes_residual", False)
            scale = site.extra.get("write_scale", 1.0)
            self._handles.append(blk.register_forward_pre_hook(stash_hook, with_kwargs=True))
            self._handles.append(write_mod.register_forward_hook(write_hook, with_kwargs=True))

    def _install_gate(self, site, point, fns, items):
        """Read sigmoid(gate) where it is projected; a steered gate rescales the output projection's
        input (z * gate) by new / old gate, elementwise, so z itself is untouched."""
        stash = {}

        def read_hook(module, args, kwargs, output):
            g = site.get(output)
            new = _chain(fns, g)
            if new is g:
                return None
            changed = new != g
            if bool((changed & (g == 0)).any()):
                raise SteeringError(f"{point}: the gate underflowed to exactly 0 at a steered position, so "
                                    f"z cannot be recovered to apply the new gate; steer z instead.")
            stash["ratio"] = torch.where(changed, new.float() / g.float(), torch.ones_like(g, dtype=torch.float32))

        def write_hook(module, args, kwargs):
            ratio = stash.pop("ratio", None)
            if ratio is None:
                return None
            x = args[0] if args else kwargs["input"]
            new = (x.float() * ratio.reshape(x.shape)).to(x.dtype)
            return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "input": new})

        self._handles.append(site.module.register_forward_hook(read_hook, with_kwargs=True))
        if any(r == "write" for _, _, r in items):
            self._handles.append(site.extra["o_proj"].register_forward_pre_hook(write_hook, with_kwargs=True))

    def _install_hc_collapse(self, site, point, fns, items):
        """Hyper-connection collapse weights: recomputed from the module's input streams; a steered
        set re-collapses the streams and replaces the module's collapsed output."""
        weights_fn, idx = site.extra["weights"], site.extra["collapsed"]

        def hook(module, args, kwargs, output):
            streams = args[0] if args else next(iter(kwargs.values()))
            w = weights_fn(module, streams)
            new = _chain(fns, w)
            if new is w:
                return None
            collapsed = (new.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
            return tuple(collapsed if i == idx else o for i, o in enumerate(output))

        self._handles.append(site.module.register_forward_hook(hook, with_kwargs=True))

    def _install_sum(self, site, point, fns, items):
        """A sublayer made of two modules whose outputs are added (granite-4: routed experts plus a
        shared MLP): read first + second; a steered sum replaces the second's output by new - first."""
        stash = {}

        def first_hook(module, args, output):
            stash["first"] = _first_of(output)

        def hook(module, args, kwargs, output):
            first = stash.pop("first")
            t = first + _first_of(output)
            new = _chain(fns, t)
            if new is t:
                return None
            second = new - first
            return (second, *output[1:]) if isinstance(output, tuple) else second

        self._handles.append(site.extra["first"].register_forward_hook(first_hook))
        self._handles.append(site.module.register_forward_hook(hook, with_kwargs=True))


def _first_of(x):
    return x[0] if isinstance(x, tuple) else x
