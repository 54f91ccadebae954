"""Text like an OpenAI server: chat messages through the model's chat template, tokens back to
text incrementally for streams (deltas that add up exactly to the final text), stop strings cut
from the text, and the finish reason."""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

from engine.serve.errors import ServeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.core.results import RequestResult
    from engine.serve.runner import Runner
    from engine.serve.schemas import Message


def chat_ids(runner: Runner, messages: list[Message], template: str | None, add_generation_prompt: bool,
             kwargs: dict | None) -> list[int]:
    """Token ids of a conversation: the chat template renders it, the text is tokenized without
    adding special tokens again (as vLLM does); a text too long in characters to fit the model is
    refused before it is tokenized."""
    tokenizer = runner.tokenizer
    tmpl = template or getattr(tokenizer, "chat_template", None)
    if not tmpl:
        raise ServeError(400, "messages: this model's tokenizer has no chat template; start the server with "
                              "--chat-template (a file or a Jinja string), or use /v1/completions", "messages")
    conv = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conv, chat_template=tmpl, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **(kwargs or {}))
    except Exception as e:  # a template that raises (e.g. roles out of order) is the request's fault
        raise ServeError(400, f"messages: the chat template refused this conversation ({type(e).__name__}: {e})",
                         "messages") from None
    if len(text) > runner.max_prompt_chars:
        raise ServeError(400, f"messages: the conversation is {len(text)} characters, which cannot fit the "
                              f"{runner.max_model_len} positions this server's model takes; send less", "messages")
    with runner.tokenizer_lock:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def whole_chars(text: str) -> str:
    """The text without the replacement characters that an incomplete UTF-8 sequence at its end
    decodes to (a generation cut mid-character ends there, as vLLM's own server answers)."""
    return text.rstrip("\ufffd")


def cut(text: str, stops: list[str] | None) -> tuple[str, str | None]:
    """The text up to the first stop string (excluded), and that stop string."""
    if not stops:
        return text, None
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    i, s = min(hits)
    return text[:i], s


class Detok:
    """Incremental detokenization of one sequence. Each push returns the text to send now: never a
    half-decoded character, and (with stop strings) never text a later stop string could cut."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str] | None) -> None:
        self.tok, self.stops = tokenizer, stops
        self.hold = max(len(s) for s in stops) - 1 if stops else 0
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = cast(str, self.tok.decode(self.ids, skip_special_tokens=True))  # one sequence's ids: one text
        if text.endswith("\ufffd"):
            return ""
        text, _ = cut(text, self.stops)
        return self._advance(text[:len(text) - self.hold] if self.hold else text)

    def final(self, text: str) -> str:
        """The rest, given the final (uncut) text of the whole sequence."""
        return self._advance(cut(whole_chars(text), self.stops)[0])

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def finish(result: RequestResult, max_tokens: int, prompt_len: int, max_model_len: int | None,
           stops: list[str] | None, stop_token_ids: list[int] | None, eos_id: int | None,
           ignore_eos: bool = False) -> tuple[str, str, "str | int | None"]:
    """(text, finish_reason, stop_reason) of a finished sequence, as vLLM's server reports them."""
    text, hit = cut(whole_chars(result.text), stops)
    toks = result.new_tokens.tolist()
    if hit is not None:
        return text, "stop", hit
    if toks and stop_token_ids and toks[-1] in stop_token_ids:
        return text, "stop", toks[-1]
    if toks and toks[-1] == eos_id and not ignore_eos:
        return text, "stop", None
    if len(toks) >= max_tokens or (max_model_len and prompt_len + len(toks) >= max_model_len):
        return text, "length", None
    return text, "stop", None
