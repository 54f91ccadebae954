"""The real dimensions of every zoo checkpoint, for ``--size real`` twins (throughput at real shape).

Weight values do not change how long a forward takes, so a twin with the checkpoint's real layer
count, widths, heads, vocabulary and experts and seeded random weights gives real-shape speed
offline. Each row gives, on top of the tiny entry's overrides (which carry the family's quirks):
the real layer count, the size fields under the same config names the tiny entry uses, and the
published parameter count, which ``tests/test_zoo_sizes.py`` checks against a meta-device build of
the config, so a wrong width or head count shows up as a wrong total.

Values come from each checkpoint's ``config.json`` as remembered here, without a hub to check
against; a row whose values were not all certain says which in ``uncertain`` (shown by
``python -m engine.zoo list --size real`` and written into the twin's marker). What a real-size
twin does not copy: the tokenizer (the zoo's 512-token one, so prompts use the first 512 ids of
the real vocabulary), and rope scaling, which stays as in the tiny entry.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable


@dataclasses.dataclass(frozen=True)
class RealDims:
    name: str
    layers: int
    params_b: float | None  # published total parameter count, billions (None: not known here)
    overrides: dict[str, Any]
    uncertain: str = ""

    def canonical(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=repr)


REAL: dict[str, RealDims] = {}


def _r(name: str, layers: int, params_b: float | None, uncertain: str = "", **overrides: Any) -> None:
    if name in REAL:
        raise ValueError(f"duplicate real-size row {name}")
    REAL[name] = RealDims(name, layers, params_b, dict(overrides), uncertain)


# per-layer kind lists at real length --------------------------------------------------------------
SW, FA = "sliding_attention", "full_attention"


def every(n: int, period: int, hit: str = FA, other: str = SW, offset: int | None = None) -> list[str]:
    """`hit` at layers i % period == offset (default period - 1: the last of each group), else `other`."""
    off = period - 1 if offset is None else offset
    return [hit if i % period == off else other for i in range(n)]


def at(n: int, indices: Iterable[int], hit: str = FA, other: str = "conv") -> list[str]:
    """`hit` at the given layer indices, `other` elsewhere."""
    idx = set(indices)
    return [hit if i in idx else other for i in range(n)]


def from_pattern(pattern: str, table: dict[str, str]) -> list[str]:
    """A per-layer list from a one-character-per-layer pattern (Nemotron-H's hybrid_override_pattern)."""
    return [table[ch] for ch in pattern]


def _llama(h, heads, kv, hd, inter, vocab, pos, **kw):
    return dict(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                intermediate_size=inter, vocab_size=vocab, max_position_embeddings=pos, **kw)


# GPT-2 / BigCode ----------------------------------------------------------------------------------
_GPT2 = dict(vocab_size=50257, n_positions=1024)
_r("openai-community/gpt2", 12, 0.124, n_embd=768, n_head=12, n_inner=3072, **_GPT2)
_r("distilbert/distilgpt2", 6, 0.082, n_embd=768, n_head=12, n_inner=3072, **_GPT2)
_r("openai-community/gpt2-medium", 24, 0.355, n_embd=1024, n_head=16, n_inner=4096, **_GPT2)
_r("bigcode/gpt_bigcode-santacoder", 24, 1.12, "vocab_size 49280",
   n_embd=2048, n_head=16, n_inner=8192, vocab_size=49280, n_positions=2048)
_r("bigcode/starcoderbase-1b", 24, 1.14, n_embd=2048, n_head=16, n_inner=8192, vocab_size=49152, n_positions=8192)

# GPT-NeoX / GPT-J / Phi / OPT / BLOOM / Falcon ------------------------------------------------------
_NEOX = dict(vocab_size=50304, max_position_embeddings=2048)
_r("EleutherAI/pythia-70m-deduped", 6, 0.070, hidden_size=512, num_attention_heads=8, intermediate_size=2048, **_NEOX)
_r("EleutherAI/pythia-160m", 12, 0.162, hidden_size=768, num_attention_heads=12, intermediate_size=3072, **_NEOX)
_r("EleutherAI/pythia-1.4b", 24, 1.41, hidden_size=2048, num_attention_heads=16, intermediate_size=8192, **_NEOX)
_r("EleutherAI/gpt-j-6b", 28, 6.05, n_embd=4096, n_head=16, n_inner=16384, rotary_dim=64, vocab_size=50400,
   n_positions=2048)
_r("microsoft/phi-2", 32, 2.78, hidden_size=2560, num_attention_heads=32, intermediate_size=10240, vocab_size=51200,
   max_position_embeddings=2048)
_r("microsoft/phi-1_5", 24, 1.42, hidden_size=2048, num_attention_heads=32, intermediate_size=8192, vocab_size=51200,
   max_position_embeddings=2048)
_r("facebook/opt-125m", 12, 0.125, hidden_size=768, num_attention_heads=12, ffn_dim=3072, word_embed_proj_dim=768,
   vocab_size=50272, max_position_embeddings=2048)
_r("facebook/opt-350m", 24, 0.331, hidden_size=1024, num_attention_heads=16, ffn_dim=4096, word_embed_proj_dim=512,
   vocab_size=50272, max_position_embeddings=2048)
_r("bigscience/bloom-560m", 24, 0.559, hidden_size=1024, n_head=16, vocab_size=250880)
_r("tiiuae/falcon-7b", 32, 6.92, "published as 7B; 6.92B from its config", hidden_size=4544, num_attention_heads=71, vocab_size=65024,
   max_position_embeddings=2048)
_r("tiiuae/falcon-rw-1b", 24, 1.31, hidden_size=2048, num_attention_heads=32, vocab_size=50304,
   max_position_embeddings=2048)
_r("tiiuae/falcon-11B", 60, 11.1, hidden_size=4096, num_attention_heads=32, num_kv_heads=8, vocab_size=65024,
   max_position_embeddings=8192)

# Llama family ---------------------------------------------------------------------------------------
_r("meta-llama/Llama-3.2-1B", 16, 1.24, **_llama(2048, 32, 8, 64, 8192, 128256, 131072))
_r("meta-llama/Llama-3.1-8B", 32, 8.03, **_llama(4096, 32, 8, 128, 14336, 128256, 131072))
_r("meta-llama/Llama-2-7b-hf", 32, 6.74, **_llama(4096, 32, 32, 128, 11008, 32000, 4096))
_r("TinyLlama/TinyLlama-1.1B-Chat-v1.0", 22, 1.10, **_llama(2048, 32, 4, 64, 5632, 32000, 2048))
_r("HuggingFaceTB/SmolLM2-135M", 30, 0.135, **_llama(576, 9, 3, 64, 1536, 49152, 8192))
_r("HuggingFaceTB/SmolLM2-360M", 32, 0.362, **_llama(960, 15, 5, 64, 2560, 49152, 8192))
_r("HuggingFaceTB/SmolLM2-1.7B", 24, 1.71, **_llama(2048, 32, 32, 64, 8192, 49152, 8192))
_r("meta-llama/Meta-Llama-3-8B", 32, 8.03, **_llama(4096, 32, 8, 128, 14336, 128256, 8192))
_r("meta-llama/Llama-3.2-3B", 28, 3.21, **_llama(3072, 24, 8, 128, 8192, 128256, 131072))

# Mistral --------------------------------------------------------------------------------------------
_r("mistralai/Mistral-7B-v0.1", 32, 7.24, sliding_window=4096, **_llama(4096, 32, 8, 128, 14336, 32000, 32768))
_r("mistralai/Mistral-7B-Instruct-v0.3", 32, 7.25, **_llama(4096, 32, 8, 128, 14336, 32768, 32768))
_r("mistralai/Mistral-Nemo-Base-2407", 40, 12.2, **_llama(5120, 32, 8, 128, 14336, 131072, 1024000))

# Qwen2 / Qwen3 / SmolLM3 ----------------------------------------------------------------------------
_r("Qwen/Qwen2.5-0.5B", 24, 0.494, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
   intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768)
_r("Qwen/Qwen2.5-7B-Instruct", 28, 7.62, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
   intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768)
_r("Qwen/Qwen3-0.6B", 28, 0.596, **_llama(1024, 16, 8, 128, 3072, 151936, 40960))
_r("Qwen/Qwen3-1.7B", 28, 1.72, **_llama(2048, 16, 8, 128, 6144, 151936, 40960))
_r("Qwen/Qwen3-4B", 36, 4.02, **_llama(2560, 32, 8, 128, 9728, 151936, 40960))
_r("Qwen/Qwen3-8B", 36, 8.19, **_llama(4096, 32, 8, 128, 12288, 151936, 40960))
_r("HuggingFaceTB/SmolLM3-3B", 36, 3.08, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
   intermediate_size=11008, vocab_size=128256, max_position_embeddings=65536)

# Granite / OLMo / StarCoder2 / Phi-3 / StableLM / Cohere ---------------------------------------------
_r("ibm-granite/granite-3.0-2b-base", 40, 2.53, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
   intermediate_size=8192, vocab_size=49155, max_position_embeddings=4096)
_r("ibm-granite/granite-3.1-8b-base", 40, 8.17, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
   intermediate_size=12800, vocab_size=49155, max_position_embeddings=131072)
_r("allenai/OLMo-1B-hf", 16, 1.18, hidden_size=2048, num_attention_heads=16, intermediate_size=8192,
   vocab_size=50304, max_position_embeddings=2048)
_r("allenai/OLMo-7B-0424-hf", 32, 6.89, hidden_size=4096, num_attention_heads=32, intermediate_size=11008,
   vocab_size=50304, max_position_embeddings=4096)
_r("allenai/OLMo-2-0425-1B", 16, 1.48, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
   intermediate_size=8192, vocab_size=100352, max_position_embeddings=4096)
_r("allenai/OLMo-2-1124-7B", 32, 7.30, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
   intermediate_size=11008, vocab_size=100352, max_position_embeddings=4096)
_r("allenai/Olmo-3-1025-7B", 32, 7.30, "vocab_size 100278 and max_position_embeddings 65536",
   hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=100278,
   max_position_embeddings=65536, sliding_window=4096, layer_types=every(32, 4))
_r("bigcode/starcoder2-3b", 30, 3.03, hidden_size=3072, num_attention_heads=24, num_key_value_heads=2,
   intermediate_size=12288, vocab_size=49152, max_position_embeddings=16384, sliding_window=4096)
_r("microsoft/Phi-3-mini-4k-instruct", 32, 3.82, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
   intermediate_size=8192, vocab_size=32064, max_position_embeddings=4096, sliding_window=2047)
_r("microsoft/Phi-3-medium-4k-instruct", 40, 14.0, hidden_size=5120, num_attention_heads=40,
   num_key_value_heads=10, intermediate_size=17920, vocab_size=32064, max_position_embeddings=4096,
   sliding_window=2047)
_r("microsoft/Phi-4-mini-instruct", 32, 3.84, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
   intermediate_size=8192, vocab_size=200064, max_position_embeddings=131072)
_r("stabilityai/stablelm-2-1_6b", 24, 1.64, hidden_size=2048, num_attention_heads=32, num_key_value_heads=32,
   intermediate_size=5632, vocab_size=100352, max_position_embeddings=4096)
_r("stabilityai/stablelm-2-12b", 40, 12.1, hidden_size=5120, num_attention_heads=32, num_key_value_heads=8,
   intermediate_size=13824, vocab_size=100352, max_position_embeddings=4096)
_r("CohereForAI/c4ai-command-r-v01", 40, 35.0, hidden_size=8192, num_attention_heads=64, num_key_value_heads=64,
   intermediate_size=22528, vocab_size=256000, max_position_embeddings=131072)
_r("CohereForAI/c4ai-command-r-plus", 64, 104.0, hidden_size=12288, num_attention_heads=96, num_key_value_heads=8,
   intermediate_size=33792, vocab_size=256000, max_position_embeddings=131072)
_r("CohereForAI/c4ai-command-r7b-12-2024", 32, 8.03, hidden_size=4096, num_attention_heads=32,
   num_key_value_heads=8, intermediate_size=14336, vocab_size=256000, max_position_embeddings=131072,
   sliding_window=4096, layer_types=every(32, 4))

# Gemma ------------------------------------------------------------------------------------------------
_r("google/gemma-2b", 18, 2.51, **_llama(2048, 8, 1, 256, 16384, 256000, 8192))
_r("google/gemma-7b", 28, 8.54, **_llama(3072, 16, 16, 256, 24576, 256000, 8192))
_r("google/gemma-2-2b", 26, 2.61, query_pre_attn_scalar=256, layer_types=every(26, 2), sliding_window=4096,
   **_llama(2304, 8, 4, 256, 9216, 256000, 8192))
_r("google/gemma-2-9b", 42, 9.24, query_pre_attn_scalar=256, layer_types=every(42, 2), sliding_window=4096,
   **_llama(3584, 16, 8, 256, 14336, 256000, 8192))
_r("google/gemma-2-27b", 46, 27.2, query_pre_attn_scalar=144, layer_types=every(46, 2), sliding_window=4096,
   **_llama(4608, 32, 16, 128, 36864, 256000, 8192))
_r("google/gemma-3-1b-pt", 26, 1.00, query_pre_attn_scalar=256, sliding_window=512, layer_types=every(26, 6),
   **_llama(1152, 4, 1, 256, 6912, 262144, 32768))
_r("google/gemma-3-4b-it", 34, 3.88, "text tower only (the checkpoint's 4.3B includes the vision tower)",
   query_pre_attn_scalar=256, sliding_window=1024, layer_types=every(34, 6),
   **_llama(2560, 8, 4, 256, 10240, 262208, 131072))
_r("google/gemma-3-270m", 18, 0.268, query_pre_attn_scalar=256, sliding_window=512, layer_types=every(18, 6),
   **_llama(640, 4, 1, 256, 2048, 262144, 32768))

# Mixture of experts ---------------------------------------------------------------------------------
_r("mistralai/Mixtral-8x7B-v0.1", 32, 46.7, num_local_experts=8, num_experts_per_tok=2,
   **_llama(4096, 32, 8, 128, 14336, 32000, 32768))
_r("Qwen/Qwen1.5-MoE-A2.7B", 24, 14.3, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
   intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
   num_experts_per_tok=4, vocab_size=151936, max_position_embeddings=8192)
_r("Qwen/Qwen3-30B-A3B", 48, 30.5, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
   **_llama(2048, 32, 4, 128, 6144, 151936, 40960))
_r("allenai/OLMoE-1B-7B-0924", 16, 6.92, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
   intermediate_size=1024, num_experts=64, num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096)
_r("ibm-granite/granite-3.0-1b-a400m-base", 24, 1.33, hidden_size=1024, num_attention_heads=16,
   num_key_value_heads=8, intermediate_size=512, num_local_experts=32, num_experts_per_tok=8, vocab_size=49155,
   max_position_embeddings=4096)
_r("microsoft/Phi-3.5-MoE-instruct", 32, 41.9, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
   intermediate_size=6400, num_local_experts=16, num_experts_per_tok=2, vocab_size=32064,
   max_position_embeddings=131072)
_r("openai/gpt-oss-20b", 24, 20.9, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
   layer_types=every(24, 2), **_llama(2880, 64, 8, 64, 2880, 201088, 131072))
_r("deepseek-ai/DeepSeek-V2-Lite", 27, 15.7, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
   intermediate_size=10944, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
   n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
   first_k_dense_replace=1, vocab_size=102400, max_position_embeddings=163840)
_r("deepseek-ai/DeepSeek-V3", 61, 671.0, "the published 671B excludes the multi-token-prediction layer",
   hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432, q_lora_rank=1536,
   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
   num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, moe_intermediate_size=2048,
   first_k_dense_replace=3, vocab_size=129280, max_position_embeddings=163840)
_r("zai-org/GLM-4.5-Air", 46, 106.0, "the published 106B includes one multi-token-prediction layer, not built here",
   moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1,
   first_k_dense_replace=1, **_llama(4096, 96, 8, 128, 10944, 151552, 131072))
_r("baidu/ERNIE-4.5-21B-A3B-PT", 28, 21.8, moe_intermediate_size=1536, moe_num_experts=64, moe_k=6,
   moe_num_shared_experts=2, moe_layer_start_index=1, **_llama(2560, 20, 4, 128, 12288, 103424, 131072))
_r("tencent/Hunyuan-A13B-Instruct", 32, 80.4, "expert width (intermediate_size 3072) and vocab_size 128167",
   num_experts=64, moe_topk=8, **_llama(4096, 32, 8, 128, 3072, 128167, 32768))
_r("rednote-hilab/dots.llm1.base", 62, 142.0, moe_intermediate_size=1408, n_routed_experts=128,
   num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
   **_llama(4096, 32, 32, 128, 10944, 152064, 32768))

# Hybrid / exotic --------------------------------------------------------------------------------------
_r("Qwen/Qwen3-Next-80B-A3B-Instruct", 48, 80.0, "intermediate_size (dense width, unused by its all-MoE layers)",
   layer_types=every(48, 4, FA, "linear_attention"), linear_num_key_heads=16, linear_num_value_heads=32,
   linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
   moe_intermediate_size=512, shared_expert_intermediate_size=512,
   **_llama(2048, 16, 2, 256, 5120, 151936, 262144))
_r("LiquidAI/LFM2-350M", 16, 0.354, "which 6 of the 16 layers are attention ([2, 5, 8, 10, 12, 14] here)",
   hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, intermediate_size=6656, block_multiple_of=256,
   layer_types=at(16, [2, 5, 8, 10, 12, 14]), vocab_size=65536, max_position_embeddings=128000)
_r("LiquidAI/LFM2-8B-A1B", 24, 8.34, "which 6 of the 24 layers are attention ([2, 6, 10, 14, 18, 21] here)",
   hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, intermediate_size=7168,
   moe_intermediate_size=1792, num_experts=32, num_experts_per_tok=4, num_dense_layers=2,
   layer_types=at(24, [2, 6, 10, 14, 18, 21]), vocab_size=65536, max_position_embeddings=128000)
_r("deepseek-ai/DeepSeek-V4-Flash", 43, None,
   "every size field is transformers 5.19's DeepseekV4Config default (written for this checkpoint), not "
   "checked against the hub's config.json; no published parameter count is known here",
   hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
   qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
   sliding_window=128, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
   layer_types=["heavily_compressed_attention"] * 2 + [
       "heavily_compressed_attention" if i % 2 == 0 else "compressed_sparse_attention" for i in range(2, 43)],
   mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40, n_routed_experts=256, num_experts_per_tok=6,
   moe_intermediate_size=2048, intermediate_size=2048, vocab_size=129280, max_position_embeddings=1048576)
_r("THUDM/glm-4-9b-chat-hf", 40, 9.40, **_llama(4096, 32, 2, 128, 13696, 151552, 131072))
_r("zai-org/GLM-4-9B-0414", 40, 9.40, **_llama(4096, 32, 2, 128, 13696, 151552, 32768))
_r("LGAI-EXAONE/EXAONE-4.0-32B", 64, 32.0, sliding_window=4096, layer_types=every(64, 4),
   **_llama(5120, 40, 8, 128, 27392, 102400, 131072))
_r("LGAI-EXAONE/EXAONE-4.0-1.2B", 30, 1.28, layer_types=[FA] * 30, **_llama(2048, 32, 8, 64, 4096, 102400, 65536))
_r("swiss-ai/Apertus-8B-2509", 32, 8.05, "intermediate_size 21504 and max_position_embeddings 65536",
   **_llama(4096, 32, 8, 128, 21504, 131072, 65536))
_r("baidu/ERNIE-4.5-0.3B-PT", 18, 0.36, **_llama(1024, 16, 2, 128, 3072, 103424, 131072))
_r("ByteDance-Seed/Seed-OSS-36B-Base", 64, 36.2, **_llama(5120, 80, 8, 128, 27648, 155136, 524288))
_r("tencent/Hunyuan-1.8B-Pretrain", 32, 1.79, "vocab_size 120818 and intermediate_size 6144",
   **_llama(2048, 16, 4, 128, 6144, 120818, 262144))
_r("arcee-ai/AFM-4.5B-Base", 36, 4.62, "intermediate_size 18432 and vocab_size 128004",
   **_llama(2560, 20, 4, 128, 18432, 128004, 65536))
_r("nvidia/Minitron-4B-Base", 32, 4.19, **_llama(3072, 24, 8, 128, 9216, 256000, 4096))
_r("ibm-granite/granite-4.0-h-tiny", 40, 6.94,
   "which 4 of the 40 layers are attention ([5, 15, 25, 35] here), the Mamba-2 widths and the chunk size",
   hidden_size=1536, num_attention_heads=12, num_key_value_heads=4, intermediate_size=512,
   shared_intermediate_size=1024, num_local_experts=64, num_experts_per_tok=6,
   layer_types=at(40, [5, 15, 25, 35], FA, "linear_attention"), mamba_n_heads=48, mamba_d_head=64,
   mamba_d_state=128, mamba_chunk_size=256, vocab_size=100352, max_position_embeddings=131072)
_r("tiiuae/Falcon-H1-0.5B-Base", 36, 0.52, "the Mamba-2 widths (d_ssm 1536, 24 heads of 64, state 128) and vocab 32784",
   hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=2048,
   mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128, mamba_chunk_size=256,
   vocab_size=32784, max_position_embeddings=16384)
_r("nvidia/NVIDIA-Nemotron-Nano-9B-v2", 56, 8.89, "the Mamba-2 head width (80) and the block pattern",
   layers_block_type=from_pattern("M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
                                  {"M": "linear_attention", "-": "mlp", "*": FA}),
   mamba_num_heads=128, mamba_head_dim=80, n_groups=8, ssm_state_size=128, chunk_size=256,
   **_llama(4480, 40, 8, 128, 15680, 131072, 131072))
_r("EleutherAI/gpt-neo-125m", 12, 0.125, hidden_size=768, num_heads=12, num_layers=12,
   attention_types=[[["global", "local"], 6]], window_size=256, intermediate_size=3072, vocab_size=50257,
   max_position_embeddings=2048)
_r("roneneldan/TinyStories-33M", 4, 0.068, "the published 33M counts the 4 blocks only; 68M with embeddings",
   hidden_size=768, num_heads=16, num_layers=4, attention_types=[[["global", "local"], 2]], window_size=256,
   intermediate_size=3072, vocab_size=50257, max_position_embeddings=2048)
_r("mosaicml/mpt-7b", 32, 6.65, d_model=4096, n_heads=32, n_layers=32, expansion_ratio=4, max_seq_len=2048,
   vocab_size=50432)
_r("ai21labs/AI21-Jamba-Mini-1.5", 32, 51.6, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
   intermediate_size=14336, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1,
   num_experts=16, num_experts_per_tok=2, vocab_size=65536, max_position_embeddings=262144)
_r("ibm-ai-platform/Bamba-9B", 32, 9.78, "the attention layers ([9, 18, 27] here) and the Mamba-2 widths",
   hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
   attn_layer_indices=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128, mamba_chunk_size=256,
   vocab_size=128256, max_position_embeddings=262144)
_r("Zyphra/Zamba2-1.2B", 38, 1.22, "which layers reuse the shared block (every 6th here) and the Mamba-2 widths",
   hidden_size=2048, num_attention_heads=32, n_mamba_heads=64, mamba_d_state=128, intermediate_size=8192,
   layers_block_type=every(38, 6, "hybrid", "mamba"), chunk_size=256, vocab_size=32000,
   max_position_embeddings=4096)
