"""Peer: TransformerLens 4.x TransformerBridge, booted by repo id (the zoo twin offline, or the real
checkpoint from the HF cache), raw HF numerics (compatibility mode off)."""
from __future__ import annotations

import torch

from benchmarks.spec import steer_vector
from benchmarks.variants.base import Job, Runner, logits_changed, tokens_changed


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
        self.tokenize(tok)
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

    def _cache(self, ids, layers):
        names = self._names(layers)

        def run():
            with torch.no_grad():
                return self.b.run_with_cache(ids, names_filter=names)
        return run

    def _fwd(self, ids):
        def run():
            with torch.no_grad():
                return self.b(ids)
        return run

    def generate(self, wl, ids):
        return Job(self._gen(ids))

    def forward(self, wl, ids):
        return Job(self._fwd(ids))

    def capture(self, wl, ids):
        layers = self.capture_layers(wl, self.n_layers)
        names = self._names(layers)  # the cache also holds each hook's aliases (hook_out): read ours only
        return Job(self._cache(ids, layers),
                   self.capture_check(wl.name, self.n_layers, lambda out: [tuple(out[1][n].shape) for n in names],
                                      self.d_model))

    def capture_gen(self, wl, ids):
        if wl.batch > 1:  # TransformerLens 4.3 refuses generate(return_cache=True) for more than one prompt
            return self.cannot(wl)
        names = self._names(range(self.n_layers))

        def shapes(out):  # the clean forward covers prompt + every new token; the last has no place in a
            # generation loop's capture, so a full capture here has one row more than the loop's
            return [(out[1][n].shape[0], out[1][n].shape[1] - 1, *out[1][n].shape[2:]) for n in names]
        return Job(self._gen(ids, return_cache=True, names_filter=names),
                   self.capture_check(wl.name, self.n_layers, shapes, self.d_model),
                   notes=["TransformerLens generate(return_cache=True) generates first, then runs one extra clean "
                          "forward over prompt + output to fill the cache (its rows include the last new token)"])

    def _steer_hooks(self, wl):
        v = steer_vector(self.d_model, self.p.steer_scale).to(self.p.device)

        def add(t, hook):
            return t + v.to(t.dtype)
        return [(f"blocks.{i}.hook_resid_post", add) for i in self.steer_layers(wl.name, self.n_layers)]

    def steer_forward(self, wl, ids):
        hooks, fwd = self._steer_hooks(wl), self._fwd(ids)

        def run():
            with self.b.hooks(fwd_hooks=hooks):
                return fwd()
        return Job(run, lambda last: logits_changed(last, fwd()))

    def steer(self, wl, ids):
        hooks = self._steer_hooks(wl)
        gen = self._gen(ids)

        def run():
            with self.b.hooks(fwd_hooks=hooks):
                return gen()

        def check(last):
            return tokens_changed(_new(last, ids), _new(gen(), ids))
        return Job(run, check)

    def lens(self, wl, ids):
        run_cache = self._cache(ids, range(self.n_layers))

        def run():
            with torch.no_grad():
                _, cache = run_cache()
                return [self.b.unembed(self.b.ln_final(cache[n])) for n in self._names(range(self.n_layers))]
        return Job(run, self.capture_check(wl.name, self.n_layers, lambda out: [tuple(t.shape) for t in out]))


def _new(tokens, prompt):
    return tokens[:, prompt.shape[1]:]
