"""Peer: plain Hugging Face transformers, what a user gets with no interpretability library."""
from __future__ import annotations

import torch

from benchmarks.spec import prompt_ids
from benchmarks.variants.base import Job, Runner


class HFRunner(Runner):
    def load(self):
        from engine.loading import load_hf
        p = self.p
        # the eager attention HF picks by default for these tiny models; no engine hooks are attached
        self.hf, self.tok, used = load_hf(p.model, p.source, p.torch_dtype(), p.device)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.ids1 = prompt_ids(self.tok, p.prompt_tokens, 1).to(p.device)
        self.ids8 = prompt_ids(self.tok, p.prompt_tokens, 8).to(p.device)
        self.model_info = {"n_layers": self.hf.config.get_text_config().num_hidden_layers, "source": used}

    def _gen(self, ids, **kw):
        n = self.p.new_tokens

        def run():
            with torch.no_grad():
                return self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False, pad_token_id=self.pad, **kw)
        return run

    def _fwd(self, **kw):
        def run():
            with torch.no_grad():
                return self.hf(self.ids1, use_cache=False, **kw)
        return run

    def decode(self):
        return Job(self._gen(self.ids1))

    def concurrency8(self):
        return Job(self._gen(self.ids8))

    def prefill(self):
        return Job(self._fwd())

    def capture_all(self):
        return Job(self._fwd(output_hidden_states=True),
                   notes=["HF output_hidden_states: every layer's output, the last one after the final "
                          "norm (resid_post of the last layer is not among them)"])

    def capture_gen(self):
        return Job(self._gen(self.ids1, output_hidden_states=True, return_dict_in_generate=True),
                   notes=["HF generate(output_hidden_states=True): hidden states per step, the last "
                          "entry after the final norm"])
