"""The vLLM backends, client side (the user's process): `vllm` (hooks), `vllm-static` (taps baked into
the compiled forward) and `vllm-generate` (stock).

Its modules, one line each: the tree in docs/architecture.md (tests/test_architecture_map.py keeps it whole).
"""
