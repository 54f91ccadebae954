"""The engine's core: what a request means, independent of any model library (no HF or vLLM import,
module-level or deferred; torch is allowed).

    errors        every error type, one hierarchy under EngineError (each names the bad input and the fix)
    integers      as_int: what counts as an integer wherever an index or a count is taken
    backends      the backend registry: each backend's name -> its object (runtime, defaults, knobs)
    points        the point registry: every point's definition and traits
    address       `resid_post.10`, `z.4.head-3`: parsing and the Address type
    positions     which token positions a capture or steer applies to
    steering      Steer, the op table and the maths of each op
    steer_checks  steers validated against a model (once, before any backend sees them)
    plan          per-sequence Plans and what a call's plans do at each site, grouped (SiteWork)
    step          one forward's rows as index tensors, built once per step
    site          run_site: a site's steers, captures and readouts as whole-batch operations; the guard
    ledger        what the steers did (receipts, non-finite rows), kept on the device, read once
    syncs         SyncCounter: host reads of device values made by the engine (tests, benchmarks)
    results       ActivationCache, Request, RequestResult, GenerationResult, StreamStep
    tokens        token/string helpers shared by every backend
    inputs        what a user may pass as input (strings, token lists, tensors) and its limits
    files         write_atomic: the one atomic file writer (engine, validator, benchmarks, site data)
    sae           SAE: SAELens-format SAEs and transcoders (architectures, normalizations, encode, decode)
    sae_files     load_sae / save_sae / random_sae: SAELens's on-disk format (cfg.json + safetensors)
    features      topk / above readouts and feature steering (clamp, scale, add a decoder direction)
"""

# the distribution's name, the one a user reads (README, the site, the server's `owned_by`); the
# published `interp-engine` package is a reference engine the validator compares against, not this
DISTRIBUTION = "interp-standard"
