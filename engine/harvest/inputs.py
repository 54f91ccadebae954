"""Reading the input documents: a text file (one document per line), JSONL, or a parquet / Arrow
dataset, all through the `datasets` library in streaming mode (local files only), so that memory
stays flat whatever the dataset's size. Splitting into parts is by document index (index % N), so
that part i of N selects the same documents on every machine without coordination."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from engine.core.errors import InputError

# file suffix -> datasets builder
BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet",
            ".arrow": "arrow"}


@dataclass(frozen=True)
class Source:
    """Where the documents come from: files of one format, read in this order."""
    root: Path
    files: tuple[Path, ...]
    builder: str
    text_field: str

    def describe(self) -> dict:
        """What the manifest records about the input (names relative to the root, so that a copy of
        the data mounted elsewhere still resumes)."""
        return {"path": str(self.root), "format": self.builder, "text_field": self.text_field,
                "files": [self._rel(f) for f in self.files], "fingerprint": fingerprint(self)}

    def _rel(self, f: Path) -> str:
        return f.name if self.root.is_file() else str(f.relative_to(self.root))


def open_source(path: str | os.PathLike[str], text_field: str = "text") -> Source:
    """Check `path` and list its files; every error says what was expected."""
    root = Path(path).expanduser()
    if not root.exists():
        raise InputError(f"input {str(root)!r} does not exist; give a .txt, .jsonl, .parquet or .arrow "
                         f"file, or a directory of them (or one written by datasets' save_to_disk).")
    if root.is_file():
        files = [root]
    elif (root / "state.json").is_file():  # datasets.Dataset.save_to_disk
        state = json.loads((root / "state.json").read_text())
        files = [root / f["filename"] for f in state.get("_data_files", [])]
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in BUILDERS)
    if not files:
        raise InputError(f"no input files in {str(root)!r}: expected {', '.join(sorted(BUILDERS))} files.")
    kinds = {BUILDERS.get(f.suffix) for f in files}
    if None in kinds:
        bad = next(f for f in files if f.suffix not in BUILDERS)
        raise InputError(f"{str(bad)!r} has an unknown suffix; use one of {', '.join(sorted(BUILDERS))}.")
    if len(kinds) > 1:
        raise InputError(f"{str(root)!r} mixes formats ({', '.join(sorted(kinds))}); harvest one format at a time.")
    return Source(root, tuple(files), kinds.pop(), text_field)


def fingerprint(src: Source) -> str:
    """A cheap identity of the input: names, sizes, and the first and last MiB of every file (a
    full hash of a large corpus would cost as long as reading it)."""
    h = hashlib.sha256()
    for f in src.files:
        size = f.stat().st_size
        h.update(f"{src._rel(f)}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()


def _stream(src: Source):
    import datasets
    kw = {"sample_by": "line"} if src.builder == "text" else {}
    return datasets.load_dataset(src.builder, data_files=[str(f) for f in src.files], split="train",
                                 streaming=True, **kw)


def documents(src: Source, part: int = 0, of: int = 1, start: int = 0) -> Iterator[tuple[int, str]]:
    """(document index, text) for the documents of part `part` of `of`, from index `start` on.
    The index counts every row of the input (empty ones too), so it names the row in the source."""
    ds = _stream(src)
    field = "text" if src.builder == "text" else src.text_field
    cols = ds.column_names
    if cols is not None and field not in cols:
        raise InputError(f"{str(src.root)!r} has no column {field!r}; its columns are {cols} "
                         f"(choose one with --text-field).")
    for i, row in enumerate(ds):
        if i < start or i % of != part:
            continue
        text = row.get(field)
        if text is None and field not in row:
            raise InputError(f"{str(src.root)!r} row {i} has no field {field!r}; it has {sorted(row)}.")
        if not isinstance(text, str):
            raise InputError(f"{str(src.root)!r} row {i}: {field!r} is {type(text).__name__}, not text.")
        yield i, text


def count_documents(src: Source) -> int | None:
    """Number of rows in the input, cheaply (for the progress bar's ETA); None when unknown."""
    try:
        if src.builder in ("text", "json"):
            n = 0
            for f in src.files:
                last = b"\n"
                with open(f, "rb") as fh:
                    while chunk := fh.read(1 << 22):
                        n += chunk.count(b"\n")
                        last = chunk[-1:]
                n += last != b"\n"
            return n
        import pyarrow as pa
        import pyarrow.parquet as pq
        if src.builder == "parquet":
            return sum(pq.ParquetFile(f).metadata.num_rows for f in src.files)
        n = 0
        for f in src.files:
            with pa.memory_map(str(f)) as mm:
                try:
                    reader = pa.ipc.open_stream(mm)
                except pa.ArrowInvalid:
                    reader = pa.ipc.open_file(mm)
                    n += sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
                    continue
                n += sum(b.num_rows for b in reader)
        return n
    except Exception:  # noqa: BLE001 (only the progress bar's ETA depends on it)
        return None


def part_size(total: int | None, part: int, of: int) -> int | None:
    """Rows of the input that index % of == part selects."""
    return None if total is None else len(range(part, total, of))
