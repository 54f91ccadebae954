"""The async vLLM model: requests with their own captures and steers, many in flight from one event
loop, against a vLLM engine whose core runs in its own process.

    m = await AsyncVLLMModel.start(name, backend="vllm", ...)      (or load_model(..., backend="vllm").aio)
    logits, cache = await m.capture(["a prompt", "another"], ["resid_post.-1"])
    out = await m.generate("a prompt", 8, points=["z.1"], steer=[Steer("resid_post.2", "add", v)])
    async for step in m.stream("a prompt", 8, logprobs=5): ...      (StreamStep: token, text, logprobs, rows)

Its coroutines run on the model's own event loop (where vLLM's AsyncLLM lives) and are awaited from
any loop: a call from another one is handed over and its result comes back (vllm_runtime.Loop.hop).

Per request: the plan rides with the request (its SamplingParams' extra_args: the plan's key and its
wire form), every worker registers it when a schedule first holds the request, the request runs in
vLLM's continuous batch, and the captures come back when it finishes (collective_rpc "interp_collect"),
gathered across tensor-parallel ranks. One call to the workers per batch of requests: each such call
stalls the engine core for every request it serves.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.backends.vllm.catalogue import VLLMCatalogue
from engine.backends.vllm.modes import NO_CAPTURE, Mode, mode_for
from engine.backends.vllm.worker import attn as vllm_attn
from engine.backends.vllm.worker import wire as vllm_wire
from engine.backends.vllm.worker.rows import EXTRA_KEY, PLAN_ARG
from engine.core.address import Address, parse
from engine.core.errors import AddressError, EngineError, SteeringError, UnsupportedPointError
from engine.core.inputs import limits_of, new_tokens, row_label, token_rows, top_logprobs
from engine.core.loop import on_home_loop
from engine.core.ops import OPS
from engine.core.plan import Plan
from engine.core.points import INTEGER_POINTS
from engine.core.readouts import Readout, ReadoutError, as_value, parts_of, validate_readouts
from engine.core.results import (
    ActivationCache,
    GenerationResult,
    Request,
    RequestResult,
    StreamStep,
    StrictSteerError,
    batch_cache,
    check_strict,
    columns,
    columns_of,
    combine,
    pad_rows,
)
from engine.core.steer_checks import check_steers
from engine.core.steering import NonFiniteSteer, Steer
from engine.core.tokens import TokensMixin, special_ids
from engine.interop.mappers import check_sae_sites
from engine.model.base import ModelBase
from engine.model.capabilities import Verdict, refused
from engine.model.sampling import Sampling

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

    from engine.core.loop import Loop
    from engine.model.weights import BlockLayout

__all__ = ["AsyncVLLMModel", "Submission", "StreamEvent", "NO_CAPTURE"]


@dataclass(frozen=True)
class Submission:
    """One request as the client submits it: the plan its workers run, and what only the client needs."""
    plan: Plan
    params: dict  # vLLM SamplingParams keywords
    prompt: list[int]  # the prompt's token ids
    derived: tuple[Address, ...] = ()  # attention patterns recomputed from the captured q and k afterwards
    salted: bool = False  # its own prefix-cache key (see AsyncVLLMModel._salted)


StreamEvent = StreamStep  # the earlier name of one streamed step
# a worker's failure of one request that is the request's own fault (a steer): re-raised as that class
_REQUEST_FAULTS = {c.__name__: c for c in (NonFiniteSteer, SteeringError)}


def _logprobs(entry, token: int, n: int) -> tuple:
    """(the sampled token's log-probability, {id: log-probability} of the n most likely) from vLLM's
    per-token logprobs dict ({id: Logprob(logprob, rank)})."""
    if not entry:
        return None, {}
    top = {int(i): float(v.logprob) for i, v in entry.items() if v.rank is not None and v.rank <= n}
    chosen = entry.get(token)
    return (None if chosen is None else float(chosen.logprob)), top


def _step_readouts(parts: dict, kinds: dict, prompt_len: int, index: int) -> dict | None:
    """The per-position readouts of the forward that produced new token `index` ({name: value}), cut
    from parts read from position 0 (as _step_rows cuts captures)."""
    lo, hi = (0, prompt_len) if index == 0 else (prompt_len + index - 1, prompt_len + index)
    out = {n: as_value(kinds[n], tuple(t[lo:hi] for t in p)) for n, p in parts.items() if p[0].shape[0] >= hi}
    return out or None


def _step_rows(rows: dict, prompt_len: int, index: int) -> dict:
    """The rows of the forward that produced new token `index` ({address: [n, ...]}): the prompt for
    the first, then the token fed back; addresses not read that far are left out."""
    lo, hi = (0, prompt_len) if index == 0 else (prompt_len + index - 1, prompt_len + index)
    return {k: t[lo:hi] for k, t in rows.items() if t.shape[0] >= hi}


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
        return Submission(plan, params, prompt, derived, self._salted(plan, derived, prefill))

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

    async def _submit(self, sub: Submission, key: str, on_output=None):
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
        if final is not None and sp.output_kind == RequestOutputKind.DELTA:
            # each DELTA output holds only its new tokens: the result is built from all of them (a
            # copy: the last output may still be queued for a stream)
            final = copy.copy(final)
            final.outputs = [copy.copy(final.outputs[0])]
            final.outputs[0].token_ids = ids
        return final

    async def _run_many(self, built: list[Submission], want_logits: bool, prefill: bool = False,
                        on_output=None, keys=None, hold: asyncio.Event | None = None,
                        sink: str | None = None) -> list[RequestResult]:
        """Run the requests concurrently, each carrying its plan (registered by the workers when it is
        first scheduled), and collect every plan in one RPC (after `hold` is set, when given: a stream
        reads the plans' rows step by step until then; with `sink`, a shared-memory directory, the rows
        come back as files there: worker/sink.py)."""
        keys = keys or [uuid.uuid4().hex for _ in built]
        active = [(k, s.plan) for k, s in zip(keys, built) if self._needs_worker(s.plan)]
        try:  # collected in `finally`: a request cancelled once scheduled has a plan to forget
            outs = await asyncio.gather(*(self._submit(s, k, on_output) for k, s in zip(keys, built)))
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
                    collected[k] = [rank[i] for rank in per_rank]
        return [self._result(s, out, collected.get(k), want_logits, prefill) for k, s, out in zip(keys, built, outs)]

    def _gather(self, key: str, ranks: list[dict]) -> torch.Tensor:
        """One capture from every rank's part: a sharded point's heads / neurons put in place."""
        parts = [(r["captures"][key][0], vllm_wire.tensor_in(r["captures"][key][1])) for r in ranks
                 if key in r["captures"]]
        errors = [r["errors"][key] for r in ranks if key in r.get("errors", {})]
        if errors:
            raise RuntimeError(errors[0])
        if not parts:
            raise RuntimeError(f"{key} was never computed for this request.")
        addr = parse(key)
        info = self.catalogue.info(addr.base)
        if len(parts) == 1 or not info.get("sharded") or addr.coords:
            return parts[0][1]
        held = [r for r in ranks if key in r["captures"]]
        full = torch.zeros(parts[0][1].shape[0], *info["shape"], dtype=parts[0][1].dtype)
        for (_, t), r in zip(parts, held):
            full[:, torch.tensor(r["held"][key])] = t
        return full

    def _result(self, sub: Submission, out, ranks: list[dict] | None, want_logits: bool, prefill: bool) -> RequestResult:
        plan = sub.plan
        if out is None:
            raise EngineError("vLLM returned no output for a request (aborted?).")
        if ranks:
            bad = [r["error"] for r in ranks if "error" in r]
            if bad:
                raise EngineError(f"a worker lost this request's plan: {bad[0]}")
            failed = [r["failed"] for r in ranks if "failed" in r]
            if failed:
                kind, _, why = failed[0].partition(": ")
                if kind in _REQUEST_FAULTS:  # the request's own input (a steer), not the engine: say so
                    raise _REQUEST_FAULTS[kind](f"{why} (this request alone failed; others are unaffected)")
                raise EngineError(f"this request failed inside the vLLM worker ({failed[0]}); other requests "
                                  f"and the engine are unaffected.")
        new = torch.tensor(list(out.outputs[0].token_ids), dtype=torch.long)
        cache = ActivationCache(self.n_layers)
        for addr in plan.captures:
            cache[str(addr)] = self._gather(str(addr), ranks)
        for addr in sub.derived:
            layer = addr.layer
            assert layer is not None and self.catalogue is not None  # attention patterns are per layer
            q, k = self._gather(f"q.{layer}", ranks), self._gather(f"k.{layer}", ranks)
            t = vllm_attn.scores(q, k, self.catalogue.attn[layer])
            t = vllm_attn.probs(t) if addr.point == "attn_probs" else t
            cache[str(addr)] = t[:, addr.coords[0][1]] if addr.coords else t
        for r in plan.readouts:
            cache.put_readout(r.name, self._readout_value(r, ranks), r.kind.per_position)
        logits = None
        if want_logits and ranks and "logits" in ranks[0]:
            logits = vllm_wire.tensor_in(ranks[0]["logits"])  # rows from position ranks[0]["logits_from"]
            if not prefill:  # the scores each new token was chosen from: the last prompt position on
                start = plan.prompt_len - 1 - ranks[0]["logits_from"]
                logits = logits[start:start + len(new)]
        text = self.tokenizer.decode(new.tolist(), skip_special_tokens=True)
        return RequestResult(torch.tensor(sub.prompt, dtype=torch.long), new, text, cache, logits,
                             int(getattr(out, "num_cached_tokens", 0) or 0),
                             max([r.get("recomputed", 0) for r in ranks or []], default=0),
                             vllm_wire.receipts_in(plan, ranks))

    @staticmethod
    def _readout_value(r: Readout, ranks: list[dict] | None):
        """One readout's result from the rank that computed it (rank 0)."""
        for rank in ranks or []:
            if r.name in rank.get("errors", {}):
                raise RuntimeError(rank["errors"][r.name])
            if r.name in rank.get("readouts", {}):
                return as_value(r.kind, tuple(vllm_wire.decode(rank["readouts"][r.name])))
        raise RuntimeError(f"readout {r.name!r} was never computed for this request.")

    # -- public async API ----------------------------------------------------------------------------
    @on_home_loop
    async def generate_batch(self, requests: list[Request], return_logits: bool = True,
                             strict: bool = False, sink: str | None = None) -> list[RequestResult]:
        """Run requests concurrently (one continuous batch); each keeps its own captures and steers
        (each Request is one sequence: its steer values take no batch axis) and its receipts;
        strict=True fails when a steer touched no row of its request. sink: a directory in shared
        memory the workers hand the captured rows through (the harvester's; worker/sink.py)."""
        self._live()
        want = return_logits and self.mode.worker
        res = await self._run_many([self._plan(r, False, want, strict=strict) for r in requests], want, sink=sink)
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
        out = self._batch(await self._run_many(built, want))
        if strict:
            check_strict(out.receipts, "generation")
        return out

    @on_home_loop
    async def capture(self, inputs: Any, points: Any = (), steer: Any = (), strict: bool = False,
                      readouts: Any = ()) -> tuple:
        """One forward over each prompt. Returns (logits [b, pos, vocab], cache of [b, pos, ...]),
        padded on the left (or in the layout of a given attention_mask); padded positions hold 0.
        The cache's receipts say what each steer did; strict=True fails a steer that touched no row."""
        self._live()
        self._refuse_if_generate("capture")
        prompts, mask = self._prompts(inputs, None)
        built = [self._plan(Request(p, 1, points, steer, readouts=readouts), True, True, i, len(prompts), strict)
                 for i, p in enumerate(prompts)]
        res = await self._run_many(built, True, prefill=True)
        lengths = [len(p) for p in prompts]
        width = max(lengths) if mask is None else mask.shape[1]
        cols = columns(lengths, width, "left") if mask is None else columns_of(mask)
        logits = pad_rows([r.logits for r in res], cols, width)
        receipts = combine([r.receipts for r in res])
        if strict:
            check_strict(receipts, "forward")
        return logits, batch_cache([r.cache for r in res], cols, width, self.n_layers, receipts)

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
        steps = self._stream(sub, want, logprobs, rows, strict)
        return steps if self._home is None else self._home.relay(steps)

    async def _stream(self, sub: Submission, want: bool, logprobs: int, rows: bool, strict: bool):
        key, plan = uuid.uuid4().hex, sub.plan
        queue: asyncio.Queue = asyncio.Queue()
        hold = asyncio.Event()  # the plan stays registered until the final output was seen
        task = asyncio.ensure_future(self._run_many([sub], want, on_output=queue.put_nowait, keys=[key],
                                                    hold=hold))
        live = [str(a) for a in plan.captures if a.point not in vllm_attn.ATTN_POINTS] if rows else []
        since = {k: 0 for k in live}  # read from the workers up to here
        got: dict = {}  # {address: rows from position 0}, as read so far
        live_r = {r.name: r.kind for r in plan.readouts if r.kind.per_position}
        since_r = {n: 0 for n in live_r}
        got_r: dict = {}  # {readout name: parts from position 0}, as read so far
        pending: list[StreamStep] = []  # seen, not yielded (the newest goes out last, with the result)
        seen: list[int] = []
        try:
            finished = False
            while not finished:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:  # the request ended without a final output: raise its error
                    getter.cancel()
                    task.result()
                    break
                ro = getter.result()
                finished = bool(getattr(ro, "finished", False))
                out = ro.outputs[0]
                for j, tok in enumerate(out.token_ids):
                    lp, top = _logprobs(out.logprobs[j] if out.logprobs else None, tok, logprobs)
                    pending.append(StreamStep(len(seen), tok, self.tokenizer.decode([tok], skip_special_tokens=True),
                                              lp, top))
                    seen.append(tok)
                if finished:
                    hold.set()
                if len(pending) < 2 or finished:
                    continue
                if since or since_r:
                    caps, reads = await self._peek(key, since, since_r)
                    for k, t in caps.items():
                        got[k] = torch.cat([got[k], t]) if k in got else t
                    for k, parts in reads.items():
                        got_r[k] = tuple(torch.cat(z) for z in zip(got_r[k], parts)) if k in got_r else parts
                while len(pending) > 1:
                    step = pending.pop(0)
                    step.rows = _step_rows(got, plan.prompt_len, step.index) if live else None
                    step.readouts = _step_readouts(got_r, live_r, plan.prompt_len, step.index)
                    yield step
            hold.set()
            (result,) = await task  # built from every DELTA output's tokens (_submit)
            cache = {k: result.cache[k] for k in live}
            final_r = {n: parts_of(result.cache.readouts[n]) for n in live_r}
            for step in pending:
                step.rows = _step_rows(cache, plan.prompt_len, step.index) if live else None
                step.readouts = _step_readouts(final_r, live_r, plan.prompt_len, step.index)
            if pending:
                pending[-1].result = result
            failure = None
            if strict:
                try:
                    check_strict(result.receipts, "generation")
                except StrictSteerError as e:
                    failure, pending = e, pending[:-1]
            for step in pending:
                yield step
            if failure is not None:
                raise failure
        finally:
            hold.set()
            if not task.done():
                task.cancel()

    async def _peek(self, key: str, since: dict, since_r: dict) -> tuple[dict, dict]:
        """Capture rows ({address: rows}) and per-position readout parts ({name: parts}) of a running
        request from `since` / `since_r` ({address or name: position}, advanced here)."""
        ranks = [r[0] for r in await self._rpc("interp_peek", [key], [dict(since)], [dict(since_r)])]
        reads = {}
        for r in ranks:
            for name, (start, parts) in r.get("readouts", {}).items():
                reads[name] = tuple(vllm_wire.decode(parts))
                since_r[name] = start + reads[name][0].shape[0]
        out = {}
        for k in since:
            starts = [r["captures"][k][0] for r in ranks if k in r["captures"]]
            if starts:
                t = self._gather(k, ranks)
                out[k] = t
                since[k] = starts[0] + t.shape[0]
        return out, reads

    def _batch(self, res: list[RequestResult]) -> GenerationResult:
        lengths = [r.tokens.shape[0] for r in res]
        width = max(lengths)
        cols = columns(lengths, width, "left")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        tokens = pad_rows([r.tokens for r in res], cols, width, pad)
        mask = pad_rows([torch.ones_like(r.tokens) for r in res], cols, width, 0)
        n_new = max(r.new_tokens.shape[0] for r in res)
        new = pad_rows([r.new_tokens for r in res], columns([r.new_tokens.shape[0] for r in res], n_new, "right"),
                       n_new, pad)
        seen = [n - 1 for n in lengths]
        cache = batch_cache([r.cache for r in res], columns(seen, width - 1, "left"), width - 1, self.n_layers)
        logits = None
        if all(r.logits is not None for r in res):
            logits = pad_rows([r.logits for r in res], columns([r.logits.shape[0] for r in res], n_new, "right"), n_new)
        return GenerationResult(tokens, new, [r.text for r in res], cache, logits, mask, res,
                                combine([r.receipts for r in res]))

    @on_home_loop
    async def logit_lens(self, x: torch.Tensor | tuple[ActivationCache, Address | str],
                         point: str = "resid_post") -> torch.Tensor:
        """Logits from a residual tensor through vLLM's own final norm and head (softcap, scaling)."""
        from engine.core.points import get_point
        from engine.model import lens
        self._live()
        self._refuse_if_generate("capture")
        if isinstance(x, tuple):
            cache, a = x
            point, x = parse(a).point, cache[a]
        point = get_point(point).name
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
