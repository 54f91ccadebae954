"""The engine under test: every case captured in one forward, decode-time capture, steering.

A capture that fails as a whole is retried address by address, so one broken point costs one row,
not the model; the error text becomes that row's evidence.
"""
from __future__ import annotations

import torch

from validator.engines.base import Case, Missing, on_device
from validator.prompts import DECODE_TOKENS, decode_case
from validator.scoring import KPOS_POINTS


class Subject:
    def __init__(self, model):
        self.m = model

    def _enc(self, case: Case) -> dict:
        return on_device({"input_ids": case.input_ids, "attention_mask": case.attention_mask}, self.m.device)

    def _collect(self, run, addresses, first_split=None) -> dict:
        """run(addresses) -> cache; on failure, split (first by `first_split`, then in halves) so that
        only the failing addresses are lost."""
        try:
            cache = run(addresses)
            return {a: cache[a].detach().float().cpu() if cache[a].is_floating_point() else cache[a].cpu()
                    for a in addresses}
        except Exception as e:  # noqa: BLE001  (isolate the failing addresses below)
            if len(addresses) == 1:
                return {addresses[0]: Missing(f"engine error: {type(e).__name__}: {str(e)[:300]}")}
        if first_split:
            groups = [[a for a in addresses if not first_split(a)]] + [[a] for a in addresses if first_split(a)]
            groups = [g for g in groups if g]
            if len(groups) > 1:
                return {k: v for g in groups for k, v in self._collect(run, g).items()}
        half = len(addresses) // 2
        return {**self._collect(run, addresses[:half]), **self._collect(run, addresses[half:])}

    def capture(self, case: Case, addresses: list[str]) -> dict:
        """{address: tensor | Missing(engine error)} from one forward (per-address on failure)."""
        def run(addrs):
            logits, cache = self.m.run_with_cache(self._enc(case), list(addrs))
            return cache
        return self._collect(run, addresses)

    def decode(self, case: Case, addresses: list[str]) -> tuple[Case, dict]:
        """Greedy-generate DECODE_TOKENS from `case`; return the reference case (the sequence minus its
        last token) and the engine's capture at the last decode step, [b, 1, ...] per address."""
        gen = self.m.generate(self._enc(case), max_new_tokens=DECODE_TOKENS)
        ref_case = decode_case(gen.tokens)
        state = {}

        def run(addrs):
            res = self.m.generate(self._enc(case), max_new_tokens=DECODE_TOKENS, points=list(addrs))
            if not torch.equal(res.tokens.cpu(), gen.tokens.cpu()):
                raise RuntimeError("capturing changed the generated tokens")
            state["tokens"] = res.tokens
            return {a: res.cache[a][:, -1:] for a in addrs}
        # patterns grow a key axis at every decode step: if capturing them fails, try them one by one
        growing = lambda a: a.split(".")[0] in KPOS_POINTS  # noqa: E731
        return ref_case, self._collect(run, addresses, first_split=growing)

    def logits(self, case: Case, steer=()) -> torch.Tensor:
        logits, _ = self.m.run_with_cache(self._enc(case), [], steer=list(steer))
        return logits.detach().float().cpu()

    def steer_vector(self, case: Case, layer: int, seed: int = 0) -> torch.Tensor:
        """A fixed random direction scaled to twice the residual's RMS norm at `layer` (large enough
        to move the logits, small enough to stay finite), on the model's device and in its dtype. The
        direction is drawn on the CPU (the same numbers whatever the device) and scaled there."""
        _, cache = self.m.run_with_cache(self._enc(case), [f"resid_post.{layer}"])
        resid = cache[f"resid_post.{layer}"].float()
        g = torch.Generator().manual_seed(seed)
        v = torch.randn(self.m.d_model, generator=g)
        scale = float(resid.pow(2).mean(-1).sqrt().mean())  # one read, wherever the model runs
        return on_device(v / v.norm() * scale * (self.m.d_model ** 0.5) * 2.0, self.m.device, self.m.dtype)
