"""The vLLM backends, client side (the user's process): `vllm` (hooks), `vllm-static` (taps baked into
the compiled forward) and `vllm-generate` (stock).

    backend     `load` and the synchronous VLLMModel (a private event loop drives the async one)
    client      AsyncVLLMModel: plans to the workers, requests through vLLM, results gathered
    catalogue   what the engine serves, merged from the workers' own tables
    runtime     engine start/stop (engine core in its own process), environment, load report
    proof       the startup proof that static taps capture real data and steers act
    worker/     what runs inside vLLM's processes
"""
