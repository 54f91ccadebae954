"""An HTTP server for the engine: OpenAI-compatible generation with per-request capture and
steering, on vLLM (continuous batching) or eager.

    python -m engine.serve meta-llama/Llama-3.2-1B --backend vllm --port 8000 [--api-key KEY]

Modules, one job each: schemas (request bodies), interp (the `interp` field against the model and
the results cut to it), encoding (tensors in JSON), text (chat template, incremental text, stop
strings), runner (the model behind the server, per backend), routes (the endpoints), capabilities
(/v1/points), guard (auth, body limit, bounded queue), metrics (/metrics), errors (error shapes),
app (wiring), offload (CPU work off the event loop; abandoned requests cancelled),
__main__ (the command line).
"""
from engine.serve.app import build_app
from engine.serve.runner import make as runner_for

__all__ = ["build_app", "runner_for"]
