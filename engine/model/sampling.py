"""Sampling knobs: one set of names on every backend, checked once.

    temperature   0 (default) = greedy; > 0 samples from softmax(logits / temperature)
    top_p         nucleus sampling: the smallest set of tokens whose probability reaches top_p (0 < p <= 1)
    top_k         sample among the k most likely tokens (None = all)
    seed          makes a sampled generation repeatable (eager: seeds torch's global generator for the
                  call, whose state is put back after it; vLLM: the request's own generator). Samples
                  differ between backends; greedy tokens do not. On eager the rows of a call share
                  the generator, so a seeded row's tokens depend on the rest of its batch: the same
                  call repeats, the same prompt in another batch need not.

`Sampling.parse(kw, backend)` refuses unknown names by name (`do_sample` included: say temperature>0);
vLLM also takes SamplingParams' own fields, as vLLM-only extras.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.core.backends import backend_for
from engine.core.errors import OptionError
from engine.core.integers import as_int

KNOBS = ("temperature", "top_p", "top_k", "seed")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    extra: tuple = ()  # vLLM SamplingParams fields beyond the knobs, as (name, value) pairs

    @classmethod
    def parse(cls, kw: dict, backend: str) -> "Sampling":
        kw = dict(kw or {})
        extras_taken = backend_for(backend).runtime.sampling_extras  # vLLM: SamplingParams fields, one sample each
        if "do_sample" in kw:
            raise OptionError("do_sample is not a knob here: sample with temperature > 0 (greedy is temperature=0, "
                              "the default); the same names work on every backend: " + ", ".join(KNOBS) + ".")
        extra = {k: kw.pop(k) for k in list(kw) if k not in KNOBS}
        if extra and not extras_taken:
            raise OptionError(f"unknown sampling option{'s' if len(extra) > 1 else ''} {sorted(extra)} for backend "
                              f"{backend!r}; the knobs every backend takes are {', '.join(KNOBS)}.")
        n = extra.get("n", 1)
        if extras_taken and (isinstance(n, bool) or n != 1):
            raise OptionError(f"n={n!r}: the vLLM backends run one sample per request, so each request's captured "
                              f"rows and steers are its own; pass the prompt several times instead "
                              f"(generate([prompt] * k, temperature=...)).")
        if extra:
            from vllm import SamplingParams
            known = set(SamplingParams.__struct_fields__) if hasattr(SamplingParams, "__struct_fields__") else set()
            bad = sorted(k for k in extra if known and k not in known)
            if bad:
                raise OptionError(f"unknown sampling option{'s' if len(bad) > 1 else ''} {bad}; the knobs every "
                                  f"backend takes are {', '.join(KNOBS)} (vLLM also takes SamplingParams fields).")
        t = kw.get("temperature", 0.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:  # NaN fails too
            raise OptionError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}.")
        p = kw.get("top_p", 1.0)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise OptionError(f"top_p must be in (0, 1], got {p!r}.")
        k_in, s_in = kw.get("top_k"), kw.get("seed")  # any integer scalar (numpy's, a 0-d tensor)
        k, s = as_int(k_in), as_int(s_in)
        if k_in is not None and (k is None or k < 1):
            raise OptionError(f"top_k must be an int >= 1 or None, got {k_in!r}.")
        if s_in is not None and (s is None or not -(2 ** 63) <= s < 2 ** 63):
            raise OptionError(f"seed must be an int64 (-2**63 <= seed < 2**63) or None, got {s_in!r}.")
        if t == 0 and (p != 1.0 or k is not None):
            raise OptionError("top_p / top_k shape a sampled distribution, but temperature is 0 (greedy); set "
                              "temperature > 0 to sample.")
        return cls(float(t), float(p), k, s, tuple(sorted(extra.items())))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def hf(self) -> dict:
        """Keyword arguments of HF generate."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or 0}

    def vllm(self) -> dict:
        """Keyword arguments of vLLM's SamplingParams."""
        out = {"temperature": self.temperature, "top_p": self.top_p}
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.seed is not None:
            out["seed"] = self.seed
        out.update(dict(self.extra))
        return out
