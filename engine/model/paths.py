"""Walking a dotted path ("model.layers.3.mlp") in a module tree: shared by the HF sites, the lens,
the weight layout and the vLLM worker, so it lives below all of them and imports nothing."""
from __future__ import annotations

from typing import Any


def get_path(root: Any, path: str) -> Any:
    """Resolve a dotted path (numeric parts index ModuleLists); None when any part is missing."""
    obj = root
    for part in path.split("."):
        if obj is None:
            return None
        if part.isdigit():
            try:
                obj = obj[int(part)]
            except (IndexError, TypeError):
                return None
        else:
            obj = getattr(obj, part, None)
    return obj
