"""engine.serve.encoding's writer: the server's JSON answer, with each capture's data deferred and
written in pieces of bounded work, is byte for byte what json.dumps writes for the same answer
encoded at once, for every kind of string beside it, and decodes back to the exact tensors; no
piece of work encodes more than one chunk (measured by what each call is given, not by time)."""
from __future__ import annotations

import base64
import json

import pytest
import torch

from engine.serve import encoding


def _reference(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _eager(obj):
    """obj with every deferred tensor encoded at once (encoding.encode), as json.dumps can write it."""
    if isinstance(obj, dict):
        return {k: _eager(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_eager(v) for v in obj]
    return obj.value() if isinstance(obj, encoding.Lazy) else obj


def _tensors():
    g = torch.Generator().manual_seed(0)
    out = {f"resid_post.{i}": torch.randn(47, 64, generator=g) for i in range(3)}
    out["z.1"] = torch.randn(5, 2, 8, generator=g).to(torch.bfloat16)
    out["big"] = torch.randn(3, encoding.CHUNK_BYTES // 4 + 5, generator=g)  # base64 in several pieces
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 4)
    out["ids"] = torch.arange(12).reshape(3, 4)
    return out


@pytest.mark.parametrize("how", ["base64", "list"])
def test_json_bytes_is_json_dumps_byte_for_byte_and_the_captures_decode_exactly(how):
    tensors = _tensors()
    caps = {k: encoding.deferred(t, how) for k, t in tensors.items()}
    assert all(type(c["data"]) is encoding.Lazy for c in caps.values())
    obj = {"id": "cmpl-1", "choices": [{"text": 'quote " backslash \\ newline \n nul \x00 é ☃',
                                        "interp": {"captures": caps, "positions": list(range(47)), "ok": True,
                                                   "none": None, "x": 1.5}}],
           "long_user_text": ('a"b\\c\n' * 500) + "é" * 500, "plain_long": "x" * 5000, "tuple": (1, "t"),
           "looks_like_a_placeholder": "0123456789abcdef0123456789abcdef:0"}
    out = encoding.json_bytes(obj)
    assert out == _reference(_eager(obj))
    back = json.loads(out)["choices"][0]["interp"]["captures"]
    for k, t in tensors.items():
        assert back[k] == encoding.encode(t, how)  # what encoding everything at once gives
        assert torch.equal(encoding.decode(back[k]).view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype),
                           t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


@pytest.mark.parametrize("shape", [(3, encoding.CHUNK_NUMBERS + 7), (70000,), (9000, 3), (2, 3, 5000)])
def test_every_piece_of_work_encodes_at_most_one_chunk(monkeypatch, shape):
    """Long lists go out in pieces of whole rows (or a long row's own pieces), base64 in CHUNK_BYTES:
    no single call works on more, so the event loop waits at most one piece for the interpreter."""
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 7
    numbers: list[int] = []
    raw: list[int] = []
    real_text, real_b64 = encoding._list_text, base64.b64encode
    monkeypatch.setattr(encoding, "_list_text", lambda x, inner: (numbers.append(x.numel()), real_text(x, inner))[1])
    monkeypatch.setattr(base64, "b64encode", lambda b: (raw.append(len(b)), real_b64(b))[1])
    obj = {"list": encoding.deferred(t, "list"), "b64": encoding.deferred(t, "base64")}
    pieces = list(encoding.json_pieces(obj))
    assert max(numbers) <= encoding.CHUNK_NUMBERS and sum(numbers) == t.numel()
    assert max(raw) <= encoding.CHUNK_BYTES and sum(raw) == t.numel() * 4
    monkeypatch.undo()
    assert len(pieces) > 2  # it streams: one piece after another
    assert b"".join(pieces) == _reference(_eager(obj))
    assert all(len(p) >= 1 << 16 for p in pieces[:-1])  # pieces are not tiny


def test_json_bytes_without_captures_is_json_dumps():
    for obj in ({"a": [1, 2, {"b": "c"}]}, {"data": encoding.encode(torch.ones(2, 3), "list")}, [], "s", 3):
        assert encoding.json_bytes(obj) == _reference(obj)
    assert encoding.lazy_numbers({"a": [encoding.deferred(torch.ones(2, 3))], "b": encoding.deferred(torch.ones(4))}) \
        == 10


def test_json_bytes_refuses_what_json_dumps_refuses():
    with pytest.raises(ValueError):
        encoding.json_bytes({"x": float("nan"), "d": encoding.deferred(torch.ones(1))})
