"""The backends, one folder per process world; `engine.loading.load_model` dispatches here and every
backend runs the one pipeline of engine/core/plan.py.

Its modules, one line each: the tree in docs/architecture.md (tests/test_architecture_map.py keeps it whole).
"""
