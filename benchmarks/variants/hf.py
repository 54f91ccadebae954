"""Peer: plain Hugging Face transformers, what a user gets with no interpretability library."""
from __future__ import annotations

import torch

from benchmarks.variants.base import Job, Runner

_LAST_NORMED = ("HF output_hidden_states: every layer's output, the last one after the final norm (resid_post of "
                "the last layer is not among them)")


class HFRunner(Runner):
    def load(self):
        from engine.loading import load_hf
        p = self.p
        # the attention HF picks for the model (sdpa where it has it), as from_pretrained gives a user; no hooks
        self.hf, self.tok, used = load_hf(p.model, p.source, p.torch_dtype(), p.device)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.tokenize(self.tok)
        self.n_layers = self.hf.config.get_text_config().num_hidden_layers
        self.model_info = {"n_layers": self.n_layers, "source": used,
                           "attn_implementation": self.hf.config._attn_implementation}

    def _gen(self, ids, **kw):
        n = self.p.new_tokens

        def run():
            with torch.no_grad():
                return self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False, pad_token_id=self.pad, **kw)
        return run

    def _fwd(self, ids, **kw):
        def run():
            with torch.no_grad():
                return self.hf(ids, use_cache=False, **kw)
        return run

    def generate(self, wl, ids):
        return Job(self._gen(ids))

    def forward(self, wl, ids):
        return Job(self._fwd(ids))

    def capture(self, wl, ids):
        if wl.captures != -1:  # output_hidden_states returns every layer or none
            return self.cannot(wl)
        # hidden_states holds the embeddings first, then one entry per layer
        check = self.capture_check(wl.name, self.n_layers, lambda out: [tuple(h.shape) for h in out.hidden_states[1:]])
        return Job(self._fwd(ids, output_hidden_states=True), check, notes=[_LAST_NORMED])

    def capture_gen(self, wl, ids):
        def shapes(out):  # one tuple per step: the prompt's rows first, then one row per fed-back token
            steps = out.hidden_states
            return [(steps[0][i + 1].shape[0], sum(s[i + 1].shape[1] for s in steps), steps[0][i + 1].shape[2])
                    for i in range(self.n_layers)]
        return Job(self._gen(ids, output_hidden_states=True, return_dict_in_generate=True),
                   self.capture_check(wl.name, self.n_layers, shapes),
                   notes=["HF generate(output_hidden_states=True): hidden states per step, the last entry after "
                          "the final norm"])
