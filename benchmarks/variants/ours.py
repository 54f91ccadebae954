"""Our backends: eager (HF + hooks) and the vLLM family, all driven through the engine's one API
(`load_model(...).generate / run_with_cache / logit_lens`), so every figure is what a user gets."""
from __future__ import annotations

from benchmarks.spec import prompt_ids, steer_vector
from benchmarks.variants.base import Job, NotApplicable, Runner, tokens_changed


class EagerRunner(Runner):
    load_kw: dict = {}

    def load(self):
        from engine.loading import load_model
        p = self.p
        self.m = load_model(p.model, backend=self.backend, source=p.source, dtype=p.torch_dtype(),
                            device=p.device, **self.load_kw)
        self.n_layers = self.m.n_layers
        self.L = self.middle_layer(self.n_layers)
        tok = self.m.tokenizer
        self.ids1 = prompt_ids(tok, p.prompt_tokens, 1).to(p.device)
        self.ids8 = prompt_ids(tok, p.prompt_tokens, 8).to(p.device)
        self.model_info = {"n_layers": self.n_layers, "d_model": self.m.d_model,
                           "source": getattr(self.m, "source", p.source), "layer": self.L,
                           "family": getattr(getattr(self.m, "family", None), "name", None)}

    def _gen(self, ids, **kw):
        return lambda: self.m.generate(ids, max_new_tokens=self.p.new_tokens, **kw)

    def decode(self):
        return Job(self._gen(self.ids1))

    def concurrency8(self):
        return Job(self._gen(self.ids8))

    def prefill(self):
        return Job(lambda: self.m.run_with_cache(self.ids1, []))

    def capture_one(self):
        return Job(lambda: self.m.run_with_cache(self.ids1, [f"resid_post.{self.L}"]))

    def capture_all(self):
        return Job(lambda: self.m.run_with_cache(self.ids1, ["resid_post"]))

    def capture_gen(self):
        return Job(self._gen(self.ids1, points=["resid_post"]))

    def steer(self):
        from engine.steering import Steer
        v = steer_vector(self.m.d_model, self.p.steer_scale, self.m.dtype).to(self.p.device)
        st = [Steer(f"resid_post.{self.L}", "add", v)]
        run = self._gen(self.ids1, steer=st)

        def check(last):
            plain = self.m.generate(self.ids1, max_new_tokens=self.p.new_tokens)
            return tokens_changed(_new_tokens(last), _new_tokens(plain))
        return Job(run, check)

    def lens(self):
        def run():
            _, cache = self.m.run_with_cache(self.ids1, ["resid_post"])
            return [self.m.logit_lens(cache[f"resid_post.{i}"]) for i in range(self.n_layers)]
        return Job(run)


def _new_tokens(result):
    """The generated token ids of a GenerationResult (eager or vLLM) or a plain tensor."""
    return getattr(result, "new_tokens", result)


class VllmRunner(EagerRunner):
    """vllm / vllm-static / vllm-generate: the same calls on the vLLM backends; what a backend refuses
    (by its own error) becomes this cell's n/a reason."""
    # every timed run recomputes its prompt, as on eager: identical prompts repeated across timed runs
    # would otherwise be served from vLLM's prefix cache and time a prefill that never happens
    load_kw = {"enable_prefix_caching": False}
    NOTE_PREFIX = "vLLM prefix caching off, so every timed run computes its prompt as eager does"

    def _gen(self, ids, **kw):
        # logits of the new tokens are extra work stock generate does not do; the figure is generation
        return super()._gen(ids, return_logits=False, **kw)

    def prefill(self):
        return Job(lambda: self.m.generate(self.ids1, max_new_tokens=1, return_logits=False),
                   notes=["prefill timed as generate with max_new_tokens=1 (stock vLLM has no bare forward): "
                          "the prompt's forward plus one sampled token"])

    def job(self, workload):
        from engine.errors import UnsupportedPointError
        job = super().job(workload)
        inner = job.run

        def probe():
            try:
                return inner()
            except (UnsupportedPointError, NotImplementedError) as e:
                raise NotApplicable(f"{self.backend} refuses it: {e}") from None
        job.run = probe
        job.notes.append(self.NOTE_PREFIX)
        return job

    def load(self):
        super().load()
        rep = getattr(self.m, "load_report", None)
        if rep is not None:
            self.model_info["startup_s"] = getattr(rep, "startup_s", None)
            self.model_info["compiled"] = getattr(rep, "compiled", None)
