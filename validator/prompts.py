"""The prompt cases every engine sees as the same token ids.

short    one prompt of a dozen tokens, alone
padded   a batch of two, left-padded: row 0 the short prompt (compared on its real tokens, and they
         must equal the short prompt run alone: padding must not leak), row 1 a prompt longer than
         the family's sliding window (a 13-token prompt never exercises it), unpadded; the rows are
         reported as cases `padded` and `long`
decode   built later from HF's own greedy generation of the short prompt (validator/plan.py): the
         reference recomputes that sequence in one forward, and every position of the engine's
         capture during its own generation is compared with it
"""
from __future__ import annotations

import hashlib

import torch

from validator.engines.base import Case

SHORT = "The capital of France is Paris, and the capital of Germany is"
LONG = ("Interpretability research studies the internal activations of neural networks. A transformer has "
        "attention layers and multilayer perceptron layers, with a residual stream. The sliding window "
        "attention only looks at the most recent tokens of the context. ")
MIN_LONG = 48  # tokens, also when the family has no sliding window
DECODE_TOKENS = 4  # new tokens of every checked generation (3 fed back)


def sliding_window(cfg) -> int:
    """The largest local-attention window the config declares (0 when none)."""
    w = [getattr(cfg, k, None) for k in ("sliding_window", "attention_window", "local_window")]
    return max([int(x) for x in w if isinstance(x, int) and not isinstance(x, bool)] or [0])


def _avoid(n_tokens: int, cfg) -> bool:
    """Prompt lengths equal to a head count make [b, h, pos, hd] vs [b, pos, h, hd] ambiguous."""
    heads = {getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None), 1}
    return n_tokens in heads


def _encode(tok, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


def build_cases(tokenizer, cfg) -> list[Case]:
    """The short and padded (short + long) cases of one model (token ids on the CPU)."""
    short = _encode(tokenizer, SHORT)
    while _avoid(len(short), cfg):
        short = short + _encode(tokenizer, " and")[-1:]
    max_pos = getattr(cfg, "max_position_embeddings", None) or 4096
    want = max(MIN_LONG, sliding_window(cfg) + 16)
    if want > max_pos - DECODE_TOKENS - 1:
        raise ValueError(f"the long prompt needs {want} tokens (sliding window {sliding_window(cfg)} + 16) "
                         f"but the model has only {max_pos} positions.")
    text, long = LONG, _encode(tokenizer, LONG)
    while len(long) < want:
        text += LONG
        long = _encode(tokenizer, text)
    long = long[:want]
    while _avoid(len(long), cfg):
        long = long[:-1]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    n = len(long)
    padded = torch.tensor([[pad] * (n - len(short)) + short, long])
    pmask = torch.tensor([[0] * (n - len(short)) + [1] * len(short), [1] * n])

    def one(name, ids):
        t = torch.tensor([ids])
        return Case(name, t, torch.ones_like(t), torch.ones_like(t, dtype=torch.bool))

    return [one("short", short),
            Case("padded", padded, pmask, pmask.bool(), meta={"short_row": 0, "short_len": len(short), "long_row": 1})]


def decode_case(sequence: torch.Tensor) -> Case:
    """The reference side of decode-time capture: the whole generated sequence minus its last token
    (which was never fed back), compared at every position."""
    ids = sequence[:, :-1].cpu()
    return Case("decode", ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))


def digest(cases: list[Case]) -> str:
    """sha256 over every case's token ids and mask (the prompt digest of a cell)."""
    h = hashlib.sha256()
    for c in cases:
        h.update(c.name.encode())
        h.update(c.input_ids.cpu().numpy().tobytes())
        h.update(c.attention_mask.cpu().numpy().tobytes())
    return h.hexdigest()[:16]
