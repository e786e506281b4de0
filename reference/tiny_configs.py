"""Configurations of the tiny random DeepSeek-V4 checkpoints used for the golden tests.

Both are plain keyword dictionaries for transformers' DeepseekV4Config. The layer pattern,
window and compression rates follow the real models (tiny-flash) or are shrunk to exercise
ring-buffer wrap-around and top-k binding cheaply (tiny-pro).
"""

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _rope(original_max_position_embeddings):
    # main: plain RoPE (pure sliding-window layers); compress: YaRN (all compressed layers).
    return {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "factor": 16.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": original_max_position_embeddings,
            "attention_factor": 1.0,
            "partial_rotary_factor": 0.5,
        },
    }


COMMON = dict(
    num_key_value_heads=1,
    head_dim=128,  # 64 nope (= one FP8 block) + 64 rope
    partial_rotary_factor=0.5,
    index_head_dim=128,
    n_shared_experts=1,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    hidden_act="silu",
    attention_bias=False,
    num_nextn_predict_layers=0,
)

TINY_FLASH = dict(
    COMMON,
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=128,
    layer_types=[SWA, SWA, CSA, HCA, CSA, HCA],
    compress_rates={CSA: 4, HCA: 128},
    index_n_heads=4,
    index_topk=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3,
    routed_scaling_factor=1.5,
    swiglu_limit=2.0,
    # YaRN ramp: low = floor(c(32)) = 8, high = ceil(c(1)) = 18 for dim 64, theta 160000.
    rope_parameters=_rope(4096),
    max_position_embeddings=4096 * 16,  # = factor * original, so no transformers version re-derives another factor
)

TINY_PRO = dict(
    COMMON,
    vocab_size=256,
    hidden_size=96,
    num_hidden_layers=4,
    num_attention_heads=6,
    q_lora_rank=48,
    o_groups=3,
    o_lora_rank=32,
    sliding_window=16,
    layer_types=[HCA, HCA, CSA, HCA],
    compress_rates={CSA: 4, HCA: 16},
    index_n_heads=4,
    index_topk=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=24,
    mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 2,
    routed_scaling_factor=2.5,
    swiglu_limit=2.0,
    # YaRN ramp: c(32) < 0 so low clamps to 0, high = ceil(c(1)) = 7.
    rope_parameters=_rope(64),
    max_position_embeddings=64 * 16,
)

MODELS = {"tiny-flash": TINY_FLASH, "tiny-pro": TINY_PRO}
