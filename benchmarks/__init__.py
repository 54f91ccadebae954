"""Throughput of every backend and of the peers, measured so that ratios can be trusted on a noisy
machine: every variant in a long-lived worker, every workload timed in interleaved rounds, ratios
paired per round and reported as a median with a 95% interval (unresolved when it is too wide).

    python -m benchmarks run [--model M --size real]   # one sweep -> reports/benchmarks/sweeps/<sweep>/
    python -m benchmarks publish                       # report, README block, plots (all or nothing)
    python -m visualizer_data build --only benchmarks,history  # the site data of the same cells (and its history)
    python -m benchmarks publish --check               # fail when a committed output drifted from its cells
    bash benchmarks/gpu.sh                             # the headline run on a CUDA machine (see the script)
    bash benchmarks/device.sh                          # a lent GPU without vLLM: the batched GPU goals (batch_*
                                                       # workloads against HF and the peers), the validator and the
                                                       # README on cuda, in under 8 minutes (device_prep.sh first)

The library's client beside raw httpx (engine.connect; about 3 minutes here):

    python -m benchmarks.remote_cost --rounds 20 --calls 8   # reports/serve/remote-cost.md

Modules: spec (settings), workloads and variants (the two tables), worker (one variant's model, kept
warm, timing samples on request) and pool (its process, from the sweep's side), rounds (the rotated
order), sweep (load, warm up, rounds, checks, cells), cells (strict files), ci (the interval over
rounds), table (what may share a table), ratios (what is compared with what), report / publish /
plots (the outputs; the site's file is visualizer_data/benchmarks_ts.py's, which imports benchmarks,
never the reverse).

Regenerate (zoo cache: INTERP_ZOO_HOME; offline: HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1):

    bash benchmarks/cpu.sh   # both committed CPU sweeps, publish, --check (about 30 min here)

which runs, in turn:

    python -m benchmarks run --model HuggingFaceTB/SmolLM2-135M --size real --rounds 6 --warmups 1 \
        --workloads decode,concurrency8,prefill,capture_all,capture_gen,capture_gen8,steer_all,long_prefill,long_capture
                                                                          # cpu-smollm2-135m-real
    python -m benchmarks run                                              # cpu-llama-3.2-1b-tiny
    python -m benchmarks publish   # results-latest.md, plots, README THROUGHPUT block
    python -m visualizer_data build --only benchmarks,history      # visualizer-data/benchmarks.generated.ts, history.generated.ts

The SAE readout against raw capture alone (tok/s and bytes per token; about 5 minutes here):

    python -m benchmarks run --model HuggingFaceTB/SmolLM2-135M --size real --rounds 6 --warmups 1 \
        --variants eager,vllm,vllm-generate --workloads decode,capture_gen,readout_gen \
        --sweep cpu-smollm2-135m-real-readout && python -m benchmarks publish
"""
