"""Our backends: eager (HF + hooks) and the vLLM family, all driven through the engine's one API
(`load_model(...).generate / run_with_cache / logit_lens`), so every figure is what a user gets."""
from __future__ import annotations

import shutil
import tempfile

from benchmarks.spec import steer_vector
from benchmarks.variants.base import Job, NotApplicable, Runner, logits_changed, tokens_changed


def _shapes(cache) -> list:
    return [tuple(v.shape) if hasattr(v, "shape") else (len(v), *v[0].shape) for v in cache.values()]


def nbytes(value) -> int:
    """Bytes of the tensors in a returned value (a tensor, a TopK, or lists / dicts of them): what a call
    hands back to the caller (on vLLM, what crossed from the worker to the client)."""
    import torch
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if hasattr(value, "indices") and hasattr(value, "values"):  # engine.core.readouts.TopK
        return nbytes(value.indices) + nbytes(value.values)
    raise TypeError(f"cannot count the bytes of a {type(value).__name__}")


def with_bytes(check: dict, returned: int, positions: int) -> dict:
    """A capture check plus the bytes it returned, in all and per position captured (the prompt and every
    fed-back token of every stream)."""
    per = returned / positions
    return {**check, "bytes_returned": returned, "bytes_per_token": per,
            "detail": f"{check['detail']}; {returned:,} bytes returned, {per:,.0f} per token"}


class EagerRunner(Runner):
    load_kw: dict = {}
    sae_dir: str | None = None  # the random SAE readout_gen reads through, written on first use

    def load(self):
        from engine.loading import load_model
        p = self.p
        self.m = load_model(p.model, backend=self.backend, source=p.source, dtype=p.torch_dtype(),
                            device=p.device, **self.load_kw)
        self.n_layers = self.m.n_layers
        self.L = self.middle_layer(self.n_layers)
        tok = self.m.tokenizer
        self.tokenize(tok)
        self.model_info = {"n_layers": self.n_layers, "d_model": self.m.d_model,
                           "source": getattr(self.m, "source", p.source), "layer": self.L,
                           "family": getattr(getattr(self.m, "family", None), "name", None)}
        hf = getattr(self.m, "hf", None)  # eager only: the vLLM model lives in its engine
        if hf is not None:
            self.model_info["parameters"] = sum(t.numel() for t in hf.parameters())

    def close(self):
        if self.sae_dir is not None:
            shutil.rmtree(self.sae_dir, ignore_errors=True)

    def _gen(self, ids, **kw):
        return lambda: self.m.generate(ids, max_new_tokens=self.p.new_tokens, **kw)

    def generate(self, wl, ids):
        return Job(self._gen(ids))

    def forward(self, wl, ids):
        return Job(lambda: self.m.run_with_cache(ids, []))

    def capture(self, wl, ids):
        points = [f"resid_post.{self.L}"] if wl.captures == 1 else ["resid_post"]
        return Job(lambda: self.m.run_with_cache(ids, points),
                   self.capture_check(wl.name, self.n_layers, lambda out: _shapes(out[1]), self.m.d_model))

    def capture_gen(self, wl, ids):
        rows = self.capture_check(wl.name, self.n_layers, lambda out: _shapes(out.cache), self.m.d_model)
        positions = wl.batch * wl.rows(self.p)
        return Job(self._gen(ids, points=["resid_post"]),
                   lambda out: with_bytes(rows(out), nbytes(dict(out.cache)), positions))

    def _readouts(self, wl) -> tuple[list, int]:
        """The workload's readout at resid_post of every layer and the width of its result per position: a
        random SAE's top-k latents (written to a folder once per runner, as a user's SAE would be), or a
        seeded linear probe of wl.probe directions."""
        from engine.core.readouts import Project, Readout, SAEFeatures
        if wl.sae_k:
            from engine.core.sae_files import write_random_sae
            if self.sae_dir is None:
                self.sae_dir = tempfile.mkdtemp(prefix="bench-sae-")
                write_random_sae(self.sae_dir, "standard", d_in=self.m.d_model,
                                 d_sae=wl.sae_expansion * self.m.d_model, dtype=self.m.dtype)
            kind, width, name = SAEFeatures(self.sae_dir, k=wl.sae_k), wl.sae_k, "sae"
        else:
            import torch
            g = torch.Generator().manual_seed(0)
            W = torch.randn(wl.probe, self.m.d_model, generator=g).to(device=self.p.device, dtype=self.m.dtype)
            kind, width, name = Project(W), wl.probe, "probe"
        return [Readout(f"resid_post.{i}", kind, name=f"{name}.{i}") for i in range(self.n_layers)], width

    def readout_gen(self, wl, ids):
        """capture_gen's points, read through the workload's readout: the SAE's k largest latents or the probe's
        scores per row come back instead of the row."""
        reads, width = self._readouts(wl)
        rows = self.capture_check(wl.name, self.n_layers, lambda out: [r.shape for r in out.cache.readouts.values()],
                                  width)
        positions = wl.batch * wl.rows(self.p)
        return Job(self._gen(ids, readouts=reads),
                   lambda out: with_bytes(rows(out), nbytes(dict(out.cache.readouts)), positions))

    def readout(self, wl, ids):
        """One forward reading the workload's readout at every layer (the scores come back, not the rows)."""
        reads, width = self._readouts(wl)
        rows = self.capture_check(wl.name, self.n_layers, lambda out: [r.shape for r in out[1].readouts.values()],
                                  width)
        positions = wl.batch * wl.rows(self.p)
        return Job(lambda: self.m.run_with_cache(ids, [], readouts=reads),
                   lambda out: with_bytes(rows(out), nbytes(dict(out[1].readouts)), positions))

    def _steers(self, wl):
        from engine.core.steering import Steer
        v = steer_vector(self.m.d_model, self.p.steer_scale, self.m.dtype).to(self.p.device)
        return [Steer(f"resid_post.{i}", "add", v) for i in self.steer_layers(wl.name, self.n_layers)]

    def steer_forward(self, wl, ids):
        """One forward with the vector added at the workload's layers; the check compares its logits with an
        unsteered forward's."""
        st = self._steers(wl)
        return Job(lambda: self.m.run_with_cache(ids, [], steer=st),
                   lambda last: logits_changed(last[0], self.m.run_with_cache(ids, [])[0]))

    def steer(self, wl, ids):
        run = self._gen(ids, steer=self._steers(wl))

        def check(last):
            plain = self._gen(ids)()
            return tokens_changed(_new_tokens(last), _new_tokens(plain))
        return Job(run, check)

    def lens(self, wl, ids):
        def run():
            _, cache = self.m.run_with_cache(ids, ["resid_post"])
            return [self.m.logit_lens(cache[f"resid_post.{i}"]) for i in range(self.n_layers)]
        return Job(run, self.capture_check(wl.name, self.n_layers, lambda out: [tuple(t.shape) for t in out]))


def _new_tokens(result):
    """The generated token ids of a GenerationResult (eager or vLLM) or a plain tensor."""
    return getattr(result, "new_tokens", result)


class VllmRunner(EagerRunner):
    """vllm / vllm-static / vllm-generate: the same calls on the vLLM backends; what a backend refuses
    (by its own error) becomes this cell's n/a reason."""
    NOTE_PREFIX = "vLLM prefix caching off, so every timed run computes its prompt as eager does"
    # on one GPU the three vLLM workers and the eager one are loaded at once: each engine takes a share
    GPU_SHARE = 0.25

    def load(self):
        from transformers import AutoConfig

        from engine import zoo
        p = self.p
        # room for the longest request this sweep makes (vLLM refuses a prompt past max_model_len)
        need = max(p.prompt_tokens + p.new_tokens, p.long_prompt_tokens + 1)
        name = str(zoo.ensure_twin(p.model)) if p.source == "zoo" else p.model
        cfg = AutoConfig.from_pretrained(name)
        positions = getattr(cfg.get_text_config(), "max_position_embeddings", None) or need
        self.max_len = min(-(-need // 16) * 16, positions)
        # every timed run recomputes its prompt, as on eager: identical prompts repeated across timed runs
        # would otherwise be served from vLLM's prefix cache and time a prefill that never happens
        # tokens one engine step must hold: the longest prompt, or 8 prompts prefilled together; no more,
        # since vllm-static sizes a read and a write buffer per tap by it (8192 tokens default: 1.1 GiB of
        # buffers on a 30-layer 576-wide model)
        step = -(-max(p.long_prompt_tokens + 1, 8 * p.prompt_tokens, self.max_len) // 16) * 16
        self.load_kw = {"enable_prefix_caching": False, "max_model_len": self.max_len, "max_num_batched_tokens": step}
        if p.device.startswith("cuda"):
            self.load_kw["gpu_memory_utilization"] = self.GPU_SHARE
        super().load()
        rep = getattr(self.m, "load_report", None)
        self.model_info.update(max_model_len=self.max_len, max_num_batched_tokens=self.load_kw["max_num_batched_tokens"])
        if rep is not None:
            self.model_info["startup_s"] = getattr(rep, "startup_s", None)
            self.model_info["compiled"] = getattr(rep, "compiled", None)

    def close(self):
        if hasattr(self, "m"):
            self.m.close()
        super().close()

    def _gen(self, ids, **kw):
        # logits of the new tokens are extra work stock generate does not do; the figure is generation
        return super()._gen(ids, return_logits=False, **kw)

    def _room(self, ids) -> None:
        if ids.shape[1] + 1 > self.max_len:
            raise NotApplicable(f"the model's {self.max_len} positions leave no room for the token vLLM must "
                                f"generate after a {ids.shape[1]}-token prompt")

    def forward(self, wl, ids):
        self._room(ids)
        return Job(lambda: self.m.generate(ids, max_new_tokens=1, return_logits=False),
                   notes=[f"{wl.title} timed as generate with max_new_tokens=1 (stock vLLM has no bare forward): "
                          "the prompt's forward plus one sampled token"])

    def capture(self, wl, ids):
        if wl.long:
            self._room(ids)
        return super().capture(wl, ids)

    def job(self, workload):
        from engine.core.errors import UnsupportedPointError
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
