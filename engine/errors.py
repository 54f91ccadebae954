"""Error types. Every message names the bad input and the fix."""


class EngineError(Exception):
    """Base class for errors raised by the engine."""


class AddressError(EngineError, ValueError):
    """Unknown point, bad layer or coordinate, point absent from the family."""


class UnsupportedPointError(AddressError):
    """The point exists but this backend (or this layer of this family) cannot serve it."""


class SteeringError(EngineError, ValueError):
    """Bad steering input: width, dtype, device, NaN, op, positions."""


class ModelNotFoundError(EngineError, LookupError):
    """A model name that is neither a zoo entry nor a cached real checkpoint."""
