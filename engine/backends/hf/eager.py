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
import math
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from engine.backends.hf import attention, generation, sites
from engine.backends.hf.generation import _HEADS
from engine.backends.hf.grid import Call, Layout, padded, pattern_rows, prefill_layout
from engine.backends.hf.stop import Stop, stopped_at
from engine.core.address import Address, closest, known_point, parse
from engine.core.errors import AddressError, SteeringError, UnsupportedPointError
from engine.core.inputs import host_batch, limits_of, row_label
from engine.core.ledger import GUARD
from engine.core.plan import Plan, SiteWork, site_work
from engine.core.points import INTEGER_POINTS, backend_status, get_point
from engine.core.readouts import Env, Facts, Readout, ReadoutError, bind, validate_readouts
from engine.core.results import (
    PATTERNS,
    ActivationCache,
    GenerationResult,
    Request,
    RequestResult,
    batch_readouts,
    check_strict,
    combine,
    scatter,
)
from engine.core.sae_files import sae_header
from engine.core.site import guard, run_site
from engine.core.steer_checks import check_steers
from engine.core.steering import Steer, check_feature_steer, failure
from engine.core.tokens import TokensMixin, special_ids
from engine.families.base import Family
from engine.interop.mappers import check_sae_sites
from engine.model import lens
from engine.model.base import ModelBase
from engine.model.capabilities import Verdict, refused
from engine.model.facade import InThread
from engine.model.weights import WeightsMixin

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from engine.core.results import StreamStep
    from engine.model.api import Model


@dataclass(frozen=True)
class Batch:
    """A validated, padded batch: `enc` (input_ids / attention_mask on the model's device) and their host
    copies (numpy: ids, and the mask as bool)."""
    enc: dict
    ids: np.ndarray
    mask: np.ndarray

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.enc[key]


def main_device(hf: PreTrainedModel) -> torch.device:
    """Where a call's inputs, steps and results live: the first GPU of a model placed across devices
    (accelerate's hf_device_map; host memory and disk hold weights that run there, or on the CPU when the
    map names no GPU), else the device of its parameters."""
    placed = getattr(hf, "hf_device_map", None)
    if placed:
        gpus = [d for d in placed.values() if d not in ("cpu", "disk")]
        return torch.device(f"cuda:{gpus[0]}" if isinstance(gpus[0], int) else gpus[0]) if gpus else torch.device("cpu")
    return next(hf.parameters()).device


class EagerModel(ModelBase, WeightsMixin, TokensMixin):
    backend = "eager"

    def __init__(self, name: str, hf: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, family: Family,
                 source: str) -> None:
        self.name, self.hf, self.tokenizer, self.family, self.source = name, hf, tokenizer, family, source
        self.config = sites.text_config(hf)
        self.n_layers = len(sites.get_path(hf, family.layers))
        self.d_model = self.config.hidden_size
        self.device = main_device(hf)
        self.dtype = next(hf.parameters()).dtype
        # attention: the implementation HF loaded (sdpa, flash) with the engine's points around it, a read
        # pattern computed beside it (engine/backends/hf/attention.py); a family whose attention runs
        # inline forms its pattern only on HF's eager path, so it runs that
        self._attention = attention.install(attention.native_of(hf)) if family.attn_interface else "eager"
        attention.select(attention.configs(hf), self._attention)
        self._layout: Layout | None = None
        self._sites: dict = {}
        self._shapes: dict[str, tuple] = {}  # per-position shape of each point and layer (point_shape)
        self._lock = threading.RLock()
        self._init_base()
        self.aio = InThread(self)  # the async API (engine/model/api.py): each call on a worker thread

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
    def _inputs(self, inputs, new: int | None = None) -> Batch:
        """A validated (engine/core/inputs.py), padded batch, each prompt with room for `new` generated
        tokens (None: a forward); a given attention_mask keeps its layout. The ids and mask are read to
        the host once, here: everything the engine builds from them (spans, plans) is host work."""
        if isinstance(inputs, Batch):
            return inputs
        ids, mask = host_batch(inputs, self.tokenizer, limits_of(self), self.prepend_bos, new)
        first, last = mask.argmax(1), mask.shape[1] - 1 - mask[:, ::-1].argmax(1)
        gaps = np.flatnonzero(last - first + 1 != mask.sum(1))
        if len(gaps):
            raise ValueError(f"attention_mask row {int(gaps[0])} has padding between real tokens; pad on one side "
                             f"only.")
        enc = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask).long()}
        return Batch({k: v.to(self.device, non_blocking=True) for k, v in enc.items()}, ids, mask)

    # -- plans ----------------------------------------------------------------------------------
    def point_shape(self, addr: Address | str) -> tuple | None:
        """Per-position shape of a capture at addr (what a steering value must have; coordinates taken
        off), read once per point and layer from a one-token forward; None for a point whose key axis
        grows with the sequence (attention scores and probabilities)."""
        addr = self.address(addr)
        if get_point(addr.point).key_axis:
            return None
        key = str(addr.base)
        if key not in self._shapes:
            bare = self._steers.set(())  # the probe runs without the caller's steering() blocks
            try:
                _, cache = self.run_with_cache([[0]], [addr.base], return_logits=False)
            finally:
                self._steers.reset(bare)
            self._shapes[key] = tuple(cache[key].shape[2:])
        return self._shapes[key][len(addr.coords):]

    def _steer(self, st: Steer) -> Steer:
        """A steer checked against this model, at its absolute address, its value's shape the point's,
        its value on the model's device (moved once per call; called by
        engine.core.steer_checks.check_steers, after the steer's own checks)."""
        addr = self.address(st.address)
        if addr.point in INTEGER_POINTS:
            raise UnsupportedPointError(f"{addr} is capture-only.")
        why = self._capture_only(addr.point, self._site(addr.base))
        if why:
            raise SteeringError(f"{addr} can be captured but not steered on this model: {why}.")
        shape = self.point_shape(addr) if isinstance(st.value, torch.Tensor) or st.sae is not None else None
        if st.sae is not None:
            check_feature_steer(st, sae_header(st.sae, f"{st.op} at {addr}"), None if shape is None else math.prod(shape))
        v = st.value
        if isinstance(v, torch.Tensor) and shape is not None:
            st.at(addr).check_shape(shape)
        moved = v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) and v.device != self.device else None
        return st.at(addr, moved).bound()

    def _readout(self, r: Readout) -> Readout:
        """A readout checked against this model, at its absolute address, before anything runs."""
        addr = self.address(r.address)
        shape = self.point_shape(addr)
        r.kind.check_model(Facts(vocab=self.config.vocab_size, width=None if shape is None else math.prod(shape)), addr)
        return r.at(addr)

    def _env(self) -> Env:
        return Env(lens=self._lens_rows, sae=self._load_sae)

    def _lens_rows(self, x: torch.Tensor, point: str) -> torch.Tensor:
        """Logits of [n, d] rows inside a forward: the hooks stand aside (layout None) while the final
        norm and head run, so captures there never see these rows."""
        layout, self._layout = self._layout, None
        try:
            return lens.unembed(self.hf, self.family, x.to(self.dtype), apply_norm=(point != "final_norm")).to(x.device)
        finally:
            self._layout = layout

    def _load_sae(self, path: str):
        """An SAE directory, loaded once per process on the model's device (engine/core/sae_store.py)."""
        from engine.core.sae_store import sae_for
        return sae_for(path, self.device)

    def _plans(self, batch: Batch, points, steer, max_new_tokens: int, readouts=(), strict: bool = False) -> list[Plan]:
        """One plan per batch row: its own length, its row of any batch value or mask, its exclusions,
        its readouts bound to this model."""
        capture = self.expand(points) if points else []
        reads = [self._readout(r) for r in validate_readouts(readouts)]
        steers = check_steers(steer, self._context_steers(), self._steer)
        check_sae_sites(self, steers, reads, strict)
        if steers:  # a steer's row view needs the row's ids (its `exclude` names special tokens)
            rows = [batch.ids[r][batch.mask[r]].tolist() for r in range(len(batch.ids))]
            special = special_ids(self.tokenizer)
            plans = [Plan(len(ids), list(capture), [st.for_row(r, len(rows), ids, special) for st in steers])
                     for r, ids in enumerate(rows)]
        else:  # capture only: a plan needs the row's length alone
            plans = [Plan(int(n), list(capture), []) for n in batch.mask.sum(1)]
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

    def _at_site(self, work: SiteWork, t: torch.Tensor) -> torch.Tensor | None:
        if self._layout is None:  # a readout's own lens call inside the forward
            return None
        x = self._home(t)
        new = run_site(x.reshape(-1, *x.shape[2:]), self._layout.step(x.shape[1]), work)
        return None if new is None else new.reshape(t.shape).to(t.device)

    def _home(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the main device, where a call's steps, ledger and captures live: a model placed across
        devices (load_model(device="auto")) reaches a site of a layer on another GPU, and its work is done
        here and the result handed back to that layer's device."""
        return t if t.device == self.device else t.to(self.device)

    def _at_site_grad(self, work: SiteWork, held: dict, writable: bool, t: torch.Tensor) -> torch.Tensor | None:
        """With gradients a capture must be the tensor the rest of the forward is computed from: the
        site's whole [batch, pos, ...] tensor (after steering) is kept and the model continues with a
        clone of it (so in-place edits downstream never reach the capture). A capture-only site
        (`writable` False) cannot hand the forward a tensor (it has no write path, or one that does
        not carry the whole point): its capture is a differentiable copy of what it read, and the
        forward runs untouched."""
        if not writable:
            for g in work.reads:
                held[g.key] = t.clone() if g.coord is None else t[:, :, g.coord].clone()
            return None
        assert self._layout is not None
        x = self._home(t)
        new = run_site(x.reshape(-1, *x.shape[2:]), self._layout.step(x.shape[1]), SiteWork(steers=work.steers))
        cur = t if new is None else new.reshape(t.shape).to(t.device)
        for g in work.reads:
            held[g.key] = cur if g.coord is None else cur[:, :, g.coord]
        return cur.clone()

    def _guard(self, t: torch.Tensor) -> None:
        """The call's guard on the hidden state entering the head (engine.core.site.guard): a row of a
        steering plan that is not finite there fails its call when the ledger is read."""
        if self._layout is not None:
            guard(self._home(t).reshape(-1, t.shape[-1]), self._layout.step(t.shape[1]))

    def _guard_site(self):
        """Where the guard reads: the last block's output (what the final norm and the head read: a row too
        large there normalizes to zeros, which a check after the norm would pass), else the final norm's."""
        try:
            return self._site(Address("resid_post", self.n_layers - 1))
        except UnsupportedPointError:
            return self._site(Address("final_norm"))

    @contextlib.contextmanager
    def _attached(self, plans: list[Plan], layouts, held: dict | None = None):
        """Attach every site the plans need and track each forward's layout, for one call; with
        `held` (gradients), captures go there whole instead of into the call's store. Plans that steer
        also get the guard."""
        step = iter(layouts)

        def on_forward(module, args, kwargs):
            self._layout = next(step)

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
                    fn, writes = functools.partial(self._at_site, work), bool(work.steers)
                else:  # steers are refused at capture-only sites, so this one only reads
                    writable = self._capture_only(points[site], site) is None
                    fn, writes = functools.partial(self._at_site_grad, work, held, writable), writable
                handles += site.install(fn, writes=writes)
            if held is None and any(p.steers for p in plans):
                handles += self._guard_site().install(self._guard, writes=False)
            yield
        finally:
            for h in handles:
                h.remove()
            self._layout = None

    @staticmethod
    def _position_ids(mask: torch.Tensor, from_zero: bool | None = None) -> torch.Tensor:
        """Each row's positions, counted from its first real token. When every row starts at column 0
        (right padding or none; `from_zero`, from the host mask, else read here) that is one shared row,
        0..width-1: HF then builds its rotary tables once instead of per row (3% of a small model's
        forward; docs/harvest.md)."""
        if bool(mask[:, 0].all()) if from_zero is None else from_zero:
            return torch.arange(mask.shape[1], device=mask.device)[None]
        return (mask.long().cumsum(-1) - 1).clamp_min(0)

    def _outcomes(self, plans: list[Plan], call: Call) -> dict:
        """The call's one read of its ledger (engine/core/ledger.py): receipts, and the first plan whose
        rows went non-finite fails the call, naming its steer."""
        if not call.ledger:
            return {}
        outcomes = call.ledger.read()
        for r, p in enumerate(plans):
            o = outcomes.get(p.key)
            if o is not None and o.failed is not None:
                raise failure(None if o.failed == GUARD else p.steers[o.failed], self.dtype, p.steers)
        return outcomes

    # -- public API -------------------------------------------------------------------------------
    def run_with_cache(self, inputs: Any, points: Any = (), steer: Any = (), grad: bool = False, strict: bool = False,
                       readouts: Any = (), stop_at_layer: int | None = None,
                       return_logits: bool = True) -> tuple[torch.Tensor | None, ActivationCache]:
        """One forward. Returns (logits [b, pos, vocab], ActivationCache of [b, pos, ...] tensors);
        padded positions hold 0 in both. With grad=True the captures stay in the autograd graph (they
        are the model's own tensors, padded positions as the model computed them); a capture-only
        point (`m.verdict(addr).capture_only` says why) is a differentiable copy, so gradients flow into
        it from below but the logits do not depend on it. The cache's `receipts` say what each steer
        did; strict=True fails a steer that touched no row. `readouts` (engine.core.readouts.Readout)
        are computed in the hooks; their results are in `cache.readouts`. stop_at_layer=L runs blocks
        0..L-1 only (TransformerLens's stop_at_layer; L = n_layers stops before the final norm): the first
        value is then the hidden state block L would receive instead of logits, and reading or steering
        anything past the stop is refused. return_logits=False returns None in their place. Captures stay
        on the model's device."""
        self._live()
        batch = self._inputs(inputs)
        if grad and readouts:
            raise ReadoutError("readouts are computed without gradients; capture the points with grad=True and "
                               "compute the readout on the captured tensors instead.")
        plans = self._plans(batch, points, steer, 0, readouts, strict)
        stop = None if stop_at_layer is None else Stop.checked(stop_at_layer, self.hf, self.family, plans[0])
        held = {} if grad else None
        with contextlib.closing(Call(self.device)) as call:  # its chunks and steps go when the result is built
            layout = prefill_layout(plans, batch.mask, call)
            ctx = contextlib.nullcontext() if grad else torch.no_grad()
            with self._lock, ctx, self._attached(plans, [layout], held):
                with stopped_at(stop):
                    out = self.hf(**batch.enc, position_ids=self._position_ids(batch.enc["attention_mask"], bool(batch.mask[:, 0].all())), use_cache=False)
            first = out.logits if stop is None else self._home(stop.reached())
            if stop is not None and not grad and any(p.steers for p in plans):
                guard(first.reshape(-1, first.shape[-1]), layout.step(first.shape[1]))
            real = batch.enc["attention_mask"].bool()
            pad = ~real[..., None]
            logits = first.masked_fill(pad, 0) if grad or stop is not None else first.masked_fill_(pad, 0)
            outcomes = self._outcomes(plans, call)
            receipts = combine([p.receipts(outcomes.get(p.key)) for p in plans])
            if strict:
                check_strict(receipts, "forward")
            cols = [torch.from_numpy(np.flatnonzero(row)) for row in batch.mask]
            cache = ActivationCache(self.n_layers, cols, receipts)
            if grad:
                for addr in plans[0].captures:
                    cache[str(addr)] = held[str(addr)]
                return (logits if return_logits else None), cache
            width = batch.mask.shape[1]
            for addr in plans[0].captures:
                key = str(addr)
                if key.split(".")[0] in PATTERNS:
                    pattern_rows(call, key, self._compress_rate(key))
                    cache[key] = scatter(key, [p.tensor(key) for p in plans], cols, width)
                else:
                    cache[key] = padded(call.grid(key), real)
            if plans[0].accumulators:
                batch_readouts(cache, [self._readouts(p) for p in plans], cols, width)
            return (logits if return_logits else None), cache

    def forward(self, inputs: Any, steer: Any = (), strict: bool = False) -> torch.Tensor:
        logits, _ = self.run_with_cache(inputs, (), steer, strict=strict)
        assert logits is not None  # return_logits=True
        return logits

    def _readouts(self, plan: Plan) -> ActivationCache:
        cache = ActivationCache(self.n_layers)
        for name, acc in plan.accumulators.items():
            cache.put_readout(name, acc.result(), acc.readout.kind.per_position)
        return cache

    def generate(self, inputs: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (),
                 return_logits: bool = True, strict: bool = False, readouts: Any = (),
                 **sampling: Any) -> GenerationResult:
        """Generation (greedy by default; sampling knobs of engine/model/sampling.py: temperature, top_p,
        top_k, seed) with capture and steering in prefill and every step. `receipts` (per sequence
        and for the call) say what each steer did; strict=True fails a steer that touched no row."""
        out = self._generate(inputs, max_new_tokens, points, steer, sampling, strict=strict, readouts=readouts)
        return out if return_logits else generation.without_logits(out)

    def _generate(self, inputs, max_new_tokens, points, steer, sampling, streamer=None, internal=(),
                  stopping=None, on_plans=None, strict: bool = False, readouts=()) -> GenerationResult:
        prep = generation.prepare(self, inputs, max_new_tokens, points, steer, sampling, readouts, strict, internal)
        return generation.run(self, prep, streamer, stopping, on_plans, strict)

    def generate_batch(self, requests: list[Request], return_logits: bool = True, progress: bool = False,
                       strict: bool = False, sink: str | None = None) -> list[RequestResult]:
        """Each request (its own prompt, captures, steers, sampling and readouts) as its own generation, one
        after another, every one checked before the first runs; strict=True fails a request whose steer
        touched no row."""
        return generation.generate_batch(self, requests, return_logits, progress, strict, sink)

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
            lens.check_lensable(known_point(point).name)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"logit lens needs a [..., {self.d_model}] residual, got shape {tuple(x.shape)}.")
        n_streams = getattr(self.config, "hc_mult", None)
        if point == "resid_streams" and (x.dim() < 3 or x.shape[-2] != n_streams):
            raise ValueError(f"logit lens of resid_streams needs [..., {n_streams}, {self.d_model}] (all streams), "
                             f"got shape {tuple(x.shape)}.")
        with self._lock, torch.no_grad():
            return lens.unembed(self.hf, self.family, x.to(self.dtype), apply_norm=(point != "final_norm"),
                                streams=(point == "resid_streams"))


if TYPE_CHECKING:
    def _implements(m: EagerModel) -> Model:  # mypy holds EagerModel to the declared API (engine/model/api.py)
        return m
