"""Peer: nnsight 0.8 `TransformersModel` trace / generate (the pin is 0.8.1; `LanguageModel` is now its deprecated
alias), modules addressed by the family table's paths (so the same code works on every family the engine knows)."""
from __future__ import annotations

import torch

from benchmarks.spec import steer_vector
from benchmarks.variants.base import Job, Runner, logits_changed, tokens_changed


def envoy(root, path: str):
    """Follow a dotted family path (numeric parts index) on an nnsight Envoy tree."""
    for part in path.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def _out(t):
    return t[0] if isinstance(t, tuple) else t


class NNsightRunner(Runner):
    def load(self):
        from nnsight import TransformersModel

        from engine.families import family_for
        p = self.p
        if p.source == "zoo":
            from engine import zoo
            zoo.ensure_twin(p.model)
        self.lm = TransformersModel(p.model, task="text-generation", device_map=p.device, dispatch=True,
                                    dtype=p.torch_dtype())
        cfg = self.lm.config.get_text_config()
        self.fam = family_for(cfg.model_type)
        self.n_layers = cfg.num_hidden_layers
        self.L = self.middle_layer(self.n_layers)
        self.d_model = cfg.hidden_size
        self.tokenize(self.lm.tokenizer)
        self.model_info = {"n_layers": self.n_layers, "d_model": self.d_model, "layer": self.L,
                           "source": p.source, "family": self.fam.name}

    def layer(self, i):
        return envoy(self.lm, f"{self.fam.layers}.{i}")

    def _generate(self, ids, body=None):
        n = self.p.new_tokens
        pad = self.lm.tokenizer.pad_token_id or self.lm.tokenizer.eos_token_id

        def run():
            # nnsight runs the with-body in its own frame: results travel back through this dict
            res = {}
            with torch.no_grad(), self.lm.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                   pad_token_id=pad) as tracer:
                if body:
                    res["saved"] = body(tracer)
                res["out"] = tracer.result.save()  # the generated ids (0.8: model.generator.output is deprecated)
            return res["out"], res.get("saved")
        return run

    def _trace(self, ids, layers, lens=False):
        def run():
            saved = []
            with torch.no_grad(), self.lm.trace(ids):
                for i in layers:
                    h = self.layer(i).output
                    if lens:
                        if self.fam.final_norm:
                            h = envoy(self.lm, self.fam.final_norm)(h)
                        h = envoy(self.lm, self.fam.lm_head)(h)
                    saved.append(h.save())
                if not layers:
                    saved.append(envoy(self.lm, self.fam.lm_head).output.save())
            return saved
        return run

    def _capture(self, workload, ids, layers, lens=False):
        check = self.capture_check(workload, self.n_layers, lambda out: [tuple(_out(t).shape) for t in out],
                                   None if lens else self.d_model)
        return Job(self._trace(ids, layers, lens), check)

    def generate(self, wl, ids):
        return Job(self._generate(ids))

    def forward(self, wl, ids):
        return Job(self._trace(ids, []), notes=["nnsight trace saving the logits (lm_head output)"])

    def capture(self, wl, ids):
        return self._capture(wl.name, ids, self.capture_layers(wl, self.n_layers))

    def capture_gen(self, wl, ids):
        def body(tracer):
            saved = [list().save() for _ in range(self.n_layers)]
            for _ in tracer.iter[:self.p.new_tokens]:  # every step appends its rows: prompt + fed-back tokens
                for i in range(self.n_layers):
                    saved[i].append(self.layer(i).output)
            return saved

        def shapes(out):
            per_layer = out[1]
            return [(_out(s[0]).shape[0], sum(_out(t).shape[1] for t in s), _out(s[0]).shape[2]) for s in per_layer]
        return Job(self._generate(ids, body), self.capture_check(wl.name, self.n_layers, shapes, self.d_model),
                   notes=["nnsight generate iterating its new_tokens forwards (tracer.iter), appending every step's layer outputs to saved lists"])

    def steer_forward(self, wl, ids):
        """One trace adding the vector to every steered layer's output in place, saving the logits (as the
        plain forward does)."""
        v = steer_vector(self.d_model, self.p.steer_scale).to(self.p.device)
        layers = self.steer_layers(wl.name, self.n_layers)

        def run():
            with torch.no_grad(), self.lm.trace(ids):
                for i in layers:
                    self.layer(i).output[:] += v
                logits = envoy(self.lm, self.fam.lm_head).output.save()
            return logits
        plain = self._trace(ids, [])
        return Job(run, lambda last: logits_changed(_out(last), _out(plain()[0])))

    def steer(self, wl, ids):
        v = steer_vector(self.d_model, self.p.steer_scale).to(self.p.device)
        layers = self.steer_layers(wl.name, self.n_layers)

        def body(tracer):
            # bounded (one iteration per forward of the generation): under nnsight 0.8 nothing after an
            # unbounded tracer.all() runs, so the generator's output was never saved (KeyError 'out')
            for _ in tracer.iter[:self.p.new_tokens]:
                for i in layers:
                    self.layer(i).output[:] += v
        run = self._generate(ids, body)
        plain = self._generate(ids)

        def check(last):
            n = ids.shape[1]
            return tokens_changed(last[0][:, n:], plain()[0][:, n:])
        return Job(run, check)

    def lens(self, wl, ids):
        job = self._capture(wl.name, ids, range(self.n_layers), lens=True)
        job.notes.append("nnsight lens: the final norm and lm_head modules applied to each saved layer output "
                         "inside the trace")
        return job
