"""The vLLM backends' public model class and `load`.

    m = load_model("meta-llama/Llama-3.2-1B", backend="vllm")
    logits, cache = m.run_with_cache("Hello world", ["resid_post", "z.1.head-2"])
    out = m.generate(["a", "b"], 8, points=["resid_post.-1"], steer=[Steer("resid_post.1", "add", v)])
    res = m.generate_batch([Request("a", 8, points=["mlp_out.0"]), Request("b", 8, steer=[...])])

`vllm` installs hooks per batch, `vllm-static` serves the taps declared at load from buffers inside
the compiled forward, `vllm-generate` is stock vLLM and refuses capture and steering.
"""
from __future__ import annotations

import contextlib

import torch

from engine import lens
from engine.catalogue import PointCatalogue
from engine.address import Address, closest, parse
from engine.backends import vllm_attn
from engine.backends import vllm_runtime as rt
from engine.backends.vllm_batch import EXTRA_KEY, Plan, StepTracker
from engine.backends.vllm_hooked import HookedTaps
from engine.backends.vllm_results import Request, RequestResult, VLLMGeneration, stack
from engine.backends.vllm_static import StaticTaps, width_of
from engine.backends.vllm_tree import resolve, tree_for
from engine.errors import AddressError, SteeringError, UnsupportedPointError
from engine.inputs import limits_of, token_rows
from engine.model import ActivationCache
from engine.points import ALIASES, BY_NAME, INTEGER_POINTS, backend_status, get_point
from engine.sites import get_path
from engine.steer_inputs import validate_steers
from engine.steering import Steer

__all__ = ["load", "VLLMModel", "Request", "RequestResult", "VLLMGeneration"]
BACKENDS = ("vllm", "vllm-static", "vllm-generate")
_NO_CAPTURE = ("vllm-generate is stock vLLM: no capture, no steering, no logit lens; load the model with "
               "backend='vllm' (any servable point, per request) or backend='vllm-static' (declared taps)")
_HEADED = ("z", "q", "k", "value")


class VLLMModel(PointCatalogue):
    def __init__(self, name, backend, source, path, llm, startup_s, taps: StaticTaps | None = None,
                 declared: list[Address] | None = None):
        self.name, self.backend, self.source, self.path, self.llm = name, backend, source, path, llm
        self.runner = rt.runner_of(llm)
        self.vmodel = self.runner.get_model()
        hf = llm.llm_engine.model_config.hf_config
        self.config = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        if backend == "vllm-generate":  # serves any architecture vLLM runs: no point table needed
            self.tree, self.n_layers = None, self.config.num_hidden_layers
        else:
            self.tree = tree_for(self.vmodel, self.config)
            self.n_layers = len(get_path(self.vmodel, self.tree.layers))
        self.d_model = self.config.hidden_size
        self.device = self.runner.device
        self.dtype = llm.llm_engine.model_config.dtype
        self.tokenizer = llm.get_tokenizer()
        self.taps, self.declared = taps, declared
        self._context_steers: list[Steer] = []
        self._sites: dict = {}
        self._point_layers: dict = {}
        self.tracker = StepTracker(self.runner) if backend != "vllm-generate" else None
        self.hooks = HookedTaps(self.tracker, self._site) if backend == "vllm" else None
        if taps is not None:
            self.tracker.before, self.tracker.after = taps.before, taps.after
        kv_bytes, kv_tokens = rt.kv_cache_size(self.runner)
        self.load_report = rt.LoadReport(backend, startup_s, kv_bytes, kv_tokens,
                                         taps.nbytes if taps else 0, rt.rss_gib(),
                                         compiled=not llm.llm_engine.vllm_config.model_config.enforce_eager)
        self.startup_s, self.kv_cache_bytes = startup_s, kv_bytes
        self.tap_buffer_bytes = self.load_report.tap_buffer_bytes
        rt.log.info("%s %s", name, self.load_report.line())

    def __repr__(self):
        return (f"<VLLMModel {self.name} ({self.source}, {type(self.vmodel).__name__}, layers={self.n_layers}, "
                f"d_model={self.d_model}, backend={self.backend})>")

    # -- the point catalogue for this model -----------------------------------------------------
    def _site(self, addr: Address):
        key = (addr.point, addr.layer)
        if key not in self._sites:
            self._sites[key] = resolve(self.vmodel, self.tree, addr.point, addr.layer)
        return self._sites[key]

    def _probe(self, point, layer):
        self._check(Address(point, layer))

    def _check(self, addr: Address) -> None:
        """Raise UnsupportedPointError unless this backend serves addr (no coordinates)."""
        if self.backend == "vllm-static":
            if addr in self.declared:
                return
            status, reason = backend_status(addr.point, "vllm")
            if status != "refused":
                reason = (f"{backend_status(addr.point, 'vllm-static')[1] or 'not declared'}; declared at "
                          f"load: {', '.join(str(a) for a in self.declared)}")
            raise UnsupportedPointError(f"{addr} cannot be served by backend 'vllm-static': {reason}.")
        status, reason = backend_status(addr.point, self.backend)
        if status == "refused":
            raise UnsupportedPointError(f"{addr} cannot be served by backend {self.backend!r}: {reason}.")
        if addr.point in vllm_attn.ATTN_POINTS:  # recomputed from q and k: both must be served
            q = self._site(Address("q", addr.layer))
            self._site(Address("k", addr.layer))
            vllm_attn.check(addr.point, vllm_attn.params(q.module), str(addr))
            return
        self._site(addr)

    def address(self, a) -> Address:
        """Parse and check an address against this model and backend; absolute layer."""
        addr = parse(a).resolved(self.n_layers)
        self._check(addr.base)
        for name, value in addr.coords:
            n = self._heads(addr.point)
            if not -n <= value < n:
                raise AddressError(f"{name} {value} is out of range for {addr.point!r} ({n} {name}s).")
        return addr

    def _heads(self, point: str) -> int:
        cfg = self.config
        if point in ("k", "value"):
            return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cfg.num_attention_heads

    def point_shape(self, addr: Address) -> tuple:
        """Per-token shape of a capture at addr (what a steering value must have)."""
        w = width_of(self._site(addr.base), addr.point, self.d_model)
        if addr.point in _HEADED:
            shape = (self._heads(addr.point), w // self._heads(addr.point))
            return shape[1:] if addr.coords else shape
        return (w,)

    # -- requests ---------------------------------------------------------------------------------
    def _refuse_if_generate(self, what: str) -> None:
        if self.backend == "vllm-generate":
            raise (SteeringError if what == "steer" else UnsupportedPointError)(_NO_CAPTURE + ".")

    def _steer(self, st: Steer) -> Steer:
        if not isinstance(st, Steer):
            raise SteeringError(f"steer entries must be engine.steering.Steer objects, got {type(st).__name__}.")
        self._refuse_if_generate("steer")
        addr = self.address(st.address)
        if addr.point in INTEGER_POINTS:
            raise UnsupportedPointError(f"{addr} is capture-only.")
        if addr.point in vllm_attn.ATTN_POINTS:
            raise SteeringError(f"{addr} is recomputed from q and k after the forward on backend "
                                f"{self.backend!r} (capture only); steer q or k, or use backend='eager'.")
        why = self._site(addr.base).write_refused
        if why:
            raise SteeringError(f"{addr} is capture-only on {type(self.vmodel).__name__}: {why}.")
        if self.taps is not None and not self.taps.taps[str(addr.base)].writable:
            raise UnsupportedPointError(f"{addr} is a read-only tap of this vllm-static engine; declare it in "
                                        f"static_points to steer it, or use backend='vllm'.")
        v = st.value
        if isinstance(v, torch.Tensor) and st.op != "scale":
            want = self.point_shape(addr)
            if tuple(v.shape) != want:
                raise SteeringError(f"steering value for {addr} has shape {tuple(v.shape)} but the point's "
                                    f"per-position shape is {want}.")
        if isinstance(v, torch.Tensor):
            v = v.to(self.device, self.dtype)
        return Steer(addr, st.op, v, st.positions)

    def to_tokens(self, text, padding_side: str = "left") -> dict:
        """Tokenize like EagerModel.to_tokens (a padded input_ids / attention_mask batch)."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
        tok = self.tokenizer
        tok.padding_side = padding_side
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        enc = tok([text] if isinstance(text, str) else list(text), return_tensors="pt", padding=True)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def _prompt_ids(self, prompt) -> list[int]:
        return token_rows(prompt, self.tokenizer, limits_of(self), one=True)[0]  # validated (engine/inputs.py)

    def _prompts(self, inputs) -> list[list[int]]:
        return token_rows(inputs, self.tokenizer, limits_of(self))

    def _plan(self, req: Request, logits: bool, prefill: bool = False) -> tuple[Plan, dict]:
        """A request's plan and sampling params. logits: keep final_norm from the last prompt token
        (every position with prefill=True, which also makes the whole prompt recomputed)."""
        caps = self.expand(req.points) if req.points else []
        if caps:
            self._refuse_if_generate("capture")
        steers = validate_steers(req.steer)
        steers = [self._steer(s) for s in self._context_steers + steers]
        if self.taps is not None:
            StaticTaps.check_order(steers)
        derived = [a for a in caps if a.point in vllm_attn.ATTN_POINTS]
        plan = Plan(self._prompt_ids(req.prompt), [a for a in caps if a not in derived], steers)
        plan.derived = derived
        plan.internal += [Address(p, a.layer) for a in derived for p in ("q", "k")]
        plan.force_salt = bool(derived)
        if logits and self.backend != "vllm-generate":
            plan.internal.append(Address("final_norm"))
            plan.force_salt = plan.force_salt or prefill
            if not prefill and Address("final_norm") not in plan.captures:
                plan.start_at["final_norm"] = len(plan.prompt) - 1
        # min_tokens bans end-of-sequence until max_new_tokens, as eager's min_new_tokens does
        params = dict(temperature=0.0, max_tokens=req.max_new_tokens, min_tokens=req.max_new_tokens)
        params.update(req.sampling)
        return plan, params

    @contextlib.contextmanager
    def _active(self, plans):
        if self.tracker is None:
            yield
            return
        for p in plans:
            self.tracker.plans[p.key] = p
        try:
            if self.hooks is not None:
                self.hooks.install(plans)
            yield
        finally:
            if self.hooks is not None:
                self.hooks.remove()
            for p in plans:
                self.tracker.plans.pop(p.key, None)

    def _execute(self, plans, params, progress):
        from vllm import SamplingParams, TokensPrompt
        prompts, sps = [], []
        for plan, kw in zip(plans, params):
            tp = TokensPrompt(prompt_token_ids=plan.prompt)
            salt = plan.salt
            if salt:
                tp["cache_salt"] = salt
            prompts.append(tp)
            sps.append(SamplingParams(**kw, extra_args={EXTRA_KEY: plan.key}))
        with torch.no_grad(), self._active(plans):
            try:
                return self.llm.generate(prompts, sps, use_tqdm=progress)
            except BaseException:  # never leave half-run requests in the engine for the next call
                engine = self.llm.llm_engine
                left = list(getattr(engine.output_processor, "request_states", {}))
                if left:
                    engine.abort_request(left, internal=True)
                raise

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.vmodel.compute_logits(rows.to(self.device, self.dtype)).float().cpu()

    def generate_batch(self, requests: list[Request], return_logits: bool = True,
                       progress: bool = False) -> list[RequestResult]:
        """Run requests concurrently (one continuous batch); each keeps its own captures and steers."""
        built = [self._plan(r, return_logits) for r in requests]
        plans, params = [b[0] for b in built], [b[1] for b in built]
        outs = self._execute(plans, params, progress)
        return [self._result(plan, out, return_logits) for plan, out in zip(plans, outs)]

    def _result(self, plan: Plan, out, return_logits: bool) -> RequestResult:
        new = torch.tensor(list(out.outputs[0].token_ids), dtype=torch.long)
        cache = self._cache(plan)
        logits = None
        if return_logits and Address("final_norm") in plan.internal:
            p0, rows = plan.tail("final_norm")  # from the last prompt token (kept from there on)
            start = len(plan.prompt) - 1 - p0
            logits = self._logits(rows[start:start + len(new)])
        text = self.tokenizer.decode(new.tolist(), skip_special_tokens=True)
        return RequestResult(torch.tensor(plan.prompt, dtype=torch.long), new, text, cache, logits,
                             int(getattr(out, "num_cached_tokens", 0) or 0), plan.recomputed)

    def _cache(self, plan: Plan) -> ActivationCache:
        """The request's captures as [pos, ...] tensors, in the order they were asked for."""
        cache = ActivationCache(self.n_layers)
        for addr in plan.captures:
            cache[str(addr)] = plan.tensor(str(addr))
        for addr in plan.derived:
            q, k = plan.tensor(f"q.{addr.layer}"), plan.tensor(f"k.{addr.layer}")
            p = vllm_attn.params(self._site(Address("q", addr.layer)).module)
            t = vllm_attn.scores(q, k, p)
            t = vllm_attn.probs(t) if addr.point == "attn_probs" else t
            cache[str(addr)] = t[:, addr.coords[0][1]] if addr.coords else t
        return cache

    def generate(self, inputs, max_new_tokens: int = 8, points=(), steer=(), return_logits: bool = True,
                 progress: bool = False, **sampling) -> VLLMGeneration:
        """Greedy (by default) generation of every prompt in one continuous batch, with the same
        captures and steers for each; see generate_batch for per-request ones."""
        reqs = [Request(p, max_new_tokens, points, steer, sampling) for p in self._prompts(inputs)]
        res = self.generate_batch(reqs, return_logits and self.backend != "vllm-generate", progress)
        cache = ActivationCache(self.n_layers)
        for k in (res[0].cache if res else {}):
            cache[k] = stack([r.cache[k] for r in res])
        return VLLMGeneration(res, stack([r.tokens for r in res]), stack([r.new_tokens for r in res]),
                              [r.text for r in res], cache, stack([r.logits for r in res]))

    def run_with_cache(self, inputs, points=(), steer=()):
        """One prefill per prompt. Returns (logits [b, pos, vocab], cache of [b, pos, ...]); with
        prompts of different lengths, lists of per-prompt [pos, ...] tensors instead."""
        self._refuse_if_generate("capture")
        reqs = [Request(p, 1, points, steer) for p in self._prompts(inputs)]
        built = [self._plan(r, True, prefill=True) for r in reqs]
        plans = [b[0] for b in built]
        self._execute(plans, [b[1] for b in built], False)
        logits = [self._logits(p.tensor("final_norm")) for p in plans]
        caches = [self._cache(p) for p in plans]
        cache = ActivationCache(self.n_layers)
        for k in caches[0]:
            cache[k] = stack([c[k] for c in caches])
        return stack(logits), cache

    def forward(self, inputs, steer=()):
        return self.run_with_cache(inputs, (), steer)[0]

    @contextlib.contextmanager
    def steering(self, *steers: Steer):
        """Apply steers to every request made inside the block (on top of per-request steers)."""
        checked = [self._steer(s) for s in validate_steers(steers)]
        self._context_steers.extend(checked)
        try:
            yield self
        finally:
            for s in checked:
                self._context_steers.remove(s)

    def logit_lens(self, x, point: str = "resid_post") -> torch.Tensor:
        """Logits from a residual tensor through vLLM's own final norm and head (softcap, scaling)."""
        self._refuse_if_generate("capture")
        if isinstance(x, tuple):
            cache, a = x
            point, x = parse(a).point, cache[a]
        point = get_point(point).name
        lens.check_lensable(point)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"logit lens needs a [..., {self.d_model}] residual, got shape {tuple(x.shape)}.")
        flat = x.reshape(-1, self.d_model).to(self.device, self.dtype)
        with torch.no_grad():
            if point != "final_norm":
                flat = get_path(self.vmodel, self.tree.final_norm)(flat)
                flat = flat[0] if isinstance(flat, tuple) else flat
            return self._logits(flat).reshape(*x.shape[:-1], -1)

    def close(self) -> None:
        """Free the engine (other engines in this process keep working)."""
        rt.release(self.llm)


# -- loading ----------------------------------------------------------------------------------------
def _declared(spec, n_layers: int) -> list[Address]:
    """static_points: "auto" (resid_post at every layer) or names / addresses (bare name = every layer)."""
    if spec == "auto":
        return [Address("resid_post", layer) for layer in range(n_layers)]
    spec = [spec] if isinstance(spec, (str, Address)) else list(spec)
    if not spec:
        raise ValueError("static_points is empty; use 'auto' or a list such as ['resid_post', 'attn_out.2'].")
    out = []
    for s in spec:
        if isinstance(s, str) and "." not in s and (s in BY_NAME or s in ALIASES) and get_point(s).scope == "layer":
            out += [Address(get_point(s).name, layer) for layer in range(n_layers)]
            continue
        addr = parse(s).resolved(n_layers)
        if addr.coords:
            raise AddressError(f"declare {addr.base} rather than {addr}: a tap holds the whole point and "
                               f"serves its coordinates.")
        out.append(addr)
    for addr in out:
        status, reason = backend_status(addr.point, "vllm")
        if status == "refused":
            raise UnsupportedPointError(f"{addr} cannot be a vllm-static tap: {reason}.")
        if status == "recompute":
            raise UnsupportedPointError(f"{addr} cannot be a vllm-static tap: it is {reason}; declare "
                                        f"q.{addr.layer} and k.{addr.layer} or use backend='vllm'.")
    return list(dict.fromkeys(out))


def load(name: str, backend: str = "vllm", source: str = "auto", dtype=torch.float32, device: str = "cpu",
         static_points="auto", compile: bool = True, max_model_len: int = 512, max_num_seqs: int = 8,
         max_num_batched_tokens: int | None = None, kv_cache_memory_bytes: int | None = None,
         seed: int = 0, prove: bool = True, **llm_kwargs) -> VLLMModel:
    """Load `name` on a vLLM backend (see module docstring). Extra kwargs go to vllm.LLM."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown vLLM backend {backend!r}.{closest(backend, BACKENDS)} Use one of {BACKENDS}.")
    if backend != "vllm-static" and static_points != "auto":
        raise ValueError(f"static_points is for backend='vllm-static', not {backend!r}.")
    rt.prepare_env()
    path, used = rt.model_path(name, source)
    from transformers import AutoConfig
    hf_cfg = AutoConfig.from_pretrained(path)
    text_cfg = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    dt = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else str(dtype)
    kw = dict(dtype=dt, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
              kv_cache_memory_bytes=kv_cache_memory_bytes or rt.kv_bytes_for(
                  text_cfg, max_num_seqs, max_model_len, getattr(torch, dt)))
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    taps, declared, install, internal, env = None, None, None, [], {}
    if backend == "vllm":
        kw.update(enforce_eager=True, async_scheduling=False)  # Python hooks never fire in graph replay
    elif backend == "vllm-static":
        declared = _declared(static_points, text_cfg.num_hidden_layers)
        kw.update(enforce_eager=not compile, async_scheduling=False)
        # vLLM keys its compiled-graph cache on its config and model class, not on our taps, and
        # fails to reload a graph whose modules were wrapped: never save or load one.
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        taps = StaticTaps()
        internal = [] if Address("final_norm") in declared else [(Address("final_norm"), False)]

        def install(runner):  # errors wait until the engine exists, so that it can be released
            try:
                model = runner.get_model()
                tree = tree_for(model, text_cfg)
                hd = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
                taps.install([(a, True) for a in declared] + internal,
                             lambda a: resolve(model, tree, a.point, a.layer), text_cfg.hidden_size,
                             runner.max_num_tokens, runner.device, runner.model_config.dtype,
                             {p: hd for p in _HEADED})
            except Exception as e:  # noqa: BLE001 (re-raised below)
                failed.append(e)
    failed: list = []
    kw.update(llm_kwargs)
    llm, startup = rt.build_llm(path, install, env, **kw)
    try:
        if failed:
            raise failed[0]
        model = VLLMModel(name, backend, used, path, llm, startup, taps,
                          declared + [a for a, _ in internal] if declared is not None else None)
    except Exception:
        rt.release(llm)
        raise
    if backend == "vllm-static" and prove:
        from engine.backends.vllm_proof import prove_taps
        try:
            model.load_report.extra["proof"] = prove_taps(model)
        except Exception:
            model.close()
            raise
    return model
