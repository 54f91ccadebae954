"""Family adapters, one small module per family or group; every module here is imported so its
`register(...)` call runs. Add a family by adding a module with a Family table entry."""
from engine.families.base import (  # noqa: F401
    Family,
    FusedSplit,
    Router,
    Split,
    Streams,
    family_for,
    load_all,
    register,
    registry,
)

load_all()
