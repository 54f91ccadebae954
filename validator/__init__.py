"""The validator: proof that every point the engine serves is the tensor its definition names.

`python -m validator run` loads each model once, captures every point the family has with the
engine (one forward per prompt), runs each reference engine (HF itself, TransformerLens, nnsight,
nnterp, the published interp-engine package; the engine's own vLLM backends on request) on the
same token ids, scores the pairs and writes one JSON cell per model x engine x variant under
reports/validator/cells/ (ad-hoc runs: .validator/runs/). `python -m validator report` renders
the tables from the cells; `show MODEL` prints one model's details.

Modules, one job each:
    prompts      the prompt cases (short, longer than the sliding window, padded batch, decode)
    matrix       which points and layers each model is checked at
    subject      the engine side: capture every case in one forward each, decode, steering
    engines/     the reference adapters and their registry (one table entry per engine);
                 interp_align: how interp-engine's layouts line up with ours (one rule per point)
    scoring      metrics, structural checks, verdicts
    tolerances   the tolerance tiers (the one place they are stated)
    known_gaps   declared gaps, known upstream bugs and definitional differences, with evidence
    variant      what changes a cell's meaning besides model and engine (its file key)
    cells        cell files: strict reading, provenance, digests, atomic writes, resume
    outputs      where a run writes (published vs ad hoc), --out checks, log files
    runner       the per-model loop (errors never replace passing cells)
    workers      --jobs processes that die with the run
    quiet        third-party output to the run's log; progress: the console's one bar
    report       README matrix, per-model details, summary CSV, heatmap, drift check
    dropin       the interp-engine drop-in table (point by point)
    exits        exit codes; pipes: quiet exit on a closed stdout
    cli          argument parsing
"""
