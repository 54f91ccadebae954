"""The async vLLM model: requests with their own captures and steers, many in flight from one event
loop, against a vLLM engine whose core runs in its own process.

    m = await AsyncVLLMModel.start(name, backend="vllm", ...)      (or load_model(..., backend="vllm").aio)
    logits, cache = await m.run_with_cache(["a prompt", "another"], ["resid_post.-1"])
    out = await m.generate("a prompt", 8, points=["z.1"], steer=[Steer("resid_post.2", "add", v)])
    async for step in m.stream("a prompt", 8, logprobs=5): ...      (StreamStep: token, text, logprobs, rows)

Its coroutines run on the model's own event loop (where vLLM's AsyncLLM lives) and are awaited from
any loop: a call from another one is handed over and its result comes back (vllm_runtime.Loop.hop).

Per request: the plan rides with the request (its SamplingParams' extra_args: the plan's key and its
wire form), every worker registers it when a schedule first holds the request, the request runs in
vLLM's continuous batch, and the captures come back when it finishes (collective_rpc "interp_collect"),
gathered across tensor-parallel ranks (engine/backends/vllm/replies.py makes the results; a stream
peeks while its request runs, engine/backends/vllm/streaming.py). One call to the workers per batch of
requests: each such call stalls the engine core for every request it serves.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.backends.vllm import replies, streaming
from engine.backends.vllm.catalogue import VLLMCatalogue
from engine.backends.vllm.modes import NO_CAPTURE, Mode, mode_for
from engine.backends.vllm.worker import attn as vllm_attn
from engine.backends.vllm.worker import wire as vllm_wire
from engine.backends.vllm.worker.rows import EXTRA_KEY, PLAN_ARG
from engine.core.address import Address, known_point, parse
from engine.core.errors import AddressError, SteeringError, UnsupportedPointError
from engine.core.inputs import limits_of, new_tokens, row_label, token_rows, top_logprobs
from engine.core.loop import on_home_loop
from engine.core.ops import OPS
from engine.core.plan import Plan
from engine.core.points import INTEGER_POINTS
from engine.core.readouts import Facts, Readout, ReadoutError, validate_readouts
from engine.core.results import (
    ActivationCache,
    GenerationResult,
    Request,
    RequestResult,
    StreamStep,
    batch_cache,
    check_strict,
    columns,
    columns_of,
    combine,
    pad_rows,
)
from engine.core.sae_files import sae_header
from engine.core.steer_checks import check_steers
from engine.core.steering import Steer, check_feature_steer
from engine.core.tokens import TokensMixin, pad_id, special_ids
from engine.interop.mappers import check_sae_sites
from engine.model.api import unserved
from engine.model.base import ModelBase
from engine.model.batch import Progress, requests_of
from engine.model.capabilities import Verdict, refused
from engine.model.facade import awaited
from engine.model.sampling import Sampling

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine.core.loop import Loop
    from engine.model.api import AsyncModel
    from engine.model.weights import BlockLayout

SHM = "/dev/shm"
__all__ = ["AsyncVLLMModel", "Submission", "StreamEvent", "NO_CAPTURE"]


@dataclass(frozen=True)
class Submission:
    """One request as the client submits it: the plan its workers run, and what only the client needs."""
    plan: Plan
    params: dict  # vLLM SamplingParams keywords
    prompt: list[int]  # the prompt's token ids
    derived: tuple[Address, ...] = ()  # attention patterns recomputed from the captured q and k afterwards
    salted: bool = False  # its own prefix-cache key (see AsyncVLLMModel._salted)
    keys: dict = dataclasses.field(default_factory=dict)  # capture key -> the keys it was asked under (replies.rekey)


StreamEvent = StreamStep  # the earlier name of one streamed step
class AsyncVLLMModel(ModelBase, TokensMixin):
    """Capture and steering on a vLLM engine, async. Built by engine.backends.vllm.backend.load, on
    `home` (engine.backends.vllm.runtime.Loop): its coroutines run there, awaited from any loop."""

    def __init__(self, name: str, backend: "str | Mode", source: str, path: str, engine: AsyncLLM,
                 catalogue: VLLMCatalogue | None, config: PretrainedConfig, tokenizer: TokenizerLike,
                 home: Loop | None = None) -> None:
        self._home = home
        self.mode = mode_for(backend) if isinstance(backend, str) else backend
        self.name, self.backend, self.source, self.path = name, self.mode.name, source, path
        self.engine, self.catalogue, self.config, self.tokenizer = engine, catalogue, config, tokenizer
        self.n_layers = catalogue.n_layers if catalogue else config.num_hidden_layers
        self.d_model = config.hidden_size
        self.declared = catalogue.declared if catalogue else None
        self.dtype = engine.model_config.dtype  # what vLLM computes in
        from vllm.platforms import current_platform
        self.device = torch.device(current_platform.device_type)  # where vLLM runs (results come back on the CPU)
        self._shm: str | None = None  # the directory captured rows come back through (_capture_dir)
        self._init_base()

    def __repr__(self):
        cls = self.catalogue.model_class if self.catalogue else "stock"
        return (f"<{type(self).__name__} {self.name} ({self.source}, {cls}, layers={self.n_layers}, "
                f"d_model={self.d_model}, backend={self.backend})>")

    # -- the point catalogue ----------------------------------------------------------------------
    def _refuse_if_generate(self, what: str) -> None:
        """Refuse a capture (or a steer) when this mode serves none (stock vLLM), saying why."""
        if self.mode.unserved:
            raise (SteeringError if what == "steer" else UnsupportedPointError)(self.mode.unserved + ".")

    def _probe(self, point, layer):
        self._refuse_if_generate("capture")
        self.catalogue.check(Address(point, layer) if layer is not None else Address(point))

    def _verdict(self, point, layer) -> Verdict:
        addr = Address(point, layer)
        if self.mode.unserved:
            return refused(point, layer, self.backend, self.mode.unserved)
        try:
            self.catalogue.check(addr)
        except UnsupportedPointError as e:
            return refused(point, layer, self.backend, str(e))
        if point in vllm_attn.ATTN_POINTS:
            return Verdict(str(addr), True, "recompute", "recomputed from q and k after the forward (capture only); "
                                                         "steer q or k, or use backend='eager'")
        info = self.catalogue.info(addr)
        only = "integer expert indices: capture only" if point in INTEGER_POINTS else info.get("write_refused")
        only = only or self.mode.capture_only(info)
        return Verdict(str(addr), True, "hook", only)

    def address(self, a: "str | Address") -> Address:
        """Parse and check an address against this model and backend; absolute layer, coordinates
        counted from 0."""
        self._live()
        self._refuse_if_generate("capture")
        addr = parse(a).resolved(self.n_layers)
        self.catalogue.check(addr.base)
        if not addr.coords:
            return addr
        (name, value), = addr.coords
        n = self.catalogue.heads(addr)
        if not -n <= value < n:
            raise AddressError(f"{name} {value} is out of range for {addr.point!r} ({n} {name}s).")
        return Address(addr.point, addr.layer, **{name: value % n})

    def block_layout(self) -> BlockLayout:
        """The block layout from the family table and config (per-layer mixers: where q is served)."""
        from engine.families import family_for
        from engine.model.weights import layout
        fam = family_for(self.config.model_type)
        mixer = None
        if self.catalogue is not None:
            mixer = lambda i: "attention" if self.serves(f"q.{i}") else "other"  # noqa: E731
        return layout(fam, self.config, self.n_layers, mixer)

    def _weights_refused(self, what):
        self._live()
        raise UnsupportedPointError(f"{what} lives in vLLM's worker processes (sharded under tensor parallelism) "
                                    f"and is not copied to the client; load the model with backend='eager' to read "
                                    f"weights.")

    def W_O(self, layer: int) -> None:
        self._weights_refused("W_O")

    def W_down(self, layer: int) -> None:
        self._weights_refused("W_down")

    @property
    def W_U(self) -> None:
        self._weights_refused("W_U")

    def point_shape(self, addr: Address) -> tuple:
        """Per-token shape of a capture at addr (what a steering value must have)."""
        self._live()
        return self.catalogue.shape(addr)

    # -- plans -------------------------------------------------------------------------------------
    def _steer(self, st: Steer) -> Steer:
        """One steer checked against this engine and its mode, at its resolved address, value on the CPU
        (called by engine.core.steer_checks.check_steers, after the steer's own checks)."""
        self._refuse_if_generate("steer")
        addr = self.address(st.address)
        if addr.point in INTEGER_POINTS:
            raise UnsupportedPointError(f"{addr} is capture-only.")
        if addr.point in vllm_attn.ATTN_POINTS:
            raise SteeringError(f"{addr} is recomputed from q and k after the forward on backend "
                                f"{self.backend!r} (capture only); steer q or k, or use backend='eager'.")
        info = self.catalogue.info(addr.base)
        if info.get("write_refused"):
            raise SteeringError(f"{addr} is capture-only on {self.catalogue.model_class}: {info['write_refused']}.")
        self.mode.check_steer(st.at(addr), info)
        if info.get("sharded") and OPS[st.op].whole and not addr.coords:
            raise SteeringError(f"{st.op} at {addr} needs the whole vector, but this point is split across "
                                f"{self.catalogue.tp} tensor-parallel ranks; steer one head ({addr}.head-N) or "
                                f"use tensor_parallel_size=1.")
        if st.sae is not None and not isinstance(st.sae, str):
            raise SteeringError(f"{st.op} at {addr}: the vLLM workers load an SAE from its directory (once, then "
                                f"cached); pass sae=<directory> instead of a loaded SAE.")
        if st.sae is not None:  # its facts from cfg.json here; the workers load the SAE itself
            check_feature_steer(st, sae_header(st.sae, f"{st.op} at {addr}"), math.prod(self.point_shape(addr)))
        st = st.at(addr).bound()
        v = st.value
        if isinstance(v, torch.Tensor):  # (a value on the meta device was refused by check_steers)
            st.check_shape(self.point_shape(addr))
        return st.at(addr, v.detach().cpu() if isinstance(v, torch.Tensor) else None)

    def _readout_kinds(self) -> dict:
        from engine.core.readouts import KINDS
        if self.mode.unserved:
            return {k: self.mode.unserved for k in KINDS}
        out: dict = {k: None for k in KINDS}
        if self.mode.declares:
            out = {k: "at the declared taps only (static_points)" for k in KINDS}
        if self.catalogue.tp > 1:
            out = {k: "at replicated points only (head- and neuron-sharded points are split across ranks)"
                   for k in KINDS}
            out["LensTopK"] = "refused under tensor parallelism (the sharded head runs on every rank)"
        out["SAEFeatures"] = ((out["SAEFeatures"] + "; ") if out["SAEFeatures"] else "") + \
            "from an SAE directory (the workers load it once), not a loaded SAE object"
        return out

    def _readout(self, r: Readout) -> Readout:
        """A readout checked against this engine, at its absolute address (what a worker can compute:
        vllm-static's declared taps only; under tensor parallelism, replicated points and no lens)."""
        from engine.core.readouts import LensTopK, SAEFeatures
        self._refuse_if_generate("capture")
        addr = self.address(r.address)
        if addr.point in vllm_attn.ATTN_POINTS:
            raise ReadoutError(f"{addr} is recomputed after the forward on backend {self.backend!r}; readouts "
                               f"read what the forward computes.")
        if self.catalogue.tp > 1:
            if self.catalogue.info(addr.base).get("sharded"):
                raise ReadoutError(f"readout {r.name!r}: {addr} is split across {self.catalogue.tp} tensor-parallel "
                                   f"ranks; read a replicated point (resid_post, attn_out, mlp_out, ...) or use "
                                   f"tensor_parallel_size=1.")
            if isinstance(r.kind, LensTopK):
                raise ReadoutError(f"readout {r.name!r}: LensTopK runs the sharded head on one rank, which tensor "
                                   f"parallelism cannot do; capture the point and call logit_lens, or use "
                                   f"tensor_parallel_size=1.")
        if isinstance(r.kind, SAEFeatures) and not isinstance(r.kind.sae, str):
            raise ReadoutError(f"readout {r.name!r}: the vLLM workers load an SAE from its directory (once, then "
                               f"cached); pass SAEFeatures(path, ...) instead of a loaded SAE.")
        shape = None if addr.point in vllm_attn.ATTN_POINTS else self.point_shape(addr)
        r.kind.check_model(Facts(vocab=self.config.vocab_size, width=None if shape is None else math.prod(shape)), addr)
        return r.at(addr)

    def _plan(self, req: Request, prefill: bool, logits: bool, row: int = 0, n_rows: int = 1,
              strict: bool = False) -> Submission:
        """A request's plan and sampling params, as a Submission. prefill: a forward over the prompt (run_with_cache):
        every prompt position computed, logits at each; else logits of each new token. The request
        is sequence `row` of a call of `n_rows` (batch values and masks are cut to its row)."""
        n_new = None if prefill else req.max_new_tokens  # checked when the Request was made
        prompt = self._prompt_ids(req.prompt, n_new)
        caps = self.expand(req.points) if req.points else []
        if caps:
            self._refuse_if_generate("capture")
        special = special_ids(self.tokenizer)
        steers = [s.for_row(row, n_rows, prompt, special)
                  for s in check_steers(req.steer, self._context_steers(), self._steer, self.mode.check_steers)]
        derived = tuple(a for a in caps if a.point in vllm_attn.ATTN_POINTS)
        plan = Plan(len(prompt), [a for a in caps if a not in derived], steers,
                    [Address(p, a.layer) for a in derived for p in ("q", "k")],
                    readouts=[self._readout(r) for r in validate_readouts(req.readouts)])
        if row == 0:  # the same steers and readouts on every row of a call: checked once
            check_sae_sites(self, plan.steers, plan.readouts, strict)
        if logits and self.mode.worker:
            plan.internal.append(Address("final_norm"))
            if not prefill and Address("final_norm") not in plan.captures:
                plan.start_at["final_norm"] = len(prompt) - 1
        plan.check_positions(0 if prefill else n_new, row_label(row, n_rows))
        # min_tokens bans end-of-sequence until max_new_tokens, as eager's min_new_tokens does
        n_new = n_new or 1  # a capture generates one token (vLLM always does)
        params = dict(max_tokens=n_new, min_tokens=n_new)
        params.update(Sampling.parse(req.sampling, self.backend).vllm())
        return Submission(plan, params, prompt, derived, self._salted(plan, derived, prefill),
                          self._asked_as(req.points, caps))

    def _asked_as(self, points: Any, caps: list[Address]) -> dict:
        """{capture key: the keys it was asked under}, where they differ: the workers need a coordinate
        counted from 0 (`address`), the caller reads the key it asked for (layer resolved, the coordinate as
        written, as on eager: 'z.0.head--1' of a 4-head model is captured as 'z.0.head-3' and read as asked)."""
        if not caps or not points:
            return {}
        items = [points] if isinstance(points, (str, Address)) else list(points)
        keys: dict = {}
        for p in items:
            if isinstance(p, str) and "." not in p:  # a bare point name (every layer) takes no coordinate
                continue
            a = parse(p)
            if not a.coords:
                continue
            asked, captured = str(a.resolved(self.n_layers)), str(self.address(a))
            keys.setdefault(captured, [])
            if asked not in keys[captured]:
                keys[captured].append(asked)
        return {k: tuple(v) for k, v in keys.items() if v != [k]}

    def _capture_dir(self, built: list[Submission]) -> str | None:
        """Where generate, run_with_cache and stream have the workers hand captured rows back: a directory in
        shared memory, as files (worker/sink.py, as the harvest does: a few MB of rows a request no longer
        pickled through collective_rpc), made on first use and removed at close; None (inline in the RPC
        reply) when no request captures or there is no /dev/shm. generate_batch takes its caller's `sink`
        (the harvest's, None for its inline hand-off). Workers that cannot see the directory answer inline."""
        if not any(s.plan.captures for s in built):
            return None
        if self._shm is None and os.path.isdir(SHM):
            self._shm = tempfile.mkdtemp(prefix=f"interp-harvest-{os.getpid()}-", dir=SHM)  # swept like a harvest's
        return self._shm

    @staticmethod
    def _needs_worker(plan: Plan) -> bool:
        return bool(plan.captures or plan.steers or plan.internal or plan.readouts)

    @staticmethod
    def _salted(plan: Plan, derived: tuple, prefill: bool) -> bool:
        """Whether the request needs its own prefix-cache key: positions served from the cache are
        never computed, so a capture, a steer or prefill logits there would be silently skipped (and
        a steered prefix must never be served to others). Logits of new tokens alone need none: the
        last prompt token is always computed."""
        return bool(plan.captures or plan.steers or plan.readouts or derived or prefill)

    # -- tokens ------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt, new: int | None = None) -> list[int]:
        """One prompt's validated token ids (engine/core/inputs.py), with room for `new` tokens (None: a capture)."""
        return token_rows(prompt, self.tokenizer, limits_of(self), one=True, prepend_bos=self.prepend_bos,
                          new=new)[0]

    def _prompts(self, inputs, new: int | None) -> tuple[list[list[int]], torch.Tensor | None]:
        """Prompts as validated token lists (each with room for `new` tokens; None: a capture), and the
        attention mask whose layout results follow (None: left-padded)."""
        mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
        mask = None if mask is None else torch.as_tensor(mask).reshape(-1, torch.as_tensor(mask).shape[-1]).cpu()
        return token_rows(inputs, self.tokenizer, limits_of(self), prepend_bos=self.prepend_bos, new=new), mask

    # -- running requests ----------------------------------------------------------------------------
    async def _rpc(self, method: str, *args):
        return await self.engine.collective_rpc(method, args=args)

    async def worker_syncs(self, on: bool) -> list[dict]:
        """Start (on=True) or stop counting the engine's host reads inside the workers' steps
        (engine/core/syncs.py); stopping returns each rank's {"syncs", "steps", "sites"}."""
        self._live()
        return await self._rpc("interp_syncs", on)

    async def worker_ops(self, on: bool) -> list[dict]:
        """Start (on=True) or stop counting the ops the workers dispatch around their steps, outside the
        forward (engine/core/opcount.py); stopping returns each rank's {"steps", "labels", "ops", "sites"}:
        labels as in engine/backends/vllm/worker/meters.py (a step's "step" and "hooks", a call's "register" and
        "collect")."""
        self._live()
        return await self._rpc("interp_ops", on)

    async def worker_timing(self, on: bool) -> list[dict]:
        """Start (on=True) or stop timing the host work the workers do around their steps; stopping returns
        each rank's {"steps", "seconds": {window label: seconds}} (labels as worker_ops')."""
        self._live()
        return await self._rpc("interp_timing", on)

    async def _submit(self, sub: Submission, key: str, on_output=None, on_done=None):
        """Run one request in the continuous batch; returns vLLM's final RequestOutput."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        extras = {"cache_salt": f"interp-{key}"} if sub.salted else None
        (prompt,) = await self.engine.renderer.render_cmpl_async([{"prompt_token_ids": sub.prompt}],
                                                                prompt_extras=extras)
        # the plan rides with the request: each worker registers it when a schedule first holds the request
        # (WorkerState.scheduled), so no call to the workers stalls the engine before it runs
        sp = SamplingParams(**sub.params, extra_args={EXTRA_KEY: key, PLAN_ARG: vllm_wire.plan_out(sub.plan, key)}
                            if self._needs_worker(sub.plan) else None)
        final = None
        ids: list[int] = []
        try:
            async for out in self.engine.generate(prompt, sp, request_id=key):
                final = out
                ids += out.outputs[0].token_ids
                if on_output is not None:
                    on_output(out)
        except BaseException:
            await self.engine.abort(key)
            raise
        if on_done is not None:
            on_done()
        if final is not None and sp.output_kind == RequestOutputKind.DELTA:
            # each DELTA output holds only its new tokens: the result is built from all of them (a
            # copy: the last output may still be queued for a stream)
            final = copy.copy(final)
            final.outputs = [copy.copy(final.outputs[0])]
            final.outputs[0].token_ids = ids
        return final

    async def _run_many(self, built: list[Submission], want_logits: bool, prefill: bool = False,
                        on_output=None, keys=None, hold: asyncio.Event | None = None,
                        sink: str | None = None, on_done=None) -> list[RequestResult]:
        """Run the requests concurrently, each carrying its plan (registered by the workers when it is
        first scheduled), and collect every plan in one RPC (after `hold` is set, when given: a stream
        reads the plans' rows step by step until then; with `sink`, a shared-memory directory, the rows
        come back as files there: worker/sink.py)."""
        keys = keys or [uuid.uuid4().hex for _ in built]
        active = [(k, s.plan) for k, s in zip(keys, built) if self._needs_worker(s.plan)]
        try:  # collected in `finally`: a request cancelled once scheduled has a plan to forget
            outs = await asyncio.gather(*(self._submit(s, k, on_output, on_done) for k, s in zip(keys, built)))
            if hold is not None:
                await hold.wait()
        finally:
            collected = {}
            if active:  # shielded: a second cancellation must not leave the plans registered
                per_rank = await asyncio.shield(self._rpc(
                    "interp_collect" if sink is None else "interp_collect_to", [k for k, _ in active],
                    [want_logits and Address("final_norm") in p.internal for _, p in active],
                    *(() if sink is None else (sink,))))
                for i, (k, _) in enumerate(active):
                    collected[k] = [vllm_wire.CollectReply.read(rank[i]) for rank in per_rank]
        return [replies.request_result(s.plan, s.prompt, s.derived, out, collected.get(k), want_logits, prefill,
                                       catalogue=self.catalogue, n_layers=self.n_layers, tokenizer=self.tokenizer,
                                       keys=s.keys)
                for k, s, out in zip(keys, built, outs)]

    # -- public async API ----------------------------------------------------------------------------
    @on_home_loop
    async def generate_batch(self, requests: list[Request], return_logits: bool = True, progress: bool = False,
                             strict: bool = False, sink: str | None = None) -> list[RequestResult]:
        """Run requests concurrently (one continuous batch); each keeps its own captures and steers
        (each Request is one sequence: its steer values take no batch axis) and its receipts;
        strict=True fails when a steer touched no row of its request; progress=True ticks a bar as each
        request finishes. sink: a directory in shared memory the workers hand the captured rows through
        (the harvester's; worker/sink.py)."""
        self._live()
        want = return_logits and self.mode.worker
        built = [self._plan(r, False, want, strict=strict) for r in requests_of(requests)]
        with Progress(len(built), progress) as bar:
            res = await self._run_many(built, want, sink=sink, on_done=bar.tick)
        if strict:
            for r in res:
                check_strict(r.receipts, "request")
        return res

    @on_home_loop
    async def generate(self, inputs: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (),
                       return_logits: bool = True, strict: bool = False, readouts: Any = (),
                       **sampling: Any) -> GenerationResult:
        """Greedy (by default) generation of every prompt, the same captures and steers for each
        (a steer value or mask with a batch axis gives each prompt its own row); results padded on
        the left like eager's. strict=True fails when a steer touched no row of the call."""
        self._live()
        max_new_tokens = new_tokens(max_new_tokens)
        prompts, _ = self._prompts(inputs, max_new_tokens)
        want = return_logits and self.mode.worker
        built = [self._plan(Request(p, max_new_tokens, points, steer, sampling, readouts), False, want, i, len(prompts),
                            strict)
                 for i, p in enumerate(prompts)]
        # the pad every backend fills with (the remote client is handed the same id by its server)
        out = replies.batch_result(await self._run_many(built, want, sink=self._capture_dir(built)),
                                   pad_id(self.tokenizer), self.n_layers)
        if strict:
            check_strict(out.receipts, "generation")
        return out

    @on_home_loop
    async def run_with_cache(self, inputs: Any, points: Any = (), steer: Any = (), grad: bool = False,
                             strict: bool = False, readouts: Any = (), stop_at_layer: int | None = None,
                             return_logits: bool = True) -> tuple[torch.Tensor | None, ActivationCache]:
        """One forward over each prompt. Returns (logits [b, pos, vocab] or None, cache of [b, pos, ...]),
        padded on the left (or in the layout of a given attention_mask); padded positions hold 0.
        The cache's receipts say what each steer did; strict=True fails a steer that touched no row.
        grad and stop_at_layer are the eager backend's (vLLM runs its whole forward, without autograd)."""
        self._live()
        if grad:
            raise unserved(self.backend, "grad=True (vLLM's forward keeps no autograd graph)",
                           "load the model with backend='eager' for gradients")
        if stop_at_layer is not None:
            raise unserved(self.backend, f"stop_at_layer={stop_at_layer!r} (vLLM runs its whole forward)",
                           "use backend='eager' to stop after a block")
        self._refuse_if_generate("capture")
        prompts, mask = self._prompts(inputs, None)
        want = bool(return_logits)
        built = [self._plan(Request(p, 1, points, steer, readouts=readouts), True, want, i, len(prompts), strict)
                 for i, p in enumerate(prompts)]
        res = await self._run_many(built, want, prefill=True, sink=self._capture_dir(built))
        lengths = [len(p) for p in prompts]
        width = max(lengths) if mask is None else mask.shape[1]
        cols = columns(lengths, width, "left") if mask is None else columns_of(mask)
        logits = pad_rows([r.logits for r in res], cols, width) if want else None
        receipts = combine([r.receipts for r in res])
        if strict:
            check_strict(receipts, "forward")
        return logits, batch_cache([r.cache for r in res], cols, width, self.n_layers, receipts)

    @on_home_loop
    async def forward(self, inputs: Any, steer: Any = (), strict: bool = False) -> torch.Tensor:
        logits, _ = await self.run_with_cache(inputs, (), steer, strict=strict)
        assert logits is not None
        return logits

    to_tokens = awaited(ModelBase.to_tokens)
    to_string = awaited(ModelBase.to_string)

    def stream(self, prompt: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (), logprobs: int = 0,
               return_logits: bool = True, rows: bool = True, strict: bool = False, readouts: Any = (),
               **sampling: Any) -> AsyncGenerator[StreamStep, None]:
        """An async iterator of StreamSteps, one per generated token (token, text, logprob and the top
        `logprobs` of the raw distribution, and with rows=True the captured rows of the forward that
        produced it, read from the workers while the request runs); the last step carries the full
        RequestResult, also when sampling stops generation before max_new_tokens. Attention patterns
        are recomputed after the request on vLLM: only the result holds them. strict=True raises
        instead of yielding the last step when a steer touched no row (the result's receipts).

        Everything is checked, and the steers of the `steering()` blocks around this call are bound,
        when the stream is created: iterating it later (after the block, from any loop) runs the
        same request."""
        self._live()
        from vllm.sampling_params import RequestOutputKind
        logprobs = top_logprobs(logprobs)
        want = return_logits and self.mode.worker
        sub = self._plan(Request(prompt, max_new_tokens, points, steer, sampling, readouts), False, want, strict=strict)
        # vLLM returns the sampled token's logprob too
        sub = dataclasses.replace(sub, params={**sub.params, "output_kind": RequestOutputKind.DELTA,
                                               "logprobs": logprobs})
        steps = streaming.stream_steps(
            sub.plan, lambda on_output, key, hold: self._run_many([sub], want, on_output=on_output, keys=[key], hold=hold,
                                                                  sink=self._capture_dir([sub])),
            self._peek, lambda tok: self.tokenizer.decode([tok], skip_special_tokens=True), logprobs, rows, strict,
            sub.keys)
        return steps if self._home is None else self._home.relay(steps)

    async def _peek(self, key: str, since: dict, since_r: dict) -> tuple[dict, dict]:
        """Capture rows ({address: rows}) and per-position readout parts ({name: parts}) of a running
        request from `since` / `since_r` ({address or name: position}, advanced here)."""
        ranks = [vllm_wire.PeekReply.read(r[0]) for r in await self._rpc("interp_peek", [key], [dict(since)],
                                                                          [dict(since_r)])]
        reads = {}
        for r in ranks:
            for name, (start, parts) in r.readouts.items():
                reads[name] = tuple(vllm_wire.decode(parts))
                since_r[name] = start + reads[name][0].shape[0]
        out = {}
        for k in since:
            starts = [r.captures[k][0] for r in ranks if k in r.captures]
            if starts:
                t = replies.gather(self.catalogue, k, ranks)
                out[k] = t
                since[k] = starts[0] + t.shape[0]
        return out, reads

    @on_home_loop
    async def logit_lens(self, x: torch.Tensor | tuple[ActivationCache, Address | str],
                         point: str = "resid_post") -> torch.Tensor:
        """Logits from a residual tensor through vLLM's own final norm and head (softcap, scaling)."""
        from engine.model import lens
        self._live()
        self._refuse_if_generate("capture")
        if isinstance(x, tuple):
            cache, a = x
            point, x = parse(a).point, cache[a]
        point = known_point(point).name
        lens.check_lensable(point)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"logit lens needs a [..., {self.d_model}] residual, got shape {tuple(x.shape)}.")
        out = await self._rpc("interp_lens", vllm_wire.tensor_out(x.reshape(-1, self.d_model)), point != "final_norm")
        return vllm_wire.tensor_in(out[0]).reshape(*x.shape[:-1], -1)

    @on_home_loop
    async def aclose(self) -> None:
        """Shut the engine down from its event loop (idempotent); any later call says it was closed."""
        self.close()

    def close(self) -> None:
        """Shut the engine down (idempotent). Call it from the thread running the engine's event loop
        (or await aclose()); the synchronous VLLMModel does that for you."""
        if not self._closed:
            self._closed = True
            engine, self.engine = self.engine, None  # type: ignore[assignment]  # released: _live() refuses later calls
            from engine.backends.vllm.runtime import stop_engine
            stop_engine(engine)
            if self._shm is not None:
                shutil.rmtree(self._shm, ignore_errors=True)


if TYPE_CHECKING:
    def _implements(m: AsyncVLLMModel) -> AsyncModel:  # mypy holds it to the declared API (engine/model/api.py)
        return m
