"""Where the engine meets vLLM's V1 model runner: where a schedule arrives (`execute_model`), where
a step begins and ends (`_model_forward`, or module hooks where the runner has no such method), and
the step's row geometry from the runner's host copies. Each wrap replaces the instance's method with
one around the class's own, so a second setup never nests (engine/backends/vllm/worker/runner.py says
why V1)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from engine.backends.vllm.worker.tree import Tree


def query_start_loc(ctx: Any) -> list[int]:
    """The step's query_start_loc from the forward context's attention metadata (a device read: used
    only where the runner keeps no host copy, host_rows)."""
    md = ctx.attn_metadata
    for m in (md.values() if isinstance(md, dict) else [md]):
        q = getattr(m, "query_start_loc", None)
        if q is not None:
            return q.tolist()
    raise RuntimeError("the forward context carries no attention metadata with query_start_loc; this "
                       "architecture has no softmax attention layer the engine can align rows with")


def host_rows(runner: Any, batch_rows: list[int]) -> tuple[list[int], list[int]] | None:
    """(query_start_loc, the first position of each of `batch_rows`) from the host copies V1's runner
    fills before every forward (query_start_loc.np, input_batch.num_computed_tokens_cpu): no device
    read. None where the runner keeps no such copies."""
    qsl = getattr(getattr(runner, "query_start_loc", None), "np", None)
    batch = getattr(runner, "input_batch", None)
    computed = getattr(batch, "num_computed_tokens_cpu", None)
    if qsl is None or batch is None or computed is None:
        return None
    n = batch.num_reqs
    return qsl[:n + 1].tolist(), [int(computed[i]) for i in batch_rows]


def hooks_fire(module: torch.nn.Module) -> bool:
    """True when calling the module runs torch's hooks. vLLM's @support_torch_compile replaces a
    class's __call__ with one that calls forward (or the compiled graph) directly, skipping them."""
    return type(module).__call__ is torch.nn.Module.__call__


def step_anchors(model: torch.nn.Module, tree: Tree
                 ) -> tuple[torch.nn.Module, torch.nn.Module, int, str | None]:
    """(module whose pre-hook begins a step, module whose hook ends it, index of `positions` in the
    begin module's positional args, why no anchor can work or None).

    The top-level model is the anchor wherever its hooks fire. Some vLLM classes are compile-decorated
    at the top (Ernie4_5ForCausalLM in vLLM 0.32): then the first decoder layer begins the step
    (it receives `positions` first) and the final norm ends it; those fire only when the forward runs
    uncompiled (vllm, or vllm-static with compile=False)."""
    from engine.model.paths import get_path
    if hooks_fire(model):
        return model, model, 1, None
    layers = get_path(model, tree.layers)
    end = get_path(model, tree.final_norm) if tree.final_norm else layers[-1]
    error = None
    if not getattr(model, "do_not_compile", True):
        error = (f"vLLM compiles {type(model).__name__} as a whole (its top-level class is "
                 f"torch.compile-decorated), so no step boundary is visible to the engine; load "
                 f"vllm-static with compile=False for this architecture")
    return layers[0], end, 0, error


def wrap_execute_model(runner: Any, before: Callable[[Any], None]) -> bool:
    """Run before(scheduler_output) ahead of every call of the runner's `execute_model` (the worker's
    one call per schedule, before the runner updates its states or runs a forward). False where the
    runner has no such method."""
    if not callable(getattr(type(runner), "execute_model", None)):
        return False
    orig = type(runner).execute_model.__get__(runner)  # the class's, so a second setup never nests

    def execute_model(scheduler_output, *args, **kwargs):
        before(scheduler_output)
        return orig(scheduler_output, *args, **kwargs)
    runner.execute_model = execute_model
    return True


def wrap_model_forward(runner: Any, begin: Callable[[None, tuple, dict], None],
                       end: Callable[[None, tuple, Any], None]) -> bool:
    """Run begin(None, args, kwargs) before and end(None, args, output) after every call of the V1
    runner's `_model_forward` (eager, compiled, PIECEWISE or FULL CUDA-graph replay alike: the call
    itself is Python). False where the runner has no such method (then module hooks anchor steps)."""
    if not callable(getattr(type(runner), "_model_forward", None)):
        return False
    orig = type(runner)._model_forward.__get__(runner)  # the class's, so a second setup never nests

    def model_forward(*args, **kwargs):
        begin(None, args, kwargs)
        out = orig(*args, **kwargs)  # a failure here ends the engine; the next begin starts afresh
        end(None, args, out)
        return out
    runner._model_forward = model_forward
    return True
