"""Throughput of every backend and of the peers, one process per cell.

    python -m benchmarks run        # sweep -> reports/benchmarks/cells/*.json
    python -m benchmarks report     # -> reports/benchmarks/results-latest.md
    python -m benchmarks publish    # README THROUGHPUT block, visualizer-data/benchmarks.generated.ts, plots
"""
