"""The engine under test, through its public API only: captures, other address forms, steering, the
logit lens, readouts, greedy generation with capture (plain and steered).

One class for every backend: the eager engine is the subject of the reference columns, and a vLLM
backend is the other side of the vLLM columns (compared with the eager engine). A capture that fails
as a whole is retried address by address, so one broken point costs one row, not the model; the
error text becomes that row's evidence. A point the backend refuses by name comes back as a Missing
saying so ("refused by backend ..."), which the declared gap `vllm-refused` covers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from validator.engines.base import Case, Missing, on_device, split_address
from validator.scoring import KPOS_POINTS


@dataclass
class Generation:
    """A greedy generation of one prompt: tokens [1, P + N], the scores each new token was chosen from
    [1, N, vocab], and captures {address: [1, P + N - 1, ...] (logits: [1, N, vocab]) | Missing}."""
    tokens: torch.Tensor
    logits: torch.Tensor | None
    cache: dict


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.float().cpu() if t.is_floating_point() else t.cpu()


def _value(v):
    """A readout's value on the host: a tensor, or (indices, values) of a sparse one."""
    from engine import TopK
    return (_host(v.indices), _host(v.values)) if isinstance(v, TopK) else _host(v)


def _err(e: BaseException, what: str = "engine error") -> Missing:
    return Missing(f"{what}: {type(e).__name__}: {str(e)[:300]}")


class Subject:
    """One loaded engine model (any backend) and the calls the validator makes of it."""

    def __init__(self, model, config: str = "auto"):
        self.m = model
        self.config = config
        self.backend = model.backend
        self._head_capturable = model.refuses("lm_head") is None

    @property
    def device(self):
        return self.m.device if self.backend == "eager" else torch.device("cpu")

    def _enc(self, case: Case) -> dict:
        return on_device({"input_ids": case.input_ids, "attention_mask": case.attention_mask}, self.device)

    def _refused(self, addresses) -> tuple[list[str], dict]:
        ok, out = [], {}
        for a in addresses:
            if a == "lm_head" and not self._head_capturable:
                ok.append(a)  # every backend returns every position's logits
                continue
            try:
                why = self.m.refuses(a)
            except Exception as e:  # noqa: BLE001  (an address the backend cannot even parse)
                why = f"{type(e).__name__}: {e}"
            if why:
                out[a] = Missing(f"refused by backend {self.backend!r}: {why}")
            else:
                ok.append(a)
        return ok, out

    def _collect(self, run, addresses, first_split=None) -> dict:
        """run(addresses) -> {address: tensor}; on failure, split (first by `first_split`, then in halves)
        so that only the failing addresses are lost."""
        if not addresses:
            return {}
        try:
            got = run(addresses)
            return {a: _host(got[a]) for a in addresses}
        except Exception as e:  # noqa: BLE001  (isolate the failing addresses below)
            if len(addresses) == 1:
                return {addresses[0]: _err(e)}
        if first_split:
            groups = [[a for a in addresses if not first_split(a)]] + [[a] for a in addresses if first_split(a)]
            groups = [g for g in groups if g]
            if len(groups) > 1:
                return {k: v for g in groups for k, v in self._collect(run, g).items()}
        half = len(addresses) // 2
        return {**self._collect(run, addresses[:half]), **self._collect(run, addresses[half:])}

    def _forward(self, case: Case, addrs, steer=(), readouts=()):
        capture = [a for a in addrs if not (a == "lm_head" and not self._head_capturable)]
        logits, cache = self.m.run_with_cache(self._enc(case), capture, steer=list(steer), readouts=list(readouts))
        return logits, cache

    # -- captures --------------------------------------------------------------------------------
    def capture(self, case: Case, addresses: list[str]) -> dict:
        """{address: tensor | Missing} from one forward (per address on failure)."""
        ok, out = self._refused(addresses)

        def run(addrs):
            logits, cache = self._forward(case, addrs)
            return {a: logits if (a == "lm_head" and not self._head_capturable) else cache[a] for a in addrs}
        out.update(self._collect(run, ok))
        return out

    def forms(self, case: Case, forms) -> dict:
        """{form text: tensor | Missing}: each form (validator.plan.Form) asked for as users write it, in one
        forward (form by form on failure), read back under its key."""
        by_text = {f.text: f for f in forms}
        # a refusal is asked of the address a form names (a bare point name is every layer of one)
        _, out = self._refused([f.address if f.kind == "bare name" else f.text for f in by_text.values()])
        refused = {f.text: out[a] for f in by_text.values()
                   for a in [f.address if f.kind == "bare name" else f.text] if a in out}

        def run(texts):
            picked = [by_text[t] for t in texts]
            logits, cache = self._forward(case, texts)
            return {f.text: logits if (f.key == "lm_head" and not self._head_capturable) else cache[f.key]
                    for f in picked}
        got = self._collect(run, [t for t in by_text if t not in refused])
        return {**got, **refused}

    # -- steering, lens, readouts -------------------------------------------------------------------
    def logits(self, case: Case, steer=()) -> torch.Tensor:
        logits, _ = self._forward(case, [], steer=steer)
        return _host(logits)

    def steered(self, case: Case, steer_cases) -> dict:
        """{case name: logits | Missing} for each steering case (validator.plan.SteerCase), one forward each."""
        out = {}
        for sc in steer_cases:
            try:
                out[sc.name] = self.logits(case, [sc.engine_steer()])
            except Exception as e:  # noqa: BLE001  (a refusal or a crash is this row's evidence)
                out[sc.name] = _err(e, "refused or failed")
        return out

    def lens(self, case: Case, layers: list[int]) -> dict:
        """{layer: logits | Missing}: the logit lens of this engine's own resid_post capture at each layer."""
        out = {}
        addrs = [f"resid_post.{layer}" for layer in layers]
        try:
            _, cache = self._forward(case, addrs)
        except Exception as e:  # noqa: BLE001
            return {layer: _err(e) for layer in layers}
        for layer, a in zip(layers, addrs):
            try:
                out[layer] = _host(self.m.logit_lens((cache, a)))
            except Exception as e:  # noqa: BLE001
                out[layer] = _err(e)
        return out

    def readouts(self, case: Case, readout_cases, sae_dir: str | None) -> dict:
        """{readout name: tensor | (indices, values) | Missing} from one forward (per readout on failure)."""
        out = {}
        todo = []
        for rc in readout_cases:
            try:
                todo.append((rc, rc.engine_readout(sae_dir)))
            except Exception as e:  # noqa: BLE001
                out[rc.name] = _err(e, "refused")

        def run(names):
            rs = [r for rc, r in todo if rc.name in names]
            _, cache = self._forward(case, [], readouts=rs)
            return {n: cache.readouts[n] for n in names}

        def one(name):
            try:
                return _value(run([name])[name])
            except Exception as e:  # noqa: BLE001
                return _err(e)
        try:
            got = run([rc.name for rc, _ in todo])
            for n, v in got.items():
                out[n] = _value(v)
        except Exception:  # noqa: BLE001  (find the failing readouts one by one)
            for rc, _ in todo:
                out[rc.name] = one(rc.name)
        return out

    # -- generation -------------------------------------------------------------------------------
    def generate(self, case: Case, n: int, addresses: list[str], steer=None) -> "Generation | Missing":
        """Greedy generation of `n` tokens capturing `addresses` (refused ones are Missing), steered by one
        SteerCase or none. Patterns grow a key axis every step: if capturing them fails they are tried
        one by one."""
        steers = [steer.engine_steer()] if steer is not None else []
        try:
            plain = self.m.generate(self._enc(case), max_new_tokens=n, steer=steers)
        except Exception as e:  # noqa: BLE001
            return _err(e, "engine generate failed")
        ok, cache = self._refused([a for a in addresses if a != "lm_head"])
        if "lm_head" in addresses:
            ok.append("lm_head")

        def run(addrs):
            points = [a for a in addrs if a != "lm_head" or self._head_capturable]
            res = self.m.generate(self._enc(case), max_new_tokens=n, points=points, steer=steers)
            if not torch.equal(res.tokens.cpu(), plain.tokens.cpu()):
                raise RuntimeError("capturing changed the generated tokens")
            return {a: (res.logits if a == "lm_head" and not self._head_capturable else res.cache[a]) for a in addrs}
        growing = lambda a: split_address(a)[0] in KPOS_POINTS  # noqa: E731
        cache.update(self._collect(run, ok, first_split=growing))
        logits = None if plain.logits is None else _host(plain.logits)
        return Generation(plain.tokens.cpu(), logits, cache)
