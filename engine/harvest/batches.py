"""From documents to forward batches: tokenize, cut into context windows, pack windows into batches.

Packing is greedy and memoryless, so a batch boundary depends only on the window stream from that
point on. That is what makes resuming exact: restarting at a recorded batch start (a `Cursor`)
rebuilds the very batches of the uninterrupted run, and a backend that computes the same batch the
same way writes the same bytes.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, NamedTuple

from engine.harvest.priority import ThreadCPU, lower_this_thread

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

POSITIONS = ("all", "last")


class Cursor(NamedTuple):
    """A place in the window stream: document index and window index within it (a window index
    past the document's last window means 'the next document')."""
    doc: int
    window: int


@dataclass(frozen=True)
class Window:
    """Tokens forwarded together as one sequence; `start` is the position in the document of ids[0]."""
    doc: int
    index: int
    start: int
    ids: list[int]


@dataclass(frozen=True)
class Batch:
    windows: list[Window]
    start: Cursor  # the first window
    end: Cursor  # just past the last window

    @property
    def tokens(self) -> int:
        return sum(len(w.ids) for w in self.windows)


def windows(docs: Iterable[tuple[int, str]], tokenizer: PreTrainedTokenizerBase, context: int, positions: str = "all",
            start: Cursor = Cursor(0, 0), chunk: int = 64) -> Iterator[Window]:
    """Windows of each document. positions='all': consecutive non-overlapping windows of `context`
    tokens (a long document's later windows start without its earlier context); positions='last':
    one window, the document's last `context` tokens (the last token with the most context)."""
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}.")
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}.")
    pending: list[tuple[int, str]] = []

    def flush():
        enc = tokenizer([t for _, t in pending])["input_ids"]
        for (doc, _), ids in zip(pending, enc):
            ids = list(ids)
            if not ids:
                continue
            if positions == "last":
                spans = [(0, max(0, len(ids) - context))]
            else:
                spans = list(enumerate(range(0, len(ids), context)))
            for w, s in spans:
                if (doc, w) >= start:
                    yield Window(doc, w, s, ids[s:s + context])
        pending.clear()

    for doc, text in docs:
        if doc < start.doc or not text:
            continue
        pending.append((doc, text))
        if len(pending) >= chunk:
            yield from flush()
    if pending:
        yield from flush()


def pack(stream: Iterable[Window], batch_tokens: int) -> Iterator[Batch]:
    """Greedy batches of whole windows holding at most batch_tokens tokens."""
    cur: list[Window] = []
    n = 0
    for w in stream:
        if len(w.ids) > batch_tokens:
            raise ValueError(f"a {len(w.ids)}-token window does not fit batch_tokens={batch_tokens}; "
                             f"raise batch_tokens to at least the context length.")
        if cur and n + len(w.ids) > batch_tokens:
            yield _batch(cur)
            cur, n = [], 0
        cur.append(w)
        n += len(w.ids)
    if cur:
        yield _batch(cur)


def _batch(ws: list[Window]) -> Batch:
    return Batch(list(ws), Cursor(ws[0].doc, ws[0].index), Cursor(ws[-1].doc, ws[-1].index + 1))


def prefetch(items: Iterable, depth: int = 2, nice: int = 0, cpu: ThreadCPU | None = None) -> Iterator:
    """Iterate `items` on a thread, `depth` ahead: reading and tokenizing the next batches overlaps
    the current forward. Same items, same order; an error in the producer is raised here. nice: how
    much lower the thread runs than the caller (engine/harvest/priority.py); cpu: kept up to date with
    the thread's CPU seconds."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce():
        lower_this_thread(nice)
        try:
            for x in items:
                if cpu is not None:
                    cpu.update()
                if not put(x):
                    return
            put(done)
        except BaseException as e:  # noqa: BLE001 (re-raised in the consumer)
            put(e)

    t = threading.Thread(target=produce, name="harvest-reader", daemon=True)
    t.start()
    try:
        while (x := q.get()) is not done:
            if isinstance(x, BaseException):
                raise x
            yield x
    finally:
        stop.set()
