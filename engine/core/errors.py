"""Error types. Every message names the bad input and the fix."""


class EngineError(Exception):
    """Base class for errors raised by the engine."""


class AddressError(EngineError, ValueError):
    """Unknown point, bad layer or coordinate, point absent from the family."""


class UnsupportedPointError(AddressError):
    """The point exists but this backend (or this layer of this family) cannot serve it."""


class SteeringError(EngineError, ValueError):
    """Bad steering input: width, dtype, device, NaN, op, positions."""


class ModelNotFoundError(EngineError, LookupError, ValueError):
    """A model name that is neither a local model directory, a zoo entry nor a cached real checkpoint
    (also a ValueError, as unknown names have always been)."""


class OptionError(EngineError, ValueError):
    """A bad load option: dtype, device or source."""


class InputError(EngineError, ValueError):
    """Bad model input: an empty prompt, a prompt longer than the model's positions, token ids out of
    the vocabulary, a malformed batch."""


class FamilyLimitationError(EngineError, NotImplementedError):
    """What was asked is a known limitation of the family's upstream implementation (see
    engine/families/limits.py); the message names the limitation and the workaround."""


class InputTypeError(InputError, TypeError):
    """Model input of a type no backend takes (also a TypeError)."""


class SAEError(EngineError, ValueError):
    """A malformed or mismatched SAE or transcoder: a missing file, a bad cfg.json field, a tensor of the
    wrong shape, an unknown architecture, a width that is not the point's."""


class SAESiteWarning(UserWarning):
    """An SAE used at another point than the hook its cfg.json names (engine/interop/mappers.py
    check_sae_sites); strict=True on the call refuses it instead (SAESiteError)."""


class SAESiteError(SAEError):
    """strict=True: an SAE used at another point than the hook its cfg.json names."""
