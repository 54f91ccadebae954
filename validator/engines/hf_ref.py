"""Reference `hf`: HF transformers itself, with nothing of engine/ in the loop.

Residual points come from `output_hidden_states`, attention patterns from `output_attentions`,
logits from the model output; everything else from raw PyTorch hooks on the modules named by the
validator's own layout table (hf_layouts.py) and from the arguments HF passes to its eager
attention function (the module-level `eager_attention_forward` of each modeling file, swapped for
a recording wrapper during the forward).
"""
from __future__ import annotations

import contextlib
import inspect

import torch

from validator.engines.base import (
    Case,
    Missing,
    Reference,
    first,
    probs_from_scores,
    scores_from_qk,
    split_address,
    to_heads,
)
from validator.engines.hf_layouts import get_path, layout_for

TENSORS = {
    "embeddings": "output_hidden_states[0]",
    "resid_pre": "output_hidden_states[L]",
    "resid_post": "output_hidden_states[L+1]; at the last layer the decoder layer's output (HF's last "
                  "hidden state is after the final norm)",
    "final_norm": "output of the final norm module (layout final_norm)",
    "lm_head": "CausalLM output .logits",
    "lm_head_raw": "output of get_output_embeddings() (the head module, before logit scaling / softcap)",
    "attn_in": "input hidden_states of the layer's attention (or mixer) module",
    "attn_out": "output[0] of the attention (or mixer) module; minus its residual argument on BLOOM",
    "attn_out_post": "output of the post-attention sandwich norm",
    "resid_mid": "input of the pre-MLP norm (output of OPT-350m's post-LN self_attn_layer_norm; input of "
                 "the MLP on post-norm OLMo-2/3, EXAONE-4)",
    "mlp_in": "input of the MLP module (fc1's input on OPT)",
    "mlp_pre": "output of the gate projection (first chunk of a fused gate_up_proj; fc1 / c_fc on plain MLPs)",
    "mlp_pre_linear": "output of the up projection (second chunk of gate_up_proj)",
    "mlp_act": "input of the down projection",
    "mlp_out": "output of the MLP module (element 0 on gpt-oss; minus its residual argument on BLOOM and "
               "MPT; fc2 output on OPT)",
    "mlp_out_post": "output of the post-MLP sandwich norm",
    "q_norm_in": "input of the q norm module, per head", "q_norm_out": "output of the q norm module, per head",
    "k_norm_in": "input of the k norm module, per head", "k_norm_out": "output of the k norm module, per head",
    "q": "query argument of eager_attention_forward, [b, h, pos, hd] -> [b, pos, h, hd] (q/k/value: the "
         "projection output per head where HF computes attention inline on them, GPT-Neo and MPT)",
    "k": "key argument of eager_attention_forward (not repeated for GQA)",
    "value": "value argument of eager_attention_forward",
    "attn_scores": "recomputed here from the recorded query, key, mask, scaling and softcap",
    "attn_probs": "output_attentions[L] transposed to [b, pos, h, kpos]",
    "z": "first output of eager_attention_forward (o_a_proj's input per head on DeepSeek-V4, after its inverse "
         "RoPE; the o_proj input per head where HF has no attention "
         "function)",
    "router_logits": "router module output (element per layout), reshaped to [b, pos, e]",
    "expert_weights": "router module output (element per layout), reshaped to [b, pos, k]",
    "expert_indices": "router module output (element per layout), reshaped to [b, pos, k]",
}

_ATTN_INTERNAL = ("q", "k", "value", "attn_scores", "z")
_STREAM_WEIGHTS = ("attn_stream_collapse", "mlp_stream_collapse", "attn_stream_write", "mlp_stream_write",
                   "attn_stream_mix", "mlp_stream_mix", "attn_stream_collapse_weights", "mlp_stream_collapse_weights")
_HC_OUTPUT = {"write": 0, "mix": 1, "collapse": 2}  # the connection module returns (post, comb, collapsed input)


class _Recorder:
    """Hooks and the eager-attention wrapper for one forward; records by key."""

    def __init__(self):
        self.data: dict = {}
        self.calls: dict = {}
        self.handles = []

    def pre(self, module, key, arg=0):
        def hook(mod, args, kwargs):
            self.calls[key] = self.calls.get(key, 0) + 1
            if key not in self.data:  # cloned: some blocks update tensors in place afterwards
                t = args[arg] if len(args) > arg else kwargs.get("hidden_states")
                self.data[key] = t.detach().clone() if isinstance(t, torch.Tensor) else t
        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def post(self, module, key, index=None, minus_arg=None):
        def hook(mod, args, kwargs, output):
            self.calls[key] = self.calls.get(key, 0) + 1
            if key in self.data:
                return
            t = output[index] if index is not None else first(output)
            if minus_arg is not None:
                t = t - (args[minus_arg] if len(args) > minus_arg else kwargs["residual"])
            self.data[key] = t.detach().clone()  # Falcon adds the attention output into the MLP's in place
        self.handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


class HFReference(Reference):
    name = "hf"
    TENSORS = TENSORS

    def __init__(self, ctx):
        super().__init__(ctx)
        # read-only (hooks and the attention wrapper are removed after each forward): the pristine model itself,
        # unless this adapter runs another attention implementation, which needs a copy of its own
        same = ctx.attention is None or ctx.attention == ctx.hf.config._attn_implementation
        self.hf = ctx.hf.eval() if same else ctx.fresh_hf()
        self.cfg = ctx.config
        self.layout = layout_for(ctx.model_type, self.cfg)
        self.layers = get_path(self.hf, self.layout.layers) if self.layout else _find_layers(self.hf, ctx.n_layers)
        self.n_layers = len(self.layers)
        self.head_dim = getattr(self.cfg, "head_dim", None) or self.cfg.hidden_size // self.cfg.num_attention_heads
        self.layer_of = {id(m): i for i, layer in enumerate(self.layers) for m in layer.modules()}
        self.attention = str(self.hf.config._attn_implementation or "eager")

    # -- helpers ------------------------------------------------------------------------------
    def _lay(self, layer):
        return self.layout.at(self.cfg, layer) if self.layout is not None else None

    def _attn(self, layer: int):
        lay = self._lay(layer)
        for name in (lay.attn if lay else ("self_attn",)):
            mod = get_path(self.layers[layer], name)
            if mod is not None:
                return mod, True
        for name in (lay.mixers if lay else ()):
            mod = get_path(self.layers[layer], name)
            if mod is not None:
                return mod, False
        return None, False

    def _mlp_root(self, layer: int):
        lay = self._lay(layer)
        return self.layers[layer] if lay.mlp_on_layer else (get_path(self.layers[layer], lay.mlp) if lay.mlp else None)

    def _plan(self, rec: _Recorder, point: str, layer: int | None, key: str):
        """Install what `point` at `layer` needs; return a finisher (records, outputs, case) -> tensor,
        or a Missing."""
        lay = self._lay(layer)
        if point == "embeddings" and lay is not None and lay.embed:
            rec.post(get_path(self.hf, lay.embed), key)
            return lambda out, b, p: rec.data[key]
        if point == "embeddings":
            return lambda out, b, p: out.hidden_states[0]
        if point == "resid_pre":
            return lambda out, b, p: out.hidden_states[layer]
        if point == "resid_streams" and lay is not None and lay.streams:
            point = "resid_post"  # HF's hidden states of a hyper-connection trunk are the streams
        if point == "resid_post":
            if layer < self.n_layers - 1:
                return lambda out, b, p: out.hidden_states[layer + 1]
            rec.post(self.layers[layer], key)
            return lambda out, b, p: rec.data[key]
        if point == "lm_head":
            return lambda out, b, p: out.logits
        if point == "lm_head_raw":
            rec.post(self.hf.get_output_embeddings(), key)
            return lambda out, b, p: rec.data[key]
        if point == "attn_probs":
            attn, softmax = self._attn(layer)
            if attn is not None and softmax and "eager_attention_forward" in type(attn).forward.__globals__:
                rec.data.setdefault("_patch", set()).add(type(attn))  # the fallback of hybrid trunks
            return self._probs(rec, layer, key)
        if lay is None:
            return Missing(f"the validator's HF layout table has no row for model_type {self.ctx.model_type!r}; "
                           f"only hidden states, attention patterns and logits are read")
        if point == "final_norm":
            mod = get_path(self.hf, lay.final_norm)
            if mod is None:
                return Missing(f"no final norm module at {lay.final_norm!r}")
            rec.post(mod, key)
            return lambda out, b, p: rec.data[key]
        attn, softmax = self._attn(layer)
        if point in ("attn_in", "attn_out"):
            if attn is None:
                return Missing(f"layer {layer} has no attention or mixer module")
            if point == "attn_in":
                rec.pre(attn, key)
            else:
                rec.post(attn, key, minus_arg=1 if lay.adds_residual else None)
            return lambda out, b, p: rec.data[key]
        if point in _ATTN_INTERNAL:
            if attn is None or not softmax:
                return Missing(f"layer {layer} has no softmax attention module")
            return self._internal(rec, attn, point, layer, key)
        if point in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"):
            path = lay.q_norm if point.startswith("q") else lay.k_norm
            norm = get_path(attn, path) if (attn is not None and path) else None
            if norm is None:
                return Missing(f"no {point[:6]} module at layer {layer} (layout: {path!r})")
            heads = self.cfg.num_attention_heads if point.startswith("q") else _kv_heads(self.cfg)
            (rec.pre if point.endswith("_in") else rec.post)(norm, key)
            return lambda out, b, p: _heads(rec.data[key], b, p, heads, self.head_dim)
        if point in ("attn_out_post", "mlp_out_post"):
            path = lay.attn_post if point == "attn_out_post" else lay.mlp_post
            mod = get_path(self.layers[layer], path) if path else None
            if mod is None:
                return Missing(f"no sandwich norm for {point} at layer {layer}")
            rec.post(mod, key)
            return lambda out, b, p: rec.data[key]
        if point in _STREAM_WEIGHTS:
            if not lay.streams:
                return Missing("not a hyper-connection family")
            if point.endswith("_collapse_weights"):
                return Missing("HF's hyper-connection module computes its collapse weights inside forward and "
                               "returns only the collapsed input")
            hc = get_path(self.layers[layer], lay.streams[0 if point.startswith("attn") else 1])
            rec.post(hc, key, index=_HC_OUTPUT[point.split("_stream_")[1]])
            return lambda out, b, p: rec.data[key]
        if point == "resid_mid":
            if lay.is_parallel(self.cfg) or lay.mid is None:
                return Missing("parallel block: attention and MLP read the same residual (no mid point)")
            mod = get_path(self.layers[layer], lay.mid[0])
            if mod is None:
                return Missing(f"no module {lay.mid[0]!r} at layer {layer}")
            (rec.pre if lay.mid[1] == "in" else rec.post)(mod, key)
            return lambda out, b, p: rec.data[key].reshape(b, p, -1)
        return self._mlp_point(rec, point, layer, key)

    def _mlp_point(self, rec, point, layer, key):
        lay = self._lay(layer)
        root = self._mlp_root(layer)
        if root is None:
            return Missing(f"layer {layer} has no MLP module at {lay.mlp!r}")
        reshape = lambda t, b, p: t.reshape(b, p, -1)  # noqa: E731  (OPT and routers flatten tokens)
        if point in ("mlp_in", "mlp_out") and not lay.mlp_on_layer:
            if point == "mlp_in":
                rec.pre(root, key)
            else:
                rec.post(root, key, index=lay.mlp_index,
                         minus_arg=1 if (lay.adds_residual or lay.mlp_adds_residual) else None)
            sib = get_path(self.layers[layer], lay.mlp_sibling) if (point == "mlp_out" and lay.mlp_sibling) else None
            if sib is not None:  # granite-4: the MLP slot is block_sparse_moe(x) + shared_mlp(x)
                rec.post(sib, key + "#sibling")
                return lambda out, b, p: reshape(rec.data[key], b, p) + reshape(rec.data[key + "#sibling"], b, p)
            return lambda out, b, p: reshape(rec.data[key], b, p)
        if point in ("router_logits", "expert_weights", "expert_indices"):
            router = get_path(root, lay.router[0]) if lay.router else None
            if router is None:
                return Missing(f"layer {layer} has no router (dense MLP)")
            index = lay.router[{"router_logits": 1, "expert_weights": 2, "expert_indices": 3}[point]]
            if index is None:
                return Missing(f"this family's router returns only its logits; {point} is never a tensor")
            rec.post(router, key, index=None if index == "self" else index)
            return lambda out, b, p: reshape(rec.data[key], b, p)
        spec = {"mlp_in": lay.gate, "mlp_pre": lay.gate, "mlp_pre_linear": lay.up, "mlp_act": lay.down,
                "mlp_out": lay.down}.get(point)
        if spec is None:
            return Missing(f"the layout maps no module for {point} on {self.ctx.model_type}")
        path, chunk, parts = spec if isinstance(spec, tuple) else (spec, None, None)
        mod = get_path(root, path)
        if mod is None:
            return Missing(f"no module {path!r} in the MLP at layer {layer} (MoE layers have no dense projections)")
        if point in ("mlp_act", "mlp_in"):
            rec.pre(mod, key)
        else:
            rec.post(mod, key)

        def finish(out, b, p):
            t = rec.data[key]
            if chunk is not None:
                t = t.chunk(parts, dim=-1)[chunk]
            return reshape(t, b, p)
        return finish

    def _probs(self, rec, layer, key):
        def finish(out, b, p):
            atts = out.attentions
            if atts is None or len(atts) != self.n_layers or atts[layer] is None:
                got = rec.data.get(("attn_fn", layer))
                if got is None:
                    raise LookupError(f"HF returned no attention pattern for layer {layer}")
                if got["probs"] is None:  # sdpa returns none: the validator forms them from the call's q and k
                    return probs_from_scores(scores_from_qk(got["q"], got["k"], got["mask"], got["scaling"],
                                                            got["softcap"]), got["sinks"])
                return got["probs"].transpose(1, 2)
            return atts[layer].transpose(1, 2)
        return finish

    def _internal(self, rec, attn, point, layer, key):
        z_in = self._lay(layer).z_in
        if point == "z" and z_in:  # what the output projection reads, per head
            rec.pre(get_path(attn, z_in), key)
            n = self.cfg.num_attention_heads
            return lambda out, b, p: rec.data[key].reshape(b, p, n, -1)  # V4: [b, pos, groups, heads/group * hd]
        if "eager_attention_forward" not in type(attn).forward.__globals__:
            inline = self._lay(layer).inline_qkv
            if point in ("q", "k", "value") and inline:  # the projection output is the tensor itself
                path, chunk, parts = _spec(inline[("q", "k", "value").index(point)])
                mod = get_path(attn, path)
                if mod is None:
                    return Missing(f"no projection {path!r} in the attention module")
                rec.post(mod, key)
                return lambda out, b, p: to_heads(rec.data[key] if chunk is None else
                                                  rec.data[key].chunk(parts, dim=-1)[chunk], b, p, self.head_dim)
            if point == "z":
                o_path = self._lay(layer).o_proj
                o = get_path(attn, o_path)
                if o is None:
                    return Missing(f"no output projection {o_path!r}")
                rec.pre(o, key)
                return lambda out, b, p: to_heads(rec.data[key], b, p, self.head_dim)
            return Missing(f"HF {type(attn).__name__} computes attention inline (no attention function), so "
                           f"{point} is never a separate tensor")
        rec.data.setdefault("_patch", set()).add(type(attn))

        def finish(out, b, p):
            got = rec.data.get(("attn_fn", layer))
            if got is None:
                raise LookupError(f"eager_attention_forward was not called for layer {layer}")
            if point == "z":
                return got["out"]
            if point == "attn_scores":
                return scores_from_qk(got["q"], got["k"], got["mask"], got["scaling"], got["softcap"])
            return got[{"q": "q", "k": "k", "value": "v"}[point]].transpose(1, 2)
        return finish

    def _recording(self, rec: _Recorder, fn):
        """`fn` (an attention function) with its arguments and result recorded per layer."""
        layer_of = self.layer_of
        sig = inspect.signature(fn)

        def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            out = fn(module, query, key, value, attention_mask, *args, **kwargs)
            try:
                bound = sig.bind(module, query, key, value, attention_mask, *args, **kwargs)
                bound.apply_defaults()
                a = dict(bound.arguments)
            except TypeError:
                a = dict(kwargs)
            extra = a.pop("kwargs", {}) or {}
            scaling = a.get("scaling", extra.get("scaling"))
            if scaling is None:
                scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
            softcap = a.get("softcap", extra.get("softcap"))
            probs = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            rec.data[("attn_fn", layer_of[id(module)])] = {
                "q": query.detach().clone(), "k": key.detach().clone(), "v": value.detach().clone(),
                "mask": attention_mask, "scaling": scaling, "softcap": softcap,
                "sinks": a.get("s_aux", extra.get("s_aux")), "out": first(out).detach().clone(),
                "probs": probs.detach().clone() if isinstance(probs, torch.Tensor) else None}
            return out
        wrapper._validator_wrapped = True
        return wrapper

    @contextlib.contextmanager
    def _patched(self, rec: _Recorder):
        """The attention calls of this forward recorded: the module-level eager function of each class that
        needs it (eager models, and the fallback of hybrid trunks), and the loaded implementation (sdpa)
        through HF's registry, which every modeling file looks up at call time."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        classes = rec.data.pop("_patch", set())
        saved = []
        for cls in classes:
            g = cls.forward.__globals__
            orig = g["eager_attention_forward"]
            if getattr(orig, "_validator_wrapped", False):
                continue
            g["eager_attention_forward"] = self._recording(rec, orig)
            saved.append((g, orig))
        impl = self.attention
        local = None
        if classes and impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS:
            local = ALL_ATTENTION_FUNCTIONS._local_mapping.get(impl)
            ALL_ATTENTION_FUNCTIONS[impl] = self._recording(rec, ALL_ATTENTION_FUNCTIONS[impl])
        try:
            yield
        finally:
            for g, orig in saved:
                g["eager_attention_forward"] = orig
            if classes and impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS:
                if local is None:
                    del ALL_ATTENTION_FUNCTIONS[impl]
                else:
                    ALL_ATTENTION_FUNCTIONS[impl] = local

    def _forward(self, case: Case, output_attentions: bool, extra_hooks=None):
        kw = dict(input_ids=case.input_ids, attention_mask=case.attention_mask, use_cache=False,
                  output_hidden_states=True, output_attentions=output_attentions)
        if "position_ids" in inspect.signature(self.hf.forward).parameters:
            kw["position_ids"] = case.position_ids
        with torch.no_grad():
            return self.hf(**kw)

    # -- public -------------------------------------------------------------------------------
    def capture(self, case: Case, addresses: list[str]) -> dict:
        case = self.place(case)
        rec = _Recorder()
        plans = {}
        for addr in addresses:
            point, layer = split_address(addr)
            try:
                plans[addr] = self._plan(rec, point, layer, addr)
            except Exception as e:  # noqa: BLE001  (a mapping error is this row's evidence)
                plans[addr] = Missing(f"{type(e).__name__}: {e}")
        need_probs = any(split_address(a)[0] == "attn_probs" for a in addresses)
        try:
            with self._patched(rec):
                out = self._forward(case, need_probs and self.attention == "eager")
        finally:
            rec.remove()
        b, p = case.input_ids.shape
        result = {}
        for addr, plan in plans.items():
            if isinstance(plan, Missing):
                result[addr] = plan
                continue
            try:
                n = rec.calls.get(addr, 1)
                if n > 1:
                    raise RuntimeError(f"module for {addr} ran {n} times in one forward")
                result[addr] = plan(out, b, p).detach().float().cpu()
            except KeyError:
                result[addr] = Missing(f"the hooked module for {addr} never ran in this forward")
            except Exception as e:  # noqa: BLE001
                result[addr] = Missing(f"{type(e).__name__}: {e}")
        return result

    # -- interventions ----------------------------------------------------------------------------
    intervenes = True

    def _site(self, point: str, layer: int):
        """(module, 'out'|'in', how) where `point` at `layer` can be replaced, or a Missing: resid_post is
        the decoder layer's output, attn_out the attention module's (its residual argument taken off and
        put back on BLOOM), z the output projection's input per head."""
        lay = self._lay(layer)
        if point == "resid_post":
            return self.layers[layer], "out", None
        if lay is None:
            return Missing(f"the validator's HF layout table has no row for model_type {self.ctx.model_type!r}")
        attn, softmax = self._attn(layer)
        if attn is None:
            return Missing(f"layer {layer} has no attention module")
        if point == "attn_out":
            return attn, "out", ("residual" if lay.adds_residual else None)
        if point == "z":
            o = get_path(attn, lay.o_proj) if softmax and not lay.z_in else None
            if o is None:
                return Missing(f"no output projection {lay.o_proj!r} whose input is z at layer {layer}")
            return o, "in", "heads"
        return Missing(f"the validator intervenes at resid_post, attn_out and z only, not {point}")

    def _hook(self, point: str, layer: int, fn):
        """Install fn(canonical [b, q, ...], pos0) -> replacement at (point, layer); returns the handle. pos0
        counts the positions earlier calls of this forward fed (generation: prefill, then one per step)."""
        site = self._site(point, layer)
        if isinstance(site, Missing):
            raise LookupError(site.reason)
        mod, event, how = site
        seen = [0]
        heads = self.cfg.num_attention_heads

        def replace(t):
            q = t.shape[1]
            new = fn(t, seen[0])
            seen[0] += q
            return new

        if event == "in":
            def pre(m, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]
                b, q = x.shape[:2]
                new = replace(x.reshape(b, q, heads, -1)).reshape(x.shape).to(x.dtype)
                return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})
            return mod.register_forward_pre_hook(pre, with_kwargs=True)

        def post(m, args, kwargs, output):
            t = output[0] if isinstance(output, tuple) else output
            resid = (args[1] if len(args) > 1 else kwargs["residual"]) if how == "residual" else 0
            new = (replace(t - resid) + resid).to(t.dtype)
            return (new, *output[1:]) if isinstance(output, tuple) else new
        return mod.register_forward_hook(post, with_kwargs=True)

    def intervene(self, case: Case, point: str, layer: int, fn) -> torch.Tensor:
        """Logits [b, pos, vocab] of a forward in which the canonical tensor at (point, layer) is
        replaced by fn(tensor, pos0)."""
        case = self.place(case)
        h = self._hook(point, layer, fn)
        try:
            return self._forward(case, False).logits.detach().float().cpu()
        finally:
            h.remove()

    def steer_logits(self, case: Case, layer: int, vector: torch.Tensor) -> torch.Tensor:
        vector = self.place(vector)
        return self.intervene(case, "resid_post", layer, lambda t, pos0: t + vector.to(t.dtype))

    def generate(self, case: Case, n: int, point: str | None = None, layer: int | None = None, fn=None):
        """HF's own greedy generate of `n` new tokens (a Generation without captures), with fn applied at
        (point, layer) in every forward when given."""
        from validator.subject import Generation
        case = self.place(case)
        h = self._hook(point, layer, fn) if fn is not None else None
        tok = self.ctx.tokenizer
        try:
            with torch.no_grad():
                out = self.hf.generate(input_ids=case.input_ids, attention_mask=case.attention_mask,
                                       max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        finally:
            if h is not None:
                h.remove()
        return Generation(out.sequences.cpu(), torch.stack(out.logits, dim=1).float().cpu(), {})

    def versions(self) -> dict:
        import transformers
        return {"transformers": transformers.__version__}

    def close(self):
        self.hf = None


def _spec(spec):
    """(path, chunk_index, n_chunks) from a layout spec (a bare path has no chunk)."""
    return spec if isinstance(spec, tuple) else (spec, None, None)


def _kv_heads(cfg) -> int:
    if getattr(cfg, "multi_query", False):
        return 1
    return getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None) or cfg.num_attention_heads


def _heads(t, b, p, heads, head_dim):
    return to_heads(t, b, p, t.shape[-1] if t.dim() == 4 else t.shape[-1] // heads)


def _find_layers(hf, n_layers: int):
    """The decoder layer list of an unmapped model: the one ModuleList of n_layers blocks."""
    hits = [m for _, m in hf.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers]
    if not hits:
        raise LookupError(f"no ModuleList of {n_layers} layers in {type(hf).__name__}")
    return hits[0]
