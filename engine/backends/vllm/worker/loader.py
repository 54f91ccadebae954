"""vllm-static's taps, installed through vLLM's public model-loader registry.

`load_format="interp_static"` loads weights exactly like vLLM's default loader, then wraps the
declared modules with fixed tap buffers (engine/backends/vllm/worker/static.py) before vLLM first runs,
and so before torch.compile traces the forward or CUDA graphs are captured: the taps are part of
the compiled graph. The declared addresses arrive in `model_loader_extra_config["interp_static"]`.
Every decoder layer also gets the in-graph layer guard (engine/backends/vllm/worker/guard.py),
whatever was declared.
The taps are kept on the model object, where the worker extension finds them.
"""
from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader

from engine.core.address import parse
from engine.core.points import HEADED_POINTS

if TYPE_CHECKING:
    import torch
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.load import LoadConfig

LOAD_FORMAT = "interp_static"
CONFIG_KEY = "interp_static"
TAPS_ATTR = "_interp_static_taps"
ERRORS_ATTR = "_interp_static_errors"  # declared address -> why it cannot be a tap on this model


@register_model_loader(LOAD_FORMAT)
class StaticTapLoader(DefaultModelLoader):
    def __init__(self, load_config: LoadConfig) -> None:
        extra = dict(load_config.model_loader_extra_config or {})
        self.declared = extra.pop(CONFIG_KEY, [])
        own = copy.copy(load_config)  # the weights themselves load exactly as vLLM's default would
        own.load_format, own.model_loader_extra_config = "auto", extra
        super().__init__(own)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> torch.nn.Module:
        model = super().load_model(vllm_config, model_config, prefix)
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from engine.backends.vllm.worker.static import StaticTaps
        from engine.backends.vllm.worker.tree import tree_for
        cfg = model_config.hf_config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        tree = tree_for(model, cfg)
        rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        from engine.core.errors import UnsupportedPointError
        site_of = functools.partial(_site, model, tree, rank, tp)
        good, errors = [], {}
        for a, writable in self.declared:  # a tap that cannot be is reported, not raised: the client
            try:                           # names it and shuts the engine down cleanly
                site_of(parse(a))
                good.append((parse(a), writable))
            except UnsupportedPointError as e:
                errors[a] = str(e)
        taps = StaticTaps()
        rows, device = vllm_config.scheduler_config.max_num_batched_tokens, next(model.parameters()).device
        # ModelConfig.dtype is declared `ModelDType | torch.dtype` but holds the torch.dtype once the config is built
        dtype: torch.dtype = model_config.dtype  # type: ignore[assignment]
        from engine.model.paths import get_path
        layers = list(get_path(model, tree.layers))
        # the banks (stacked coefficients) and the guard's marks live on the first decoder layer (inside the compiled
        # forward); each tap keeps its own cap, pre, change and flag buffers
        taps.install(good, site_of, cfg.hidden_size, rows, device, dtype, {p: hd for p in HEADED_POINTS}, layers[0])
        # every decoder layer guarded, after the taps (so outside a resid_post tap): worker/guard.py
        taps.install_guard(layers, tree)
        setattr(model, TAPS_ATTR, taps)
        setattr(model, ERRORS_ATTR, errors)
        return model


def _site(model, tree, rank, tp, addr):
    from engine.backends.vllm.worker.tree import resolve
    return resolve(model, tree, addr.point, addr.layer, rank, tp)
