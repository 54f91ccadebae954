"""The startup proof of `vllm-static`: taps must return real data and steers must act, or the
engine refuses to serve (a compiled or graph-replayed forward can silently skip Python-side
wiring; see pitfalls.md).

Checks, on a short probe prompt, greedy:
  1. every declared tap captures finite, non-zero rows, one per processed position;
  2. the logits recomputed from the `final_norm` tap pick exactly the tokens vLLM sampled, and
     (when the last layer's resid_post is declared) the lens of that tap gives the same logits;
  3. an `add` steer at the first write tap moves that tap's capture by the vector and changes the
     logits, and its receipt counts every row and the vector's norm at each (the pre-write buffer);
  4. the next unsteered run reproduces step 1 (write buffers were reset).
"""
from __future__ import annotations

import torch

PROBE = "The quick brown fox jumps over the lazy dog because it was asked to"


class TapProofError(RuntimeError):
    pass


def prove_taps(model) -> dict:
    from engine.results import Request
    from engine.steering import Steer
    refuse = ("vllm-static refuses to serve {}: {}; the forward does not run its taps. "
              "Use compile=False or backend='vllm'.")
    reads = [str(a) for a in model.declared if a.point != "final_norm"] + ["final_norm"]
    ids = model._prompt_ids(PROBE)
    raw = {"min_tokens": 0, "ignore_eos": True}  # sample the raw argmax (no end-of-sequence ban)
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
    proof = {"taps": len(reads), "sampled": base.new_tokens.tolist(), "lens_max_abs": lens_err}
    writable = [str(a) for a in model.declared if model.catalogue.info(a).get("writable")]
    if writable:
        tap = writable[0]
        x = base.cache[tap]
        g = torch.Generator().manual_seed(0)
        v = torch.randn(x.shape[1:], generator=g)
        v = v / v.norm() * 10.0 * float(x.norm(dim=-1).mean())
        steer = [Steer(tap, "add", v)]
        steered = model.generate_batch([Request(ids, 2, points=[tap], steer=steer, sampling=raw)])[0]
        moved = float((steered.cache[tap][: len(ids)] - x[: len(ids)] - v).abs().max())
        changed = float((steered.logits[0] - base.logits[0]).abs().max())
        if moved > 1e-3 * float(v.abs().max()) or changed < 1e-4:
            raise TapProofError(refuse.format(model.name, f"an add steer at {tap} moved the tap by the vector "
                                                          f"up to {moved:.3g} and changed the logits by {changed:.3g}"))
        (receipt,) = steered.receipts  # every position ran: the prompt, then the first token fed back
        rows, norm = len(ids) + 1, float(v.norm()) * (len(ids) + 1) ** 0.5
        if receipt.rows != rows or abs(receipt.change_norm - norm) > 1e-3 * norm:
            raise TapProofError(refuse.format(model.name, f"the add steer's receipt at {tap} says {receipt.rows} rows "
                                                          f"and a change of {receipt.change_norm:.4g}, not {rows} "
                                                          f"rows and {norm:.4g} (the pre-write tap buffer)"))
        again = model.generate_batch([Request(ids, 2, points=reads, sampling=raw)])[0]
        drift = float((again.logits - base.logits).abs().max())
        if drift > 1e-4 * max(1.0, float(base.logits.abs().max())):
            raise TapProofError(refuse.format(model.name, f"an unsteered run after a steer drifted by {drift:.3g} "
                                                          f"(write buffers not reset)"))
        proof.update(steer_tap=tap, steer_logit_change=changed, reset_drift=drift, receipt_rows=receipt.rows)
    return proof
