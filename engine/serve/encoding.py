"""Tensors over JSON, both ways: captures out, steering values in.

Default: base64 of the tensor's raw little-endian bytes with its dtype and shape,
`{"dtype": "float32", "shape": [7, 64], "data": "<base64>"}`: exact (bit for bit), binary-safe in
JSON, 4/3 of the raw size, and an order of magnitude cheaper to produce and parse than nested
number lists (reports/serve/ has the measurement). `"list"` gives the same object with `data` as
nested lists, for readers without a base64 decoder.

Binary (`"binary"`, for a client that sends `Accept: application/x-interp-frame`, engine/serve/wire.py):
`data` is the raw bytes themselves, and the answer is a frame instead of JSON: MAGIC, the header's
length (8 bytes, little-endian), the header (JSON: `{"blobs": [n0, n1, ...], "body": ...}`, each
tensor's data written `{"blob": i}`), then the blobs back to back. No base64 on either side and 3/4
of the bytes; `unframe` gives back the body with each data as its bytes, which `decode` takes.

    obj = encode(t)                  # server side
    t = decode(obj)                  # client side (or numpy: np.frombuffer(b64decode(data), dtype))
    body = frame_bytes({"x": encode(t, "binary")}); decode(unframe(body)["x"])   # the binary form

The server writes its JSON answers with `deferred` and `json_pieces`: a tensor's data is encoded
only while the response goes out, in pieces of bounded work, each piece a job of the server's
worker threads (engine/serve/offload.py), so eight answers of hundreds of megabytes each take turns
with every other request instead of holding the interpreter for seconds at a time.
"""
from __future__ import annotations

import base64
import functools
import itertools
import json
import math
import re
import struct
import uuid
from typing import Any, Callable, Iterator

import torch

MAX_RANK = 8  # a steering value has at most [batch, pos, heads, head_dim]; checked before any tensor op
MAX_ELEMENTS = 1 << 26  # numbers in one tensor object (256 MiB of float32)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}
ENCODINGS = ("base64", "list")  # the JSON forms a request may ask for (interp.capture.encoding)
BINARY = "binary"  # raw bytes in a frame: chosen by the Accept header, never inside JSON
MAGIC = b"\x89IEF\r\n\x1a\n"  # a frame's first bytes: no JSON text starts with 0x89


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def encode(t: torch.Tensor, how: str = "base64") -> dict:
    """One tensor as a JSON-able object (see the module docstring)."""
    t = t.detach().to("cpu").contiguous()
    out = {"dtype": dtype_name(t), "shape": list(t.shape)}
    if how == "list":
        out["data"] = t.tolist()
        return out
    raw = (t.view(torch.uint8) if t.dtype == torch.bfloat16 else t).numpy().tobytes()  # numpy has no bfloat16
    out["data"] = Blob(raw) if how == BINARY else Base64(base64.b64encode(raw).decode("ascii"))
    return out


def decode(obj: dict) -> torch.Tensor:
    """The tensor of an encoded object; ValueError says what is wrong with it."""
    if not isinstance(obj, dict) or set(obj) - {"dtype", "shape", "data", "positions"} \
            or not {"dtype", "shape", "data"} <= set(obj):
        raise ValueError("a tensor object has the keys dtype, shape and data (and, in a response, positions)")
    name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if isinstance(data, Lazy):  # a server-side object not written yet
        data = data.value()
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"shape must be a list of non-negative ints, got {shape!r:.60}")
    if len(shape) > MAX_RANK:
        raise ValueError(f"shape has {len(shape)} dims; a tensor here has at most {MAX_RANK}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f"shape {shape!r:.60} holds {math.prod(shape)} numbers; a tensor here holds at most "
                         f"{MAX_ELEMENTS}")
    dtype = DTYPES[name]
    if isinstance(data, list) or (shape == [] and isinstance(data, (int, float)) and not isinstance(data, bool)):
        t = from_list(data, dtype)
        if t.numel() == 0 == math.prod(shape):  # [] is every empty shape's nested list
            return torch.empty(shape, dtype=dtype)
        if list(t.shape) != shape:
            raise ValueError(f"data has shape {list(t.shape)} but shape says {shape}")
        return t
    if isinstance(data, (bytes, bytearray, memoryview)):  # a frame's blob (unframe)
        raw = data
    elif not isinstance(data, str):
        raise ValueError("data must be a base64 string or nested lists (a number for shape [])")
    else:
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError as e:
            raise ValueError(f"data is not valid base64 ({e})") from None
    size = torch.tensor([], dtype=dtype).element_size()
    want = math.prod(shape) * size
    if len(raw) != want:
        raise ValueError(f"data holds {len(raw)} bytes but shape {shape} of {name} needs {want}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bfloat16:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def from_list(data: float | list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor from a number or nested lists of numbers; ValueError for ragged or non-numeric data."""
    def bad(x):
        return isinstance(x, bool) or not isinstance(x, (int, float, list))
    stack, n = [(data, 0)], 0
    while stack:
        x, depth = stack.pop()
        if bad(x):
            raise ValueError(f"expected numbers or nested lists of numbers, found {type(x).__name__} {x!r:.40}")
        if isinstance(x, list):
            if depth >= MAX_RANK:
                raise ValueError(f"nested lists more than {MAX_RANK} deep; a tensor here has at most {MAX_RANK} dims")
            stack.extend((y, depth + 1) for y in x)
        else:
            n += 1
            if n > MAX_ELEMENTS:
                raise ValueError(f"more than {MAX_ELEMENTS} numbers in one tensor")
    try:
        return torch.tensor(data, dtype=dtype)
    except (ValueError, TypeError) as e:
        raise ValueError(f"nested lists must be rectangular ({e})") from None
    except (RuntimeError, OverflowError) as e:
        raise ValueError(f"a number does not fit {str(dtype).replace('torch.', '')} ({e})") from None


def value_in(v: Any) -> "torch.Tensor | float | None":
    """A steering value from JSON: null, a number (scale), nested lists, or a tensor object."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError("a steering value is a number, nested lists of numbers or a tensor object, not a boolean")
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:
            raise ValueError(f"the number {v!r:.40} does not fit a float") from None
    if isinstance(v, dict):
        t = decode(v)
        if not torch.is_floating_point(t):
            raise ValueError(f"a steering value must be floating point, got dtype {v['dtype']}")
        return t
    if isinstance(v, list):
        return from_list(v)
    raise ValueError(f"a steering value is a number, nested lists of numbers or a tensor object, got "
                     f"{type(v).__name__}")


class Blob(bytes):
    """A tensor's raw bytes made by `encode(t, "binary")`: written into a frame by `frame_bytes`."""


class Base64(str):
    """A base64 text made by `encode`: its JSON form is itself in quotes (no character needs
    escaping), which `json_bytes` relies on to splice it in without the encoder scanning it."""


CHUNK_NUMBERS = 1 << 12  # numbers per piece of a list encoding (about a millisecond of one core)
CHUNK_BYTES = 3 << 18  # raw bytes per piece of a base64 encoding (768 KiB: a multiple of 3, so pieces join exactly)
_JSON = dict(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class Lazy:
    """A tensor's `data` not encoded yet: `deferred` puts one in a response, and `json_pieces` writes
    it in pieces of bounded work (CHUNK_NUMBERS numbers, CHUNK_BYTES raw bytes), so a capture of
    hundreds of megabytes never sits in memory as text at once and no single call holds the
    interpreter (and with it the event loop and /health) for seconds."""

    __slots__ = ("t", "how")

    def __init__(self, t: torch.Tensor, how: str) -> None:
        self.t, self.how = t, how

    def pieces(self) -> Iterator[Callable[[], bytes] | bytes]:
        """The JSON text of the data: literal bytes, and calls that each encode one bounded piece."""
        if self.how == "list":
            yield from _list_pieces(self.t)
            return
        t = self.t
        raw = (t.view(torch.uint8) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1).data.cast("B")
        yield b'"'
        for i in range(0, len(raw), CHUNK_BYTES):
            yield functools.partial(base64.b64encode, raw[i:i + CHUNK_BYTES])
        yield b'"'

    def value(self) -> str | list | float | int:
        """The data as `encode` gives it (all at once)."""
        return json.loads(b"".join(p if isinstance(p, bytes) else p() for p in self.pieces()))


def _list_text(t: torch.Tensor, inner: bool) -> bytes:
    text = json.dumps(t.tolist(), **_JSON).encode()  # type: ignore[arg-type]
    return text[1:-1] if inner else text


def _list_pieces(t: torch.Tensor) -> Iterator[Callable[[], bytes] | bytes]:
    """Nested lists of t in pieces of at most CHUNK_NUMBERS numbers: groups of whole rows, or, for a
    row longer than that, the row's own pieces."""
    if t.dim() == 0 or t.numel() <= CHUNK_NUMBERS:
        yield functools.partial(_list_text, t, False)
        return
    per = t[0].numel()
    yield b"["
    if per > CHUNK_NUMBERS:
        for i in range(t.shape[0]):
            if i:
                yield b","
            yield from _list_pieces(t[i])
    else:
        step = CHUNK_NUMBERS // per
        for i in range(0, t.shape[0], step):
            if i:
                yield b","
            yield functools.partial(_list_text, t[i:i + step], True)
    yield b"]"


def deferred(t: torch.Tensor, how: str = "base64") -> dict:
    """`encode(t, how)` with its data a `Lazy` (encoded when the response is written); the binary form
    is raw bytes already (a copy, no encoding), so it is made at once."""
    if how == BINARY:
        return encode(t, how)
    t = t.detach().to("cpu").contiguous()
    return {"dtype": dtype_name(t), "shape": list(t.shape), "data": Lazy(t, how)}


def json_pieces(obj: Any, at_least: int = 1 << 16) -> Iterator[bytes]:
    """`json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()`, byte for
    byte, in pieces: each `next()` does a bounded amount of work (the text around the tensors, or about
    one piece of a tensor's data, CHUNK_NUMBERS / CHUNK_BYTES) and returns at least `at_least` bytes
    where that much is left, so a caller can run each step on a worker thread and let other work in
    between. Neither a `Lazy` nor a `Base64` text is scanned by the JSON encoder (megabytes per
    response, the largest CPU cost of a capturing request on the server): each is replaced by a
    placeholder holding a per-call random nonce in one json.dumps of the rest, and written where the
    placeholder was."""
    parts_of: list[Lazy | bytes] = []
    nonce = uuid.uuid4().hex

    def pull(x):
        if isinstance(x, dict):
            return {k: pull(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return x if _plain(x) else [pull(v) for v in x]
        if isinstance(x, Lazy) or type(x) is Base64:
            parts_of.append(x if isinstance(x, Lazy) else b'"' + x.encode("ascii") + b'"')
            return f"{nonce}:{len(parts_of) - 1}"
        return x
    text = json.dumps(pull(obj), **_JSON).encode()  # type: ignore[arg-type]
    parts = re.split(b'"' + nonce.encode() + rb':(\d+)"', text) if parts_of else [text]
    buf: list[bytes] = [parts[0]]
    size = len(parts[0])
    for i in range(1, len(parts), 2):
        item = parts_of[int(parts[i])]
        for piece in item.pieces() if isinstance(item, Lazy) else [item]:
            worked = callable(piece)
            b = piece() if callable(piece) else piece
            buf.append(b)
            size += len(b)
            if worked and size >= at_least:
                yield b"".join(buf)
                buf, size = [], 0
        buf.append(parts[i + 1])
        size += len(parts[i + 1])
    if buf:
        yield b"".join(buf)


def lazy_numbers(obj: Any) -> int:
    """How many numbers the `Lazy` data inside obj hold together (what writing them costs)."""
    if isinstance(obj, dict):
        return sum(lazy_numbers(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return 0 if _plain(obj) else sum(lazy_numbers(v) for v in obj)
    return obj.t.numel() if isinstance(obj, Lazy) else 0


def json_bytes(obj: Any) -> bytes:
    """`json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()`, byte for
    byte, with each `Lazy` written as its encoded data and each `Base64` spliced in (json_pieces)."""
    return b"".join(json_pieces(obj))


def frame_bytes(obj: Any) -> bytes:
    """`obj` as a frame (see the module docstring): each `Blob` pulled out of the JSON into the blob
    section, in the order met."""
    blobs: list[bytes] = []

    def pull(x):
        if isinstance(x, dict):
            return {k: pull(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return x if _plain(x) else [pull(v) for v in x]
        if type(x) is Blob:
            blobs.append(x)
            return {"blob": len(blobs) - 1}
        return x
    body = pull(obj)
    head = json_bytes({"blobs": [len(b) for b in blobs], "body": body})
    return b"".join([MAGIC, struct.pack("<Q", len(head)), head, *blobs])


def unframe(body: bytes) -> Any:
    """The object of a frame, each tensor's `data` the bytes of its blob (a memoryview of `body`);
    ValueError when `body` is not a whole frame."""
    view = memoryview(body)
    n = len(MAGIC) + 8
    if len(view) < n or bytes(view[:len(MAGIC)]) != MAGIC:
        raise ValueError("not a frame: it does not start with the frame's magic bytes")
    (size,) = struct.unpack("<Q", view[len(MAGIC):n])
    if size > len(view) - n:
        raise ValueError(f"truncated frame: its header says {size} bytes, {len(view) - n} follow")
    try:
        head = json.loads(bytes(view[n:n + size]))
        sizes = [int(k) for k in head["blobs"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"a frame's header is not valid ({e})") from None
    if any(k < 0 for k in sizes) or n + size + sum(sizes) != len(view):
        raise ValueError(f"truncated frame: its blobs need {sum(sizes)} bytes, {len(view) - n - size} follow")
    starts = list(itertools.accumulate(sizes[:-1], initial=n + size))

    def put(x):
        if isinstance(x, dict):
            ref = x.get("data")
            if isinstance(ref, dict) and set(ref) == {"blob"}:
                i = ref["blob"]
                if not isinstance(i, int) or not 0 <= i < len(sizes):
                    raise ValueError(f"a tensor of the frame names blob {i!r}, which it does not hold")
                return {**{k: put(v) for k, v in x.items() if k != "data"}, "data": view[starts[i]:starts[i] + sizes[i]]}
            return {k: put(v) for k, v in x.items()}
        if isinstance(x, list):
            return x if _plain(x) else [put(v) for v in x]
        return x
    return put(head["body"])


_SCALARS = (int, float, bool, type(None))


def _plain(xs: list | tuple) -> bool:
    """A list of plain numbers (token ids, a shape): nothing inside to pull out or put back, so the
    walks above skip it whole instead of visiting every number."""
    return all(type(v) in _SCALARS for v in xs)


def has_blob(x: Any) -> bool:
    """Whether an answer holds binary tensors (`Blob`): then it is written as a frame."""
    if isinstance(x, dict):
        return any(has_blob(v) for v in x.values())
    if isinstance(x, list):
        return any(has_blob(v) for v in x)
    return isinstance(x, Blob)


def answer_bytes(obj: Any) -> bytes:
    """An answer's bytes: a frame when it holds binary tensors (`Blob`), else `json_bytes`."""
    return frame_bytes(obj) if has_blob(obj) else json_bytes(obj)
