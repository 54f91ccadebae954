"""The backends: eager HF with hooks (`eager`), and vLLM with hooks in its workers (`vllm`), with
fixed tap buffers baked into the compiled forward (`vllm-static`) and stock (`vllm-generate`).
`engine.loading.load_model` dispatches here. Every backend runs the one pipeline of engine/plan.py.

    eager           the HF model: per-call attachment of typed sites (engine/site_kinds.py)
    vllm_backend    `load` and the synchronous VLLMModel (a private event loop drives the async one)
    vllm_client     AsyncVLLMModel: plans to the workers, requests through vLLM, results gathered
    vllm_catalogue  what the engine serves, merged from the workers' own tables
    vllm_runtime    engine start/stop (engine core in its own process), environment, load report
    vllm_sizing     the load defaults by platform (CPU twin numbers, a GPU user's on CUDA), with reasons
    vllm_runner     V1 model runner forced, V2 refused by name
    vllm_wire       plain-data messages between client and workers (tensors, plans)
    vllm_worker     the worker extension (collective_rpc endpoints), step spans, hooks, TP shards
    vllm_rows       a logits processor that maps vLLM's batch rows to plans
    vllm_tree       where each point lives in vLLM's module tree, one resolver per point
    vllm_loader     the registered load format that installs vllm-static's taps before compile
    vllm_static     vllm-static's capture/steer buffers and their per-step fill and read
    vllm_proof      the startup proof that static taps capture real data and steers act
    vllm_attn       attn_scores / attn_probs recomputed from captured q and k
"""
