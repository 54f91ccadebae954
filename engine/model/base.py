"""What every backend's model class shares beyond its point catalogue: verdicts before running
(describe / serves / refuses, engine/model/capabilities.py), steering blocks scoped to the calling thread
or task, use as a context manager, and a clear error after close()."""
from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, Iterator, Self

from engine.core.backends import backend_for
from engine.core.errors import EngineError
from engine.model.api import Aliases
from engine.model.capabilities import CapabilityMixin
from engine.model.catalogue import PointCatalogue

if TYPE_CHECKING:
    from engine.core.steering import Steer


class ModelBase(PointCatalogue, CapabilityMixin, Aliases):
    """Subclasses set `name`, `backend`, implement `_steer(steer) -> Steer` (validation) and
    `close()`, and call `_init_base()` in their constructor."""

    def _init_base(self) -> None:
        self._point_layers: dict = {}
        self._steers: contextvars.ContextVar[tuple] = contextvars.ContextVar(f"steering-{id(self)}", default=())
        self._closed = False

    def _live(self) -> None:
        """Refuse any call on a closed model by name (every public method starts here, or with a call
        that does: tests/test_pipeline_defects.py calls each one after close())."""
        if self._closed:
            raise EngineError(f"{self.name} ({self.backend}) was closed; load it again with load_model().")

    def _context_steers(self) -> tuple:
        return self._steers.get()

    @contextlib.contextmanager
    def steering(self, *steers: Steer) -> Iterator[Self]:
        """Apply steers to every call made in this block, in this thread or asyncio task (composable:
        nested blocks add up and each exit removes exactly its own steers)."""
        from engine.core.steer_checks import check_steers
        self._live()
        check_steers(list(steers), (), self._steer)  # refuse a bad steer when the block opens, not at the first call
        token = self._steers.set((*self._steers.get(), *steers))
        try:
            yield self
        finally:
            self._steers.reset(token)

    def to_tokens(self, text: str | list[str], padding_side: str = "left", prepend_bos: bool | None = None) -> dict:
        """Tokenize a string or a list of strings into input_ids / attention_mask (a padded batch), on
        the device the model's inputs go to (eager: the model's; vLLM: the CPU), with the BOS policy
        `prepend_bos` (None: the model's own, engine/core/tokens.py)."""
        from engine.core.tokens import to_tokens
        self._live()  # a closed model is closed for every call; its tokenizer stays at m.tokenizer
        device = "cpu" if backend_for(self.backend).runtime.own_processes else self.device
        return to_tokens(self.tokenizer, text, padding_side,
                         getattr(self, "prepend_bos", None) if prepend_bos is None else prepend_bos, device)

    def to_string(self, tokens: Any, skip_special_tokens: bool = False) -> str | list[str]:
        """Token ids back to text with this model's tokenizer: one sequence gives a str, a batch (a
        2-D tensor, a list of id lists) a list of str (engine/core/tokens.py)."""
        from engine.core.tokens import to_string
        self._live()
        return to_string(self.tokenizer, tokens, skip_special_tokens)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
