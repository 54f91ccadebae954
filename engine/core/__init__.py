"""The engine's core: what a request means, independent of any model library (no HF or vLLM import,
module-level or deferred; torch is allowed).

Its modules, one line each: the tree in docs/architecture.md (tests/test_architecture_map.py keeps it whole).
"""

# the distribution's name, the one a user reads (README, the site, the server's `owned_by`); the
# published `interp-engine` package is a reference engine the validator compares against, not this
DISTRIBUTION = "interp-standard"
