"""An HTTP server for the engine: OpenAI-compatible generation with per-request capture and
steering, on vLLM (continuous batching) or eager.

    python -m engine.serve meta-llama/Llama-3.2-1B --backend vllm --port 8000 [--api-key KEY]

Modules, one job each: settings (what a server is started with, checked once), schemas (request
bodies, parsed and checked), interp (the `interp` field against the model and the results cut to
it), encoding (tensors in JSON, written in bounded pieces, and binary frames), wire (what the server
and the library's client agree on), text (chat template, incremental text, stop strings), runner
(the model behind the server, per backend), routes (the endpoints), native (the library client's
endpoints: capabilities, tokenize, detokenize, lens), capabilities (/v1/points), guard (auth, body
limit, bounded queue), metrics (/metrics), errors (error shapes), app (wiring; a 500 never closes a
connection), offload (CPU work and answers off the event loop; abandoned requests cancelled),
__main__ (the command line).

`build_app` and `runner_for` are imported on first use, so a client importing the wire pieces
(engine/remote/ imports wire and encoding) does not import the server's stack.
"""
from __future__ import annotations

from typing import Any

__all__ = ["build_app", "runner_for", "ServeSettings"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from engine.serve.app import build_app
        return build_app
    if name == "ServeSettings":
        from engine.serve.settings import ServeSettings
        return ServeSettings
    if name == "runner_for":
        from engine.serve.runner import make
        return make
    raise AttributeError(f"module 'engine.serve' has no attribute {name!r}")
