"""Tokenization stated and switchable (engine/core/tokens.py): the BOS policy and prepend_bos on every
text path, chat templates (refused by message without one) and per-message token spans."""
from __future__ import annotations

import copy

import pytest
import torch
from tokenizers import processors

from engine import load_model
from engine.core.errors import InputError
from engine.core.tokens import apply_chat_template, bos_policy, encode

LLAMA = "meta-llama/Llama-3.2-1B"
TEXT = "The quick brown fox"
TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|bos|>assistant:{% endif %}")
_M: dict = {}


def model():
    if "m" not in _M:
        _M["m"] = load_model(LLAMA, source="zoo")
    return _M["m"]


def _adds_bos(tok):
    t = copy.deepcopy(tok)
    t._tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    return t


def test_bos_policy_is_stated_and_switchable():
    m = model()
    plain = m.tokenizer(TEXT)["input_ids"]
    assert not m.bos().added_by_default and m.bos().id == 1 and "does not prepend" in m.bos().describe()
    assert encode(m.tokenizer, TEXT, True) == [1, *plain] and encode(m.tokenizer, TEXT, False) == plain
    adds = _adds_bos(m.tokenizer)
    assert bos_policy(adds).added_by_default and "prepends" in bos_policy(adds).describe()
    assert encode(adds, TEXT) == [1, *plain] and encode(adds, TEXT, False) == plain
    assert encode(adds, TEXT, True) == [1, *plain]  # never two
    enc = m.to_tokens([TEXT, "Water"], prepend_bos=True)
    first = [int(r.nonzero()[0]) for r in enc["attention_mask"]]  # left padded: BOS first in each row
    assert [int(enc["input_ids"][i, c]) for i, c in enumerate(first)] == [1, 1] and first[1] > 0


def test_model_prepend_bos_applies_to_every_text_call():
    m = model()
    ids = torch.tensor([[1, *m.tokenizer(TEXT)["input_ids"]]])
    ref, _ = m.run_with_cache(ids)
    try:
        m.prepend_bos = True
        got, _ = m.run_with_cache(TEXT)
        gen = m.generate(TEXT, 2)
        assert gen.tokens[0, 0] == 1
        got_ids, _ = m.run_with_cache(ids[:, 1:])  # ids are never changed
        assert got_ids.shape[1] == ids.shape[1] - 1
    finally:
        m.prepend_bos = None
    torch.testing.assert_close(got, ref)
    with pytest.raises(InputError, match="prepend_bos is True, False or None"):
        encode(m.tokenizer, TEXT, "yes")


def test_chat_template_and_message_spans():
    m = model()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The capital of France?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Germany?"}]
    with pytest.raises(InputError, match="has no chat template"):
        m.apply_chat_template(messages)
    tok = copy.deepcopy(m.tokenizer)
    tok.chat_template = TEMPLATE
    chat = apply_chat_template(tok, messages)
    assert chat.text.endswith("<|bos|>assistant:") and chat.ids == tok(chat.text, add_special_tokens=False)["input_ids"]
    assert [r for r, _, _ in chat.spans] == ["system", "user", "assistant", "user"]
    assert chat.spans[0][1] == 0 and all(a[2] == b[1] for a, b in zip(chat.spans, chat.spans[1:]))
    for (role, a, b), msg in zip(chat.spans, messages):
        piece = tok.decode(chat.ids[a:b])
        assert msg["content"] in piece and role in piece
    assert chat.message_at(chat.spans[2][1]) == 2 and chat.message_at(len(chat.ids) - 1) is None
    _, cache = m.run_with_cache(chat.ids, ["resid_post.0"])  # the ids run as any prompt
    assert cache["resid_post.0"].shape[1] == len(chat.ids)
    with pytest.raises(InputError, match="message 1 must be a dict"):
        apply_chat_template(tok, [messages[0], "hi"])
    with pytest.raises(InputError, match="non-empty list of messages"):
        apply_chat_template(tok, [])
