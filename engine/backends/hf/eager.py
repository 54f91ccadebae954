"""The eager backend: an HF model with hooks. Serves every point the family has, capture and
steering, prefill and generation, with gradients.

Each call builds one plan per batch row (engine/core/plan.py), attaches the sites its plans need for
the duration of that call only, and maps every forward's rows to spans: a row's real tokens (never
its pad columns), at the row's own absolute positions. Calls on one model are serialized by a
lock (the hooks live on the shared HF module tree); `steering()` blocks are per thread and per
asyncio task (a context variable), so two threads never see each other's steers.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from engine.backends.hf import attention, sites
from engine.backends.hf.stop import Stop, stopped_at
from engine.core.address import Address, closest, parse
from engine.core.errors import AddressError, SteeringError, UnsupportedPointError
from engine.core.inputs import limits_of, new_tokens, padded_batch, row_label
from engine.core.plan import Plan, SiteWork, Span, run_site, site_work
from engine.core.points import INTEGER_POINTS, backend_status, get_point
from engine.core.readouts import Env, Readout, ReadoutError, bind, validate_readouts
from engine.core.results import (
    PATTERNS,
    ActivationCache,
    GenerationResult,
    RequestResult,
    batch_cache,
    batch_readouts,
    check_strict,
    columns,
    columns_of,
    combine,
    one_run_per_row,
)
from engine.core.steer_checks import check_steers
from engine.core.steering import Steer, check_feature_steer
from engine.core.tokens import TokensMixin, special_ids
from engine.families import limits as family_limits
from engine.families.base import Family
from engine.interop.mappers import check_sae_sites
from engine.model import lens
from engine.model.base import ModelBase
from engine.model.capabilities import Verdict, refused
from engine.model.sampling import Sampling
from engine.model.weights import WeightsMixin

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from engine.core.results import StreamStep

_HEADS = ("lm_head", "lm_head_raw")  # read at the last prompt token and each new one while generating


@dataclass
class Layout:
    """How the running forward's [batch, cols] rows map to sequences: spans over the flat rows, the
    chunk's shape, and which columns of the sequence so far are real tokens (for attention keys)."""
    spans: list[Span]
    shape: tuple[int, int]
    key_mask: torch.Tensor  # [batch, columns so far], bool

    def spans_for(self, n_cols: int) -> list[Span]:
        """Spans over a tensor holding only the last n_cols columns of the chunk (HF computes the
        logits of the last prompt token alone when generating)."""
        b, width = self.shape
        if n_cols == width:
            return self.spans
        out = []
        for sp in self.spans:
            c0, c1 = sp.a - sp.row * width, sp.b - sp.row * width
            lo = max(c0, width - n_cols)
            if lo < c1:
                a = sp.row * n_cols + lo - (width - n_cols)
                out.append(Span(sp.plan, a, a + c1 - lo, sp.pos0 + lo - c0, sp.row))
        return out

    def align_keys(self, row: int, seg: torch.Tensor, key: str, compress_rate: int = 0) -> torch.Tensor:
        """An attention pattern's key axis, which covers the last K columns of the sequence so far
        (a sliding-window cache holds only the newest keys), as the row's own absolute key positions:
        pad keys dropped, keys the cache no longer holds filled with the masked value. Compressed-KV
        layers (DeepSeek-V4) append one compressor entry per `compress_rate` columns after the
        positions: those are kept as they are, after the aligned positions."""
        extra = self.key_mask.shape[1] // compress_rate if compress_rate else 0
        seg, entries = seg[..., :seg.shape[-1] - extra], seg[..., seg.shape[-1] - extra:]
        k = seg.shape[-1]
        real = self.key_mask[row, -k:].to(seg.device)
        seg = seg[..., real]
        missing = int(self.key_mask[row].sum()) - seg.shape[-1]
        if missing > 0:
            fill = torch.finfo(seg.dtype).min if key.startswith("attn_scores") else 0.0
            seg = torch.nn.functional.pad(seg, (missing, 0), value=fill)
        return torch.cat([seg, entries], dim=-1) if extra else seg


def _prefill_layout(plans: list[Plan], mask: torch.Tensor) -> Layout:
    b, width = mask.shape
    spans = []
    for r, (plan, cols) in enumerate(zip(plans, columns_of(mask))):
        a = r * width + int(cols[0])
        spans.append(Span(plan, a, a + len(cols), 0, r))
    return Layout(spans, (b, width), mask.bool())


def _decode_layout(plans: list[Plan], mask: torch.Tensor, step: int) -> Layout:
    """The forward feeding back generated token `step` (1-based): one column per row."""
    spans = [Span(plan, r, r + 1, plan.prompt_len + step - 1, r) for r, plan in enumerate(plans)]
    key_mask = torch.cat([mask.bool(), torch.ones(mask.shape[0], step, dtype=torch.bool)], dim=1)
    return Layout(spans, (mask.shape[0], 1), key_mask)


class EagerModel(ModelBase, WeightsMixin, TokensMixin):
    backend = "eager"

    def __init__(self, name: str, hf: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, family: Family,
                 source: str) -> None:
        self.name, self.hf, self.tokenizer, self.family, self.source = name, hf, tokenizer, family, source
        self.config = sites.text_config(hf)
        self.n_layers = len(sites.get_path(hf, family.layers))
        self.d_model = self.config.hidden_size
        self.device = next(hf.parameters()).device
        self.dtype = next(hf.parameters()).dtype
        if family.attn_interface:
            attention.use_on(hf)
        self._layout: Layout | None = None
        self._sites: dict = {}
        self._lock = threading.RLock()
        self._init_base()

    def __repr__(self):
        return (f"<{type(self).__name__} {self.name} ({self.source}, family={self.family.name}, "
                f"layers={self.n_layers}, d_model={self.d_model}, backend={self.backend})>")

    def close(self) -> None:
        """Release the HF model (idempotent); any later call says the model was closed."""
        self._closed = True
        self._sites.clear()
        self.hf = None  # type: ignore[assignment]  # released: _live() refuses every later call

    # -- the point catalogue for this model -----------------------------------------------------
    def _shape(self):
        return self._layout.shape if self._layout is not None else (1, 1)

    def _site(self, addr: Address):
        key = (addr.point, addr.layer)
        if key not in self._sites:
            self._sites[key] = sites.resolve(self.hf, self.family, addr.point, addr.layer, self._shape)
        return self._sites[key]

    def _probe(self, point, layer):
        self._site(Address(point, layer) if layer is not None else Address(point))

    def _verdict(self, point, layer) -> Verdict:
        addr = Address(point, layer)
        status, reason = backend_status(point, self.backend)
        if status == "refused":
            return refused(point, layer, self.backend, reason)
        try:
            site = self._site(addr)
        except UnsupportedPointError as e:
            return refused(point, layer, self.backend, str(e))
        how = "recompute" if "recompute" in (status, site.how) else "hook"
        return Verdict(str(addr), True, how, self._capture_only(point, site))

    def _capture_only(self, point: str, site) -> str | None:
        """Why `point` (served at `site`) can be captured but not written here, or None."""
        if point in INTEGER_POINTS:
            return "integer expert indices: capture only"
        return self.family.capture_only.get(point) or site.capture_only

    def address(self, a: Address | str) -> Address:
        """Parse and check an address against this model and backend; absolute layer."""
        self._live()
        addr = parse(a).resolved(self.n_layers)
        status, reason = backend_status(addr.point, self.backend)
        if status == "refused":
            raise UnsupportedPointError(f"{addr} cannot be served by backend {self.backend!r}: {reason}.")
        layers = self.point_layers(addr.point)
        if not layers:
            try:  # the family's own reason (a refusal, a missing module), from the first layer
                sites.resolve(self.hf, self.family, addr.point, 0 if addr.layer is None else addr.layer, self._shape)
                why = ""
            except UnsupportedPointError as e:
                why = f": {str(e).split(': ', 1)[-1].rstrip('.')}"
            have = self.points()
            raise UnsupportedPointError(
                f"{addr.point!r} does not exist in the {self.family.name} family "
                f"({self.config.model_type}){why}.{closest(addr.point, have)} This model has: {', '.join(have)}.")
        if addr.layer is not None and addr.layer not in layers:
            try:
                self._site(addr.base)
            except UnsupportedPointError as e:
                raise UnsupportedPointError(f"{str(e).rstrip('.')}. It exists at layers {layers}.") from None
        for name, value in addr.coords:
            n = self._coord_size(addr.point, name)
            if not -n <= value < n:
                raise AddressError(f"{name} {value} is out of range for {addr.point!r} ({n} {name}s).")
        return addr

    def _coord_size(self, point, name):
        cfg = self.config
        if name == "head":
            if point not in ("k", "value", "k_norm_in", "k_norm_out"):
                return cfg.num_attention_heads
            if getattr(cfg, "multi_query", False):  # gpt_bigcode / falcon MQA: one shared key/value head
                return 1
            return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return getattr(cfg, "hc_mult", 1)

    # -- tokens (to_tokens: ModelBase) --------------------------------------------------------------
    def _inputs(self, inputs, new: int | None = None) -> dict:
        """A validated (engine/core/inputs.py), padded batch, each prompt with room for `new` generated
        tokens (None: a forward); a given attention_mask keeps its layout."""
        enc = padded_batch(inputs, self.tokenizer, limits_of(self), self.device, self.prepend_bos, new)
        if one_run_per_row(enc["attention_mask"]):
            return enc
        for r, cols in enumerate(columns_of(enc["attention_mask"])):
            if int(cols[-1] - cols[0]) + 1 != len(cols):
                raise ValueError(f"attention_mask row {r} has padding between real tokens; pad on one side only.")
        return enc

    # -- plans ----------------------------------------------------------------------------------
    def _steer(self, st: Steer) -> Steer:
        """A steer checked against this model, at its absolute address (called by
        engine.core.steer_checks.check_steers, after the steer's own checks)."""
        addr = self.address(st.address)
        if addr.point in INTEGER_POINTS:
            raise UnsupportedPointError(f"{addr} is capture-only.")
        why = self._capture_only(addr.point, self._site(addr.base))
        if why:
            raise SteeringError(f"{addr} can be captured but not steered on this model: {why}.")
        if st.sae is not None:
            check_feature_steer(st, self._load_sae(st.sae) if isinstance(st.sae, str) else st.sae)
        return st.at(addr)

    def _readout(self, r: Readout) -> Readout:
        """A readout checked against this model, at its absolute address."""
        return r.at(self.address(r.address))

    def _env(self) -> Env:
        return Env(lens=self._lens_rows, sae=self._load_sae)

    def _lens_rows(self, x: torch.Tensor, point: str) -> torch.Tensor:
        """Logits of [n, d] rows inside a forward: the hooks stand aside (layout None) while the final
        norm and head run, so captures there never see these rows."""
        layout, self._layout = self._layout, None
        try:
            return lens.unembed(self.hf, self.family, x.to(self.dtype), apply_norm=(point != "final_norm"))
        finally:
            self._layout = layout

    def _load_sae(self, path: str):
        """An SAE directory, loaded once per process on the model's device (engine/core/sae_store.py)."""
        from engine.core.sae_store import sae_for
        return sae_for(path, self.device)

    def _plans(self, enc: dict, points, steer, max_new_tokens: int, readouts=(), strict: bool = False) -> list[Plan]:
        """One plan per batch row: its own length, its row of any batch value or mask, its exclusions,
        its readouts bound to this model."""
        capture = self.expand(points) if points else []
        reads = [self._readout(r) for r in validate_readouts(readouts)]
        steers = check_steers(steer, self._context_steers(), self._steer)
        check_sae_sites(self, steers, reads, strict)
        cols = columns_of(enc["attention_mask"])
        if steers:  # a steer's row view needs the row's ids (its `exclude` names special tokens)
            rows = [enc["input_ids"][r, c.to(enc["input_ids"].device)].tolist() for r, c in enumerate(cols)]
            special = special_ids(self.tokenizer)
            plans = [Plan(len(ids), list(capture), [st.for_row(r, len(rows), ids, special) for st in steers])
                     for r, ids in enumerate(rows)]
        else:  # capture only: a plan needs the row's length alone (no ids read back, on CUDA no sync per row)
            plans = [Plan(len(c), list(capture), []) for c in cols]
        env = self._env() if reads else None
        for r, p in enumerate(plans):
            if env is not None:
                p.readouts, p.accumulators = list(reads), bind(reads, env)
            p.check_positions(max_new_tokens, row_label(r, len(plans)))
            for head in _HEADS:  # generating: logits from the last prompt token (HF keeps only its logits)
                if max_new_tokens and Address(head) in capture:
                    p.start_at[head] = p.prompt_len - 1
        return plans

    # -- attaching ------------------------------------------------------------------------------
    def _compress_rate(self, key: str) -> int:
        """Columns per compressor entry on a layer's attention key axis (DeepSeek-V4's compressed
        layers); 0 where the key axis holds positions only."""
        layer = parse(key).layer
        if layer is None or not self.family.attn:
            return 0
        attn = sites.get_path(self.hf, f"{self.family.layers}.{layer}.{self.family.attn}")
        return int(getattr(getattr(attn, "compressor", None), "compress_rate", 0) or 0)

    def _keep(self):
        rates: dict[str, int] = {}

        def keep(span, key, rows):
            if key.split(".")[0] in PATTERNS:
                if key not in rates:
                    rates[key] = self._compress_rate(key)
                rows = self._layout.align_keys(span.row, rows, key, rates[key])
            # a copy: HF edits some outputs in place after the hook (Falcon adds the attention output
            # into mlp_out), which must not reach the capture
            return rows.detach().clone()
        return keep

    def _at_site(self, work, keep, t):
        if self._layout is None:  # a readout's own lens call inside the forward
            return None
        flat = t.reshape(-1, *t.shape[2:])
        new = run_site(flat, self._layout.spans_for(t.shape[1]), work, keep)
        return None if new is None else new.reshape(t.shape)

    def _at_site_grad(self, work, held, writable, t):
        """With gradients a capture must be the tensor the rest of the forward is computed from: the
        site's whole [batch, pos, ...] tensor (after steering) is kept and the model continues with a
        clone of it (so in-place edits downstream never reach the capture). A capture-only site
        (`writable` False) cannot hand the forward a tensor (it has no write path, or one that does
        not carry the whole point): its capture is a differentiable copy of what it read, and the
        forward runs untouched."""
        if not writable:
            for key, coord in next(iter(work.reads.values()), ()):
                held[key] = t.clone() if coord is None else t[:, :, coord].clone()
            return None
        flat = t.reshape(-1, *t.shape[2:])
        new = run_site(flat, self._layout.spans, SiteWork(writes=work.writes), None)
        cur = t if new is None else new.reshape(t.shape)
        for key, coord in next(iter(work.reads.values()), ()):
            held[key] = cur if coord is None else cur[:, :, coord]
        return cur.clone()

    @contextlib.contextmanager
    def _attached(self, plans: list[Plan], layouts, held: dict | None = None):
        """Attach every site the plans need and track each forward's layout, for one call; with
        `held` (gradients), captures go there whole instead of into the plans."""
        step = iter(layouts)

        def on_forward(module, args, kwargs):
            self._layout = next(step)

        keep = self._keep()
        handles = [self.hf.register_forward_pre_hook(on_forward, with_kwargs=True)]
        try:
            points = {}

            def site_of(a):
                site = self._site(a)
                points[site] = a.point
                return site
            work_at = list(site_work(plans, site_of).items())
            if held is not None:  # with gradients every site writes: a recomputed one rebuilds its module's
                # output from recomputed parts (the hyper-connection collapse from its weights), so it goes
                # first and the hooks reading that same output see its replacement (stay on the forward's path)
                work_at.sort(key=lambda kv: kv[0].how != "recompute")
            for site, work in work_at:
                if held is None or not work.reads:
                    fn, writes = functools.partial(self._at_site, work, keep), bool(work.writes)
                else:  # steers are refused at capture-only sites, so this one only reads
                    writable = self._capture_only(points[site], site) is None
                    fn, writes = functools.partial(self._at_site_grad, work, held, writable), writable
                handles += site.install(fn, writes=writes)
            yield
        finally:
            for h in handles:
                h.remove()
            self._layout = None

    @staticmethod
    def _position_ids(mask: torch.Tensor) -> torch.Tensor:
        """Each row's positions, counted from its first real token. When every row starts at column 0
        (right padding or none) that is one shared row, 0..width-1: HF then builds its rotary tables
        once instead of per row (3% of a small model's forward; docs/harvest.md)."""
        if bool(mask[:, 0].all()):
            return torch.arange(mask.shape[1], device=mask.device)[None]
        return (mask.long().cumsum(-1) - 1).clamp_min(0)

    # -- public API -------------------------------------------------------------------------------
    def run_with_cache(self, inputs: Any, points: Any = (), steer: Any = (), grad: bool = False, strict: bool = False,
                       readouts: Any = (), stop_at_layer: int | None = None) -> tuple[torch.Tensor, ActivationCache]:
        """One forward. Returns (logits [b, pos, vocab], ActivationCache of [b, pos, ...] tensors);
        padded positions hold 0 in both. With grad=True the captures stay in the autograd graph (they
        are the model's own tensors, padded positions as the model computed them); a capture-only
        point (`m.verdict(addr).capture_only` says why) is a differentiable copy, so gradients flow into
        it from below but the logits do not depend on it. The cache's `receipts` say what each steer
        did; strict=True fails a steer that touched no row. `readouts` (engine.core.readouts.Readout)
        are computed in the hooks; their results are in `cache.readouts`. stop_at_layer=L runs blocks
        0..L-1 only (TransformerLens's stop_at_layer; L = n_layers stops before the final norm): the first
        value is then the hidden state block L would receive instead of logits, and reading or steering
        anything past the stop is refused."""
        self._live()
        enc = self._inputs(inputs)
        mask = enc["attention_mask"]
        if grad and readouts:
            raise ReadoutError("readouts are computed without gradients; capture the points with grad=True and "
                               "compute the readout on the captured tensors instead.")
        plans = self._plans(enc, points, steer, 0, readouts, strict)
        stop = None if stop_at_layer is None else Stop.checked(stop_at_layer, self.hf, self.family, plans[0])
        held = {} if grad else None
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with self._lock, ctx, self._attached(plans, [_prefill_layout(plans, mask.cpu())], held):
            with stopped_at(stop):
                out = self.hf(**enc, position_ids=self._position_ids(mask), use_cache=False)
        first = out.logits if stop is None else stop.reached()
        pad = ~mask.bool()[..., None]
        logits = first.masked_fill(pad, 0) if grad or stop is not None else first.masked_fill_(pad, 0)
        receipts = combine([p.receipts() for p in plans])
        if strict:
            check_strict(receipts, "forward")
        if grad:
            cache = ActivationCache(self.n_layers, columns_of(mask), receipts)
            for addr in plans[0].captures:
                cache[str(addr)] = held[str(addr)]
            return logits, cache
        caches = [self._cache(p) for p in plans]
        return logits, batch_cache(caches, columns_of(mask), mask.shape[1], self.n_layers, receipts)

    def forward(self, inputs: Any, steer: Any = (), strict: bool = False) -> torch.Tensor:
        return self.run_with_cache(inputs, (), steer, strict=strict)[0]

    def _cache(self, plan: Plan) -> ActivationCache:
        cache = ActivationCache(self.n_layers)
        for addr in plan.captures:
            key = str(addr)
            cache[key] = plan.tensor(key, plan.start_at.get(key, 0))
        for name, acc in plan.accumulators.items():
            cache.put_readout(name, acc.result(), acc.readout.kind.per_position)
        return cache

    def generate(self, inputs: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (), strict: bool = False,
                 readouts: Any = (), **sampling: Any) -> GenerationResult:
        """Generation (greedy by default; sampling knobs of engine/model/sampling.py: temperature, top_p,
        top_k, seed) with capture and steering in prefill and every step. `receipts` (per sequence
        and for the call) say what each steer did; strict=True fails a steer that touched no row."""
        return self._generate(inputs, max_new_tokens, points, steer, sampling, strict=strict, readouts=readouts)

    def _generate(self, inputs, max_new_tokens, points, steer, sampling, streamer=None, internal=(),
                  stopping=None, on_plans=None, strict: bool = False, readouts=()) -> GenerationResult:
        self._live()
        max_new_tokens = new_tokens(max_new_tokens)
        knobs = Sampling.parse(sampling, "eager")
        enc = self._inputs(inputs, max_new_tokens)
        mask = enc["attention_mask"]
        family_limits.check(self.config.model_type, "eager", "generate", batch=enc["input_ids"].shape[0])
        if not bool((mask[:, -1] == 1).all()):
            raise ValueError("generate needs left padding (pad on the left so every row ends in a real "
                             "token); use model.to_tokens(texts, padding_side='left').")
        lengths = mask.sum(-1).tolist()
        plans = self._plans(enc, points, steer, max_new_tokens, readouts, strict)
        for p in plans:
            for a in internal:  # read for the engine itself (a stream's logprobs), from the last prompt token
                p.internal.append(a)
                p.start_at.setdefault(str(a), p.prompt_len - 1)
        if on_plans is not None:
            on_plans(plans)
        cpu_mask = mask.cpu()
        # built one forward at a time: a step's key mask grows with it (all of them at once is O(n^2))
        layouts = itertools.chain([_prefill_layout(plans, cpu_mask)],
                                  (_decode_layout(plans, cpu_mask, i) for i in range(1, max_new_tokens)))
        with self._lock, torch.no_grad(), self._attached(plans, layouts):
            if knobs.seed is not None:
                torch.manual_seed(knobs.seed)
            # PreTrainedModel declares no generate: the CausalLM classes mix GenerationMixin in
            out = self.hf.generate(**enc, max_new_tokens=max_new_tokens, **knobs.hf(),  # type: ignore[operator]
                                   min_new_tokens=max_new_tokens, output_logits=True,
                                   return_dict_in_generate=True, streamer=streamer, stopping_criteria=stopping,
                                   pad_token_id=self.tokenizer.pad_token_id)
        seq = out.sequences
        new = seq[:, enc["input_ids"].shape[1]:]
        logits = torch.stack(out.logits, dim=1) if out.logits else None
        text = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        caches = [self._cache(p) for p in plans]
        width = seq.shape[1] - 1
        cols = columns([n + new.shape[1] - 1 for n in lengths], width, "left")
        cache = batch_cache([{k: v for k, v in c.items() if k not in _HEADS} for c in caches], cols, width,
                            self.n_layers)
        batch_readouts(cache, caches, cols, width)
        for head in _HEADS:  # [b, new, vocab], like the logits
            if head in caches[0]:
                cache[head] = torch.stack([c[head] for c in caches])
        full_mask = torch.cat([cpu_mask, torch.ones_like(new.cpu())], dim=1)
        reqs = [RequestResult(seq[r, -(n + new.shape[1]):-new.shape[1]].cpu(), new[r].cpu(), text[r], caches[r],
                              None if logits is None else logits[r], receipts=p.receipts())
                for r, (n, p) in enumerate(zip(lengths, plans))]
        receipts = combine([r.receipts for r in reqs])
        if strict:
            check_strict(receipts, "generation")
        return GenerationResult(seq, new, text, cache, logits, full_mask, reqs, receipts)

    def stream(self, prompt: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (), logprobs: int = 0,
               return_logits: bool = True, rows: bool = True, strict: bool = False, readouts: Any = (),
               **sampling: Any) -> Generator[StreamStep, None, None]:
        """Yield a StreamStep per generated token of one prompt (token, text, logprob and the top
        `logprobs`, with rows=True the captured rows of the forward that produced it); the last step
        carries the RequestResult (its logits unless return_logits=False, its receipts; strict=True
        raises instead of yielding it when a steer touched no row). Generation runs on a worker
        thread; closing the iterator stops it."""
        from engine.backends.hf.stream import stream
        return stream(self, prompt, max_new_tokens, points, steer, logprobs, sampling, return_logits, rows, strict,
                      readouts)

    def logit_lens(self, x: torch.Tensor | tuple[ActivationCache, Address | str],
                   point: str = "resid_post") -> torch.Tensor:
        """Logits from a residual tensor (or an address captured in `x` when x is (cache, address))."""
        self._live()
        if isinstance(x, tuple):
            cache, a = x
            addr = parse(a)
            lens.check_lensable(addr.point)
            if addr.coords:
                raise AddressError(f"logit lens of {addr} needs the whole point; drop the coordinate.")
            point, x = addr.point, cast(torch.Tensor, cache[a])
        else:
            lens.check_lensable(get_point(point).name)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"logit lens needs a [..., {self.d_model}] residual, got shape {tuple(x.shape)}.")
        n_streams = getattr(self.config, "hc_mult", None)
        if point == "resid_streams" and (x.dim() < 3 or x.shape[-2] != n_streams):
            raise ValueError(f"logit lens of resid_streams needs [..., {n_streams}, {self.d_model}] (all streams), "
                             f"got shape {tuple(x.shape)}.")
        with self._lock, torch.no_grad():
            return lens.unembed(self.hf, self.family, x.to(self.dtype), apply_norm=(point != "final_norm"),
                                streams=(point == "resid_streams"))
