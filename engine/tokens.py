"""Tokenizer facts the engine needs beyond plain encoding (special tokens, BOS, chat templates)."""
from __future__ import annotations


def special_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (BOS, EOS, pad, chat markers it registers as special)."""
    if tokenizer is None:
        return set()
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
    return ids
