"""engine.serve.encoding.json_bytes: the server's JSON answer with the captures' base64 spliced in
unscanned is byte for byte what json.dumps writes, for every kind of string beside it, and decodes
back to the exact tensors."""
from __future__ import annotations

import json

import torch

from engine.serve import encoding


def _reference(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def test_json_bytes_is_json_dumps_byte_for_byte_and_the_captures_decode_exactly():
    g = torch.Generator().manual_seed(0)
    tensors = {f"resid_post.{i}": torch.randn(47, 64, generator=g) for i in range(3)}
    tensors["z.1"] = torch.randn(5, 2, 8, generator=g).to(torch.bfloat16)
    caps = {k: encoding.encode(t) for k, t in tensors.items()}
    assert all(type(c["data"]) is encoding.Base64 for c in caps.values())
    obj = {"id": "cmpl-1", "choices": [{"text": 'quote " backslash \\ newline \n nul \x00 é ☃',
                                        "interp": {"captures": caps, "positions": list(range(47)), "ok": True,
                                                   "none": None, "x": 1.5}}],
           "long_user_text": ('a"b\\c\n' * 500) + "é" * 500, "plain_long": "x" * 5000, "tuple": (1, "t"),
           "looks_like_a_placeholder": "0123456789abcdef0123456789abcdef:0"}
    out = encoding.json_bytes(obj)
    assert out == _reference(obj)
    back = json.loads(out)["choices"][0]["interp"]["captures"]
    for k, t in tensors.items():
        assert torch.equal(encoding.decode(back[k]).view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype),
                           t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


def test_json_bytes_without_captures_and_with_list_encoding_is_json_dumps():
    for obj in ({"a": [1, 2, {"b": "c"}]}, {"data": encoding.encode(torch.ones(2, 3), "list")}, [], "s", 3):
        assert encoding.json_bytes(obj) == _reference(obj)


def test_json_bytes_refuses_what_json_dumps_refuses():
    import pytest
    with pytest.raises(ValueError):
        encoding.json_bytes({"x": float("nan"), "d": encoding.encode(torch.ones(1))})
