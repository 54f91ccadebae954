"""Workflows built on any loaded model (they take a model, never a backend class).

    patching           activation patching sweeps and logit differences
    attention_capture  attention patterns for every layer and head in one call
"""
