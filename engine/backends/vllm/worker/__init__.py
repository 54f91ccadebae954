"""What runs inside vLLM's worker processes; imports only engine.core, engine.model, engine.families and
itself (never the client side, which imports it).

    extension  the worker extension (collective_rpc endpoints), step spans, hooks, TP shards
    tree       where each point lives in vLLM's module tree, one resolver per point
    rows       a logits processor that maps vLLM's batch rows to plans
    static     vllm-static's capture/steer buffers and their per-step fill and read
    loader     the registered load format that installs vllm-static's taps before compile
    wire       plain-data messages between client and workers (tensors, plans)
    attn       attn_scores / attn_probs recomputed from captured q and k
"""
