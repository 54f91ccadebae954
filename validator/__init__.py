"""The validator: proof that every point the engine serves is the tensor its definition names.

`python -m validator run` loads each model once, captures every point the family has with the
engine (one forward per prompt), runs each reference engine (HF itself, TransformerLens, nnsight,
nnterp, later the engine's vLLM backends) on the same token ids, scores the pairs and writes one
JSON cell per model x engine under reports/validator/cells/. `python -m validator report` renders
the tables from the cells; `show MODEL` prints one model's details.

Modules, one job each:
    prompts      the prompt cases (short, longer than the sliding window, padded batch, decode)
    matrix       which points and layers each model is checked at
    subject      the engine side: capture every case in one forward each, decode, steering
    engines/     the reference adapters and their registry (one table entry per engine)
    scoring      metrics, structural checks, verdicts
    tolerances   the tolerance tiers (the one place they are stated)
    known_gaps   declared gaps and known upstream bugs, with evidence
    cells        cell files: provenance, digests, atomic writes, resume
    runner       the per-model loop
    report       README matrix, per-model details, summary CSV, heatmap, drift check
    cli          argument parsing
"""
