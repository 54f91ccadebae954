"""What a server is started with besides its model: one frozen object, checked once where it is
made (`python -m engine.serve`'s flags, or a caller of `build_app`), then trusted everywhere.

The size limits default to the machine: a request's captures may hold at most 1/64 of its memory
(between 16 MiB and 256 MiB), raw and encoded alike, so 64 maximal answers in flight fit in it.
The connection, stream, engine and shutdown bounds keep the server up under slow or idle clients and
a dead or hung engine (docs/uptime.md says what each one does and why its default).
"""
from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

MIB = 1 << 20


def machine_bytes() -> int | None:
    """Physical memory of this machine in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def size_for_machine(total: int | None = None) -> int:
    """The default capture and response limit: 1/64 of the machine's memory, within [16 MiB, 256 MiB]
    (256 MiB where the memory is not known)."""
    total = machine_bytes() if total is None else total
    if total is None:
        return 256 * MIB
    return max(16 * MIB, min(256 * MIB, total // 64))


# field -> the command-line flag that sets it (errors name the flag a user typed)
FLAGS = {"served": "--served-model-name", "api_key": "--api-key", "max_body_bytes": "--max-body-bytes",
         "max_pending": "--max-pending", "max_capture_bytes": "--max-capture-bytes",
         "max_response_bytes": "--max-response-bytes", "max_tokens_limit": "--max-tokens-limit",
         "chat_template": "--chat-template", "cpu_workers": "--cpu-workers", "sae_dir": "--sae-dir",
         "header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout",
         "keep_alive_timeout_s": "--keep-alive-timeout", "max_connections": "--max-connections",
         "max_connections_per_client": "--max-connections-per-client", "open_files": "--open-files",
         "stream_stall_timeout_s": "--stream-stall-timeout", "stream_buffer_bytes": "--stream-buffer-bytes",
         "engine_restarts": "--engine-restarts", "engine_hang_timeout_s": "--engine-hang-timeout",
         "shutdown_grace_s": "--shutdown-grace"}
ZERO_OK = ("engine_restarts",)  # whole-number fields where 0 means "none"


@dataclass(frozen=True)
class ServeSettings:
    """The server's settings (see `python -m engine.serve --help` for each)."""
    served: tuple[str, ...] = ()  # names clients send as `model`; empty: the model's own name
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on /v1/* and /metrics
    max_body_bytes: int = 16 * MIB  # request body limit (413 above)
    max_pending: int = 256  # sequences in flight before new requests get a 429
    max_capture_bytes: int = field(default_factory=size_for_machine)  # raw captured bytes one request may return
    max_response_bytes: int = field(default_factory=size_for_machine)  # encoded captures one response may carry
    max_tokens_limit: int | None = None  # largest max_tokens a request may ask
    chat_template: str | None = None  # a Jinja chat template for models without one
    cpu_workers: int = 2  # threads that parse, check, tokenize and write requests off the event loop
    sae_dir: str | None = None  # the folder whose SAEs requests may name
    # connections (engine/serve/connections.py)
    header_timeout_s: float = 10.0  # a connection's request headers complete within this, else 408 and closed
    body_timeout_s: float = 60.0  # a request's body arrives within this once its headers did, else 408 and closed
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this (uvicorn's own timer)
    max_connections: int = 2048  # open connections; one more is answered 503 and closed
    max_connections_per_client: int = 256  # open connections of one client address; one more: 503, closed
    open_files: int = 65535  # the soft open-file limit is raised toward this (at most the hard limit) at start
    # slow readers (engine/serve/connections.py)
    stream_stall_timeout_s: float = 30.0  # a response whose client takes none of it for this long is aborted
    stream_buffer_bytes: int = 4 * MIB  # a response with more unsent bytes than this waiting is aborted
    # the engine (engine/serve/supervisor.py)
    engine_restarts: int = 3  # restarts of a dead or hung engine within 10 minutes; then the process exits 1
    engine_hang_timeout_s: float = 60.0  # work queued and no engine step for this long: the engine is hung
    shutdown_grace_s: float = 5.0  # on SIGTERM in-flight requests may finish within this, then get a 503

    def __post_init__(self) -> None:
        served = (self.served,) if isinstance(self.served, str) else tuple(self.served or ())
        object.__setattr__(self, "served", served)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", "int | None") and v is not None:
                least = 0 if f.name in ZERO_OK else 1
                if isinstance(v, bool) or not isinstance(v, int) or v < least:
                    raise ValueError(f"{f.name} ({FLAGS[f.name]}) must be a whole number of at least {least}, "
                                     f"got {v!r}")
            if f.type == "float" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                      or v <= 0):
                raise ValueError(f"{f.name} ({FLAGS[f.name]}) must be a number of seconds above 0, got {v!r}")
        if not all(isinstance(n, str) and n for n in served):
            raise ValueError(f"served ({FLAGS['served']}) names must be non-empty strings, got {served!r}")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key.strip()):
            raise ValueError(f"api_key ({FLAGS['api_key']}) must be a non-empty string when given")
        if self.chat_template is not None and not (isinstance(self.chat_template, str) and self.chat_template.strip()):
            raise ValueError(f"chat_template ({FLAGS['chat_template']}) must be a non-empty template when given")
        if self.sae_dir is not None and not Path(self.sae_dir).is_dir():
            raise ValueError(f"sae_dir ({FLAGS['sae_dir']}): {self.sae_dir!r} is not a folder; give the folder that "
                             f"holds one SAE folder each")

    def names(self, model_name: str) -> list[str]:
        """The names this server answers to (the model's own when none were given)."""
        return list(self.served) or [model_name]


def default(name: str) -> Any:
    """A field's default: the one place the command line's defaults come from."""
    f = next(f for f in fields(ServeSettings) if f.name == name)
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc,operator]
