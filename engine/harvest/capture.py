"""The one place where the harvester touches the model: a batch of token windows in, per-window
activations out. Everything else is backend-agnostic, so moving to another capture API (the
planned `await model.capture(...)`) changes `forward` and nothing else."""
from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, TypeGuard, cast

import torch

from engine.core.address import Address
from engine.core.backends import VLLM, backend_for
from engine.core.errors import PointError
from engine.core.points import get_point

if TYPE_CHECKING:
    from engine.backends.hf.eager import EagerModel
    from engine.backends.vllm.backend import VLLMModel
    from engine.core.readouts import Readout
    from engine.harvest.batches import Batch


def addresses(model: EagerModel | VLLMModel, points: str | Iterable[str | Address]) -> list[str]:
    """Resolved address strings for `points` (bare names expand to every layer), checked against
    the loaded model; points whose width grows with the position are refused by name."""
    if isinstance(points, str):
        points = [p for p in points.split(",") if p.strip()]
    if not points:
        raise PointError("no points given; name at least one, e.g. 'resid_post.-1,mlp_out.0'.")
    out = []
    for a in model.expand([p.strip() if isinstance(p, str) else p for p in points]):
        if "kpos" in get_point(a.point).shape:
            raise PointError(f"{a} cannot be harvested: its width grows with the position (one score per "
                             f"key); harvest q.{a.layer} and k.{a.layer} instead and recompute it.")
        out.append(str(a))
    return out


def static_points(points: Iterable[str]) -> list[str]:
    """What a vllm-static engine must declare at load to serve `points` (whole points, no coordinates;
    negative layers and bare names are resolved by the backend)."""
    from engine.core.address import parse
    from engine.core.points import ALIASES, BY_NAME
    out = []
    for p in points:
        p = p.strip()
        if "." not in p and (p in BY_NAME or p in ALIASES):
            out.append(p)
        else:
            a = parse(p)
            out.append(str(Address(a.point, a.layer)))
    return list(dict.fromkeys(out))


def per_document(cache: Mapping[str, torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]],
                 lengths: list[int], keys: list[str]) -> list[dict[str, torch.Tensor]]:
    """Per-window {address: [pos, ...]} from a capture that is either a right-padded [b, pos, ...]
    tensor (eager's forward) or a list of [pos, ...] tensors per key (vLLM's per-request results)."""
    out: list[dict] = [{} for _ in lengths]
    for key in keys:
        value = cache[key]
        for i, n in enumerate(lengths):
            t = value[i] if isinstance(value, (list, tuple)) else value[i, :n]
            if t.shape[0] != n:
                raise RuntimeError(f"{key}: window {i} came back with {t.shape[0]} positions, expected {n}.")
            out[i][key] = t
    return out


def readouts_of(model: EagerModel | VLLMModel, readouts: Iterable[Readout]) -> list[Readout]:
    """Readouts checked for a harvest: per-position kinds only (one row per token, like a point),
    checked against the model."""
    from engine.core.readouts import KINDS, Kind, ReadoutError, validate_readouts
    out = []
    for r in validate_readouts(readouts):
        if not r.kind.per_position:
            kinds = ", ".join(n for n, k in KINDS.items() if issubclass(k, Kind) and k.per_position)
            raise ReadoutError(f"readout {r.name!r} is reduced over positions; a harvest stores one row per token "
                               f"({kinds}).")
        out.append(r)
    return out


def readout_columns(readouts: list) -> list[str]:
    """The shard columns of per-position readouts: `name` for a dense one, `name.indices` and
    `name.values` for a sparse one (top-k SAE features, lens top-k)."""
    return [c for r in readouts for c in ((f"{r.name}.indices", f"{r.name}.values") if r.kind.sparse else (r.name,))]


def _readout_rows(values: dict, lengths: list[int], readouts: list, out: list[dict]) -> None:
    """Each window's readout columns [pos, ...] into `out` (values: name -> a [b, pos, ...] tensor or
    TopK, right-padded, or a list of per-window values)."""
    from engine.core.readouts import parts_of
    for r in readouts:
        v = values[r.name]
        names = readout_columns([r])
        for i, n in enumerate(lengths):
            one = v[i] if isinstance(v, list) else None
            parts = parts_of(one) if one is not None else tuple(t[i, :n] for t in parts_of(v))
            for name, t in zip(names, parts):
                out[i][name] = t.cpu()


def is_vllm(model: EagerModel | VLLMModel) -> TypeGuard[VLLMModel]:
    """The model runs on a vLLM engine (its backend's runtime, engine/core/backends.py)."""
    return backend_for(model.backend).runtime is VLLM


def forward(model: EagerModel | VLLMModel, windows: list[list[int]], keys: list[str], sink: str | None = None,
            readouts: tuple | list = ()) -> list[dict[str, torch.Tensor]]:
    """Forward a batch of token windows; per window {address: [pos, ...] CPU tensor}.
    vLLM: one continuous batch (a 1-token request per window, no logits), the rows handed over
    through files in the shared-memory directory `sink` when given (else inline in the RPC reply);
    eager: one padded forward."""
    lengths = [len(w) for w in windows]
    if is_vllm(model):
        from engine.backends.vllm.backend import Request
        results = model.generate_batch([Request(list(w), 1, points=keys, readouts=list(readouts)) for w in windows],
                                       return_logits=False, sink=sink)
        cache = {k: [r.cache[k] for r in results] for k in keys}
        docs = per_document(cache, lengths, keys)
        _readout_rows({r.name: [res.cache.readouts[r.name] for res in results] for r in readouts}, lengths,
                      list(readouts), docs)
        return docs
    model = cast("EagerModel", model)
    n = max(lengths)
    ids = torch.zeros(len(windows), n, dtype=torch.long)
    mask = torch.zeros(len(windows), n, dtype=torch.long)
    for i, w in enumerate(windows):
        ids[i, :len(w)] = torch.tensor(w, dtype=torch.long)
        mask[i, :len(w)] = 1
    _, cache = model.run_with_cache({"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)},
                                    keys, readouts=list(readouts), stop_at_layer=stop_layer(model, keys, readouts))
    docs = per_document({k: cache[k].cpu() for k in keys}, lengths, keys)
    _readout_rows(cache.readouts, lengths, list(readouts), docs)
    return docs


def stop_layer(model: EagerModel, keys: list[str], readouts: tuple | list = ()) -> int | None:
    """Where an eager harvest's forward may stop: after the last block it reads (the final norm and
    the unembedding never run: nothing stored depends on them), or None when it reads past the blocks."""
    from engine.backends.hf.stop import earliest_stop
    from engine.core.address import parse
    addrs = [parse(k) for k in keys] + [parse(r.address) for r in readouts]
    return earliest_stop(addrs, model.n_layers, model.family) if addrs else None


def pipelined(model: EagerModel | VLLMModel, stream: Iterable[Batch], keys: list[str], depth: int,
              sink: str | None = None, readouts: tuple | list = ()) -> Iterator[tuple]:
    """(batch, forward(batch), seconds waited for it) for each batch of `stream`, in order, with up to
    `depth` batches in the engine at once: vLLM computes the next batch while this process stores
    the last one (depth 1: one after another, as eager runs)."""
    if depth <= 1:
        for batch in stream:
            t = time.perf_counter()
            outs = forward(model, [w.ids for w in batch.windows], keys, sink, readouts)
            yield batch, outs, time.perf_counter() - t
        return
    from concurrent.futures import ThreadPoolExecutor
    pending: collections.deque = collections.deque()
    with ThreadPoolExecutor(depth, thread_name_prefix="harvest-forward") as pool:
        try:
            for batch in stream:
                pending.append((batch, pool.submit(forward, model, [w.ids for w in batch.windows], keys, sink,
                                                   readouts)))
                if len(pending) >= depth:
                    yield _done(pending.popleft())
            while pending:
                yield _done(pending.popleft())
        finally:
            for _, fut in pending:
                fut.cancel()


def _done(item) -> tuple:
    batch, fut = item
    t = time.perf_counter()
    outs = fut.result()
    return batch, outs, time.perf_counter() - t
