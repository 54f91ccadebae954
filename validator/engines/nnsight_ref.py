"""Reference `nnsight`: `TransformersModel.trace` (nnsight 0.8's model class; `LanguageModel` is its
deprecated alias) on the validator's own copy of the HF model.

Module inputs and outputs are saved from nnsight's envoys at the paths of the validator's HF
layout table (hf_layouts.py); the attention internals are the arguments and result of the
attention call inside the attention module's forward (`.source.attention_interface_<n>`, see
`_attention_call`). nnsight
requires a trace to touch modules in execution order, so one dry forward per model records that
order and every trace visits its envoys sorted by it.
"""
from __future__ import annotations

import inspect

import torch

from validator.engines.base import (
    Case,
    EngineUnavailable,
    Missing,
    Reference,
    first,
    probs_from_scores,
    scores_from_qk,
    split_address,
    to_heads,
)
from validator.engines.hf_layouts import get_path, layout_for
from validator.engines.hf_ref import _find_layers, _kv_heads, _spec

TENSORS = {
    "embeddings": "model.layers[0].input (the embeddings as the first block receives them)",
    "resid_pre": "layers[L].input", "resid_post": "layers[L].output (first element)",
    "final_norm": "<final norm>.output", "lm_head": "lm.output.logits",
    "lm_head_raw": "<get_output_embeddings() module>.output",
    "attn_in": "<attn>.input", "attn_out": "<attn>.output[0] (minus the residual argument on BLOOM)",
    "attn_out_post": "<post-attention sandwich norm>.output", "resid_mid": "<pre-MLP norm>.input",
    "mlp_in": "<mlp>.input", "mlp_out": "<mlp>.output (minus the residual argument on BLOOM and MPT)",
    "mlp_out_post": "<post-MLP sandwich norm>.output",
    "mlp_pre": "<gate proj>.output", "mlp_pre_linear": "<up proj>.output", "mlp_act": "<down proj>.input",
    "q_norm_in": "<q norm>.input", "q_norm_out": "<q norm>.output",
    "k_norm_in": "<k norm>.input", "k_norm_out": "<k norm>.output",
    "q": "<attn>.source.attention_interface_<n> query argument",
    "k": "<attn>.source.attention_interface_<n> key argument",
    "value": "<attn>.source.attention_interface_<n> value argument (q/k/value: <projection>.output per head "
             "where HF computes attention inline on them, GPT-Neo and MPT)",
    "z": "<attn>.source.attention_interface_<n> output[0] (<o_a_proj>.input per head on DeepSeek-V4)",
    "attn_probs": "<attn>.source.attention_interface_<n> output[1] (<attn>.output[1] where HF computes "
                  "attention inline and returns the pattern, GPT-Neo and MPT)",
    "attn_scores": "recomputed from the saved query, key, mask and scaling arguments",
    # (attn_probs under sdpa: recomputed from the same arguments, softmax over keys with the sinks where given)
    "router_logits": "<router>.output[i]", "expert_weights": "<router>.output[i]",
    "expert_indices": "<router>.output[i]",
}
_FN = "attention_interface"


def _attention_call(source) -> str | None:
    """The name nnsight gives the attention function's call in a module's source: the last
    `attention_interface_<n>` operation. nnsight 0.7 names calls only (`_0` is the call); 0.8 names every
    assignment too, so `_0` is `attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(...)` and the
    call that follows it is `_1`. None: no such call (HF computes this family's attention inline)."""
    names = getattr(source, "names", None)  # 0.8: the operations in execution order
    if names is None:  # 0.7: one attribute per operation
        names = [n for n in dir(source) if not n.startswith("_")]
    ops = [n for n in names if n.startswith(_FN + "_") and n[len(_FN) + 1:].isdigit()]
    return max(ops, key=lambda n: int(n[len(_FN) + 1:])) if ops else None


class NNsightReference(Reference):
    name = "nnsight"
    TENSORS = TENSORS

    def __init__(self, ctx):
        super().__init__(ctx)
        from nnsight import TransformersModel
        hf = ctx.fresh_hf()
        self.cfg = ctx.config
        self.layout = layout_for(ctx.model_type, self.cfg)
        if self.layout:
            self.layers_path = self.layout.layers
        else:
            layers = _find_layers(hf, ctx.n_layers)
            self.layers_path = next(n for n, m in hf.named_modules() if m is layers)
        self.head_dim = getattr(self.cfg, "head_dim", None) or self.cfg.hidden_size // self.cfg.num_attention_heads
        try:
            self.lm = TransformersModel(hf, tokenizer=ctx.tokenizer, task="text-generation")
        except Exception as e:  # noqa: BLE001
            raise EngineUnavailable(f"nnsight TransformersModel failed: {type(e).__name__}: {e}") from e
        self.hf = hf
        self._order: dict | None = None
        self.accepts_positions = "position_ids" in inspect.signature(hf.forward).parameters

    # -- which module and event each point reads --------------------------------------------------
    def _path(self, point: str, layer):
        """(module path, 'in'|'out'|'fn', extra) or Missing."""
        lay = self.layout.at(self.cfg, layer) if self.layout is not None else None
        lp = f"{self.layers_path}.{layer}" if layer is not None else None
        if point == "embeddings":
            if lay is not None and lay.embed:
                return lay.embed, "out", None
            return f"{self.layers_path}.0", "in", None
        if point == "resid_pre":
            return lp, "in", None
        if point == "resid_post" or (point == "resid_streams" and lay is not None and lay.streams):
            return lp, "out", None
        if point == "lm_head":
            return "", "logits", None
        if point == "lm_head_raw":
            head = self.hf.get_output_embeddings()
            return next(n for n, mod in self.hf.named_modules() if mod is head), "out", None
        if lay is None:
            return Missing(f"the validator's layout table has no row for {self.ctx.model_type!r}")
        if point == "final_norm":
            return lay.final_norm, "out", None
        attn = next((f"{lp}.{a}" for a in lay.attn if get_path(self.hf, f"{lp}.{a}") is not None), None) \
            if lp else None
        mixer = next((f"{lp}.{a}" for a in lay.mixers if get_path(self.hf, f"{lp}.{a}") is not None), None) \
            if lp else None
        if point in ("attn_in", "attn_out"):
            mod = attn or mixer
            if mod is None:
                return Missing(f"layer {layer} has no attention or mixer module")
            if point == "attn_in":
                return mod, "in", None
            return mod, "out", ("minus_residual" if lay.adds_residual else None)
        if point in ("q", "k", "value", "z", "attn_probs", "attn_scores"):
            if attn is None:
                return Missing(f"layer {layer} has no softmax attention module")
            if point == "z" and lay.z_in:  # what the output projection reads, per head
                return f"{attn}.{lay.z_in}", "in", "z_heads"
            if not self._has_fn(attn):
                if point == "z":
                    return f"{attn}.{lay.o_proj}", "in", "heads"
                if point in ("q", "k", "value") and lay.inline_qkv:  # the projection output is the tensor
                    path, chunk, parts = _spec(lay.inline_qkv[("q", "k", "value").index(point)])
                    return f"{attn}.{path}", "out", ("chunk_heads", chunk, parts)
                if point == "attn_probs" and lay.probs_out is not None:
                    return attn, "out", ("pattern", lay.probs_out)
                if point != "attn_probs":
                    return Missing(f"{type(get_path(self.hf, attn)).__name__} computes attention inline: its "
                                   f"source has no {_FN}_0 call, so {point} is never a separate tensor")
                return Missing(f"{type(get_path(self.hf, attn)).__name__}'s source has no {_FN}_0 call to read the "
                               f"pattern from")
            return attn, "fn", point
        if point in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"):
            sub = lay.q_norm if point.startswith("q") else lay.k_norm
            if not sub or attn is None or get_path(self.hf, f"{attn}.{sub}") is None:
                return Missing(f"no {point[:6]} module at layer {layer}")
            return f"{attn}.{sub}", "in" if point.endswith("_in") else "out", "heads"
        if point.endswith(("_stream_write", "_stream_mix", "_stream_collapse", "_stream_collapse_weights")):
            if not lay.streams:
                return Missing("not a hyper-connection family")
            if point.endswith("_collapse_weights"):
                return Missing("HF's hyper-connection module computes its collapse weights inside forward and "
                               "returns only the collapsed input")
            hc = lay.streams[0 if point.startswith("attn") else 1]
            return f"{lp}.{hc}", "out", ("index", {"write": 0, "mix": 1, "collapse": 2}[point.split("_stream_")[1]])
        if point in ("attn_out_post", "mlp_out_post"):
            sub = lay.attn_post if point == "attn_out_post" else lay.mlp_post
            return (f"{lp}.{sub}", "out", None) if sub else Missing(f"no sandwich norm for {point}")
        if point == "resid_mid":
            if lay.is_parallel(self.cfg) or lay.mid is None:
                return Missing("parallel block: no mid residual")
            return f"{lp}.{lay.mid[0]}", lay.mid[1], "flat"
        mlp = lp if lay.mlp_on_layer else (f"{lp}.{lay.mlp}" if lay.mlp else None)
        if mlp is None:
            return Missing(f"layer {layer} has no MLP module")
        if point == "mlp_in" and not lay.mlp_on_layer:
            return mlp, "in", "flat"
        if point == "mlp_out" and not lay.mlp_on_layer:
            if lay.mlp_sibling:
                return mlp, "out", ("plus", f"{lp}.{lay.mlp_sibling}")
            extra = ("index", lay.mlp_index) if lay.mlp_index is not None else \
                ("minus_residual" if (lay.adds_residual or lay.mlp_adds_residual) else "flat")
            return mlp, "out", extra
        if point in ("router_logits", "expert_weights", "expert_indices"):
            if not lay.router:
                return Missing("no router in the layout")
            idx = lay.router[{"router_logits": 1, "expert_weights": 2, "expert_indices": 3}[point]]
            if idx is None:
                return Missing(f"this family's router returns only its logits; {point} is never a tensor")
            return f"{mlp}.{lay.router[0]}", "out", "flat" if idx == "self" else ("index", idx)
        spec = {"mlp_in": lay.gate, "mlp_pre": lay.gate, "mlp_pre_linear": lay.up, "mlp_act": lay.down,
                "mlp_out": lay.down}.get(point)
        if spec is None:
            return Missing(f"the layout maps no module for {point}")
        path, chunk, parts = spec if isinstance(spec, tuple) else (spec, None, None)
        event = "in" if point in ("mlp_in", "mlp_act") else "out"
        return f"{mlp}.{path}", event, ("chunk", chunk, parts) if chunk is not None else "flat"

    def _has_fn(self, path: str) -> bool:
        try:
            return _attention_call(self._envoy(path).source) is not None
        except Exception:  # noqa: BLE001  (source parsing can fail on exotic forwards)
            return False

    def _execution_order(self, case: Case, paths) -> dict:
        """{(path, event): rank} from one plain forward with PyTorch hooks (once per set of paths:
        the call order of a model's modules does not depend on the prompt)."""
        key = frozenset(paths)
        if self._order is not None and self._order[0] == key:
            return self._order[1]
        events, handles = [], []
        for path in paths:
            mod = get_path(self.hf, path) if path else None
            if mod is None:
                continue
            handles.append(mod.register_forward_pre_hook(lambda m, a, p=path: events.append((p, "in"))))
            handles.append(mod.register_forward_hook(lambda m, a, o, p=path: events.append((p, "out"))))
        try:
            with torch.no_grad():
                self.hf(**self._inputs(case))
        finally:
            for h in handles:
                h.remove()
        order = {}
        for i, ev in enumerate(events):
            order.setdefault(ev, i)
        self._order = (key, order)
        return order

    def _inputs(self, case: Case) -> dict:
        kw = dict(input_ids=case.input_ids, attention_mask=case.attention_mask)
        if self.accepts_positions:
            kw["position_ids"] = case.position_ids
        return self.place(kw)

    def _envoy(self, path: str):
        env = self.lm
        for part in path.split("."):
            env = env[int(part)] if part.isdigit() else getattr(env, part)
        return env

    # -- public ---------------------------------------------------------------------------------
    def capture(self, case: Case, addresses: list[str]) -> dict:
        plans, out = {}, {}
        for a in addresses:
            point, layer = split_address(a)
            try:
                plan = self._path(point, layer)
            except Exception as e:  # noqa: BLE001
                plan = Missing(f"{type(e).__name__}: {e}")
            if isinstance(plan, Missing):
                out[a] = plan
            elif plan[0] and get_path(self.hf, plan[0]) is None:
                out[a] = Missing(f"no module at {plan[0]!r}")
            else:
                plans[a] = plan
        # every (module, event) to visit; BLOOM's residual-adding modules need their input as well
        needs = {a: [(path, event)] + ([(path, "in")] if extra == "minus_residual" else []) +
                 ([(extra[1], "out")] if isinstance(extra, tuple) and extra[0] == "plus" else [])
                 for a, (path, event, extra) in plans.items()}
        # the module right after the attention call: the output projection, or what reads z first (V4)
        o_proj = (self.layout.z_in or self.layout.o_proj) if self.layout else "o_proj"
        fn_paths = {p[0] for p in plans.values() if p[1] == "fn"}
        siblings = {p[2][1] for p in plans.values() if isinstance(p[2], tuple) and p[2][0] == "plus"}
        order = self._execution_order(case, {p[0] for p in plans.values()} | siblings |
                                      {f"{p}.{o_proj}" for p in fn_paths})

        def rank(ev):
            path, event = ev
            if event == "logits":
                return float("inf")
            if event == "fn":  # the attention call runs after q/k norms and RoPE, before the output projection
                return order.get((f"{path}.{o_proj}", "in"), order.get((path, "out"), 0)) - 0.5
            return order.get(ev, -1)

        for a, evs in needs.items():
            if any(rank(ev) < 0 for ev in evs):
                out[a] = Missing(f"module {plans[a][0]} never ran in this forward")
        events = sorted({ev for a, evs in needs.items() if a not in out for ev in evs}, key=rank)
        saved = {}
        inputs = self._inputs(case)
        ids = inputs.pop("input_ids")
        with torch.no_grad(), self.lm.trace({"input_ids": ids, "attention_mask": inputs.pop("attention_mask")},
                                            **inputs):
            for path, event in events:
                if event == "logits":
                    saved[(path, event)] = self.lm.output.logits.save()
                elif event == "fn":
                    source = self._envoy(path).source
                    fn = getattr(source, _attention_call(source))
                    saved[(path, event)] = (fn.inputs.save(), fn.output.save())
                elif event == "in":
                    saved[(path, event)] = self._envoy(path).inputs.save()
                else:  # cloned now: Falcon adds the attention output into the MLP's output in place
                    o = self._envoy(path).output
                    if isinstance(o, tuple):
                        saved[(path, event)] = tuple(x.clone().save() if isinstance(x, torch.Tensor) else None
                                                     for x in o)
                    else:
                        saved[(path, event)] = o.clone().save()
        b, p = ids.shape
        for a, (path, event, extra) in plans.items():
            if a in out:
                continue
            try:
                t = self._finish(a, event, extra, saved[(path, event)], b, p)
                if extra == "minus_residual":
                    args, kwargs = saved[(path, "in")]
                    t = t - (args[1] if len(args) > 1 else kwargs["residual"])
                if isinstance(extra, tuple) and extra[0] == "plus":  # granite-4: block_sparse_moe + shared_mlp
                    t = t + first(saved[(extra[1], "out")]).reshape(t.shape)
                out[a] = t.detach().float().cpu()
            except Exception as e:  # noqa: BLE001
                out[a] = Missing(f"{type(e).__name__}: {e}")
        return out

    def _finish(self, address, event, extra, val, b, p):
        point, _ = split_address(address)
        if event == "logits":
            return val
        if event == "fn":
            (args, kwargs), result = val
            q, k, v, mask = args[1], args[2], args[3], args[4]
            if point == "z":
                return first(result)
            if point == "attn_probs":
                if result[1] is None:  # sdpa returns no probabilities: formed from the call's q and k
                    scaling = kwargs.get("scaling", getattr(args[0], "scaling", q.shape[-1] ** -0.5))
                    return probs_from_scores(scores_from_qk(q, k, mask, scaling, kwargs.get("softcap")),
                                             kwargs.get("s_aux"))
                return result[1].transpose(1, 2)
            if point == "attn_scores":
                scaling = kwargs.get("scaling", getattr(args[0], "scaling", q.shape[-1] ** -0.5))
                return scores_from_qk(q, k, mask, scaling, kwargs.get("softcap"))
            return {"q": q, "k": k, "value": v}[point].transpose(1, 2)
        if event == "in":
            args, kwargs = val
            t = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
        elif isinstance(extra, tuple) and extra[0] == "pattern":  # inline attention: [b, h, q, k] returned
            return val[extra[1]].transpose(1, 2)
        elif isinstance(extra, tuple) and extra[0] == "index":
            t = val[extra[1]]
        else:
            t = first(val)
        if isinstance(extra, tuple) and extra[0] in ("chunk", "chunk_heads") and extra[1] is not None:
            t = t.chunk(extra[2], dim=-1)[extra[1]]
        if extra == "z_heads":  # V4: [b, pos, groups, heads/group * hd]
            return t.reshape(b, p, self.cfg.num_attention_heads, -1)
        if extra == "heads" or (isinstance(extra, tuple) and extra[0] == "chunk_heads"):
            heads = _kv_heads(self.cfg) if point.startswith("k") else self.cfg.num_attention_heads
            return to_heads(t, b, p, t.shape[-1] if t.dim() == 4 else t.shape[-1] // heads)
        return t.reshape(b, p, *t.shape[2:]) if t.dim() >= 3 else t.reshape(b, p, -1)

    intervenes = True

    def _z_input(self, layer: int) -> str:
        """The output projection whose input is z per head (the path the trace sets)."""
        lay = self.layout.at(self.cfg, layer) if self.layout is not None else None
        plan = self._path("z", layer)
        if lay is None or isinstance(plan, Missing) or lay.z_in:
            raise LookupError(f"no output projection whose input is z at layer {layer}")
        if plan[1] == "in" and plan[2] == "heads":  # attention computed inline: z is already o_proj's input
            return plan[0]
        return f"{plan[0]}.{lay.o_proj}"

    def intervene(self, case: Case, point: str, layer: int, fn) -> torch.Tensor:
        """Logits of a trace that sets the output of the decoder layer (resid_post) or of the attention module
        (attn_out), or the input of the output projection (z, per head), to fn(canonical tensor, 0)."""
        if point == "z":
            path, event = self._z_input(layer), "in"
        elif point in ("resid_post", "attn_out"):
            plan = self._path(point, layer)
            if isinstance(plan, Missing):
                raise LookupError(plan.reason)
            path, event, extra = plan
            if event != "out" or extra is not None:
                raise LookupError(f"{point} at layer {layer} is not a plain module output here ({extra})")
        else:
            raise LookupError(f"the validator intervenes at resid_post, attn_out and z only, not {point}")
        inputs = self._inputs(case)
        ids = inputs.pop("input_ids")
        env = self._envoy(path)
        heads = self.cfg.num_attention_heads
        with torch.no_grad(), self.lm.trace({"input_ids": ids, "attention_mask": inputs.pop("attention_mask")},
                                            **inputs):
            if event == "in":
                x = env.input
                b, q = x.shape[:2]
                env.input = fn(x.reshape(b, q, heads, -1), 0).reshape(x.shape).to(x.dtype)
            else:
                o = env.output
                if isinstance(o, tuple):
                    env.output = (fn(o[0], 0).to(o[0].dtype), *o[1:])
                else:
                    env.output = fn(o, 0).to(o.dtype)
            logits = self.lm.output.logits.save()
        return logits.detach().float().cpu()

    def steer_logits(self, case: Case, layer: int, vector: torch.Tensor) -> torch.Tensor:
        vector = self.place(vector)
        return self.intervene(case, "resid_post", layer, lambda t, pos0: t + vector.to(t.dtype))

    def versions(self) -> dict:
        from importlib import metadata
        return {"nnsight": metadata.version("nnsight")}

    def close(self):
        self.lm = self.hf = None
