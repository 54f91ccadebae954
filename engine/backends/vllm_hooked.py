"""`vllm`: Python hooks inside the in-process vLLM model, capture and steering chosen per request.

For one batch of requests, one hook is installed per site that any request reads or writes; it
sees the flat `[tokens, ...]` tensor of the whole step, applies each request's steers to that
request's rows only (masked by absolute position), then copies each request's captured rows to
the CPU (vLLM reuses its activation buffers). Writers run before readers, as in eager. Hooks are
removed when the batch finishes, so requests that neither capture nor steer pay nothing.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from engine.backends.vllm_batch import Plan, StepTracker
from engine.backends.vllm_tree import VSite
from engine.steering import apply_steer


class HookedTaps:
    def __init__(self, tracker: StepTracker, site_of):
        self.tracker = tracker
        self.site_of = site_of  # Address -> VSite
        self._handles = []

    def install(self, plans: list[Plan]) -> None:
        sites: dict = {}
        readers = defaultdict(lambda: defaultdict(list))  # site key -> plan key -> [(addr str, coord)]
        writers = defaultdict(lambda: defaultdict(list))  # site key -> plan key -> [Steer]
        for plan in plans:
            for st in plan.steers:
                site = self.site_of(st.address.base)
                sites[site.key] = site
                writers[site.key][plan.key].append(st)
            for addr in plan.reads():
                site = self.site_of(addr.base)
                sites[site.key] = site
                coord = addr.coords[0][1] if addr.coords else None
                readers[site.key][plan.key].append((str(addr), coord))
        for key, site in sites.items():
            self._hook(site, self._runner(dict(readers[key]), dict(writers[key])))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _runner(self, readers, writers):
        tracker = self.tracker

        def run(t: torch.Tensor):
            step = tracker.step
            if step is None:  # a forward outside our steps (warmup, dummy run)
                return None
            out = t
            for row in step.rows:
                for st in writers.get(row.plan.key, ()):
                    mask = row.mask(st.positions, t.device)
                    if not bool(mask.any()):
                        continue
                    if out is t:
                        out = t.clone()
                    out[row.a:row.b] = apply_steer(st, out[row.a:row.b], mask)
            for row in step.rows:
                for key, coord in readers.get(row.plan.key, ()):
                    skip = row.plan.wanted(key, row.pos0, row.b - row.a)
                    if skip is None:
                        continue
                    seg = out[row.a + skip:row.b]
                    seg = seg[:, coord] if coord is not None else seg
                    row.plan.add(key, row.pos0 + skip, seg.detach().to("cpu", copy=True))
            return None if out is t else out
        return run

    def _hook(self, site: VSite, run) -> None:
        if site.phase == "pre":
            def pre(module, args, kwargs):
                new = run(site.get((args, kwargs)))
                return None if new is None else site.put((args, kwargs), new)
            self._handles.append(site.module.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            def post(module, args, kwargs, output):
                new = run(site.get(output))
                return None if new is None else site.put(output, new)
            self._handles.append(site.module.register_forward_hook(post, with_kwargs=True))
