"""Backends other than eager: vLLM with hooks (`vllm`), vLLM with fixed tap buffers baked into the
compiled forward (`vllm-static`) and stock vLLM (`vllm-generate`). `engine.loading.load_model`
dispatches here through `vllm_backend.load`.

    vllm_tree     where each point lives in vLLM's module tree, one small table per architecture
    vllm_runtime  environment, engine construction, the model runner, load-time report
    vllm_batch    per-request plans and demultiplexing of the flattened continuous batch
    vllm_hooked   `vllm`: Python hooks that read/steer each request's own rows
    vllm_static   `vllm-static`: preallocated capture/steer buffers inside the compiled forward
    vllm_proof    the startup proof that static taps capture real data and steers act
    vllm_attn     attn_scores / attn_probs recomputed from captured q and k
    vllm_results  what requests return
    vllm_backend  the public model class and `load`
"""
