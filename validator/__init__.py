"""The validator: proof that every point the engine serves is the tensor its definition names, in every
form users use it, and proof of the proof (seeded bugs it must catch).

`python -m validator run` loads each model once, as `load_model` gives it (attention "auto"), builds a
plan of what to check (prompt cases, addresses and their other forms, steering cases, lens layers,
readouts, generations), runs it on the engine, runs each reference engine (HF itself, TransformerLens,
nnsight, nnterp, the published interp-engine package; the engine's own vLLM backends on request) on
the same token ids with the same attention kernels, scores every pair and writes one JSON cell per
model x engine x variant under reports/validator/cells/ (ad-hoc runs: .validator/runs/). `report`
renders the tables from the cells; `show MODEL` prints one model's details; `selftest` seeds engine
bugs one at a time and checks each fails the run, naming the point.

Modules, one job each:
    prompts      the prompt cases (short, longer than the sliding window, padded batch)
    matrix       which points and layers each model is checked at
    plan         what one model is checked on beyond capture: address forms, steering cases,
                 readouts, lens layers, generations (values drawn from the HF reference)
    maths        the validator's own maths: positions, every steering op, readouts, its SAE
    subject      the engine under test through its public API (any backend)
    sides        the tested side and each reference's expected side of every check
    checks       every comparison of a cell as a pair, and their scoring
    columns      one model prepared once; each column's expected side, tested side and rows
    engines/     the reference adapters and their registry (one table entry per engine);
                 interp_align: how interp-engine's layouts line up with ours (one rule per point)
    scoring      metrics, structural checks, verdicts
    rows         a row's verdict with the declared gaps applied, and its message
    tolerances   exactness and the tolerance tiers (the one place they are stated)
    known_gaps   declared gaps, known bugs, definitional differences and measured inexactness
    mutations    seeded engine bugs; selftest runs them (the validator's own score)
    variant      what changes a cell's meaning besides model and engine (its file key)
    cells        cell files: strict reading, provenance, digests, atomic writes, resume
    outputs      where a run writes (published vs ad hoc), --out checks, log files
    runner       the per-model loop (errors never replace passing cells)
    workers      --jobs processes that die with the run
    quiet        third-party output to the run's log; progress: the console's one bar
    report       README matrix, per-model details, summary CSV, heatmap, drift check
    dropin       the interp-engine drop-in table (point by point)
    exits        exit codes; pipes: quiet exit on a closed stdout
    cli          argument parsing; cli_scale: plan, merge, report --since, run's --shard / --ray
    budget       each cell's memory from the checkpoint's config, and the GPUs it needs (accelerate)
    costs        each cell's expected time from the durations earlier cells recorded
    schedule     the plan of a run: per cell GPUs, time, and the declared gaps that do not fit
    shards       --shard i/N (balanced by expected time) and merging the shards' cells
    cluster      run --ray: each model's cells as a Ray task; the driver writes the cells
    history      what changed since a reference run, and each published run's dated record
"""
