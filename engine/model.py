"""Where the eager backend and the shared result types used to live; kept so that
`from engine.model import EagerModel, ActivationCache` keeps working."""
from engine.backends.eager import EagerModel  # noqa: F401
from engine.results import ActivationCache, GenerationResult  # noqa: F401
