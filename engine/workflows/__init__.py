"""Workflows built on any loaded model (they take a model, never a backend class).

Its modules, one line each: the tree in docs/architecture.md (tests/test_architecture_map.py keeps it whole).
"""
