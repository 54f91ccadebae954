"""The hooked mode (`vllm`) in a worker: Python hooks on the sites the registered plans use, reattached when
the plans change, and the layer guard's hooks; nothing runs around a step. Its counterpart for
`vllm-static` is engine/backends/vllm/worker/static.StaticTaps (the taps the loader installed); both
answer site_key / attach / before / after / idle / describe / original_forward / nbytes, so WorkerState
(engine/backends/vllm/worker/extension.py) never asks which it has."""
from __future__ import annotations

import functools
from typing import Any, Protocol

import torch

from engine.backends.vllm.worker import kv
from engine.backends.vllm.worker.meters import HOOKS, Meters
from engine.core.address import Address
from engine.core.site import guard, run_site, zero_rows
from engine.core.step import Step


class State(Protocol):
    """What the hooks read of the worker's state (extension.WorkerState): its registered plans, its step,
    its meters, the model's tree and layers, and its sites."""
    plans: dict
    step: Step | None
    meters: Meters
    tree: Any

    def site(self, addr: Address) -> Any: ...

    def layers(self) -> list: ...


class HookSites:
    """Hooks at the registered plans' sites (engine.core.site.run_site) and on the decoder layers a steer
    can change (the layer guard), all reading the WorkerState's current step."""

    nbytes = 0

    def __init__(self, state: State) -> None:
        self.state = state

    def site_key(self, addr: Address) -> object:
        return self.state.site(addr)

    def attach(self, work: dict) -> list:
        """A hook at each site of `work`, and the layer guard from the first layer a steer can change (each
        layer's output hooks run before its guard's, registered after them). Returns the handles."""
        st = self.state
        steering = [p for p in st.plans.values() if p.steers]
        guarded = st.layers()[kv.first_layer(steering):] if steering else []
        checked = {id(layer) for layer in guarded}
        for site, w in work.items():
            w.guarded = bool(checked) and site.phase == "post" and id(site.module) in checked
        hooks = [h for site, w in work.items() for h in site.install(functools.partial(self._at_site, w))]
        return hooks + [layer.register_forward_hook(self._guard_layer) for layer in guarded]

    def before(self, step: Step, work: dict) -> None:
        pass

    def after(self, step: Step, work: dict) -> None:
        pass

    def idle(self) -> None:
        """Hooks run nothing when no step of ours runs: nothing to undo."""

    def describe(self, addr: Address, info: dict) -> None:
        pass

    def original_forward(self, name: str) -> None:
        """Hooks never wrap a module's forward: nothing to bypass."""
        return None

    def _at_site(self, work, t):
        step = self.state.step
        if step is None or not step.spans:
            return None
        with self.state.meters.window(HOOKS):
            return run_site(t, step, work)

    def _guard_layer(self, module, args, output):
        """The layer guard (engine.core.site.guard) on a decoder layer's output: a steering request's row
        that is not finite there is zeroed in every part of the stream (vLLM's (hidden, residual) pair),
        so nothing non-finite reaches a later layer or the KV cache; its request fails at collect."""
        step = self.state.step
        if step is None or not step.spans:
            return None
        with self.state.meters.window(HOOKS):
            return self._guard_output(step, output)

    def _guard_output(self, step: Step, output):
        parts = list(output) if isinstance(output, tuple) else [output]
        n, flat = step.n_tokens, self.state.tree.batched  # the Transformers backend's tensors are [1, tokens, d]
        tensors = [i for i, p in enumerate(parts) if isinstance(p, torch.Tensor) and p.dim() >= 2
                   and (p.shape[:2] == (1, n) if flat else p.shape[0] == n)]
        if not tensors:
            return None
        rows = [p if p.dim() == 2 else p.reshape(n, -1) for p in (parts[i] for i in tensors)]
        stream = rows[0]
        for r in rows[1:]:  # (hidden, residual): their sum is the stream (no 0 + hidden first, as sum() does)
            stream = stream + r
        ok = guard(stream, step, keep=True)
        if ok is None:
            return None
        ok = ok.reshape(n, 1)  # once for every part
        for i, r in zip(tensors, rows):
            z = zero_rows(r, ok)
            parts[i] = z if z.dim() == parts[i].dim() else z.reshape(parts[i].shape)
        return tuple(parts) if isinstance(output, tuple) else parts[0]
