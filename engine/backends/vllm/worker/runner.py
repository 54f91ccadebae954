"""Which vLLM model runner the hooked backends run on: V1, forced, and V2 refused by name.

vLLM 0.32 picks its V2 model runner (vllm/v1/worker/gpu/model_runner.py) by default wherever Triton
runs, i.e. on CUDA. The `vllm` and `vllm-static` backends map a step's flat rows to requests with
V1's machinery, which V2 replaces:
  - V1 hands every logits processor a `BatchUpdate` (added / removed / moved batch indices) before
    the forward; our `RowMap` (engine/backends/vllm/worker/rows.py) tracks it. V2's logits processors are a different class
    (vllm/v1/worker/gpu/sample/logits_processor/interface.py: `add_request(slot)`, and the step's
    `idx_mapping` only at `apply()`, after the forward), so `RowMap` would learn nothing, or a slot
    number where a batch row is meant.
  - V2 reorders the batch every step (decodes first, `sort_batch_req_ids`): batch row i is not
    persistent slot i, and nothing the forward receives names the request of a row.
  - V2 replays FULL CUDA graphs with `cudagraph_manager.run_fullgraph`, which calls neither the model
    nor V1's `_model_forward`, where the step begins and ends (engine/backends/vllm/worker/extension.py).
Supporting V2 means deriving rows from the step's `InputBatch` (`req_ids`, `query_start_loc`), which
V2's `prepare_inputs` returns before the forward (a wrappable seam; not used yet). So the engine sets
VLLM_USE_V2_MODEL_RUNNER=0 for the engines it hooks (a log line says so), and each worker reports the
runner it got; V2 is refused by name, never run with a wrong row map. vllm-generate (stock vLLM, no
rows) keeps vLLM's own choice. vLLM 0.34 removed V1 altogether: the hooked backends refuse it at load
(docs/vllm-internals.md, "Moving the CUDA world to 0.34").
"""
from __future__ import annotations

import importlib.util
import os

from engine.core.backends import backend_for
from engine.core.errors import RunnerError

ENV = "VLLM_USE_V2_MODEL_RUNNER"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"  # removed with the V1 runner in vLLM 0.34 (docs/vllm-internals.md)
V2_PACKAGE = "vllm.v1.worker.gpu."  # V2 runners (the CPU V2 runner subclasses the GPU one)
# engine arguments with which vLLM 0.32 uses V2 whatever the environment says (config/vllm.py)
FORCES_V2 = {"watermark_config": "watermarking", "hisparse_config": "HiSparse attention"}


def _forcing_v2(engine_kw: dict) -> list[str]:
    found = [why for k, why in FORCES_V2.items() if engine_kw.get(k) is not None]
    attn = engine_kw.get("attention_config")
    hisparse = attn.get("hisparse_config") if isinstance(attn, dict) else getattr(attn, "hisparse_config", None)
    if hisparse is not None and FORCES_V2["hisparse_config"] not in found:
        found.append(FORCES_V2["hisparse_config"])
    return found


def force_v1(backend: str, engine_kw: dict) -> tuple[dict, str]:
    """(environment for the engine's processes, what the load report says about the runner).
    Refuses, before starting anything, engine arguments that make vLLM use V2 regardless."""
    if not backend_for(backend).captures:
        return {}, "model runner: vLLM's own choice (stock vLLM, no row map)"
    if importlib.util.find_spec(V1_RUNNER) is None:
        import vllm
        raise RunnerError(f"{backend} runs on vLLM's V1 model runner, which the installed vLLM "
                          f"{getattr(vllm, '__version__', '')} no longer has "
                          f"({V1_RUNNER} is gone: vLLM 0.34 removed it); install the pinned vLLM 0.32 "
                          f"(bash scripts/setup.sh) or use backend='vllm-generate' (stock vLLM, no capture). "
                          f"docs/vllm-internals.md says what moving to 0.34 needs.")
    forcing = _forcing_v2(engine_kw)
    if forcing:
        raise RunnerError(f"{backend} needs vLLM's V1 model runner, but {', '.join(forcing)} makes vLLM 0.32 use V2 "
                          f"(whose batch rows the engine cannot map to requests); drop it or use backend='vllm-generate'.")
    asked = os.environ.get(ENV)
    note = f"model runner: V1 ({ENV}=0: the row map follows V1's persistent batch; V2 is refused)"
    if asked not in (None, "0", "false", "False"):
        note += f"; the environment's {ENV}={asked} is overridden for this engine"
    return {ENV: "0"}, note


def runner_kind(runner: object) -> str:
    """'v2' when the worker's model runner is vLLM's V2 runner (or a subclass), else 'v1'."""
    return "v2" if any(c.__module__.startswith(V2_PACKAGE) for c in type(runner).__mro__) else "v1"


def check(backend: str, kinds: list[str]) -> None:
    """Refuse an engine whose workers run V2 (kinds: one per rank, from interp_setup)."""
    if "v2" in kinds:
        raise RunnerError(f"{backend}: vLLM started its V2 model runner although {ENV}=0 was set; the engine maps "
                          f"batch rows to requests only under V1 (see engine/backends/vllm/worker/runner.py), so it "
                          f"refuses to serve rather than attribute rows to the wrong request. Use "
                          f"backend='vllm-generate' or a vLLM whose V1 runner can be forced.")
