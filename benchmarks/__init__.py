"""Throughput of every backend and of the peers, measured so that ratios can be trusted on a noisy
machine: every variant in a long-lived worker, every workload timed in interleaved rounds, ratios
paired per round and reported as a median with a 95% interval (unresolved when it is too wide).

    python -m benchmarks run [--model M --size real]   # one sweep -> reports/benchmarks/sweeps/<sweep>/
    python -m benchmarks publish                       # report, README block, site data, plots (all or nothing)
    python -m benchmarks publish --check               # fail when a committed output drifted from its cells
    bash benchmarks/gpu.sh                             # the headline sweep on a CUDA machine
"""
