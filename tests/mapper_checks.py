"""Helpers of tests/test_mappers.py and tests/test_mappers_nnterp.py: the models, the prompt, and how another
engine's tensor is laid out as ours and compared. Run as a script with .nnterp-ref first on PYTHONPATH, it is
also nnterp's side of tests/test_mappers_nnterp.py (nnterp 1.3.0 needs nnsight 0.7.0, which cannot share a
process with .venv's nnsight 0.8.1):

    PYTHONPATH=.nnterp-ref:. .venv/bin/python tests/mapper_checks.py nnterp [--refused-ok] NAME...

prints one JSON object: the nnsight and nnterp versions it ran, and per model the accessors it read and
those whose tensor differs from our capture (or why the model was skipped, or the error it raised)."""
from __future__ import annotations

import torch

from engine import load_model, zoo
from engine.core.address import parse
from engine.interop.mappers import UnmappedError, to_nnterp

TEXT = "When Mary and John went to the store, John gave"
FAMILIES = {"gpt2": "openai-community/gpt2", "llama": "meta-llama/Llama-3.2-1B", "gemma2": "google/gemma-2-2b",
            "mixtral": "mistralai/Mixtral-8x7B-v0.1", "lfm2": "LiquidAI/LFM2-350M", "bloom": "bigscience/bloom-560m",
            "gpt_neox": "EleutherAI/pythia-70m-deduped"}
OTHERS = [n for n in zoo.ZOO if n not in FAMILIES.values()]  # the slow sweeps: every other zoo twin
_M: dict = {}


def model(name):
    if name not in _M:
        _M[name] = load_model(name, source="zoo")
    return _M[name]


def same_layout(ours: torch.Tensor, theirs: torch.Tensor, point: str):
    """theirs in our layout, or None when no layout rule makes the shapes agree."""
    theirs = theirs.detach()
    theirs = theirs.float() if theirs.is_floating_point() else theirs
    if point in ("attn_scores", "attn_probs") and theirs.dim() == 4:
        theirs = theirs.transpose(1, 2)  # [b, h, q, k] -> [b, q, h, k]
    if theirs.shape == ours.shape:
        return theirs
    if theirs.dim() == ours.dim() and theirs.transpose(1, 2).shape == ours.shape:  # heads first
        return theirs.transpose(1, 2)
    if theirs.dim() == ours.dim() - 1 and theirs.numel() == ours.numel():  # heads flattened
        return theirs.reshape(ours.shape)
    if theirs.shape[:2] == ours.shape[:2] and theirs.numel() == ours.numel():  # heads regrouped per position
        return theirs.reshape(ours.shape)
    return None


def close_enough(a, b, point):
    if not a.is_floating_point():
        return torch.equal(a, b.to(a.dtype))
    if point == "attn_scores":  # masked entries: both very negative, compare where allowed
        keep = a > -1e4
        return torch.equal(keep, b > -1e4) and torch.allclose(a[keep], b[keep], rtol=1e-4, atol=1e-4)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4)


# -- nnterp's side (only with .nnterp-ref first on the path) -------------------------------------------------
_NNTERP_RANK = ["layers_input", "attentions_input", "attention_probabilities", "attentions_output", "mlps_input",
                "mlps_output", "layers_output", "ln_final", "logits"]


class Refused(Exception):
    """nnterp refuses to standardize this architecture (RenamingError): the validator's nnterp-unsupported-arch gap."""


def _standardize(name):
    """(nnterp's StandardizedTransformer of a fresh HF model, whether it has attention probabilities).
    Where nnterp cannot find this family's attention probabilities it is built without them (the
    validator's nnterp-probs-source gap); an architecture nnterp refuses to standardize raises Refused.
    Any other error propagates."""
    from nnterp import StandardizedTransformer
    from nnterp.rename_utils import RenamingError

    from engine.loading import load_hf
    hf, tok, _ = load_hf(name, source="zoo", attention="eager")  # a fresh HF model: nnterp reads its eager attention source
    try:
        return StandardizedTransformer(hf, tokenizer=tok, enable_attention_probs=True), True
    except Exception:  # noqa: BLE001  (the probabilities' source check raises several types; retried without)
        pass
    hf, tok, _ = load_hf(name, source="zoo", attention="eager")
    try:
        return StandardizedTransformer(hf, tokenizer=tok), False
    except RenamingError as e:
        raise Refused(f"nnterp cannot standardize {hf.config.model_type} (RenamingError): {str(e)[:200]}") from e


def nnterp_check(name: str) -> tuple[dict, dict]:
    """(accessors, bad): every served address mapped by to_nnterp, read through nnterp's StandardizedTransformer
    and compared with our capture (see _standardize for what nnterp refuses)."""
    m = load_model(name, source="zoo")
    ids = m._inputs(TEXT)["input_ids"]
    acc = {}
    for v in m.describe().served():
        try:
            acc[v.address] = to_nnterp(m, v.address)
        except UnmappedError:
            pass
    st, probs = _standardize(name)
    if not probs:
        acc = {a: n for a, n in acc.items() if parse(a).point != "attn_probs"}

    def key(kv):
        name = kv[1].split("[")[0].split(".")[0]
        layer = int(kv[1].split("[")[1].rstrip("]")) if "[" in kv[1] else m.n_layers
        return layer, _NNTERP_RANK.index(name)
    saved = {}
    with st.trace(ids):
        for a, name in sorted(acc.items(), key=key):
            obj = st
            head, _, idx = name.partition("[")
            for part in head.split("."):
                obj = getattr(obj, part)
            if idx:
                obj = obj[int(idx.rstrip("]"))]
            saved[a] = obj.save()
    _, ours = m.run_with_cache(ids, list(acc))
    bad = {a: acc[a] for a in acc if (t := same_layout(ours[a], saved[a], parse(a).point)) is None
           or not close_enough(ours[a], t, parse(a).point)}
    return acc, bad


def _main(argv: list[str]) -> None:
    import json
    import traceback
    from importlib import metadata
    if not argv or argv[0] != "nnterp":
        raise SystemExit("usage: tests/mapper_checks.py nnterp [--refused-ok] NAME...")
    refused_ok = "--refused-ok" in argv
    out: dict = {"versions": {d: metadata.version(d) for d in ("nnsight", "nnterp")}, "models": {}}
    for name in [a for a in argv[1:] if a != "--refused-ok"]:
        try:
            acc, bad = nnterp_check(name)
            out["models"][name] = {"accessors": acc, "bad": bad}
        except Refused as e:
            out["models"][name] = {"skipped": str(e)} if refused_ok else {"error": str(e)}
        except Exception as e:  # noqa: BLE001  (the model's own failure; the others still run)
            out["models"][name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
    print("MAPPER-CHECKS " + json.dumps(out))


if __name__ == "__main__":
    import sys
    _main(sys.argv[1:])
