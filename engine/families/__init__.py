"""Family adapters, one small module per family or group; every module here is imported so its
`register(...)` call runs. Add a family by adding a module with a Family table entry."""
import importlib
import pkgutil

from engine.families.base import Family, FusedSplit, Router, Split, Streams, family_for, register, registry  # noqa: F401

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base":
        importlib.import_module(f"{__name__}.{_mod.name}")
