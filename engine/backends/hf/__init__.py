"""The eager backend: the HF model with hooks; serves every point, capture and steering, with gradients.

    eager       EagerModel: load, run_with_cache, generate, steer contexts
    stream      token-by-token generation (StreamStep) on the eager model
    sites       where (in one loaded HF model) a point at a layer is read and written: one resolver per point
    site_kinds  the typed sites (module output, input, attention internals, ...) and how each attaches
    attention   attention scores/probs recomputed from the HF attention module's inputs
"""
