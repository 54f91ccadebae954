"""The backend-free model surface: what every loaded model offers whichever backend runs it.

Its modules, one line each: the tree in docs/architecture.md (tests/test_architecture_map.py keeps it whole).
"""
