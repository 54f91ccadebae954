"""The backend-free model surface: what every loaded model offers whichever backend runs it.

    base          ModelBase: the methods every backend's model shares
    capabilities  describe(): what this model serves, point by point, with the reasons for gaps
    catalogue     PointCatalogue: the points this model has, by layer
    paths         get_path: a dotted path walked in a module tree
    lens          the logit lens (final norm + unembedding, with the family's softcap)
    weights       the weight layout (which parameter holds what) for the lens and the mappers
    sources       where a model comes from: the real checkpoint if cached, else its zoo twin
    options       load options (device, dtype, backend knobs) checked once
    sampling      the sampling knobs every backend takes

`from engine.model import EagerModel, ActivationCache, GenerationResult` (the names the old shim module
re-exported) still works for one release, with a DeprecationWarning.
"""
import importlib as _importlib
import warnings as _warnings

_OLD_SHIM = {"EagerModel": "engine.backends.hf.eager", "ActivationCache": "engine.core.results",
             "GenerationResult": "engine.core.results"}


def __getattr__(name: str):
    if name in _OLD_SHIM:
        _warnings.warn(f"engine.model.{name} moved: import it from {_OLD_SHIM[name]} (or `engine`); the old "
                       f"name goes away in the next release.", DeprecationWarning, stacklevel=2)
        return getattr(_importlib.import_module(_OLD_SHIM[name]), name)
    raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
