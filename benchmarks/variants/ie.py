"""Peer: interp-engine (the PyPI engine we aim to surpass), its eager backend, through its documented
free functions (`load_model`, `capture`, `capture_generation`, `generate_stream`, `steer`,
`layer_logits`), loaded by repo id from the same cache as every other variant."""
from __future__ import annotations

from benchmarks.spec import steer_vector
from benchmarks.variants.base import Job, Runner, logits_changed, tokens_changed


class IERunner(Runner):
    def load(self):
        import interp_engine as ie
        p = self.p
        if p.source == "zoo":
            from engine import zoo
            zoo.ensure_twin(p.model)
        self.ie = ie
        self.m = ie.load_model(p.model, backend="eager", device=p.device, dtype=p.dtype)
        self.n_layers, self.d_model = self.m.n_layers, self.m.d_model
        self.L = self.middle_layer(self.n_layers)
        tok = self.m.tokenizer
        self.tokenize(tok)
        self.model_info = {"n_layers": self.n_layers, "d_model": self.d_model, "layer": self.L,
                           "source": p.source, "version": getattr(ie, "__version__", None)}

    def _points(self, layers):
        return [f"resid_post.{i}" for i in layers]

    def _capture(self, workload, ids, layers):
        points = self._points(layers)
        return Job(lambda: self.ie.capture(self.m, ids, points),
                   self.capture_check(workload, self.n_layers, lambda c: [tuple(t.shape) for t in c.tensors.values()],
                                      self.d_model))

    def _gen(self, ids):
        def run():  # greedy, never stopping at EOS, so every run makes new_tokens tokens
            return [s.token_id for s in self.ie.generate_stream(self.m, ids, max_tokens=self.p.new_tokens,
                                                                 temperature=0.0, stop_at_eos=False)]
        return run

    def generate(self, wl, ids):
        return Job(self._gen(ids), notes=["interp-engine generate_stream (greedy, one token per step)"])

    def forward(self, wl, ids):
        return Job(lambda: self.ie.capture(self.m, ids, []),
                   notes=["interp-engine capture with no points: one forward pass"])

    def capture(self, wl, ids):
        return self._capture(wl.name, ids, self.capture_layers(wl, self.n_layers))

    def capture_gen(self, wl, ids):
        points = self._points(range(self.n_layers))

        def run():
            return self.ie.capture_generation(self.m, ids, points, max_tokens=self.p.new_tokens,
                                              temperature=0.0)
        return Job(run, self.capture_check(wl.name, self.n_layers,
                                           lambda out: [tuple(t.shape) for t in out[1].tensors.values()],
                                           self.d_model),
                   notes=["interp-engine capture_generation generates, then runs one extra forward over prompt + "
                          "generated tokens to capture them"])

    def _spec(self, wl):
        ie = self.ie
        v = steer_vector(self.d_model, self.p.steer_scale)
        return ie.SteeringSpec(layers={i: ie.LayerSteeringSpec(operations=[ie.AddSpec(vector=v, scale=1.0)])
                                       for i in self.steer_layers(wl.name, self.n_layers)})

    def steer_forward(self, wl, ids):
        """Its plain forward (a capture of nothing) inside its steering context; the check captures the logits
        with and without it."""
        ie, spec = self.ie, self._spec(wl)

        def run():
            with ie.steer(self.m, spec):
                return ie.capture(self.m, ids, [])

        def check(last):
            with ie.steer(self.m, spec):
                steered = ie.capture(self.m, ids, ["lm_head"])["lm_head"]
            return logits_changed(steered, ie.capture(self.m, ids, ["lm_head"])["lm_head"])
        return Job(run, check, notes=["interp-engine capture with no points inside its steer context: one forward"])

    def steer(self, wl, ids):
        ie = self.ie
        spec = self._spec(wl)
        gen = self._gen(ids)

        def run():
            with ie.steer(self.m, spec):
                return gen()

        def check(last):
            import torch
            return tokens_changed(torch.tensor(last), torch.tensor(gen()))
        return Job(run, check)

    def lens(self, wl, ids):
        layers = list(range(self.n_layers))

        def run():
            return self.ie.layer_logits(self.m, ids, {"logit_lens": layers})["logit_lens"]

        def shapes(out):  # [pos, vocab] per layer (interp-engine drops the batch axis)
            return [(1, *tuple(t.shape)) for t in out.values()]
        return Job(run, self.capture_check(wl.name, self.n_layers, shapes),
                   notes=["interp-engine layer_logits (logit lens): one forward, final norm + lm_head per layer"])
