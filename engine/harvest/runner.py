"""One part of a harvest: read, batch, forward, fill shards, hand them to the writer, resume.

The forward loop never touches the disk: full shards go to the writer thread (shards.py) through a
bounded queue, so memory holds at most the queued shards, the one being filled and one batch,
whatever the size of the dataset.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from engine.core import DISTRIBUTION
from engine.core.backends import VLLM, backend_for
from engine.core.errors import OptionError
from engine.core.files import remove_temps
from engine.harvest import batches, capture, inputs
from engine.harvest import manifest as mf
from engine.harvest.priority import ThreadCPU, forward_threads, spare_pays
from engine.harvest.settings import MODEL_DTYPES, Flow, HarvestSettings  # noqa: F401  (MODEL_DTYPES, Flow: importable here)
from engine.harvest.shards import INDEX_COLUMNS, Pending, ShardBuffer, ShardWriter, WriterStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.backends.hf.eager import EagerModel
    from engine.backends.vllm.backend import VLLMModel

log = logging.getLogger("engine.harvest")
VLLM_BATCH_TOKENS = VLLM.batch_tokens  # a vLLM harvest's default tokens per batch (benchmarks read it here)
_PROBE = "Harvest probe: tokenizer identity, 0123456789 \u00e9\u00e8 \u4e2d\u6587 \n\t end."
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
    for dist in (DISTRIBUTION, "torch", "transformers", "safetensors") + backend_for(backend).runtime.dists:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    if DISTRIBUTION not in out:  # running from a checkout
        import tomllib
        pp = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if pp.is_file():
            out[DISTRIBUTION] = tomllib.loads(pp.read_text())["project"]["version"]
    return out


def _requested(points: str | Iterable[str]) -> list[str]:
    return [p.strip() for p in (points.split(",") if isinstance(points, str) else points) if str(p).strip()]


def load(name: str, s: HarvestSettings, points: list[str]) -> EagerModel | VLLMModel:
    """Load the model for harvesting: sized for 1-token requests of up to `context` tokens where the
    backend is sized, declaring exactly the harvested points where it declares taps; the caller's
    load_kw wins."""
    from engine import load_model
    spec = backend_for(s.backend)
    sizes = spec.load_kw(max_model_len=s.context + 1,
                         max_num_seqs=max(1, min(64, s.tokens_per_batch // max(1, min(s.context, 64)))),
                         static_points=capture.static_points(points) if spec.declares else None)
    return load_model(name, backend=s.backend, dtype=getattr(torch, s.model_dtype_name), **{**sizes, **(s.load_kw or {})})


def load_for(model: str, points: str | Iterable[str], data: Any = None, out: Any = None,
             **options: Any) -> EagerModel | VLLMModel:
    """The model run_part would load for these harvest options (a Ray actor loads it once and runs
    many parts on it); every option is checked, and the ones that do not shape the load (data and
    out among them) are unused here."""
    return load(model, HarvestSettings.of(model, **options), _requested(points))


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
             out: str | os.PathLike[str], settings: HarvestSettings | None = None, **options: Any) -> Summary:
    """Harvest part `part` = (i, N) of the input into OUT (see engine.harvest for the layout).
    The options (engine/harvest/settings.py), as `settings` or as keywords: backend, positions,
    shard_tokens, dtype, context, batch_tokens, part, text_field, model_dtype, progress, load_kw,
    merge, flow, readouts, spare_threads.
    `spare_threads` (eager on CPU): intra-op threads the forward leaves to the reader and writer, which
    pays on many cores with a small model (engine/harvest/priority.py; the summary's spare_would_pay
    says when) and can change the rows' last bits, so it is part of the harvest's identity.
    `readouts` (engine.core.readouts.Readout, per-position kinds) are stored instead of (or beside)
    raw rows: a column per readout (`name`, or `name.indices` / `name.values` for top-k ones).
    `model` is a name (loaded here, closed at the end) or an already loaded model (its backend and
    dtype are the harvest's). progress: a bar, or a function called with each batch's token count (a
    driver's one bar for many parts)."""
    if settings is not None and options:
        raise OptionError(f"give the harvest options as HarvestSettings or as keywords, not both (got {sorted(options)}).")
    if settings is None:
        s = HarvestSettings.of(model, **options)
    elif isinstance(model, str):
        s = settings
    else:  # a loaded model's own backend and dtype
        s = dataclasses.replace(settings, backend=model.backend, model_dtype=str(model.dtype).removeprefix("torch."))
    name = model if isinstance(model, str) else model.name
    requested = _requested(points)
    src = inputs.open_source(data, s.text_field)
    total_docs = inputs.count_documents(src)
    if total_docs == 0:
        raise inputs.InputError(f"input {str(src.root)!r} is empty: no documents to harvest.")
    out = Path(out)
    part = s.part
    identity = {"format": mf.FORMAT, "model": name, "backend": s.backend, "model_dtype": s.model_dtype_name,
                "points": requested, "dtype": s.dtype, "positions": s.positions, "context": s.context,
                "shard_tokens": s.shard_tokens, "batch_tokens": s.tokens_per_batch, "parts": part[1],
                "input": {k: v for k, v in src.describe().items() if k != "path"}}
    reads = list(s.readouts)
    if reads:  # part of the harvest's identity (a resume with other readouts is refused)
        identity["readouts"] = [f"{r.name}={r.address}:{r.kind.describe()}" for r in reads]
    if s.spare_threads:  # only when set: the identities of earlier harvests stay what they were
        identity["spare_threads"] = s.spare_threads
    if mf.check_out(out, identity) is not None:
        log.info("%s already holds this finished harvest; nothing to do.", out)
        return Summary(out, part, "complete", merged=True)
    pdir = mf.part_dir(out, *part)
    if (pdir / mf.PART).is_file() and mf.read(pdir / mf.PART)["complete"]:
        merged = mf.merge(out) is not None
        return Summary(out, part, "complete", merged=merged)

    owned = isinstance(model, str)
    if isinstance(model, str):
        model = load(name, s, requested + [str(r.address) for r in reads])
    try:
        if s.spare_threads and model.device.type != "cpu":
            raise OptionError(f"spare_threads leaves CPU threads of the forward to the reader and writer; this "
                              f"model runs on {model.device}. Drop spare_threads.")
        reads = capture.readouts_of(model, reads)
        keys = capture.addresses(model, requested) if requested or not reads else []
        resolved = {"source": getattr(model, "source", "unknown"), "addresses": keys,
                    "tokenizer": tokenizer_digest(model.tokenizer), "n_layers": model.n_layers,
                    "d_model": model.d_model}
        if reads:
            resolved["readouts"] = capture.readout_columns(reads)
        info = {"data_path": str(src.root), "engine": engine_versions(s.backend)}
        pdir.mkdir(parents=True, exist_ok=True)
        with mf.exclusive(pdir):
            manifest = mf.PartManifest.open(pdir, identity, resolved, info)
            remove_temps(pdir)
            with sink_dir(model, s.flow) as sink, forward_threads(s.spare_threads) as spared:
                return _loop(model, s, keys, src, out, manifest, total_docs, sink, reads, spared)
    finally:
        if owned and hasattr(model, "close"):  # eager models hold no engine
            model.close()


def _loop(model: EagerModel | VLLMModel, s: HarvestSettings, keys: list[str], src: inputs.Source, out: Path,
          manifest: mf.PartManifest, total_docs: int | None, sink: str | None, reads: tuple | list = (),
          spared: int = 0) -> Summary:
    part, positions, flow, progress = s.part, s.positions, s.flow, s.progress
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
    stream = batches.prefetch(batches.pack(batches.windows(docs, tok, s.context, positions, start),
                                           s.tokens_per_batch), nice=flow.nice, cpu=reader_cpu)
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
                cols = _columns(rows, s.store_dtype)
                held = manifest.data.get("columns")
                want = {k: {"shape": list(shape), "dtype": str(d).replace("torch.", "")} for k, (shape, d) in cols.items()}
                if held is not None and held != want:
                    raise mf.MixingError(f"{manifest.directory}: the columns changed ({held} vs {want}).")
                manifest.data["columns"] = want
                buf = ShardBuffer(s.shard_tokens, cols)
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
                    buf = ShardBuffer(s.shard_tokens, cols)
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
    if s.merge:
        summary.merged = mf.merge(out) is not None
    log.info("part %d/%d: %d rows in %d shards, %.0f tokens/s", i, of, summary.rows, summary.shards,
             summary.tokens_per_s)
    return summary
