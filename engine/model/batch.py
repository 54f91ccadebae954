"""What every backend's generate_batch shares: the one check of its requests and its progress bar."""
from __future__ import annotations

import sys
from typing import Any

from engine.core.errors import InputError
from engine.core.results import Request


def requests_of(requests: Any) -> list[Request]:
    """`requests` as a list of engine.Request, or an InputError saying how to make one."""
    if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests):
        got = type(requests).__name__ if not isinstance(requests, (list, tuple)) else \
            f"a {type(requests).__name__} holding {type(next(r for r in requests if not isinstance(r, Request))).__name__}"
        raise InputError(f"generate_batch takes a list of engine.Request objects, e.g. [Request('Hello', 8)], got "
                         f"{got}.")
    return list(requests)


class Progress:
    """progress=True: a bar over a batch's requests (on stderr), ticked as each one finishes; otherwise
    nothing."""

    def __init__(self, total: int, on: bool, what: str = "requests") -> None:
        self.bar = None
        if on:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, unit=what.rstrip("s"), desc=what, file=sys.stderr)

    def tick(self, *_: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
