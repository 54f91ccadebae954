"""What runs inside vLLM's worker processes; imports only engine.core, engine.model, engine.families and
itself (never the client side, which imports it).

Its modules, one line each: the tree in docs/architecture.md (tests/test_architecture_map.py keeps it whole).
"""
