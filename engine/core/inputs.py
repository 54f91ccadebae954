"""Prompts in, validated token id lists out, the same on every backend.

Accepted: a string, a list of strings, a list of token ids, a list of id lists (or 1-D tensors), a
1-D or 2-D integer tensor, or a mapping with input_ids (and attention_mask: padding is dropped).
Refused by name, saying which prompt, which limit and what to do: no prompts, an empty prompt
(alone or in a batch), text that is not valid Unicode (a lone surrogate), token ids outside the
vocabulary or negative, non-integer ids, malformed batches, and a prompt that with its new tokens
does not fit the model's positions.

The one position limit, on every backend: a call over a P-token prompt that generates N tokens
needs P + N <= M positions (M: the model's positions; on vLLM the max_model_len it was loaded
with). vLLM generates at least one token after every prompt, so a capture there counts N = 1 and a
prompt of exactly M tokens fits eager's forward but not vLLM's. `max_new_tokens` is checked by
`new_tokens` (an int >= 1, numpy ints taken) before anything runs.

    rows = token_rows(inputs, tokenizer, limits_of(model), new=8)    # vLLM: one list per request
    ids, mask = host_batch(inputs, tokenizer, limits_of(model))      # eager: left-padded, on the host
    n = new_tokens(max_new_tokens)                                   # every backend, before submitting
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.core.errors import InputError, InputTypeError
from engine.core.integers import as_int, described, is_int
from engine.core.tokens import encode, pad_id

_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx",
                    "max_sequence_length")
_FORMS = ("inputs must be text, a list of texts, a list of token ids (or of id lists), an integer token "
          "tensor, or a dict with input_ids")


@dataclass(frozen=True)
class Limits:
    """What a prompt must fit: ids in [0, vocab_size), at most max_positions tokens."""
    model: str
    vocab_size: int | None
    max_positions: int | None
    positions_from: str = "config.max_position_embeddings"  # where max_positions comes from
    grow_hint: str = ""  # how to raise the limit, when it can be raised
    capture_new: int = 0  # tokens a capture generates after its prompt (vLLM: 1, it always generates)


def limits_of(model: Any) -> Limits:
    """The limits of a loaded model (eager: its embedding rows and config positions; vLLM: the
    engine's max_model_len)."""
    cfg = model.config
    hf = getattr(model, "hf", None)
    emb = hf.get_input_embeddings() if hf is not None and hasattr(hf, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(cfg, "vocab_size", None)
    engine = getattr(model, "engine", None)
    if engine is not None:
        n = engine.model_config.max_model_len
        cfg_n = next((getattr(cfg, f) for f in _POSITION_FIELDS if getattr(cfg, f, None)), None)
        grow = (f"; or load with a larger max_model_len (up to {cfg_n}, config.max_position_embeddings)"
                if cfg_n and cfg_n > n else "")
        return Limits(model.name, vocab, n, f"max_model_len={n}, set at load", grow, capture_new=1)
    for f in _POSITION_FIELDS:
        n = getattr(cfg, f, None)
        if isinstance(n, int) and n > 0:
            return Limits(model.name, vocab, n, f"config.{f}")
    return Limits(model.name, vocab, None, "")


def _label(i: int, n: int) -> str:
    return "the prompt" if n == 1 else f"prompt {i} (of {n})"


def row_label(i: int, n: int) -> str:
    """How an error names sequence i of a call of n ('' when the call has one)."""
    return "" if n == 1 else _label(i, n)


def _ids_of(x, i: int, n: int) -> list[int]:
    """One prompt's token ids as a list of ints (no range checks yet)."""
    what = _label(i, n)
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise InputTypeError(f"{what} is a {x.dim()}-D tensor; a prompt's token ids are 1-D.")
        if x.is_floating_point() or x.dtype == torch.bool or x.is_complex():
            raise InputTypeError(f"{what} holds {x.dtype} values; token ids are integers (torch.long), "
                             f"e.g. tokenizer(text, return_tensors='pt')['input_ids'].")
        return x.tolist()
    if isinstance(x, (list, tuple)):
        ids = [as_int(t) for t in x]
        for j, t in enumerate(x):
            if ids[j] is None:
                raise InputTypeError(f"{what}: element {j} is {described(t)}; a prompt is a string or "
                                 f"a list of integer token ids.")
        return ids  # type: ignore[return-value]
    raise InputTypeError(f"{what} is a {type(x).__name__}; a prompt is a string or a list / 1-D tensor of "
                     f"token ids.")


def _split(inputs) -> list:
    """The prompts of `inputs`, each a string or an id list (padding dropped)."""
    if isinstance(inputs, str):
        return [inputs]
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0 or inputs.dim() > 2:
            raise InputError(f"a token tensor must be 1-D [pos] or 2-D [batch, pos], got shape {tuple(inputs.shape)}.")
        if inputs.numel() == 0:
            raise InputError(f"the token tensor is empty (shape {tuple(inputs.shape)}); give at least one token "
                             f"per prompt.")
        return list(inputs if inputs.dim() == 2 else inputs[None])
    if isinstance(inputs, Mapping) or (hasattr(inputs, "keys") and hasattr(inputs, "__getitem__")):
        if "input_ids" not in inputs:
            raise InputError(f"a dict of inputs needs input_ids (and optionally attention_mask); got keys "
                             f"{sorted(inputs.keys())}.")
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        ids = torch.as_tensor(ids)
        if ids.dim() == 1:
            ids = ids[None]
        if mask is None:
            return _split(ids)
        mask = torch.as_tensor(mask)
        mask = mask[None] if mask.dim() == 1 else mask
        if mask.shape != ids.shape:
            raise InputError(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(ids.shape)}; "
                             f"they must match.")
        return [r[m.bool()] for r, m in zip(ids, mask)]
    if isinstance(inputs, (list, tuple)):
        if not inputs:
            raise InputError(f"no prompts: inputs is an empty {type(inputs).__name__}; {_FORMS}.")
        if all(is_int(t) for t in inputs):
            return [list(inputs)]
        kinds = {type(x).__name__ for x in inputs if not isinstance(x, str)}
        if any(isinstance(x, str) for x in inputs) and kinds:
            raise InputTypeError(f"a batch mixes strings and {', '.join(sorted(kinds))}; give all prompts as text or "
                             f"all as token id lists.")
        return list(inputs)
    raise InputTypeError(f"{_FORMS}; got {type(inputs).__name__}.")


def new_tokens(value: object, what: str = "max_new_tokens") -> int:
    """`value` as the number of tokens to generate: an int >= 1 (numpy ints too); bool, float and
    tensors are refused by name (one check for every backend, before anything is submitted)."""
    n = as_int(value)
    if n is None:
        hint = " (a whole number: pass int(x))" if isinstance(value, float) and float(value).is_integer() else ""
        raise InputTypeError(f"{what} must be an int >= 1, got {described(value)}{hint}.")
    if n < 1:
        raise InputError(f"{what} must be >= 1, got {n}; for one forward over the prompt without generating, "
                         f"use run_with_cache (logits and captures at every prompt position).")
    return n


def top_logprobs(value: object, vocab: int | None = None) -> int:
    """How many top log-probabilities each streamed step carries: an int >= 0 (numpy ints too), and at
    most the `vocab` tokens there are where the caller knows them."""
    n = as_int(value)
    if n is None or n < 0:
        raise InputTypeError(f"logprobs is how many top log-probabilities each step carries (an int >= 0), got "
                             f"{value!r:.40}.")
    if vocab is not None and n > vocab:
        raise InputError(f"logprobs={n} asks for more top log-probabilities than the vocabulary's {vocab} tokens; "
                         f"ask for at most {vocab}.")
    return n


def fits(n_prompt: int, new: int, limits: Limits) -> bool:
    """Whether n_prompt tokens plus `new` generated ones fit the model's positions."""
    return limits.max_positions is None or n_prompt + new <= limits.max_positions


def in_vocab(lo: int, hi: int, limits: Limits) -> bool:
    """Whether token ids from lo to hi are all ids of the model."""
    return lo >= 0 and (limits.vocab_size is None or hi < limits.vocab_size)


def check_room(n_prompt: int, new: int, limits: Limits, i: int = 0, n: int = 1, capture: bool = False) -> None:
    """Raise InputError when a prompt of n_prompt tokens plus `new` generated ones does not fit the
    model's positions (capture=True: `new` is what the backend generates after a capture)."""
    if fits(n_prompt, new, limits):
        return
    m = limits.max_positions
    assert m is not None
    what = _label(i, n)
    if n_prompt > m:
        head = f"{what} is {n_prompt} tokens, longer than the {m} positions {limits.model} takes"
    elif capture:
        head = (f"{what} is {n_prompt} tokens, and vLLM generates at least {new} token after every prompt: "
                f"{n_prompt + new} positions, more than the {m} positions {limits.model} takes")
    else:
        head = (f"{what} is {n_prompt} tokens and max_new_tokens is {new}: {n_prompt + new} positions, more than "
                f"the {m} positions {limits.model} takes")
    fixes = []
    if m - new >= 1:
        fixes.append(f"truncate {'it' if n_prompt > m else 'the prompt'} to at most {m - new} tokens (e.g. "
                     f"tokenizer(text, truncation=True, max_length={m - new}) or ids[-{m - new}:])")
    if new and not capture and n_prompt < m:
        fixes.append(f"ask for at most {m - n_prompt} new tokens")
    if not fixes:
        fixes.append(f"ask for fewer than {m} new tokens")
    raise InputError(f"{head} ({limits.positions_from}); {', or '.join(fixes)}{limits.grow_hint}.")


def check_ids(ids: list[int], limits: Limits, i: int = 0, n: int = 1, new: int | None = 0) -> list[int]:
    """Raise InputError when one prompt's ids are empty, out of the vocabulary, or with `new`
    generated tokens longer than the model's positions (new=None: a capture, engine/core/inputs.py)."""
    what = _label(i, n)
    if not ids:
        raise InputError(f"{what} is empty (0 tokens); every prompt needs at least one token"
                         f"{'; drop it from the batch' if n > 1 else ''}.")
    check_room(len(ids), limits.capture_new if new is None else new, limits, i, n, capture=new is None)
    lo, hi = min(ids), max(ids)
    if not in_vocab(lo, hi, limits):
        bad = lo if lo < 0 else hi
        pos = ids.index(bad)
        rng = f"0..{limits.vocab_size - 1}" if limits.vocab_size is not None else "non-negative"
        hint = (" (-100 is the label-masking value, not a token)" if bad == -100 else "")
        raise InputError(f"token id {bad} at position {pos} of {what} is out of range: {limits.model} has "
                         f"{limits.vocab_size} token ids ({rng}){hint}; use ids from this model's tokenizer.")
    return ids


def _text(p: str, i: int, n: int) -> str:
    """A text prompt that is valid Unicode (a lone surrogate, e.g. from bytes decoded with
    'surrogateescape', cannot be tokenized)."""
    try:
        p.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{_label(i, n)} is not valid Unicode: character {e.start} is a lone surrogate "
                         f"U+{ord(p[e.start]):04X}; decode the source bytes as UTF-8 (errors='replace'), or drop "
                         f"it, e.g. text.encode('utf-8', 'replace').decode().") from None
    return p


def token_rows(inputs: Any, tokenizer: Any, limits: Limits, one: bool = False, prepend_bos: bool | None = None,
               new: int | None = 0) -> list[list[int]]:
    """Every prompt of `inputs` as a validated list of token ids, each with room for `new` generated
    tokens (None: a capture, which generates limits.capture_new). one=True: exactly one prompt. Text
    is encoded with the BOS policy `prepend_bos` (engine/core/tokens.py); token ids are taken as given."""
    prompts = _split(inputs)
    if one and len(prompts) != 1:
        raise InputError(f"a request holds one prompt, got a batch of {len(prompts)}; make one request per "
                         f"prompt.")
    n = len(prompts)
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) and tokenizer is None:
            raise InputTypeError("this model has no tokenizer; give token ids instead of text.")
        ids = encode(tokenizer, _text(p, i, n), prepend_bos) if isinstance(p, str) else _ids_of(p, i, n)
        rows.append(check_ids(ids, limits, i, n, new))
    return rows


def prompts_of(inputs: Any) -> list[str | list[int]]:
    """Every prompt of `inputs` in a form that crosses a process or a network as it is: text (valid
    Unicode, not tokenized: whoever holds the tokenizer encodes it) or a list of int token ids (their
    type checked here, their range by the model's owner). Refuses what token_rows refuses before a
    tokenizer is needed (no prompts, a mixed batch, non-integer ids), with the same errors."""
    prompts = _split(inputs)
    n = len(prompts)
    return [_text(p, i, n) if isinstance(p, str) else _ids_of(p, i, n) for i, p in enumerate(prompts)]


def _host(x: Any) -> np.ndarray:
    """A tensor or nested list as a host array (a tensor on a device: one copy)."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _valid_at_once(ids: np.ndarray, mask: np.ndarray, limits: Limits, new: int | None) -> bool:
    """Whether host [b, T] integer ids and their mask pass every check token_rows makes on them, found
    with a few whole-batch operations; False sends the inputs through token_rows, which names what is
    wrong (or passes them: anything unusual goes that way)."""
    if not (ids.ndim == 2 and mask.shape == ids.shape and ids.size and ids.dtype.kind in "iu"
            and mask.dtype.kind in "biu"):
        return False
    real = mask.astype(bool)
    lengths = real.sum(1)
    if (lengths == 0).any():
        return False
    picked = ids[real]
    return (in_vocab(int(picked.min()), int(picked.max()), limits)
            and fits(int(lengths.max()), limits.capture_new if new is None else new, limits))


def host_batch(inputs: Any, tokenizer: Any, limits: Limits, prepend_bos: bool | None = None,
               new: int | None = 0) -> tuple[np.ndarray, np.ndarray]:
    """ids (int64 [b, T]) and mask (bool [b, T]) of a batch, on the host and validated, each prompt with
    room for `new` generated tokens: a given mask (and its padding side) is kept, token tensors are taken
    as they are (one copy to the host), anything else is validated prompt by prompt and left-padded, as
    EagerModel.to_tokens pads text."""
    given = (isinstance(inputs, Mapping) or hasattr(inputs, "keys")) and inputs.get("attention_mask") is not None
    if given or isinstance(inputs, torch.Tensor):
        ids = _host(inputs["input_ids"] if given else inputs)
        mask = _host(inputs["attention_mask"]) if given else np.ones(ids.shape, dtype=bool)
        ids, mask = (ids[None], mask[None]) if ids.ndim == 1 else (ids, mask)
        if not _valid_at_once(ids, mask, limits, new):
            token_rows(inputs, tokenizer, limits, prepend_bos=prepend_bos, new=new)  # names what is wrong
        return ids.astype(np.int64), mask.astype(bool)
    rows = token_rows(inputs, tokenizer, limits, prepend_bos=prepend_bos, new=new)
    width = max(len(r) for r in rows)
    pad = 0
    if tokenizer is not None and any(len(r) < width for r in rows):
        pad = pad_id(tokenizer)
    ids = np.array([[pad] * (width - len(r)) + r for r in rows], dtype=np.int64)
    mask = np.array([[False] * (width - len(r)) + [True] * len(r) for r in rows], dtype=bool)
    return ids, mask


def padded_batch(inputs: Any, tokenizer: Any, limits: Limits, device: torch.device | str | None = None,
                 prepend_bos: bool | None = None, new: int | None = 0) -> dict:
    """input_ids / attention_mask (int64) on `device` for a batch (host_batch, uploaded)."""
    ids, mask = host_batch(inputs, tokenizer, limits, prepend_bos, new)
    return {"input_ids": torch.from_numpy(ids).to(device), "attention_mask": torch.from_numpy(mask).long().to(device)}
