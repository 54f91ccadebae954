"""The interpretability engine: one activation naming on every architecture, captured and steered
on eager HF or vLLM, checked against TransformerLens, nnsight/nnterp and HF itself.

    from engine import load_model, Steer
    m = load_model("meta-llama/Llama-3.2-1B")            # real if cached, else the tiny zoo twin
    logits, cache = m.run_with_cache("Hello world", ["resid_post.-1", "z.0.head-1"])
"""
from engine.address import Address, parse
from engine.errors import (AddressError, EngineError, FamilyLimitationError, InputError, ModelNotFoundError,
                           OptionError, SteeringError, UnsupportedPointError)
from engine.loading import BACKENDS, load_model
from engine.results import ActivationCache, GenerationResult, Request, RequestResult
from engine.points import POINTS, get_point
from engine.steering import Steer


def run_with_cache(model, inputs, points=(), steer=()):
    """Module-level form of `model.run_with_cache`."""
    return model.run_with_cache(inputs, points, steer)


__all__ = ["Address", "parse", "load_model", "run_with_cache", "Steer", "POINTS", "get_point", "BACKENDS",
           "ActivationCache", "GenerationResult", "Request", "RequestResult",
           "EngineError", "AddressError", "UnsupportedPointError", "SteeringError", "ModelNotFoundError",
           "OptionError", "InputError", "FamilyLimitationError"]
