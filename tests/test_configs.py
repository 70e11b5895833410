"""Model configs, per-rank shapes and the bytes floor, checked against hand counts."""
import pytest

from specverify.configs import (expected_distinct_experts, get_config, list_configs, per_rank_shapes,
                                verify_bytes)


def test_published_values():
    k2 = get_config("kimi-k2")
    assert (k2.hidden_size, k2.num_hidden_layers, k2.first_k_dense_replace) == (7168, 61, 1)
    assert (k2.num_attention_heads, k2.q_lora_rank, k2.kv_lora_rank) == (64, 1536, 512)
    assert (k2.qk_nope_head_dim, k2.qk_rope_head_dim, k2.v_head_dim) == (128, 64, 128)
    assert (k2.n_routed_experts, k2.n_shared_experts, k2.num_experts_per_tok) == (384, 1, 8)
    assert (k2.moe_intermediate_size, k2.intermediate_size, k2.vocab_size) == (2048, 18432, 163840)
    assert (k2.n_group, k2.topk_group, k2.routed_scaling_factor, k2.scoring_func) == (1, 1, 2.827, "sigmoid")
    v3 = get_config("deepseek-v3")
    assert (v3.num_attention_heads, v3.n_routed_experts, v3.n_group, v3.topk_group) == (128, 256, 8, 4)
    assert (v3.routed_scaling_factor, v3.first_k_dense_replace, v3.vocab_size) == (2.5, 3, 129280)
    q3 = get_config("qwen3-30b-a3b")
    assert (q3.num_attention_heads, q3.num_key_value_heads, q3.n_routed_experts, q3.scoring_func) == (
        32, 4, 128, "softmax")
    ll = get_config("llama-3.1-8b")
    assert (ll.num_attention_heads, ll.num_key_value_heads, ll.is_moe) == (32, 8, False)
    assert all(get_config(n).source for n in list_configs())


def test_per_rank_shapes():
    s = per_rank_shapes("kimi-k2", 8)
    assert (s.num_heads, s.moe_intermediate_size, s.intermediate_size, s.vocab_size) == (8, 256, 2304, 20480)
    assert s.hidden_size == 7168 and s.kv_lora_rank == 512  # replicated stay whole
    q = per_rank_shapes("qwen3-30b-a3b", 8)
    assert (q.num_heads, q.num_kv_heads) == (4, 1)  # 4 KV heads replicated over 8 ranks
    with pytest.raises(ValueError, match="not divisible"):
        per_rank_shapes("llama-3.1-8b", 3)
    with pytest.raises(ValueError, match="unknown model"):
        get_config("gpt-5")


def test_bytes_floor_hand_count_tiny_moe():
    # tiny-mla-moe: hidden 64, 3 layers (1 dense), 4 heads, q_lora 32, kv_lora 32, nope 16, rope 8, v 16,
    # dense inter 96, 12 experts top-3 inter 32, 1 shared, vocab 97; tp 2 -> 2 heads, inter 48/16, vocab 49.
    b = verify_bytes("tiny-mla-moe", tp=2, tokens=2, context=10, batch=1, distinct_experts=5)
    attn = (64 * 32 + 32 * 2 * 24 + 64 * 40 + 32 * 2 * 32 + 2 * 16 * 64 + 64 + 32 + 32) * 2 * 3
    kv = 40 * 2 * 12 * 3
    dense = (3 * 64 * 48 + 64) * 2 * 1
    router = (64 * 12 * 2 + 12 * 4 + 64 * 2) * 2
    routed = 5 * 3 * 64 * 16 * 2 * 2
    shared = 3 * 64 * 16 * 2 * 2
    lm = (64 * 49 + 64) * 2
    assert b.attention_weights == attn
    assert b.kv_cache == kv
    assert b.dense_mlp == dense
    assert b.router == router
    assert b.routed_experts == routed
    assert b.shared_experts == shared
    assert b.lm_head == lm
    assert b.total == attn + kv + dense + router + routed + shared + lm


def test_bytes_floor_hand_count_dense_gqa():
    # tiny-gqa: hidden 64, 2 layers, 4 heads / 2 KV heads of 16, inter 96, vocab 83; tp 1, batch 3
    b = verify_bytes("tiny-gqa", tp=1, tokens=4, context=20, batch=3)
    attn = (64 * (4 + 4) * 16 + 4 * 16 * 64 + 64) * 2 * 2
    kv = 2 * 2 * 16 * 2 * (20 + 4) * 3 * 2
    assert b.attention_weights == attn and b.kv_cache == kv
    assert b.dense_mlp == (3 * 64 * 96 + 64) * 2 * 2
    assert b.routed_experts == 0 and b.lm_head == (64 * 83 + 64) * 2


def test_expected_distinct_experts():
    assert expected_distinct_experts(384, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(384, 8, 1000) == pytest.approx(384, rel=1e-6)
    # two tokens: 8 + 8 * (1 - 8/384) expected distinct
    assert expected_distinct_experts(384, 8, 2) == pytest.approx(8 + 8 * (1 - 8 / 384))
