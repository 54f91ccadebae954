"""The engine inside vLLM's worker processes, reached only through vLLM's public seams.

    worker_extension_cls  `InterpWorker` is mixed into vLLM's Worker; the client calls its methods
                          on every rank with collective_rpc, sending plain data (vllm_wire)
    logits_processors     `vllm_rows.RowMap` learns which batch row holds which plan
    schedule              around V1's `execute_model` (engine/backends/vllm/worker/seams.py): a request's
                          plan, riding in its SamplingParams (PLAN_ARG), is registered when a schedule
                          first holds the request, before the runner takes that schedule
    step anchor           around V1's `GPUModelRunner._model_forward` (the runner's one call of the
                          model per step, documented by vLLM as its override point): the step begins
                          (rows -> spans, from the runner's host copies of query_start_loc and the
                          computed positions) and ends there, so it runs under any CUDA-graph mode,
                          FULL replay included (vllm_static's taps are read and written around it).
                          Without that method: forward hooks on the top-level model (seams.step_anchors)

The client collects a request's captures when it finishes (one collective_rpc). `vllm` attaches hooks
at the sites the registered plans need (none when no plan is registered, so plain requests pay
nothing); `vllm-static` fills and reads the tap buffers its loader installed (vllm_loader). Under
tensor parallelism every rank runs the same steps: sharded points (heads, MLP neurons) are captured
and steered per rank on the indices it holds, replicated ones on rank 0 only; the client gathers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from engine.backends.vllm.worker import attn as vllm_attn
from engine.backends.vllm.worker import kv, seams
from engine.backends.vllm.worker import runner as vllm_runner
from engine.backends.vllm.worker import wire as vllm_wire
from engine.backends.vllm.worker.hooks import HookSites
from engine.backends.vllm.worker.loader import ERRORS_ATTR, TAPS_ATTR
from engine.backends.vllm.worker.meters import COLLECT, REGISTER, STEP, Meters
from engine.backends.vllm.worker.rows import PLAN_ARG, ROWS
from engine.backends.vllm.worker.tree import resolve, tree_for
from engine.core.address import Address, parse
from engine.core.errors import SteeringError, UnsupportedPointError
from engine.core.ledger import GUARD, Ledger
from engine.core.plan import Plan, Span, site_work
from engine.core.points import POINTS
from engine.core.readouts import Env, bind, parts_of
from engine.core.steering import Steer, failure
from engine.core.step import Step, one_on

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from engine.backends.vllm.worker.tree import VSite


def _failed(plan: Plan, exc: BaseException) -> None:
    """A request's own failure inside the forward: kept for its collect, never raised into vLLM
    (an exception there kills the engine core and every other request with it)."""
    plan.error = vllm_wire.Failure.of(exc)


def _rows_from(chunks: list, start: int):
    """The rows of (first position, rows) chunks from absolute position `start` up to the first gap."""
    parts, at = [], start
    for p, c in chunks:
        if p + c.shape[0] <= at:
            continue
        if p > at:
            break
        parts.append(c[at - p:])
        at = p + c.shape[0]
    return torch.cat(parts) if parts else None


class WorkerState:
    """What one rank holds: the registered plans, the sites they need and the current step."""

    def __init__(self, runner: GPUModelRunner, backend: str) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        self.runner, self.backend = runner, backend
        self.model = runner.get_model()
        cfg = runner.model_config.hf_config
        self.config = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.tree = tree_for(self.model, self.config)
        self.rank, self.tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        taps = getattr(self.model, TAPS_ATTR, None)  # installed by the interp_static loader (vllm-static)
        self.mode = HookSites(self) if taps is None else taps
        self.plans: dict[str, Plan] = {}
        self.ledger = Ledger(unique=False)  # what every registered plan's steers did, read at collect
        self.device = next(self.model.parameters()).device
        self.work: dict = {}
        self.sites: dict = {}  # (point, layer) -> VSite, one object per module slot
        self.handles: list = []
        self.step: Step | None = None
        self.last: Step | None = None  # the step before, while the registered plans stay: rows carry from it
        self.meters = Meters()  # host reads, ops and host time of the steps, while the client asks
        self.end_module = self.end_handle = None
        # the KV blocks steering requests wrote, zeroed before a schedule hands one to another request
        self.blocks = kv.Blocks(runner)
        if not seams.wrap_execute_model(runner, self.scheduled):
            raise RuntimeError(f"{type(runner).__name__} has no execute_model: the engine cannot see which KV blocks a "
                               f"schedule hands on, so it cannot keep a steering request's KV entries from others")
        if seams.wrap_model_forward(runner, self._begin, self._end):
            self.positions_at, self.anchor_error = 0, None
        else:
            begin, self.end_module, self.positions_at, self.anchor_error = seams.step_anchors(self.model, self.tree)
            begin.register_forward_pre_hook(self._begin, with_kwargs=True)  # before any site's pre-hook
            self.end_handle = self.end_module.register_forward_hook(self._end)

    # -- sites ------------------------------------------------------------------------------------
    def site(self, addr: Address) -> VSite:
        key = (addr.point, addr.layer)
        if key not in self.sites:
            s = resolve(self.model, self.tree, addr.point, addr.layer, self.rank, self.tp)
            same = next((o for o in self.sites.values() if o.key == s.key), None)
            self.sites[key] = same or s
        return self.sites[key]

    def _site_key(self, addr: Address):
        return self.mode.site_key(addr)

    def _local_read(self, plan: Plan, addr: Address):
        """(capture key, local coordinate) this rank records for addr, or None."""
        held = self.site(addr.base).held
        coord = addr.coords[0][1] if addr.coords else None
        if held is None:  # replicated: rank 0 records it (every rank for the engine's own logits rows)
            return (str(addr), coord) if self.rank == 0 or addr in plan.internal else None
        if coord is None:
            return str(addr), None
        return (str(addr), held.index(coord)) if coord in held else None  # coordinates arrive non-negative

    def _local_steer(self, st):
        held = self.site(st.address.base).held
        if held is None:
            return st
        if st.address.coords:
            (name, h), = st.address.coords
            if h not in held:
                return None
            local = Address(st.address.point, st.address.layer, **{name: held.index(h)})
            return st.at(local)  # every field kept (coeff, bounds, exclude, lead): only the head is local
        st = st.bound()
        v = st.value
        if v is None or v.dim() <= st.lead:  # no value, or a scalar scale
            return st
        return st.at(st.address, v.index_select(st.lead, torch.tensor(held, device=v.device)))

    def _local_readout(self, readout) -> bool:
        """Whether this rank computes a readout: rank 0 (the client refuses readouts at sharded points
        and lens readouts under tensor parallelism, so rank 0 holds every row they read)."""
        return self.rank == 0

    def _env(self) -> Env:
        return Env(lens=self._lens_rows, sae=self._load_sae)

    def _lens_rows(self, x: torch.Tensor, point: str) -> torch.Tensor:
        """Logits of [n, d] rows inside a step through vLLM's own final norm and head; the hooks stand
        aside (no step) while they run, and a vllm-static final_norm tap is bypassed (its original
        forward), so no capture or tap steer ever sees these rows."""
        step, self.step = self.step, None
        try:
            h = x.to(self.runner.model_config.dtype)
            if point != "final_norm":
                norm = self.site(Address("final_norm")).module
                h = (self.mode.original_forward("final_norm") or norm)(h)
                h = h[0] if isinstance(h, tuple) else h
            return self.model.compute_logits(h)
        finally:
            self.step = step

    def _load_sae(self, path: str):
        """An SAE directory loaded once per worker, on the model's device (then cached: requests name it
        by path and never ship its weights)."""
        from engine.core.sae_store import sae_for
        return sae_for(path, next(self.model.parameters()).device)

    def _reports(self, st) -> bool:
        """Whether this rank's receipt of a steer counts: a replicated point is steered alike on every
        rank (rank 0 reports), a sharded one on the ranks holding its indices (each its part)."""
        held = self.site(st.address.base).held
        if held is None:
            return self.rank == 0
        return not st.address.coords or st.address.coords[0][1] in held

    def _rebuild(self) -> None:
        """Recompute what every site does for the registered plans; reattach hooks (`vllm`)."""
        plans = list(self.plans.values())
        self.last = None  # its rows are keyed by the groups being replaced
        self.work = site_work(plans, self._site_key, self._local_read, self._local_steer, self._local_readout)
        for h in self.handles:
            h.remove()
        self.handles = self.mode.attach(self.work)
        if self.end_handle is not None:  # after every site's hook, where the end module is also a site
            self.end_handle.remove()
            self.end_handle = self.end_module.register_forward_hook(self._end)

    # -- steps ------------------------------------------------------------------------------------
    def _begin(self, module, args, kwargs):
        self.step = None
        mine = [(i, self.plans[k]) for i, k in ROWS.items() if k in self.plans] if self.plans and ROWS else []
        if not mine:  # a forward without a step of ours: nothing a finished step wrote may apply to it
            self.mode.idle()
            return
        self.meters.begin()  # counted from here to the end of the step (_end)
        try:
            with self.meters.window(STEP):  # the forward itself runs outside the window
                self._start_step(mine, args, kwargs)
        except Exception as e:  # the step's plans fail; the engine serves on
            for _, plan in mine:
                _failed(plan, e)
            self.step = None

    def _start_step(self, mine, args, kwargs):
        positions = kwargs["positions"] if "positions" in kwargs else args[self.positions_at]
        flat = positions[0] if positions.dim() == 2 else positions  # M-RoPE: [3, tokens]
        host = seams.host_rows(self.runner, [i for i, _ in mine])
        if host is None:  # no host copies in this runner: read them from the device (two syncs)
            from vllm.forward_context import get_forward_context
            qsl = seams.query_start_loc(get_forward_context())
            starts = flat[torch.tensor([qsl[i] for i, _ in mine], device=flat.device)].tolist()
        else:
            qsl, starts = host
        spans = [Span(plan, qsl[i], qsl[i + 1], int(p0), i) for (i, plan), p0 in zip(mine, starts)
                 if qsl[i + 1] > qsl[i]]
        n = int(flat.shape[0])
        self.step = Step(spans, n, self.device, self.ledger, sanitize=True, on_error=_failed,
                         prev=one_on(self.last, spans, n))
        self.mode.before(self.step, self.work)

    def _end(self, module, args, output):
        try:
            if self.step is not None:
                with self.meters.window(STEP):
                    self.blocks.guarded_mark(self.step)  # first: the KV isolation never waits on the rest
                    self.mode.after(self.step, self.work)
        except Exception as e:
            for sp in self.step.spans:
                _failed(sp.plan, e)
        finally:
            self.meters.end()
        if self.step is not None:  # done building: it no longer needs the step before (kept, each step
            self.step.prev = None  # would hold every earlier one, its rows and values, until a rebuild)
        self.last, self.step = self.step, None

    # -- requests ---------------------------------------------------------------------------------
    def scheduled(self, scheduler_output: Any) -> None:
        """Before the runner takes a schedule: register the plans its new requests carry (PLAN_ARG in
        their SamplingParams' extra_args), then hand KV blocks on (kv.Blocks.reclaim)."""
        with self.meters.window(REGISTER):
            try:
                self._register_carried(scheduler_output)
            finally:
                self.blocks.reclaim(scheduler_output)

    def _register_carried(self, scheduler_output: Any) -> None:
        wires = []
        for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            args = getattr(getattr(req, "sampling_params", None), "extra_args", None) or {}
            d = args.get(PLAN_ARG)
            if isinstance(d, dict) and d.get("key") not in self.plans:
                wires.append(d)
        if wires:
            self.register(wires)

    def register(self, plans: list[dict]) -> None:
        """Add plans (wire form) and rebuild the sites once. A plan that does not decode or bind fails
        its own request at collect; nothing is raised into vLLM's step (that ends the engine)."""
        for d in plans:
            try:
                plan = self._admit(d)
            except Exception as e:  # noqa: BLE001  (kept for its collect, naming why)
                plan = Plan(0, key=d.get("key"))
                _failed(plan, e)
            self.plans[plan.key] = plan
        try:
            self._rebuild()
        except Exception as e:  # noqa: BLE001  (the sites could not be attached: every plan's request fails with it)
            for plan in self.plans.values():
                _failed(plan, e)

    def _admit(self, d: dict) -> Plan:
        """One plan from its wire form, its steer values on the model's device, its readouts bound."""
        plan = vllm_wire.plan_in(d)
        plan.steers = [self._local_steer_of(st) for st in plan.steers]
        if plan.readouts:
            try:
                plan.accumulators = bind(plan.readouts, self._env())
            except Exception as e:  # the request's own failure (an SAE that does not load): kept for collect
                _failed(plan, e)
        return plan

    def _local_steer_of(self, st: Steer) -> Steer:
        """A wire steer as the steps use it: its value on the model's device (values arrive on the CPU; the
        steered rows, and vllm-static's receipt replay, are there), its leading axes known once (Steer.bound:
        each step's checks would otherwise copy the steer again, at every site). A value bound refuses stays
        unbound: its first step fails its plan, naming it, as before."""
        if isinstance(st.value, torch.Tensor):
            st = st.at(st.address, st.value.to(self.device))
        try:
            return st.bound()
        except SteeringError:
            return st

    def collect(self, keys: list[str], logits: list[bool],
                encode: Callable[[torch.Tensor], dict] = vllm_wire.tensor_out) -> list[dict]:
        """Each plan's CollectReply (its captures, logits, readouts, receipts, or its failure), as plain
        data, and forget the plan (tensors go out through `encode`: inline bytes, or vllm_sink's
        shared-memory files)."""
        with self.meters.window(COLLECT):
            return self._collect(keys, logits, encode)

    def _collect(self, keys: list[str], logits: list[bool], encode: Callable[[torch.Tensor], dict]) -> list[dict]:
        out = []
        mine = [self.plans[k] for k in keys if k in self.plans]
        outcomes = self.ledger.read([p.key for p in mine]) if self.ledger else {}  # the one read
        self.ledger.drop([p.key for p in mine])
        dtype = self.runner.model_config.dtype
        for key, want_logits in zip(keys, logits):
            plan = self.plans.pop(key, None)
            if plan is None:
                out.append(vllm_wire.CollectReply(key, lost=f"plan {key} is not registered on rank {self.rank}").out())
                continue
            res = vllm_wire.CollectReply(key, recomputed=plan.recomputed)
            outcome = outcomes.get(plan.key)
            if plan.error is None and outcome is not None and outcome.failed is not None:
                st = None if outcome.failed == GUARD else plan.steers[outcome.failed]
                plan.error = vllm_wire.Failure.of(failure(st, dtype, plan.steers))
            if isinstance(plan.error, vllm_wire.Failure):
                res.failed = plan.error
            else:
                res.receipts = [r for r in plan.receipts(outcome) if self._reports(plan.steers[r.index])]
            if plan.accumulators and plan.error is None and self._local_readout(None):
                res.readouts = {}
                for name, acc in plan.accumulators.items():
                    try:
                        res.readouts[name] = vllm_wire.encode(list(parts_of(acc.result())))
                    except RuntimeError as e:
                        res.errors[name] = vllm_wire.Failure.of(e)
            # final_norm read only for the logits made here: the client never reads it (sent as a file, it was
            # left in /dev/shm), so it is not encoded below, nor are the keys a stack carries
            for_logits = want_logits and Address("final_norm") not in plan.captures
            skip = {"final_norm"} if for_logits else set()
            for index, first, rows in plan.stacked():  # vllm-static: a request's every layer as one tensor
                res.stacks.append(encode(rows))
                for k, j in index.items():
                    res.captures[k] = [first, {vllm_wire.STACK: len(res.stacks) - 1, "index": j}]
                    skip.add(k)
            for k in plan.store:
                if k not in skip:
                    try:
                        first = plan.first(k)
                        res.captures[k] = [first, encode(plan.tensor(k, first))]
                    except RuntimeError as e:
                        res.errors[k] = vllm_wire.Failure.of(e)
                held = self.site(parse(k).base).held
                if held is not None:
                    res.held[k] = held
            if want_logits and plan.error is None and "final_norm" in plan.store and "final_norm" not in res.errors:
                try:
                    logits_rows = self.logits(plan.tensor("final_norm", plan.first("final_norm")), apply_norm=False)
                except RuntimeError as e:
                    res.errors["final_norm"] = vllm_wire.Failure.of(e)
                else:
                    if self.rank == 0:
                        res.logits = vllm_wire.tensor_out(logits_rows)
                        res.logits_from = plan.first("final_norm")
                if for_logits:
                    res.captures.pop("final_norm", None)
            out.append(res.out())
        self._rebuild()
        return out

    def peek(self, keys: list[str], since: list[dict], readouts: list[dict] | None = None) -> list[dict]:
        """Each plan's PeekReply: its capture rows from the given absolute positions on ({capture key:
        position}) and its per-position readouts' rows likewise ({readout name: position}), keeping the
        plan: what a streaming client reads while its request runs."""
        out = []
        for i, (key, starts) in enumerate(zip(keys, since)):
            plan = self.plans.get(key)
            if plan is not None:
                plan.settle()  # vllm-static's blocks filed under their keys
            res = vllm_wire.PeekReply(key)
            ok = plan is not None and plan.error is None
            for name, start in ((readouts[i] if readouts else {}).items() if ok else ()):
                acc = plan.accumulators.get(name)
                parts = acc.rows_from(start) if acc is not None and self._local_readout(None) else None
                if parts is not None:
                    res.readouts[name] = [start, vllm_wire.encode(list(parts))]
            for k, start in (starts.items() if ok else ()):
                rows = _rows_from(plan.store.get(k) or [], start)
                if rows is not None:
                    res.captures[k] = [start, vllm_wire.tensor_out(rows)]
                    held = self.site(parse(k).base).held
                    if held is not None:
                        res.held[k] = held
            out.append(res.out())
        return out

    def logits(self, x: torch.Tensor, apply_norm: bool) -> torch.Tensor:
        """Logits of [n, d] residual rows through vLLM's own final norm and head (all ranks call it)."""
        with torch.no_grad():
            h = x.to(next(self.model.parameters()).device, self.runner.model_config.dtype)
            if apply_norm:
                h = self.site(Address("final_norm")).module(h)
                h = h[0] if isinstance(h, tuple) else h
            out = self.model.compute_logits(h)
        return None if out is None else out.float().cpu()

    # -- what this rank serves -------------------------------------------------------------------
    def describe(self) -> dict:
        """Per point and layer: served (local per-token shape, held indices, capture-only reason) or
        the reason it is not; plus each attention layer's parameters for the recompute of patterns."""
        from engine.backends.vllm.worker.static import width_of
        cfg = self.config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        points, attn = {}, {}
        for p in POINTS:
            layers = [None] if p.scope == "trunk" else range(len(self.layers()))
            entry = points.setdefault(p.name, {})
            for layer in layers:
                addr = Address(p.name, layer)
                try:
                    site = self.site(addr)
                except UnsupportedPointError as e:
                    entry[str(layer)] = {"why": str(e)}
                    continue
                width = width_of(site, p.name, cfg.hidden_size)
                shape = [width // hd, hd] if p.headed else [width]
                info = {"shape": shape, "held": site.held, "write_refused": site.write_refused}
                self.mode.describe(addr, info)
                entry[str(layer)] = info
                if p.name == "q":
                    attn[str(layer)] = vllm_attn.params(site.module)
        import os
        return {"rank": self.rank, "tp": self.tp, "pid": os.getpid(), "n_layers": len(self.layers()),
                "model_class": type(self.model).__name__, "points": points, "attn": attn,
                "tap_bytes": self.mode.nbytes,
                "tap_errors": getattr(self.model, ERRORS_ATTR, {}), "anchor_error": self.anchor_error}

    def layers(self) -> list:
        """The decoder layers, in order (the layer guard's, and describe's count)."""
        from engine.model.paths import get_path
        return get_path(self.model, self.tree.layers)


class InterpWorker:
    """Mixed into vLLM's Worker (`worker_extension_cls`): the engine's collective_rpc endpoints."""

    def interp_setup(self, backend: str) -> dict:
        runner = vllm_runner.runner_kind(self.model_runner)
        if runner != "v1":  # refused by the client (vllm_runner.check) before anything is installed
            return {"runner": runner}
        self._interp = WorkerState(self.model_runner, backend)
        return {**self._interp.describe(), "runner": runner}

    def interp_syncs(self, on: bool) -> dict:
        """Count the engine's host reads inside this rank's steps (tests: at most 2 per step)."""
        return self._interp.meters.count_syncs(on)

    def interp_ops(self, on: bool) -> dict:
        """Count the ops this rank dispatches around its steps (tests: a small constant per step)."""
        return self._interp.meters.count_ops(on)

    def interp_timing(self, on: bool) -> dict:
        """Time the host work this rank does around its steps (benchmarks/step_cost.py)."""
        return self._interp.meters.time_steps(on)

    def interp_plans(self) -> list:
        """Keys of the plans this rank holds (registered, not collected yet)."""
        return list(self._interp.plans)

    def interp_collect(self, keys: list, logits: list) -> list:
        return self._interp.collect(keys, logits)

    def interp_collect_to(self, keys: list, logits: list, directory: str) -> list:
        """interp_collect, with the capture rows written to files under `directory` (vllm_sink)."""
        from engine.backends.vllm.worker import sink as vllm_sink
        return self._interp.collect(keys, logits, vllm_sink.encoder(directory, vllm_wire.tensor_out))


    def interp_peek(self, keys: list, since: list, readouts: list | None = None) -> list:
        return self._interp.peek(keys, since, readouts)

    def interp_lens(self, x: dict, apply_norm: bool) -> dict | None:
        out = self._interp.logits(vllm_wire.tensor_in(x), apply_norm)
        return vllm_wire.tensor_out(out) if self._interp.rank == 0 else None
