"""Every error the engine raises, in one hierarchy under EngineError (each exported from `engine`).

Every message names the bad input and the fix (`closest` gives the "Did you mean" part). A subclass of EngineError is a refusal of what was
asked (the server answers it with a 4xx naming the field), except EngineFailure and its subclasses
(the engine failed, not the input) and a bare EngineError (a failure while running).

    EngineError
      AddressError (ValueError)         UnsupportedPointError, UnmappedError, PointError
      SteeringError (ValueError)        (NonFiniteSteer and StrictSteerError, beside their data for now)
      ModelNotFoundError (LookupError, ValueError)
      OptionError (ValueError)
      InputError (ValueError)           InputTypeError (TypeError)
      FamilyLimitationError (NotImplementedError)   RunnerError
      SAEError (ValueError)             SAESiteError
      SAESiteWarning (UserWarning: warned, not raised, unless a warnings filter says "error")
      ZooTwinWarning (UserWarning: a name loaded as its zoo twin, random weights; once per name)
      ReadoutError (ValueError)
      MixingError (ValueError)          PartBusyError
      EngineFailure (RuntimeError)      TapProofError
      ServeError                        BodyTooLarge
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, options: Iterable[str], n: int = 3) -> str:
    """A 'did you mean' suffix for error messages."""
    hits = difflib.get_close_matches(word, list(options), n=n, cutoff=0.5)
    return f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""


class EngineError(Exception):
    """Base class for errors raised by the engine."""


class AddressError(EngineError, ValueError):
    """Unknown point, bad layer or coordinate, point absent from the family."""


class UnsupportedPointError(AddressError):
    """The point exists but this backend (or this layer of this family) cannot serve it."""


class UnmappedError(AddressError):
    """Another engine (TransformerLens, nnsight, nnterp) has no hook or accessor holding this tensor
    (engine/interop/mappers.py; the message says why)."""


class PointError(AddressError):
    """A point the harvester cannot store in fixed-width rows (or no point at all)."""


class SteeringError(EngineError, ValueError):
    """Bad steering input: width, dtype, device, NaN, op, positions."""


class ModelNotFoundError(EngineError, LookupError, ValueError):
    """A model name that is neither a local model directory, a zoo entry nor a cached real checkpoint
    (also a ValueError, as unknown names have always been)."""


class OptionError(EngineError, ValueError):
    """A bad load option: dtype, device, source, or a keyword the backend does not take."""


class InputError(EngineError, ValueError):
    """Bad input: an empty prompt, a prompt longer than the model's positions, token ids out of the
    vocabulary, a malformed batch; for a harvest, documents that cannot be read (missing, empty, the
    wrong field, mixed formats)."""


class InputTypeError(InputError, TypeError):
    """Model input of a type no backend takes (also a TypeError)."""


class FamilyLimitationError(EngineError, NotImplementedError):
    """What was asked is a known limitation of the family's upstream implementation (see
    engine/families/limits.py); the message names the limitation and the workaround."""


class RunnerError(FamilyLimitationError):
    """vLLM runs (or would run) its V2 model runner, whose batch rows the hooked backends cannot map
    to requests (engine/backends/vllm/worker/runner.py)."""


class SAEError(EngineError, ValueError):
    """A malformed or mismatched SAE or transcoder: a missing file, a bad cfg.json field, a tensor of the
    wrong shape, an unknown architecture, a width that is not the point's."""


class SAESiteWarning(EngineError, UserWarning):
    """The warning category of an SAE used at another point than the hook its cfg.json names
    (engine/interop/mappers.py check_sae_sites); strict=True on the call refuses it instead
    (SAESiteError). An EngineError too, so a warnings filter that turns it into an error keeps it
    in the one hierarchy."""


class ZooTwinWarning(EngineError, UserWarning):
    """A model name loaded as its zoo twin (no real checkpoint in the local HF cache): the architecture is
    the checkpoint's, the weights seeded random, so what it generates is noise. Said once per name and
    process, where a reader sees the gibberish (engine/loading.py)."""


class SAESiteError(SAEError):
    """strict=True: an SAE used at another point than the hook its cfg.json names."""


class ReadoutError(EngineError, ValueError):
    """A readout that cannot be computed as asked (its kind, its parameters, its address)."""


class MixingError(EngineError, ValueError):
    """A harvest's OUT already holds a harvest made differently; writing into it would mix two datasets."""


class PartBusyError(MixingError):
    """Another process holds the harvest part's lock right now (a scheduler retrying the part of a
    process that is still dying waits for this one to clear)."""


class EngineFailure(EngineError, RuntimeError):
    """The engine failed, not the input: never a client's error."""


class TapProofError(EngineFailure):
    """vllm-static's startup proof failed: a tap did not capture or a test steer did not act
    (engine/backends/vllm/proof.py); the engine refuses to serve."""


class ServeError(EngineError):
    """An HTTP error response of the server: its status, a message saying what was wrong and the fix,
    the request field it is about, extra headers, and `kind`: the class name of the engine's exception it
    reports (None: the server's own refusal), which the remote client raises again."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.kind = status, message, param, headers, kind


class BodyTooLarge(ServeError):
    """A request body over the server's limit (413)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


# -- a model served over HTTP (engine/remote): failures only a remote call has ---------------------
class RemoteError(EngineError):
    """A call to a model server failed for a reason of the server or the network, not of the input.
    `status`: the HTTP status (None when no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerRefused(RemoteError, ValueError):
    """A 4xx that is the server's own refusal rather than the engine's (one of its limits, a field its
    protocol does not take); `param` names the request field."""

    def __init__(self, message: str, status: int | None = None, param: str | None = None) -> None:
        super().__init__(message, status)
        self.param = param


class AuthenticationError(RemoteError, PermissionError):
    """401: the server wants an API key (connect(api_key=...) or $INTERP_API_KEY) and got none or another."""


class ServerBusy(RemoteError):
    """429 / 503 still after every retry: the server's queue is full or it is not ready."""


class ServerFailed(RemoteError):
    """A 5xx other than 503: the server failed while running the call."""


class Disconnected(RemoteError, ConnectionError):
    """No answer: the server could not be reached, dropped the connection, or took longer than the timeout."""

