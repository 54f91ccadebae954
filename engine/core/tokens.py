"""Tokenizer facts the engine states instead of leaving implicit: the BOS policy (and a switch for
it), special tokens, chat templates with per-message token spans.

BOS: text prompts are encoded as the tokenizer does by default (what the checkpoint was trained
with: Llama prepends <s>, GPT-2 adds nothing). `model.prepend_bos` (None by default; or per call,
`to_tokens(..., prepend_bos=)`) switches it: True puts the tokenizer's BOS first when the encoding
lacks it, False drops a leading BOS. Token ids given directly are never changed. `model.bos()`
says what the default is for this tokenizer.

Chat: `model.apply_chat_template(messages)` renders the tokenizer's own template (refused, with the
fix, when it has none) and returns a ChatPrompt: its ids (pass them to any call), its text, and the
token span of each message, so a capture can be read message by message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.errors import InputError, InputTypeError
from engine.core.integers import described

if TYPE_CHECKING:
    import torch


def special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (BOS, EOS, pad, chat markers it registers as special)."""
    if tokenizer is None:
        return set()
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
    return ids


@dataclass(frozen=True)
class BosPolicy:
    token: str | None  # the tokenizer's BOS token (None: it has none)
    id: int | None
    added_by_default: bool  # encoding text puts it first

    def describe(self) -> str:
        if self.id is None:
            return "this tokenizer has no BOS token; text is encoded without one (prepend_bos=True is refused)"
        how = "prepends" if self.added_by_default else "does not prepend"
        return f"this tokenizer {how} its BOS {self.token!r} (id {self.id}) when encoding text; prepend_bos switches it"


def bos_policy(tokenizer: Any) -> BosPolicy:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return BosPolicy(None, None, False)
    ids = tokenizer("a")["input_ids"]
    return BosPolicy(tokenizer.bos_token, int(bos), bool(ids) and ids[0] == bos)


def encode(tokenizer: Any, text: str, prepend_bos: bool | None = None) -> list[int]:
    """Text -> ids, with the BOS policy applied (None: the tokenizer's default)."""
    if prepend_bos not in (None, True, False):
        raise InputError(f"prepend_bos is True, False or None (the tokenizer's default), got {prepend_bos!r}.")
    ids = list(tokenizer(text)["input_ids"])
    if prepend_bos is None:
        return ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if prepend_bos:
        if bos is None:
            raise InputError("prepend_bos=True, but this tokenizer has no BOS token; leave prepend_bos unset or give "
                             "token ids.")
        return ids if ids and ids[0] == bos else [bos, *ids]
    return ids[1:] if bos is not None and ids and ids[0] == bos else ids


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    text: str
    spans: list[tuple[str, int, int]]  # per message: (role, first token, one past its last token)

    def message_at(self, position: int) -> int | None:
        """Index of the message whose span holds token `position` (None: template text between them,
        e.g. the generation prompt)."""
        for i, (_, a, b) in enumerate(self.spans):
            if a <= position < b:
                return i
        return None


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("a chat is a non-empty list of messages like {'role': 'user', 'content': 'Hi'}.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"message {i} must be a dict with string 'role' and 'content', got {m!r:.80}.")
    return list(messages)


def apply_chat_template(tokenizer: Any, messages: list, add_generation_prompt: bool = True,
                        model: str = "this model") -> ChatPrompt:
    """Render `messages` with the tokenizer's chat template; spans from rendering each prefix of the
    conversation (a template that re-renders earlier turns differently is refused, not approximated)."""
    messages = _check_messages(messages)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InputError(f"the tokenizer of {model} has no chat template (a base model, or one saved without "
                         f"it); format the prompt yourself, or set tokenizer.chat_template to the Jinja template "
                         f"the checkpoint was trained with.")

    def ids_of(msgs, gen):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text, ids = ids_of(messages, add_generation_prompt)
    spans, start = [], 0
    for i, m in enumerate(messages):
        _, prefix = ids_of(messages[: i + 1], False)
        if prefix != ids[: len(prefix)]:
            raise InputError(f"the chat template renders message {i} differently once later messages follow, so "
                             f"per-message spans are not defined for this template.")
        spans.append((m["role"], start, len(prefix)))  # with the role header the template puts before it
        start = len(prefix)
    return ChatPrompt(ids, text, spans)


class TokensMixin:
    """bos(), prepend_bos, apply_chat_template for any model with a `tokenizer`."""
    prepend_bos: bool | None = None

    def _live(self) -> None:
        """A model with a closed state refuses calls after close() (ModelBase's); this mixin alone has none."""

    def bos(self) -> BosPolicy:
        """The BOS policy of this model's tokenizer (see BosPolicy.describe())."""
        self._live()
        return bos_policy(self.tokenizer)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> ChatPrompt:
        """The chat rendered with the tokenizer's template: ids to pass to any call, text, message spans."""
        self._live()
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, self.name)


def to_tokens(tokenizer: Any, text: "str | list[str]", padding_side: str = "left", prepend_bos: bool | None = None, device: torch.device | str | None = None) -> dict:
    """A padded input_ids / attention_mask batch of one text or a list of texts, BOS policy applied."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    rows = [encode(tokenizer, t, prepend_bos) for t in texts_of(text)]
    return padded(rows, pad_id(tokenizer), padding_side, device)


def texts_of(text: object) -> list[str]:
    """The texts of a to_tokens call (a text, or a non-empty list or tuple of texts) as a list; an
    InputTypeError naming anything else."""
    texts = [text] if isinstance(text, str) else list(text) if isinstance(text, (list, tuple)) else None
    if not texts or not all(isinstance(t, str) for t in texts):
        bad = text if texts is None else next((t for t in texts if not isinstance(t, str)), text)
        raise InputTypeError(f"to_tokens takes a text or a non-empty list of texts, got {described(bad)}; "
                             f"token ids go to the calls as they are (input_ids, or a dict with attention_mask).")
    return texts


def pad_id(tokenizer: Any) -> int:
    """The id a padded batch fills with: the tokenizer's pad token, else its EOS (set as its pad token,
    as HF's generate does), else 0."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def padded(rows: list[list[int]], pad: int, padding_side: str = "left", device: "torch.device | str | None" = None) -> dict:
    """input_ids / attention_mask [b, width] of token id rows, padded on `padding_side` with `pad`."""
    import torch
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    width = max(len(r) for r in rows)
    ids, mask = [], []
    for r in rows:
        fill = [pad] * (width - len(r))
        ids.append(fill + r if padding_side == "left" else r + fill)
        ones, zeros = [1] * len(r), [0] * (width - len(r))
        mask.append(zeros + ones if padding_side == "left" else ones + zeros)
    return {"input_ids": torch.tensor(ids, dtype=torch.long, device=device),
            "attention_mask": torch.tensor(mask, dtype=torch.long, device=device)}


def id_rows(tokens: Any, vocab: int | None = None) -> tuple[list[list[int]], bool]:
    """(rows of int token ids, whether `tokens` was one sequence) of to_string's argument: a list of ints
    or a 0-d / 1-D integer tensor is one sequence, a list of id lists or a 2-D tensor a batch. Refuses
    non-integer ids and, given `vocab`, ids outside 0..vocab-1."""
    import torch
    if isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool or tokens.dim() > 2:
            raise InputError(f"to_string takes integer token ids (a list, or a 0-, 1- or 2-D integer tensor), got a "
                             f"{tokens.dim()}-D {tokens.dtype} tensor.")
        tokens = tokens.tolist()
    one = not (isinstance(tokens, (list, tuple)) and tokens and all(isinstance(r, (list, tuple)) for r in tokens))
    rows = [[tokens] if isinstance(tokens, int) and not isinstance(tokens, bool) else tokens] if one else list(tokens)
    for r, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise InputError(f"to_string takes token ids (a list of ints or of id lists), got {type(row).__name__}.")
        for j, t in enumerate(row):
            if isinstance(t, bool) or not isinstance(t, int):
                raise InputError(f"to_string: element {j}{f' of row {r}' if not one else ''} is {type(t).__name__} "
                                 f"{t!r:.40}; token ids are ints.")
            if vocab is not None and not 0 <= t < vocab:
                raise InputError(f"to_string: token id {t} is out of range; this tokenizer has {vocab} ids "
                                 f"(0..{vocab - 1}).")
    return [list(row) for row in rows], one


def to_string(tokenizer: Any, tokens: Any, skip_special_tokens: bool = False) -> "str | list[str]":
    """Token ids back to text: one sequence (a list of ints, a 0-d or 1-D integer tensor) gives a str,
    a batch (a list of id lists, a 2-D tensor) a list of str (id_rows says what is refused)."""
    rows, one = id_rows(tokens, len(tokenizer))
    texts = [tokenizer.decode(row, skip_special_tokens=skip_special_tokens) for row in rows]
    return texts[0] if one else texts
