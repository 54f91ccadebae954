"""Seeded engine bugs for the validator's self-test: each a small, realistic defect in engine/, applied in
process by patching one function or table entry, and the rows that must then fail (validator/selftest.py).

A mutation says what it breaks (`what`), where it applies (`models`; one cheap zoo twin unless the bug
needs a family quirk), which column must catch it (`column`), and the rows that name it (`expect`: globs
over row case and where-text, validator.rows.where). Patches are undone when the block ends, whatever
happens inside. Nothing here is imported by the engine or by a normal run.

Categories: capture (one point kind each), family (a quirk of one family), attention (the default sdpa
path and the eager path), op (every steering op's maths), position (every position spec), address (the
forms users type), lens, readout (every kind), decode (generation), vllm (the vLLM client's side; column
"vllm-static" loads that backend under the bug, so its startup proof runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

LLAMA = "meta-llama/Llama-3.2-1B"
GEMMA2 = "google/gemma-2-2b"
QWEN3 = "Qwen/Qwen3-0.6B"
MOE = "Qwen/Qwen3-30B-A3B"
BLOOM = "bigscience/bloom-560m"


class Patcher:
    """setattr / setitem that are undone in reverse order (a monkeypatch of our own)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """obj.name = value; undone by putting back exactly what obj itself held (a staticmethod stays one), or
        by removing the attribute where obj only inherited it."""
        own = vars(obj) if isinstance(obj, type) else None
        if own is not None and name not in own:
            getattr(obj, name)  # an AttributeError for a name obj does not have at all
            setattr(obj, name, value)
            self._undo.append(lambda: delattr(obj, name))
            return
        old = own[name] if own is not None else getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old))

    def item(self, mapping: dict, key: str, value: Any) -> None:
        had, old = key in mapping, mapping.get(key)
        mapping[key] = value
        self._undo.append(lambda: mapping.__setitem__(key, old) if had else mapping.pop(key, None))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


@dataclass(frozen=True)
class Mutation:
    name: str
    category: str
    what: str
    expect: tuple[tuple[str, str], ...]  # (case glob, where glob): a failing row matching one names the bug
    apply: Callable[[Patcher], None]
    models: tuple[str, ...] = (LLAMA,)
    column: str = "hf"

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        p = Patcher()
        try:
            self.apply(p)
            yield
        finally:
            p.undo()

    def names(self, row: dict) -> bool:
        """Whether a failing row names this bug (its case and its where-text match an expectation)."""
        from validator.rows import where
        return any(fnmatch.fnmatchcase(row["case"], c) and fnmatch.fnmatchcase(where(row), w) for c, w in self.expect)


# -- helpers -------------------------------------------------------------------------------------------
def _resolver(p: Patcher, point: str, wrap: Callable) -> None:
    """Replace the eager backend's resolver of `point` by wrap(original resolver)."""
    from engine.backends.hf import sites
    p.item(sites.RESOLVERS, point, wrap(sites.RESOLVERS[point]))


def _scaled(orig: Callable, factor: float) -> Callable:
    """A resolver whose site hands every reader its tensor times `factor`."""
    def resolve(c):
        site = orig(c)
        install = site.install

        def scaled_install(fn, writes):
            return install(lambda t: fn(t * factor), writes)
        site.install = scaled_install
        return site
    return resolve


def _op(p: Patcher, name: str, apply: Callable) -> None:
    from engine.core.ops import OPS
    p.item(OPS, name, dataclasses.replace(OPS[name], apply=apply))


def _along(x, v):
    flat = x.reshape(x.shape[0], -1)
    u = v.reshape(-1 if v.dim() != x.dim() else x.shape[0], flat.shape[1]).float()
    u = (u / u.norm(dim=-1, keepdim=True)).to(x.dtype)
    return flat, u, (flat * u).sum(-1, keepdim=True)


def _offsets(p: Patcher, change: Callable) -> None:
    """positions.offsets with `change(spec, pos0, n, prompt_len, original offsets)` applied."""
    from engine.core import positions
    orig = positions.offsets

    def offsets(spec, pos0, n, prompt_len):
        return change(spec, pos0, n, prompt_len, orig(spec, pos0, n, prompt_len))
    p.set(positions, "offsets", offsets)


def _keep(a, n):
    import numpy as np
    a = np.asarray(a, dtype=np.int64)
    return a[(a >= 0) & (a < n)]


# -- the catalogue --------------------------------------------------------------------------------------
def _catalogue() -> list[Mutation]:
    import numpy as np

    from engine.backends.hf import attention, sites
    out: list[Mutation] = []

    def add(name, category, what, expect, models=(LLAMA,), column="hf"):
        def register(fn):
            out.append(Mutation(name, category, what, tuple(expect), fn, tuple(models), column))
            return fn
        return register

    # capture: one point kind each
    @add("mlp_out-off-by-5e-4", "capture", "mlp_out captured times 1 + 5e-4", [("short", "mlp_out.*")])
    def _(p):
        _resolver(p, "mlp_out", lambda orig: _scaled(orig, 1 + 5e-4))

    @add("resid_post-layer-before", "capture", "resid_post.L read at layer L-1", [("short", "resid_post.*")])
    def _(p):
        _resolver(p, "resid_post", lambda orig: lambda c: orig(dataclasses.replace(c, layer=max(c.layer - 1, 0))))

    @add("attn_in-before-norm", "capture", "attn_in read as the block's input (before its norm)",
         [("short", "attn_in.*")])
    def _(p):
        _resolver(p, "attn_in", lambda orig: lambda c: sites.in_site(c.blk))

    @add("resid_mid-is-resid_pre", "capture", "resid_mid read where the block starts", [("short", "resid_mid.*")])
    def _(p):
        _resolver(p, "resid_mid", lambda orig: lambda c: sites.in_site(c.blk))

    @add("final_norm-input", "capture", "final_norm read at the norm's input", [("short", "final_norm")])
    def _(p):
        _resolver(p, "final_norm", lambda orig: lambda c: sites.in_site(sites.get_path(c.hf, c.fam.final_norm)))

    @add("mlp_act-is-mlp_pre", "capture", "mlp_act read at the gate projection's output",
         [("short", "mlp_act.*")])
    def _(p):
        _resolver(p, "mlp_act", lambda orig: lambda c: sites.RESOLVERS["mlp_pre"](dataclasses.replace(c, point="mlp_pre")))

    @add("padded-positions-by-column", "capture", "a left-padded row's positions counted from the batch's first column, "
         "not its own first token", [("leak", "*"), ("padded", "*")])
    def _(p):
        from engine.backends.hf.eager import EagerModel
        p.set(EagerModel, "_position_ids", staticmethod(
            lambda mask, from_zero=None: torch.arange(mask.shape[1], device=mask.device)[None]))

    # family quirks
    @add("attn_out_post-before-norm", "family", "attn_out_post read before Gemma-2's post-attention sandwich norm",
         [("short", "attn_out_post.*")], models=(GEMMA2,))
    def _(p):
        _resolver(p, "attn_out_post", lambda orig: sites.RESOLVERS["attn_out"])

    @add("bloom-attn_out-with-residual", "family", "BLOOM's attn_out keeps the residual its attention module adds",
         [("short", "attn_out.*")], models=(BLOOM,))
    def _(p):
        _resolver(p, "attn_out", lambda orig: lambda c: sites.out_site(c.mixer))

    @add("lm_head-before-softcap", "family", "lm_head read before Gemma-2's final logit softcap",
         [("short", "lm_head")], models=(GEMMA2,))
    def _(p):
        _resolver(p, "lm_head", lambda orig: sites.RESOLVERS["lm_head_raw"])

    @add("q_norm_out-is-input", "family", "q_norm_out read at the QK-norm's input (Qwen3)",
         [("short", "q_norm_out.*")], models=(QWEN3,))
    def _(p):
        _resolver(p, "q_norm_out", lambda orig: lambda c: orig(dataclasses.replace(c, point="q_norm_in")))

    @add("router-softmaxed", "family", "router_logits captured after a softmax (MoE)", [("short", "router_logits.*")],
         models=(MOE,))
    def _(p):
        _resolver(p, "router_logits", lambda orig: _softmaxed(orig))

    # attention paths
    @add("sdpa-pattern-mask-leak", "attention", "the default (sdpa) path's patterns: the causal mask it builds "
         "lets each query see one key ahead", [("short", "attn_probs.*"), ("short", "attn_scores.*")])
    def _(p):
        orig = attention.additive_mask

        def leaky(mask, q_len, kv_len, dtype, device):
            if mask is None:
                q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
                mask = (torch.arange(kv_len, device=device)[None, :] <= q_pos + 1)[None, None]
            return orig(mask, q_len, kv_len, dtype, device)
        p.set(attention, "additive_mask", leaky)

    @add("scores-unscaled", "attention", "attn_scores formed without the 1/sqrt(head_dim) scaling",
         [("*", "attn_scores.*")])
    def _(p):
        orig = attention.scores_from
        p.set(attention, "scores_from", lambda m, q, k, mask, scaling, softcap=None: orig(m, q, k, mask, 1.0, softcap))

    @add("q-heads-reversed", "attention", "q, k and value laid out with their heads in reverse order",
         [("short", "q.*"), ("short", "k.*"), ("short", "value.*")])
    def _(p):
        p.set(attention, "_heads_first_to_pos_first", lambda t: t.transpose(1, 2).flip(2))

    # steering ops
    @add("project_out-sign", "op", "project_out adds the component instead of removing it",
         [("steer", "*project_out at *")])
    def _(p):
        _op(p, "project_out", lambda x, v, prm: (lambda f, u, d: (f + d * u).reshape(x.shape))(*_along(x, v)))

    @add("rescale-coeff", "op", "rescale scales the component by coeff + 1", [("steer", "rescale at *")])
    def _(p):
        _op(p, "rescale", lambda x, v, prm: (lambda f, u, d: (f + prm.coeff * d * u).reshape(x.shape))(*_along(x, v)))

    @add("projection_cap-open", "op", "projection_cap ignores its upper bound", [("steer", "projection_cap at *")])
    def _(p):
        _op(p, "projection_cap", lambda x, v, prm: x.clone())

    @add("norm_scaled_add-squared", "op", "norm_scaled_add scales by the squared norm",
         [("steer", "norm_scaled_add at *")])
    def _(p):
        _op(p, "norm_scaled_add", lambda x, v, prm: (lambda f, u, d: (f + prm.coeff * f.pow(2).sum(-1, keepdim=True) * u)
                                                  .reshape(x.shape))(*_along(x, v)))

    @add("add-twice", "op", "add adds its value twice", [("steer", "add@* at *"), ("steer", "z*:add at *")])
    def _(p):
        _op(p, "add", lambda x, v, prm: x + 2 * v)

    @add("mean_ablate-zero", "op", "mean_ablate writes zero instead of the mean", [("steer", "mean_ablate at *")])
    def _(p):
        _op(p, "mean_ablate", lambda x, v, prm: torch.zeros_like(x))

    @add("feature_scale-ignores-coeff", "op", "feature_scale leaves the feature as it was",
         [("steer", "feature_scale at *")])
    def _(p):
        from engine.core import features
        p.set(features, "scale_feature", lambda sae, x, index, factor, source=None: x.clone())

    @add("set-adds", "op", "set adds the value instead of replacing", [("steer", "set at *")])
    def _(p):
        _op(p, "set", lambda x, v, prm: x + v)

    @add("ablate-mean", "op", "ablate writes the rows' mean instead of zero", [("steer", "*ablate at *")])
    def _(p):
        _op(p, "ablate", lambda x, v, prm: x.mean(0, keepdim=True).expand_as(x).clone())

    @add("scale-squared", "op", "scale applies its factor twice", [("steer", "*scale* at *")])
    def _(p):
        _op(p, "scale", lambda x, v, prm: x * v * v)

    @add("swap-reversed", "op", "swap takes the other prompt's positions in reverse order", [("steer", "swap at *")])
    def _(p):
        _op(p, "swap", lambda x, v, prm: v.expand_as(x).flip(0).clone())

    @add("feature_clamp-drops-error", "op", "feature_clamp returns the SAE reconstruction (the error term lost)",
         [("steer", "feature_clamp at *")])
    def _(p):
        from engine.core import features
        p.set(features, "clamp_feature", lambda sae, x, index, value, source=None: sae.forward(x).to(x.dtype))

    @add("feature_add-unit", "op", "feature_add adds the unit decoder direction instead of the decoder row",
         [("steer", "feature_add at *")])
    def _(p):
        from engine.core import features
        orig = features.add_feature_direction

        def unit(sae, x, index, coeff):
            return x + (orig(sae, x, index, coeff) - x) / sae.W_dec[index].norm()
        p.set(features, "add_feature_direction", unit)

    # position specs
    @add("int-position-next-token", "position", "an int position steers the next token",
         [("steer", "add@3 at *"), ("steer", "add@-2 at *"), ("steer_generate", "gen:add@-3 at *")])
    def _(p):
        _offsets(p, lambda s, pos0, n, pl, o: _keep(o + 1, n) if isinstance(s, int) and not isinstance(s, bool) else o)

    @add("last-takes-every-row", "position", "the every-row fast path also takes 'last' (the whole prompt steered)",
         [("steer", "add@'last' at *"), ("steer", "set at *"), ("steer", "z:add at *")])
    def _(p):
        from engine.core import step
        orig = step.touches_every_row
        p.set(step, "touches_every_row", lambda st: orig(st) or st.positions == "last")

    @add("last-one-early", "position", "'last' starts one token before the last prompt token",
         [("steer", "add@'last' at *"), ("steer", "set at *")])
    def _(p):
        _offsets(p, lambda s, pos0, n, pl, o: np.arange(max(pl - 2 - pos0, 0), n, dtype=np.int64) if s == "last" else o)

    @add("generated-includes-prompt-end", "position", "'generated' also steers the last prompt token",
         [("steer_generate", "gen:*'generated'* at *")])
    def _(p):
        _offsets(p, lambda s, pos0, n, pl, o: np.arange(max(pl - 1 - pos0, 0), n, dtype=np.int64)
                 if s == "generated" else o)

    @add("list-drops-last", "position", "a positions list loses its last entry",
         [("steer", "add@[* at *"), ("steer", "mean_ablate at *")])
    def _(p):
        _offsets(p, lambda s, pos0, n, pl, o: o[:-1] if isinstance(s, list) and len(o) else o)

    @add("range-stop-inclusive", "position", "a (start, stop) range also steers stop",
         [("steer", "add@(2, 5) at *"), ("steer", "scale-elementwise at *")])
    def _(p):
        def change(s, pos0, n, pl, o):
            if isinstance(s, slice) and s.stop is not None and len(o):
                return _keep(np.append(o, o[-1] + 1), n)
            return o
        _offsets(p, change)

    # address forms
    @add("negative-layer-early", "address", "a negative layer resolves one layer too early",
         [("address", "*.-*")])
    def _(p):
        from engine.core.address import Address
        orig = Address.resolved

        def resolved(self, n_layers):
            if self.layer is not None and self.layer < 0 and self.layer - 1 >= -n_layers:
                return orig(Address(self.point, self.layer - 1, **dict(self.coords)), n_layers)
            return orig(self, n_layers)
        p.set(Address, "resolved", resolved)

    @add("head-coordinate-next", "address", "a head coordinate reads the next head",
         [("address", "*.head-*")])
    def _(p):
        from engine.backends.hf.grid import GridStep
        from engine.core.step import Step
        for cls in (Step, GridStep):  # the vLLM worker's step and the eager backend's
            p.set(cls, "capture", _next_head(cls.capture))

    @add("bare-name-skips-last-layer", "address", "a bare layer point name leaves out the last layer",
         [("address", "* (= *)")])
    def _(p):
        from engine.model.catalogue import PointCatalogue
        orig = PointCatalogue.expand

        def expand(self, points):
            items = [points] if isinstance(points, str) else list(points)
            bare = {q for q in items if isinstance(q, str) and "." not in q}
            return [a for a in orig(self, points)
                    if not (a.point in bare and a.layer is not None and a.layer == self.n_layers - 1)]
        p.set(PointCatalogue, "expand", expand)

    @add("alias-logits-raw", "address", "the alias 'logits' names lm_head_raw", [("address", "logits *")],
         models=(GEMMA2,))
    def _(p):
        from engine.core import points
        p.item(points.ALIASES, "logits", "lm_head_raw")

    # lens
    @add("lens-skips-final-norm", "lens", "the logit lens skips the final norm", [("lens", "resid_post.*")])
    def _(p):
        from engine.model import lens
        orig = lens.unembed
        p.set(lens, "unembed", lambda hf, fam, x, apply_norm=True, streams=False: orig(hf, fam, x, False, streams))

    @add("lens-no-softcap", "lens", "the logit lens skips Gemma-2's final softcap", [("lens", "resid_post.*")],
         models=(GEMMA2,))
    def _(p):
        from engine.model import lens
        orig = lens.unembed

        def unembed(hf, fam, x, apply_norm=True, streams=False):
            cfg = hf.config.get_text_config()
            cap, cfg.final_logit_softcapping = cfg.final_logit_softcapping, None
            try:
                return orig(hf, fam, x, apply_norm, streams)
            finally:
                cfg.final_logit_softcapping = cap
        p.set(lens, "unembed", unembed)

    # readouts
    @add("mean-over-n-minus-1", "readout", "Mean divides by n - 1", [("readout", "*:mean")])
    def _(p):
        from engine.core.readouts import Mean
        p.set(Mean, "combine", lambda self, parts, n: (torch.stack([q[0] for q in parts]).sum(0) / max(n - 1, 1),))

    @add("max-is-last", "readout", "Max keeps the last position", [("readout", "*:max")])
    def _(p):
        from engine.core.readouts import Last, Max
        p.set(Max, "segments", Last.segments)

    @add("last-is-first", "readout", "Last keeps the first position", [("readout", "*:last")])
    def _(p):
        from engine.core.readouts import Last

        def first(self, x, counts, device):
            import numpy as np
            at = torch.from_numpy(np.cumsum([0, *counts[:-1]]))
            return (x.index_select(0, at.to(x.device)),)
        p.set(Last, "segments", first)

    @add("norm-squared", "readout", "Norm returns the squared norm", [("readout", "*:norm")])
    def _(p):
        from engine.core.readouts import Norm
        p.set(Norm, "bind", lambda self, env, a: lambda x: (x.float().reshape(x.shape[0], -1).pow(2).sum(-1),))

    @add("project-no-bias", "readout", "Project ignores its bias", [("readout", "*:project")])
    def _(p):
        from engine.core.readouts import Project
        orig = Project.bind
        p.set(Project, "bind", lambda self, env, a: orig(dataclasses.replace(self, b=None), env, a))

    @add("lens_topk-ascending", "readout", "LensTopK returns the least likely tokens", [("readout", "*:lens_topk")])
    def _(p):
        from engine.core.readouts import LensTopK
        orig = LensTopK.bind

        def bind(self, env, a):
            fn = orig(self, env, a)
            return lambda x: (lambda i, v: (i.flip(-1), v.flip(-1)))(*fn(x))
        p.set(LensTopK, "bind", bind)

    @add("sae-no-b_dec", "readout", "the SAE encoder skips subtracting b_dec", [("readout", "*:sae"),
                                                                              ("steer", "feature_*")])
    def _(p):
        from engine.core.sae import SAE
        orig = SAE.prepare
        p.set(SAE, "prepare", lambda self, x: orig(self, x) + self.b_dec if self.apply_b_dec_to_input else orig(self, x))

    # decode
    @add("decode-drops-first-generated", "decode", "generation capture drops the first generated token",
         [("decode", "*")])
    def _(p):
        from engine.backends.hf.eager import EagerModel
        orig = EagerModel.generate

        def generate(self, inputs, max_new_tokens=8, points=(), steer=(), strict=False, readouts=(), **kw):
            res = orig(self, inputs, max_new_tokens, points, steer, strict, readouts, **kw)
            P = res.tokens.shape[1] - res.new_tokens.shape[1]
            for k in list(res.cache):
                t = res.cache[k]
                if k.split(".")[0] not in ("lm_head", "lm_head_raw", "attn_probs", "attn_scores") and t.shape[1] > P + 1:
                    dict.__setitem__(res.cache, k, torch.cat([t[:, :P], t[:, P + 1:], t[:, -1:]], dim=1))
            return res
        p.set(EagerModel, "generate", generate)

    @add("generate-scores-one-step-late", "decode", "generation returns each step's scores one step late",
         [("generate", "generate"), ("steer_generate", "*")])
    def _(p):
        from engine.backends.hf.eager import EagerModel
        orig = EagerModel.generate

        def generate(self, inputs, max_new_tokens=8, points=(), steer=(), strict=False, readouts=(), **kw):
            res = orig(self, inputs, max_new_tokens, points, steer, strict, readouts, **kw)
            return dataclasses.replace(res, logits=None if res.logits is None else res.logits.roll(1, 1))
        p.set(EagerModel, "generate", generate)

    @add("greedy-repetition-penalty", "decode", "greedy generation applies a repetition penalty",
         [("generate", "generate"), ("steer_generate", "*")])
    def _(p):
        from engine.model.sampling import Sampling
        orig = Sampling.hf
        p.set(Sampling, "hf", lambda self: {**orig(self), "repetition_penalty": 20.0} if self.greedy else orig(self))

    # the vLLM client
    @add("vllm-reply-rows-rolled", "vllm", "the vLLM client puts each capture's rows one position late",
         [("short", "*"), ("padded", "*")], column="vllm")
    def _(p):
        from engine.backends.vllm import replies
        orig = replies.gather
        p.set(replies, "gather", lambda catalogue, key, ranks: orig(catalogue, key, ranks).roll(1, 0))

    @add("vllm-readouts-rolled", "vllm", "the vLLM client hands back per-position readouts one position late",
         [("readout", "*")], column="vllm")
    def _(p):
        from engine.backends.vllm import replies
        orig = replies.readout_value

        def rolled(r, ranks):
            v = orig(r, ranks)
            if not r.kind.per_position:
                return v
            return type(v)(*(t.roll(1, 0) for t in (v.indices, v.values))) if hasattr(v, "indices") and \
                not isinstance(v, torch.Tensor) else v.roll(1, 0)
        p.set(replies, "readout_value", rolled)

    @add("vllm-receipts-one-row-short", "vllm", "the vLLM client reports each steer's receipt one row short",
         [("*", "*")], column="vllm-static")
    def _(p):
        # vllm-static's startup proof checks a receipt's rows, so the engine refuses to load: a cell of a model
        # it serves must then fail whole, never be filed as an architecture vLLM cannot load
        from engine.backends.vllm.worker import wire
        orig = wire.receipts_in
        p.set(wire, "receipts_in", lambda plan, ranks: [dataclasses.replace(r, rows=r.rows - 1)
                                                        for r in orig(plan, ranks)])

    return out


def _next_head(orig):
    def capture(self, g, t):
        if g.coord is not None:
            g = dataclasses.replace(g, coord=(g.coord + 1) % t.shape[1])
        return orig(self, g, t)
    return capture


def _softmaxed(orig):
    def resolve(c):
        site = orig(c)
        install = site.install
        site.install = lambda fn, writes: install(lambda t: fn(torch.softmax(t.float(), -1).to(t.dtype)), writes)
        return site
    return resolve


MUTATIONS: list[Mutation] = []


def catalogue() -> list[Mutation]:
    """Every seeded bug (built on first use: it imports the engine)."""
    if not MUTATIONS:
        MUTATIONS.extend(_catalogue())
    return MUTATIONS


CATEGORIES = ("capture", "family", "attention", "op", "position", "address", "lens", "readout", "decode", "vllm")
__all__ = ["CATEGORIES", "MUTATIONS", "Mutation", "Patcher", "catalogue"]
