"""Declared gaps and known upstream bugs: data with evidence, never a way to hide a result.

A *gap* says a reference has no such tensor. It applies only to a row where the reference
reported the point missing AND its runtime reason matches `match` (so a gap declared for a missing
hook cannot excuse a crash). A *bug* is a known upstream defect. It applies only to a row that
failed on numbers (never to a structural failure, never to a pass: a declared bug that does not
reproduce is reported as stale). Either way the row's verdict becomes `gap` and the report shows
the entry's reason, evidence and reproduction next to the runtime text.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

_REPRO = "python -m validator run --models '{model}' --engines {engine} --force && python -m validator show '{model}'"


@dataclass(frozen=True)
class Known:
    id: str
    kind: str  # "gap" | "bug"
    engine: str  # engine name or glob
    points: str  # glob over point names ("q*", "*")
    reason: str
    evidence: str
    match: str = ".*"  # regex the runtime reason must match (gaps)
    model_types: str = "*"  # glob over HF model_type
    repro: str = _REPRO


_NNTERP_API = ("nnterp 1.3.0 StandardizedTransformer exposes layers_input/output, attentions_input/output, "
               "mlps_input/output, attention_probabilities, ln_final, logits (nnterp/standardized_transformer.py "
               "__init__); anything else is plain nnsight, which has its own column")

KNOWN: tuple[Known, ...] = (
    Known("nnterp-no-accessor", "gap", "nnterp", "*",
          "nnterp's standardized interface has no accessor for this point", _NNTERP_API,
          match=r"has no accessor for"),
    Known("nnterp-probs-source", "gap", "nnterp", "attn_probs",
          "nnterp 1.3.0 cannot locate the attention probabilities in this family's transformers 5.19 attention "
          "code, checks that at load and disables attention_probabilities",
          "StandardizedTransformer(..., enable_attention_probs=True) raises in check_source, e.g. on GPT-2: "
          "AttributeError: 'SourceEnvoy' object has no attribute 'module_attn_dropout_0' "
          "(nnterp/rename_utils.py gpt2_attention_prob_source)",
          match=r"nnterp disabled attention probabilities"),
    Known("tl-unsupported-arch", "gap", "transformer_lens", "*",
          "TransformerLens 4.3 has no TransformerBridge adapter for this architecture",
          "TransformerBridge.boot_transformers raises (the runtime text is on every row); supported list: "
          "transformer_lens.factories.architecture_adapter_factory.SUPPORTED_ARCHITECTURES",
          match=r"boot_transformers failed"),
    Known("tl-no-hook", "gap", "transformer_lens", "*",
          "the TransformerBridge of this architecture registers no hook for this point",
          "bridge.hook_dict has none of the candidate names listed in validator/engines/tl_ref.py HOOKS",
          match=r"no bridge hook|has no hook for"),
    Known("mixer-not-attention", "gap", "*", "*",
          "this layer's token mixer is not softmax attention, so the reference has no such tensor there",
          "hybrid layer_types (linear attention / short convolution); the engine serves attn_in/attn_out of "
          "the mixer, the references' attention accessors address self_attn only",
          match=r"no softmax attention module|has no attention or mixer module"),
    Known("hf-no-attention-fn", "gap", "hf|nnsight", "q|k|value|attn_scores",
          "HF computes this family's attention inline (no attention function), so q/k/v never exist as "
          "separate tensors in HF", "the modeling file has no eager_attention_forward",
          match=r"computes attention inline|attention_interface_0"),
    Known("parallel-no-mid", "gap", "*", "resid_mid",
          "parallel block: no residual between attention and MLP", "decoder layer forward adds both "
          "sublayers to one residual", match=r"parallel block"),
)


def _glob(pattern: str, value: str) -> bool:
    return any(fnmatch.fnmatchcase(value, p) for p in pattern.split("|"))


def find(kind: str, engine: str, model_type: str, point: str, reason: str = "") -> Known | None:
    """The first declared entry of `kind` covering this row (gaps also match the runtime reason)."""
    for k in KNOWN:
        if k.kind != kind or not _glob(k.engine, engine) or not _glob(k.points, point):
            continue
        if not _glob(k.model_types, model_type):
            continue
        if kind == "gap" and not re.search(k.match, reason or ""):
            continue
        return k
    return None


def describe(k: Known, model: str, engine: str) -> dict:
    return {"id": k.id, "kind": k.kind, "reason": k.reason, "evidence": k.evidence,
            "repro": k.repro.format(model=model, engine=engine)}
