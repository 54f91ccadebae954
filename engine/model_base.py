"""What every backend's model class shares beyond its point catalogue: steering blocks scoped to
the calling thread or task, use as a context manager, and a clear error after close()."""
from __future__ import annotations

import contextlib
import contextvars

from engine.catalogue import PointCatalogue
from engine.errors import EngineError


class ModelBase(PointCatalogue):
    """Subclasses set `name`, `backend`, implement `_steer(steer) -> Steer` (validation) and
    `close()`, and call `_init_base()` in their constructor."""

    def _init_base(self) -> None:
        self._point_layers: dict = {}
        self._steers = contextvars.ContextVar(f"steering-{id(self)}", default=())
        self._closed = False

    def _live(self) -> None:
        if self._closed:
            raise EngineError(f"{self.name} ({self.backend}) was closed; load it again with load_model().")

    def _context_steers(self) -> tuple:
        return self._steers.get()

    @contextlib.contextmanager
    def steering(self, *steers):
        """Apply steers to every call made in this block, in this thread or asyncio task (composable:
        nested blocks add up and each exit removes exactly its own steers)."""
        from engine.steer_inputs import validate_steers
        for s in validate_steers(list(steers)):
            self._steer(s)  # refuse a bad steer when the block opens, not at the first call
        token = self._steers.set((*self._steers.get(), *steers))
        try:
            yield self
        finally:
            self._steers.reset(token)

    def to_tokens(self, text, padding_side: str = "left") -> dict:
        """Tokenize a string or a list of strings into input_ids / attention_mask (a padded batch), on
        the device the model's inputs go to (eager: the model's; vLLM: the CPU)."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
        tok = self.tokenizer
        tok.padding_side = padding_side
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        enc = tok([text] if isinstance(text, str) else list(text), return_tensors="pt", padding=True)
        device = self.device if self.backend == "eager" else "cpu"
        return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
