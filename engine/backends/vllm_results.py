"""What the vLLM backends return: per-request results, and eager-shaped views of a batch."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model import ActivationCache
from engine.steering import Steer


@dataclass
class Request:
    """One request of a concurrent batch: its own prompt, length, captures and steers."""
    prompt: "str | list[int]"
    max_new_tokens: int = 8
    points: "list | tuple | str" = ()
    steer: "list | tuple | Steer" = ()
    sampling: dict = field(default_factory=dict)


@dataclass
class RequestResult:
    prompt_ids: torch.Tensor  # [P]
    new_tokens: torch.Tensor  # [N]
    text: str
    cache: ActivationCache  # [pos, ...]: the prompt, then every generated token fed back (P + N - 1)
    logits: torch.Tensor | None  # [N, vocab]: the scores each new token was chosen from
    cached_tokens: int = 0  # prompt tokens vLLM served from its prefix cache (0 when capturing/steering)
    recomputed: int = 0  # times the scheduler preempted and recomputed this request

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.new_tokens])


@dataclass
class VLLMGeneration:
    """Per-request results, and eager-shaped [b, ...] views when every request has the same lengths
    (otherwise tokens/new_tokens/logits and cache values are lists, one entry per request)."""
    requests: list[RequestResult]
    tokens: object = None
    new_tokens: object = None
    text: list[str] = field(default_factory=list)
    cache: ActivationCache | None = None
    logits: object = None


def stack(items):
    """[b, ...] when every item has one shape, else the list (None if any is None)."""
    if any(i is None for i in items):
        return None
    same = len({tuple(i.shape) for i in items}) == 1
    return torch.stack(items) if same else list(items)
