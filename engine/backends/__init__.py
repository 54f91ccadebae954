"""The backends, one folder per process world; `engine.loading.load_model` dispatches here and every
backend runs the one pipeline of engine/core/plan.py.

    hf/            eager HF with hooks (`eager`): per-call attachment of typed sites
    vllm/          the vLLM client side (`vllm`, `vllm-static`, `vllm-generate`), in the user's process
    vllm/worker/   what runs inside vLLM's worker processes (never imports the client side)
"""
