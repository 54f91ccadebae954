"""The startup proof of `vllm-static`: taps must return real data and steers must act, or the
engine refuses to serve (a compiled or graph-replayed forward can silently skip Python-side
wiring; see pitfalls.md). It runs under the engine's own CUDA-graph mode (FULL_AND_PIECEWISE on
CUDA: prompts replay piecewise graphs, one-request decode steps a FULL graph) and the refusal names
that mode.

Checks, on a short probe prompt, greedy:
  1. every declared tap captures finite, non-zero rows, one per processed position;
  2. the logits recomputed from the `final_norm` tap pick exactly the tokens vLLM sampled, and
     (when the last layer's resid_post is declared) the lens of that tap gives the same logits;
  3. an `add` steer at the first write tap moves that tap's capture by the vector and changes the
     logits, and its receipt counts every row and the vector's norm at each (the tap's `change` buffer,
     which the graph writes);
  4. a steer at generated positions only moves the decode row (the step a FULL graph replays) by
     the vector, the prompt rows not at all; 5. the next unsteered run reproduces step 1 (write
     buffers were reset).
"""
from __future__ import annotations

from typing import Any

import torch

from engine.core.errors import TapProofError

PROBE = "The quick brown fox jumps over the lazy dog because it was asked to"


# `model` is the VLLMModel: typed Any (as Mode.prove's) because engine/backends/vllm/backend.py reaches this
# module through modes.py and an import back, even for type checking only, would be a cycle (tests/test_imports.py)
def prove_taps(model: Any) -> dict:
    from engine.core.results import Request
    from engine.core.steering import Steer
    mode = model.load_report.cudagraph_mode or "NONE"
    refuse = ("vllm-static refuses to serve {} under cudagraph_mode=" + mode + ": {}; the forward does not run "
              "its taps there. Use compilation_config={{'cudagraph_mode': 'PIECEWISE'}}, compile=False or "
              "backend='vllm'.")
    reads = [str(a) for a in model.declared if a.point != "final_norm"] + ["final_norm"]
    ids = model._prompt_ids(PROBE)
    # sample the raw argmax (no end-of-sequence ban); a logprob, so that vLLM's compiled sampler helper is
    # compiled here, at load, and not on the first request that asks for one (every stream)
    raw = {"min_tokens": 0, "ignore_eos": True, "logprobs": 0}
    base = model.generate_batch([Request(ids, 2, points=reads, sampling=raw)])[0]
    for k in reads:
        t = base.cache[k]
        if t.shape[0] != len(ids) + 1 or not torch.isfinite(t).all() or float(t.abs().max()) == 0.0:
            raise TapProofError(refuse.format(model.name, f"tap {k} captured shape {tuple(t.shape)}, "
                                                          f"max |x| {float(t.abs().max()):.3g}"))
    picked = base.logits.argmax(-1)
    if not torch.equal(picked, base.new_tokens):
        raise TapProofError(refuse.format(model.name, f"logits from the final_norm tap pick {picked.tolist()} "
                                                      f"but vLLM sampled {base.new_tokens.tolist()}"))
    last = f"resid_post.{model.n_layers - 1}"
    lens_err = None
    if last in reads:
        lensed = model.logit_lens(base.cache[last][len(ids) - 1:])
        lens_err = float((lensed - base.logits).abs().max())
        if lens_err > 1e-3 * max(1.0, float(base.logits.abs().max())):
            raise TapProofError(refuse.format(model.name, f"lens of {last} differs from the logits by {lens_err:.3g}"))
    proof = {"taps": len(reads), "sampled": base.new_tokens.tolist(), "lens_max_abs": lens_err,
             "cudagraph_mode": mode}
    writable = [str(a) for a in model.declared if model.catalogue.info(a).get("writable")]
    if writable:
        tap = writable[0]
        x = base.cache[tap]
        g = torch.Generator().manual_seed(0)
        v = torch.randn(x.shape[1:], generator=g)
        v = v / v.norm() * 10.0 * float(x.norm(dim=-1).mean())
        steer = [Steer(tap, "add", v)]
        steered = model.generate_batch([Request(ids, 2, points=[tap], steer=steer, sampling=raw)])[0]
        sizing = model.load_report.sizing
        rel = 1e-3 if sizing is None or sizing.dtype == "float32" else 2e-2  # 16-bit rounding
        tol = rel * float(v.abs().max())
        moved = float((steered.cache[tap][: len(ids)] - x[: len(ids)] - v).abs().max())
        changed = float((steered.logits[0] - base.logits[0]).abs().max())
        if moved > tol or changed < 1e-4:
            raise TapProofError(refuse.format(model.name, f"an add steer at {tap} moved the tap by the vector "
                                                          f"up to {moved:.3g} and changed the logits by {changed:.3g}"))
        (receipt,) = steered.receipts  # every position ran: the prompt, then the first token fed back
        rows, norm = len(ids) + 1, float(v.norm()) * (len(ids) + 1) ** 0.5
        if receipt.rows != rows or abs(receipt.change_norm - norm) > rel * norm:
            raise TapProofError(refuse.format(model.name, f"the add steer's receipt at {tap} says {receipt.rows} rows "
                                                          f"and a change of {receipt.change_norm:.4g}, not {rows} "
                                                          f"rows and {norm:.4g} (the receipts the graph leaves in the ledger)"))
        decode = model.generate_batch([Request(ids, 2, points=[tap], sampling=raw,
                                               steer=[Steer(tap, "add", v, positions="generated")])])[0]
        n = len(ids)  # same prompt rows, so the same first token and the same decode input
        prompt_moved = float((decode.cache[tap][:n] - x[:n]).abs().max())
        decode_moved = float((decode.cache[tap][n:] - x[n:] - v).abs().max())
        if prompt_moved > tol or decode_moved > tol:
            raise TapProofError(refuse.format(model.name, f"a steer at generated positions of {tap} moved the prompt "
                                                          f"rows by {prompt_moved:.3g} and missed the decode row by "
                                                          f"{decode_moved:.3g}"))
        again = model.generate_batch([Request(ids, 2, points=reads, sampling=raw)])[0]
        drift = float((again.logits - base.logits).abs().max())
        if drift > 1e-4 * max(1.0, float(base.logits.abs().max())):
            raise TapProofError(refuse.format(model.name, f"an unsteered run after a steer drifted by {drift:.3g} "
                                                          f"(write buffers not reset)"))
        proof.update(steer_tap=tap, steer_logit_change=changed, reset_drift=drift, receipt_rows=receipt.rows)
    return proof
