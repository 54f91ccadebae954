"""SAEs named by directory, loaded once per process and device: what readouts and feature steers
use in an eager model and in each vLLM worker (requests name an SAE by its path and never ship its
weights)."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from engine.core.sae import SAE

_LOADED: dict = {}  # (directory, device) -> SAE
_LOCK = threading.Lock()


def sae_for(spec: Any, device: "torch.device | str") -> SAE:
    """The SAE of `spec` (a directory in SAELens's format, or a loaded SAE) on `device`."""
    if not isinstance(spec, (str, Path)):
        return spec if spec.device == torch.device(device) else spec.to(device)
    key = (str(Path(spec).resolve()), str(torch.device(device)))
    with _LOCK:
        if key not in _LOADED:
            from engine.core.sae_files import load_sae
            _LOADED[key] = load_sae(spec, device=device)
        return _LOADED[key]
