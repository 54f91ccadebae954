"""The site's data, generated: `python -m visualizer_data build [--check]` writes
visualizer-data/{points,architectures,validation,benchmarks}.generated.ts from their sources
(engine/core/points.py, engine/families + the zoo twins, the validator cells, the benchmark cells)."""
