"""Peer: TransformerLens 4.x TransformerBridge, booted by repo id (the zoo twin offline, or the real
checkpoint from the HF cache), raw HF numerics (compatibility mode off)."""
from __future__ import annotations

import torch

from benchmarks.spec import prompt_ids, steer_vector
from benchmarks.variants.base import Job, Runner, tokens_changed


class TLRunner(Runner):
    def load(self):
        from transformer_lens.model_bridge import TransformerBridge
        p = self.p
        if p.source == "zoo":
            from engine import zoo
            zoo.ensure_twin(p.model)
        self.b = TransformerBridge.boot_transformers(p.model, device=p.device, dtype=p.torch_dtype())
        self.n_layers = self.b.cfg.n_layers
        self.L = self.middle_layer(self.n_layers)
        tok = self.b.tokenizer
        self.ids1 = prompt_ids(tok, p.prompt_tokens, 1).to(p.device)
        self.ids8 = prompt_ids(tok, p.prompt_tokens, 8).to(p.device)
        self.d_model = self.b.cfg.d_model
        self.model_info = {"n_layers": self.n_layers, "d_model": self.d_model, "layer": self.L,
                           "source": p.source}

    def _gen(self, ids, **kw):
        def run():
            with torch.no_grad():
                return self.b.generate(ids, max_new_tokens=self.p.new_tokens, do_sample=False,
                                       stop_at_eos=False, use_past_kv_cache=True, verbose=False,
                                       return_type="tokens", **kw)
        return run

    def _names(self, layers):
        return [f"blocks.{i}.hook_resid_post" for i in layers]

    def _cache(self, layers):
        names = self._names(layers)

        def run():
            with torch.no_grad():
                return self.b.run_with_cache(self.ids1, names_filter=names)
        return run

    def decode(self):
        return Job(self._gen(self.ids1))

    def concurrency8(self):
        return Job(self._gen(self.ids8))

    def prefill(self):
        def run():
            with torch.no_grad():
                return self.b(self.ids1)
        return Job(run)

    def capture_one(self):
        return Job(self._cache([self.L]))

    def capture_all(self):
        return Job(self._cache(range(self.n_layers)))

    def capture_gen(self):
        return Job(self._gen(self.ids1, return_cache=True, names_filter=self._names(range(self.n_layers))),
                   notes=["TransformerLens generate(return_cache=True) generates first, then runs one "
                          "extra clean forward over prompt + output to fill the cache"])

    def steer(self):
        v = steer_vector(self.d_model, self.p.steer_scale).to(self.p.device)

        def add(t, hook):
            return t + v.to(t.dtype)
        gen = self._gen(self.ids1)

        def run():
            with self.b.hooks(fwd_hooks=[(f"blocks.{self.L}.hook_resid_post", add)]):
                return gen()

        def check(last):
            return tokens_changed(_new(last, self.ids1), _new(gen(), self.ids1))
        return Job(run, check)

    def lens(self):
        run_cache = self._cache(range(self.n_layers))

        def run():
            with torch.no_grad():
                _, cache = run_cache()
                return [self.b.unembed(self.b.ln_final(cache[n])) for n in self._names(range(self.n_layers))]
        return Job(run)


def _new(tokens, prompt):
    return tokens[:, prompt.shape[1]:]
