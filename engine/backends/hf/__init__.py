"""The eager backend: the HF model with hooks; serves every point, capture and steering, with gradients.

Its modules, one line each: the tree in docs/architecture.md (tests/test_architecture_map.py keeps it whole).
"""
