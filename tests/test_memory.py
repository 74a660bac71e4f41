"""Tests of kvcache.memory. Expected values are worked out by hand in each test, from the formula
M = L * h_kv * (d_K * s_K + d_V * s_V) * sum_i T_i (+ metadata) and, for MLA and hybrid models, from
the published configs' arithmetic, never copied from the code's output."""

from __future__ import annotations

import doctest
import math
import subprocess
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcache import memory

KVShape = memory.KVShape
GiB, MiB, KiB = 2**30, 2**20, 2**10


# ---------------------------------------------------------------- the reference numbers


def test_8b_geometry_8k_tokens_bf16_is_exactly_one_gib():
    shape = KVShape(num_layers=32, num_kv_heads=8, head_dim=128)
    # 32 * 8 * 128 elements * (2 + 2) bytes = 2**17 bytes per token; * 8192 = 2**30
    assert memory.cache_bytes(shape, 8192, dtype="bfloat16") == 1073741824 == GiB
    assert memory.cache_bytes(shape, [8192]) == GiB  # 16 bits is the default
    assert memory.cache_bytes(shape, 8192, k_bits=16, v_bits=16) == GiB
    assert type(memory.cache_bytes(shape, 8192)) is int
    assert memory.format_bytes(memory.cache_bytes(shape, 8192)) == "1.00 GiB"


def test_llama2_7b_is_512_kib_per_token():
    shape = KVShape(32, 32, 128)
    # 32 layers * 32 heads * 128 * 4 bytes = 524288 = 512 * 1024
    assert memory.bytes_per_token(shape, dtype="float16") == 524288 == 512 * KiB
    assert memory.format_bytes(memory.bytes_per_token(shape)) == "512.00 KiB"


def test_llama31_70b_is_0_3125_mib_per_token():
    shape = KVShape(80, 8, 128)
    # 80 * 8 * 128 * 4 = 327680 = 0.3125 * 2**20
    assert memory.bytes_per_token(shape, dtype="bfloat16") == 327680
    assert Fraction(memory.bytes_per_token(shape), MiB) == Fraction(5, 16)
    assert memory.format_bytes(327680) == "320.00 KiB"


# ---------------------------------------------------------------- from_config


def _llama_like(**overrides):
    fields = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  hidden_size=4096, head_dim=None, model_type="llama")  # fmt: skip
    return SimpleNamespace(**{**fields, **overrides})


def test_from_config_llama_with_head_dim_none_falls_back_to_hidden_over_heads():
    shape = KVShape.from_config(_llama_like())
    assert shape == KVShape(32, 8, 128)  # 4096 // 32 = 128
    assert shape.sliding_windows is None


def test_from_config_refuses_more_kv_heads_than_query_heads():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 8, "hidden_size": 64}
    with pytest.raises(ValueError, match=r"num_key_value_heads=8 exceeds num_attention_heads=4"):
        KVShape.from_config(cfg)


def test_from_config_explicit_head_dim_wins_over_hidden_size():
    # Gemma-7B: hidden 3072, 16 heads, but head_dim 256 (not 3072 // 16 = 192)
    cfg = _llama_like(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                      hidden_size=3072, head_dim=256)  # fmt: skip
    assert KVShape.from_config(cfg) == KVShape(28, 16, 256)


def test_from_config_missing_kv_heads_falls_back_to_attention_heads():
    cfg = _llama_like()
    del cfg.num_key_value_heads
    assert KVShape.from_config(cfg).num_kv_heads == 32
    assert KVShape.from_config(_llama_like(num_key_value_heads=None)).num_kv_heads == 32


def test_from_config_mistral_sliding_window_caps_every_layer():
    cfg = _llama_like(head_dim=128, sliding_window=4096, model_type="mistral")
    shape = KVShape.from_config(cfg)
    assert shape.sliding_windows == (4096,) * 32
    # 10000 tokens, but each layer keeps the last 4095 (the next token attends to them and itself):
    # 32 * 8 * 128 * 4 * 4095 = 2**29 - 2**17
    assert memory.cache_bytes(shape, 10000) == 32 * 8 * 128 * 4 * 4095 == 2**29 - 2**17
    assert memory.cache_bytes(shape, 100) == 32 * 8 * 128 * 4 * 100


def test_from_config_gpt2_style_attributes():
    cfg = SimpleNamespace(n_layer=12, n_head=12, n_embd=768, model_type="gpt2")
    shape = KVShape.from_config(cfg)
    assert shape == KVShape(12, 12, 64)
    # fp32 K and V: 12 * 12 * 64 * (4 + 4) = 73728 bytes per token
    assert memory.bytes_per_token(shape, dtype="float32") == 73728


def test_from_config_reads_text_config_of_multimodal_configs():
    text = _llama_like(num_hidden_layers=40, num_key_value_heads=8, hidden_size=5120,
                       num_attention_heads=32, head_dim=128)  # fmt: skip
    cfg = SimpleNamespace(text_config=text, vision_config=SimpleNamespace(num_hidden_layers=24))
    assert KVShape.from_config(cfg) == KVShape(40, 8, 128)
    as_dict = {"text_config": vars(text), "vision_config": {"num_hidden_layers": 24}}
    assert KVShape.from_config(as_dict) == KVShape(40, 8, 128)


def _gemma3_1b_layer_types():
    # every 6th layer is global: layers 5, 11, 17, 23 of 26
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]


def test_from_config_gemma3_layer_types_multi_query():
    cfg = SimpleNamespace(num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                          hidden_size=1152, head_dim=256, sliding_window=512,
                          layer_types=_gemma3_1b_layer_types())  # fmt: skip
    shape = KVShape.from_config(cfg)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (26, 1, 256)
    windows = shape.layer_windows
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17, 23]
    assert sorted(shape.window_groups, key=str) == [(512, 22), (None, 4)]
    # bf16, 1 kv head * 256 * 4 bytes = 1024 B per token-layer; 4 full layers hold 1000 tokens,
    # 22 sliding layers hold 511 each (the window less the next token, as DynamicCache keeps)
    assert memory.cache_bytes(shape, 1000) == 1024 * (4 * 1000 + 22 * 511) == 15607808
    # below the window every layer holds every token
    assert memory.cache_bytes(shape, 300) == 1024 * 26 * 300


def test_from_config_gemma3_old_pattern_and_gemma2_alternation():
    base = dict(num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                head_dim=256, sliding_window=512)  # fmt: skip
    with_types = KVShape.from_config({**base, "layer_types": _gemma3_1b_layer_types()})
    with_pattern = KVShape.from_config({**base, "sliding_window_pattern": 6})
    assert with_pattern == with_types
    gemma2 = KVShape.from_config({**base, "num_hidden_layers": 4, "model_type": "gemma2"})
    assert gemma2.sliding_windows == (512, None, 512, None)


def test_from_config_qwen2_use_sliding_window_and_max_window_layers():
    qwen = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                hidden_size=512, sliding_window=131072, max_window_layers=2)  # fmt: skip
    # Qwen2 config.json files keep a window size with sliding turned off
    assert KVShape.from_config({**qwen, "use_sliding_window": False}).sliding_windows is None
    on = KVShape.from_config({**qwen, "use_sliding_window": True, "sliding_window": 64})
    assert on.sliding_windows == (None, None, 64, 64)  # the first max_window_layers are full
    # a sliding layer with no window is full attention, as in transformers
    types = {"layer_types": ["sliding_attention"] * 4}
    off_with_types = KVShape.from_config({**qwen, "use_sliding_window": False, **types})
    assert off_with_types.sliding_windows is None


def test_from_config_multi_query_flag_falcon_style():
    # Falcon-7B: 71 query heads share one KV head; its num_kv_heads attribute says 71
    cfg = SimpleNamespace(num_hidden_layers=32, num_attention_heads=71, num_kv_heads=71,
                          hidden_size=4544, multi_query=True, new_decoder_architecture=False)
    shape = KVShape.from_config(cfg)
    assert shape == KVShape(32, 1, 64)  # 4544 // 71 = 64
    assert memory.bytes_per_token(shape) == 32 * 1 * 64 * 4 == 8192
    # Falcon-40B: 8 K/V groups projected, but broadcast to all 71 query heads before the cache's update
    cfg.new_decoder_architecture, cfg.num_kv_heads = True, 8
    assert KVShape.from_config(cfg).num_kv_heads == 71


@pytest.mark.parametrize("new_decoder_architecture, multi_query", [(True, False), (True, True), (False, True)])
def test_from_config_counts_the_heads_transformers_caches_for_falcon(new_decoder_architecture, multi_query):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                    num_kv_heads=2, new_decoder_architecture=new_decoder_architecture,
                                    multi_query=multi_query)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(cfg).eval()
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
    keys = cache.layers[0].keys if hasattr(cache, "layers") else cache.key_cache[0]
    shape = KVShape.from_config(cfg)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, keys.shape[1], keys.shape[3])


def test_from_config_errors_name_the_missing_attribute():
    no_layers = _llama_like()
    del no_layers.num_hidden_layers
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVShape.from_config(no_layers)
    with pytest.raises(ValueError, match="head_dim"):
        KVShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        KVShape.from_config({"num_hidden_layers": 2, "head_dim": 64})
    with pytest.raises(ValueError, match="num_attention_heads"):
        KVShape.from_config({"num_hidden_layers": 2, "num_key_value_heads": 2, "hidden_size": 64})
    with pytest.raises(ValueError, match="hidden_size"):
        KVShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 64})
    with pytest.raises(ValueError, match="layer_types"):
        KVShape.from_config({**vars(_llama_like()), "layer_types": ["full_attention"] * 3})
    with pytest.raises(ValueError, match=r"layer_types\[1\]='indexed_attention'"):  # DeepSeek-V3.2's DSA
        KVShape.from_config({**vars(_llama_like(num_hidden_layers=2)),
                             "layer_types": ["full_attention", "indexed_attention"]})  # fmt: skip
    with pytest.raises(ValueError, match="num_layers"):
        KVShape.from_config(_llama_like(num_hidden_layers=0))


def test_from_config_real_transformers_configs():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=2, hidden_size=512)  # fmt: skip
    assert KVShape.from_config(llama) == KVShape(4, 2, 64)  # 512 // 8 = 64
    gpt2 = transformers.GPT2Config(n_layer=3, n_head=4, n_embd=256)
    assert KVShape.from_config(gpt2) == KVShape(3, 4, 64)
    mistral = transformers.MistralConfig(num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=1, hidden_size=256,
                                         head_dim=64, sliding_window=32)  # fmt: skip
    assert KVShape.from_config(mistral) == KVShape(2, 1, 64, sliding_windows=32)
    qwen2 = transformers.Qwen2Config(num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, hidden_size=256)  # fmt: skip
    assert KVShape.from_config(qwen2) == KVShape(4, 2, 64)  # use_sliding_window defaults off
    if hasattr(transformers, "Gemma3Config"):  # multimodal: geometry lives in text_config
        gemma3 = transformers.Gemma3Config(text_config=dict(num_hidden_layers=6, sliding_window=128,
                                                            num_key_value_heads=1, head_dim=256))
        assert KVShape.from_config(gemma3) == KVShape(6, 1, 256, [128] * 5 + [None])


# ---------------------------------------------------------------- MLA (DeepSeek-V2/V3)

# DeepSeek-V3 as its config.json states it (num_key_value_heads 128; no head_dim: the per-head K is
# qk_nope_head_dim + qk_rope_head_dim = 192 wide, V 128, but neither is what the cache holds)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", num_hidden_layers=61, num_attention_heads=128,
                   num_key_value_heads=128, hidden_size=7168, kv_lora_rank=512, q_lora_rank=1536,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)  # fmt: skip


def test_deepseek_v3_mla_bytes_per_token_by_hand():
    shape = KVShape.mla_shape(61, kv_lora_rank=512, qk_rope_head_dim=64)
    # per token and layer one 512-value latent and one 64-value rotary key, shared by all 128 heads:
    # 61 * (512 + 64) = 35136 values; bf16: 70272 bytes = 68.625 KiB
    assert memory.bytes_per_token(shape, dtype="bfloat16") == 70272
    assert memory.format_bytes(70272) == "68.62 KiB"
    # the latent is the key side, the rotary key the value side: an int8 latent beside a bf16
    # rotary key is 61 * (512 * 1 + 64 * 2) = 39040 bytes; the other way round 61 * (1024 + 64) = 66368
    assert memory.bytes_per_token(shape, k_bits="int8", v_bits="bfloat16") == 39040
    assert memory.bytes_per_token(shape, k_bits="bfloat16", v_bits="int8") == 66368
    # 8192 tokens: 70272 * 8192 = 575668224 bytes = 549 MiB
    assert memory.cache_bytes(shape, 8192, dtype="bfloat16") == 575668224 == 549 * MiB
    # against the same 61 layers caching K and V heads of 128 dims (bf16):
    # GQA with 8 KV heads 61 * 8 * 128 * 4 = 249856 B, MHA with 128 heads 61 * 128 * 128 * 4 = 3997696 B
    assert memory.bytes_per_token(KVShape(61, 8, 128)) == 249856
    assert memory.bytes_per_token(KVShape(61, 128, 128)) == 3997696
    assert Fraction(70272, 3997696) == Fraction(9, 512)  # MLA keeps 576 of 32768 values: 1.76%


def test_mla_config_path_equals_the_explicit_path():
    explicit = KVShape.mla_shape(61, 512, 64)
    assert explicit == KVShape(61, 1, 512, v_head_dim=64, mla=True)
    assert (explicit.num_kv_heads, explicit.head_dim, explicit.v_head_dim) == (1, 512, 64)
    assert KVShape.from_config(DEEPSEEK_V3) == explicit
    assert KVShape.from_config(SimpleNamespace(**DEEPSEEK_V3)) == explicit
    # DeepSeek-V2 (60 layers, the same latent and rotary widths): 60 * 576 * 2 = 69120 bytes bf16
    v2 = KVShape.from_config({**DEEPSEEK_V3, "model_type": "deepseek_v2", "num_hidden_layers": 60})
    assert memory.bytes_per_token(v2) == 69120


def test_mla_from_real_transformers_configs():
    transformers = pytest.importorskip("transformers")
    v3 = transformers.DeepseekV3Config()
    # the defaults are DeepSeek-V3's published attention shapes
    assert (v3.num_hidden_layers, v3.kv_lora_rank, v3.qk_rope_head_dim) == (61, 512, 64)
    assert (v3.num_attention_heads, v3.qk_nope_head_dim, v3.v_head_dim) == (128, 128, 128)
    # head_dim is set to qk_rope_head_dim and num_key_value_heads to 128: neither is the cache
    assert KVShape.from_config(v3) == KVShape.mla_shape(61, 512, 64)
    assert memory.bytes_per_token(KVShape.from_config(v3)) == 61 * (512 + 64) * 2
    tiny = transformers.DeepseekV2Config(num_hidden_layers=3, num_attention_heads=4, hidden_size=64,
                                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                         v_head_dim=16, q_lora_rank=None)  # fmt: skip
    assert KVShape.from_config(tiny) == KVShape.mla_shape(3, 16, 8)
    assert memory.bytes_per_token(KVShape.from_config(tiny), dtype="float32") == 3 * (16 + 8) * 4


# ---------------------------------------------------------------- hybrid layer mixes

# Qwen3-Next-80B-A3B's config.json: 48 layers, every 4th full attention (2 KV heads of 256), the
# others Gated DeltaNet (16 key heads and 32 value heads of 128, conv kernel 4)
QWEN3_NEXT = dict(model_type="qwen3_next", num_hidden_layers=48, num_attention_heads=16,
                  num_key_value_heads=2, head_dim=256, hidden_size=2048, linear_num_key_heads=16,
                  linear_key_head_dim=128, linear_num_value_heads=32, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, full_attention_interval=4,
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                               for i in range(48)])  # fmt: skip


def test_qwen3_next_only_its_attention_layers_cache_tokens():
    shape = KVShape.from_config(QWEN3_NEXT)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (12, 2, 256)
    # 12 attention layers * 2 heads * 256 * (2 + 2) bytes = 24576 bytes per token (not 48 layers' 98304)
    assert memory.bytes_per_token(shape) == 24576
    assert memory.cache_bytes(shape, 32768) == 24576 * 32768 == 768 * MiB
    # 36 Gated DeltaNet layers; each convolves the q, k, v channels 2 * 16 * 128 + 32 * 128 = 8192 over
    # 4 steps (32768 values) and keeps a 128 x 128 matrix per value head (32 * 16384 = 524288 values)
    assert shape.state_layers == 36
    assert shape.conv_state_elements == 36 * 32768 == 1179648
    assert shape.recurrent_state_elements == 36 * 524288 == 18874368
    # bf16 conv window, float32 recurrent state: 36 * (32768 * 2 + 524288 * 4) = 77856768 bytes
    assert memory.state_bytes(shape, dtype="bfloat16") == 77856768
    assert memory.state_bytes(shape, dtype="bfloat16", batch_size=3) == 3 * 77856768
    assert memory.state_bytes(shape, conv_bits=8, recurrent_bits=16) == 36 * (32768 + 524288 * 2)


# Jamba-v0.1's config.json: 32 layers, attention at i % 8 == 4 (8 KV heads of 4096 / 32 = 128), Mamba
# elsewhere (expand 2 of hidden 4096, d_conv 4, d_state 16); no layer_types in the file
JAMBA = dict(model_type="jamba", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
             hidden_size=4096, attn_layer_period=8, attn_layer_offset=4, mamba_expand=2,
             mamba_d_conv=4, mamba_d_state=16)  # fmt: skip


def test_jamba_only_its_attention_layers_cache_tokens():
    shape = KVShape.from_config(JAMBA)
    assert shape == KVShape(4, 8, 128, state_layers=28, conv_state_elements=28 * 8192 * 4,
                            recurrent_state_elements=28 * 8192 * 16)  # fmt: skip
    # layers 4, 12, 20, 28 attend: 4 * 8 * 128 * 4 = 16384 bytes per token (not 32 layers' 131072)
    assert memory.bytes_per_token(shape, dtype="bfloat16") == 16384
    # 28 Mamba layers of 8192 channels: 4 bf16 conv steps (8 B) + 16 float32 SSM values (64 B) each
    assert memory.state_bytes(shape, dtype="bfloat16") == 28 * 8192 * (8 + 64) == 16515072
    # transformers 4.x's layers_block_type and 5.x's layer_types say the same thing
    kinds = ["attention" if i % 8 == 4 else "mamba" for i in range(32)]
    assert KVShape.from_config({**JAMBA, "layers_block_type": kinds}) == shape
    types = ["full_attention" if k == "attention" else "linear_attention" for k in kinds]
    assert KVShape.from_config(SimpleNamespace(**JAMBA, layer_types=types)) == shape


def test_hybrid_state_of_an_unknown_family_is_none_and_windows_apply_to_sliding_layers():
    cfg = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
               sliding_window=3, layer_types=["sliding_attention", "linear_attention",
                                              "full_attention", "conv"])  # fmt: skip
    shape = KVShape.from_config(cfg)
    assert shape.sliding_windows == (3, None) and shape.state_layers == 2
    assert shape.conv_state_elements is None and shape.recurrent_state_elements is None
    assert memory.state_bytes(shape) is None
    # bf16: 8 * 4 = 32 bytes per token-layer; the sliding layer holds 3 - 1 of 10 tokens, the full 10
    assert memory.cache_bytes(shape, 10) == 32 * (2 + 10)
    # the window's tokens 8 and 9 share one block
    assert memory.paged_memory(shape, [10], page_size=2).blocks_per_seq == (1 + 5,)
    # a model without state layers has no state
    assert memory.state_bytes(KVShape(2, 2, 8)) == 0


def _tiny_qwen3_next(transformers):
    return transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=3, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=256,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])


def _tiny_jamba(transformers):
    return transformers.JambaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=256)


def test_hybrid_tiny_transformers_configs():
    transformers = pytest.importorskip("transformers")
    qwen = KVShape.from_config(_tiny_qwen3_next(transformers))
    # 1 attention layer of 2 heads * 16; 3 DeltaNet layers: conv (2 * 2 * 16 + 4 * 8) * 3 = 288, S 4 * 16 * 8 = 512
    assert qwen == KVShape(1, 2, 16, state_layers=3, conv_state_elements=3 * 288,
                           recurrent_state_elements=3 * 512)  # fmt: skip
    jamba = KVShape.from_config(_tiny_jamba(transformers))
    # attention at layers 1 and 3 (2 heads of 32 / 4 = 8); 2 Mamba layers of 2 * 32 = 64 channels
    assert jamba == KVShape(2, 2, 8, state_layers=2, conv_state_elements=2 * 64 * 4,
                            recurrent_state_elements=2 * 64 * 8)  # fmt: skip


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next", "jamba"])
def test_bytes_equal_what_the_real_models_cache(family):
    """The tiny models of transformers' own classes, run once on a DynamicCache: the bytes of the
    tensors it holds are kvcache.memory's per-token cache plus its fixed state."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x caches MLA's expanded heads and keeps hybrid state in model-specific caches")
    transformers.logging.set_verbosity_error()
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)
        model = transformers.DeepseekV3ForCausalLM(config)
    elif family == "qwen3_next":
        config = _tiny_qwen3_next(transformers)
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        config = _tiny_jamba(transformers)
        model = transformers.JambaForCausalLM(config)
    model = model.eval().to(torch.bfloat16)
    batch, tokens = 2, 7
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (batch, tokens - 1)), past_key_values=cache, use_cache=True)
        model(input_ids=torch.randint(0, 128, (batch, 1)), past_key_values=cache, use_cache=True)
    held = {"kv": 0, "state": 0}
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            held["kv"] += t.nbytes if isinstance(t, torch.Tensor) else 0
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            held["state"] += sum(t.nbytes for t in states.values() if t is not None)
    shape = KVShape.from_config(config)
    assert held["kv"] == memory.cache_bytes(shape, tokens, batch_size=batch, dtype="bfloat16") > 0
    assert held["state"] == memory.state_bytes(shape, batch_size=batch, dtype="bfloat16")
    assert (held["state"] == 0) == (family == "deepseek_v3")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: KVShape(61, 8, 512, v_head_dim=64, mla=True), "num_kv_heads.*8"),
        (lambda: KVShape(61, 1, 512, mla="yes"), "mla.*'yes'"),
        (lambda: KVShape(2, 1, 8, v_head_dim=0), "v_head_dim.*0"),
        (lambda: KVShape(2, 1, 8, v_head_dim=4.0), "v_head_dim"),
        (lambda: KVShape.mla_shape(61, 0, 64), "kv_lora_rank.*0"),
        (lambda: KVShape.mla_shape(61, 512, -64), "qk_rope_head_dim.*-64"),
        (lambda: KVShape.mla_shape(0, 512, 64), "num_layers.*0"),
        (lambda: KVShape(2, 1, 8, state_layers=-1), "state_layers.*-1"),
        (lambda: KVShape(2, 1, 8, state_layers=2, conv_state_elements=-5), "conv_state_elements.*-5"),
        (lambda: KVShape(2, 1, 8, state_layers=2, recurrent_state_elements=1.5),
         "recurrent_state_elements.*1.5"),
        (lambda: KVShape(2, 1, 8, conv_state_elements=10), r"conv_state_elements.*state_layers=0.*10"),
        (lambda: KVShape.from_config({**DEEPSEEK_V3, "kv_lora_rank": 0}), "kv_lora_rank.*0"),
        (lambda: KVShape.from_config({**DEEPSEEK_V3, "qk_rope_head_dim": "64"}), "qk_rope_head_dim.*'64'"),
        (lambda: KVShape.from_config({**QWEN3_NEXT, "layer_types": ["linear_attention"] * 48}),
         "no attention layer"),
        (lambda: KVShape.from_config({**QWEN3_NEXT, "layer_types": ["mamba2"] * 48}),
         r"layer_types\[0\]='mamba2'"),
        (lambda: KVShape.from_config({**QWEN3_NEXT, "linear_conv_kernel_dim": 0}), "linear_conv_kernel_dim.*0"),
        (lambda: KVShape.from_config({**JAMBA, "attn_layer_offset": 8}), "attn_layer_offset.*8"),
        (lambda: KVShape.from_config({**JAMBA, "attn_layer_period": 0}), "attn_layer_period.*0"),
        (lambda: KVShape.from_config({**JAMBA, "layers_block_type": ["attention"] * 31}),
         "layers_block_type has 31 entries"),
        (lambda: KVShape.from_config({**QWEN3_NEXT, "layer_types": ["chunked_attention"] * 48}),
         "attention_chunk_size"),
        (lambda: memory.state_bytes(KVShape.from_config(JAMBA), batch_size=0), "batch_size.*0"),
        (lambda: memory.state_bytes(KVShape.from_config(JAMBA), recurrent_bits="fp33"), "recurrent_bits.*fp33"),
        (lambda: memory.state_bytes(KVShape.from_config(JAMBA), conv_bits=-8), "conv_bits.*-8"),
    ],
)  # fmt: skip
def test_bad_mla_and_hybrid_values_raise_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- element sizes and metadata


def test_mixed_k8_v4_bits_with_scale_and_zero_point_metadata():
    shape = KVShape(32, 8, 128)
    # K int8: 128 B per token-head, plus an fp16 scale and zero point: 4 B
    # V int4 in groups of 32: 64 B, plus 4 groups * (2 B scale + 2 B zero point) = 16 B
    per_token_head = 128 + 4 + 64 + 16
    expected = 32 * 8 * per_token_head
    got = memory.bytes_per_token(shape, k_bits=8, v_bits=4, k_meta_bytes_per_token_head=4,
                                 v_meta_bytes_per_token_head=16)  # fmt: skip
    assert got == expected == 54272
    by_name = memory.bytes_per_token(shape, k_bits="int8", v_bits="int4",
                                     k_meta_bytes_per_token_head=4,
                                     v_meta_bytes_per_token_head=Fraction(16))  # fmt: skip
    assert by_name == expected
    assert memory.cache_bytes(shape, [10, 20], k_bits=8, v_bits=4, k_meta_bytes_per_token_head=4,
                              v_meta_bytes_per_token_head=16) == expected * 30  # fmt: skip


def test_k_bits_and_v_bits_override_dtype_separately():
    shape = KVShape(1, 1, 8)
    # K from dtype, fp32: 8 * 4 = 32 B; V overridden to fp8: 8 B
    assert memory.bytes_per_token(shape, dtype="float32", v_bits="float8_e4m3fn") == 32 + 8
    # 2-bit K: 8 * 2 bits = 2 B; V at the 16-bit default: 16 B
    assert memory.bytes_per_token(shape, k_bits=2) == 2 + 16


def test_sub_byte_totals_are_exact_fractions_and_ints_when_whole():
    shape = KVShape(1, 1, 3)
    per_token = memory.bytes_per_token(shape, k_bits=3, v_bits=3)  # 3 * 6 bits = 18 bits
    assert per_token == Fraction(9, 4) and isinstance(per_token, Fraction)
    four = memory.cache_bytes(shape, 4, k_bits=3, v_bits=3)  # 72 bits = 9 bytes
    assert four == 9 and type(four) is int
    # 4-bit K and V of 8 elements: 4 + 4 bytes, plus half a byte of K metadata
    half = memory.bytes_per_token(KVShape(1, 1, 8), k_bits=4, v_bits=4,
                                  k_meta_bytes_per_token_head=0.5)  # fmt: skip
    assert half == 8 + Fraction(1, 2)


def test_dtype_names_and_dtype_like_objects():
    class FakeTorchDtype:  # what torch.bfloat16 prints as, without importing torch
        def __str__(self):
            return "torch.bfloat16"

    class Unnamed:
        itemsize = 2

        def __str__(self):
            return "mystery"

    assert memory.dtype_bits(FakeTorchDtype()) == 16
    assert memory.dtype_bits(Unnamed()) == 16
    assert memory.dtype_bits("BF16") == memory.dtype_bits("half") == 16
    assert memory.dtype_bits("float32") == 32 and memory.dtype_bits("int8") == 8
    np = pytest.importorskip("numpy")
    assert memory.dtype_bits(np.dtype("float16")) == 16
    assert memory.dtype_bits(np.dtype("float64")) == 64
    assert memory.dtype_bits(np.float16) == 16 and memory.dtype_bits(np.int8) == 8  # scalar types, as the docstring says


def test_real_torch_dtypes():
    torch = pytest.importorskip("torch")
    shape = KVShape(32, 8, 128)
    assert memory.cache_bytes(shape, 8192, dtype=torch.bfloat16) == GiB
    # int8 K (1 B) + fp32 V (4 B) per element
    got = memory.bytes_per_token(shape, k_bits=torch.int8, v_bits=torch.float32)
    assert got == 32 * 8 * 128 * (1 + 4)


def test_importing_the_module_does_not_import_torch():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {memory.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.dtype_bits('bfloat16')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- sliding windows


def test_sliding_window_caps_tokens_per_layer():
    shape = KVShape(2, 1, 1, sliding_windows=[4, None])
    # int8 K and V: 2 bytes per token-layer; the windowed layer holds min(T, 4 - 1)
    assert memory.cache_bytes(shape, [6, 8, 3], dtype="int8") == 2 * ((3 + 3 + 3) + (6 + 8 + 3))
    # a window of 1: DynamicCache's keys[:, :, -1 + 1:] keeps every token (it held 0 here: audit, 5120 bytes
    # held by DynamicCache and PagedCache.stats()'s dynamic_cache_bytes against 0)
    assert memory.cache_bytes(KVShape(1, 1, 1, sliding_windows=1), [5], dtype="int8") == 2 * 5
    assert memory.paged_memory(KVShape(1, 1, 1, sliding_windows=1), [5], 4, dtype="int8").blocks_per_seq == (2,)
    assert memory.bytes_per_token(shape, dtype="int8") == 4
    assert KVShape(2, 1, 1, sliding_windows=[None, None]).sliding_windows is None
    assert KVShape(2, 1, 1, sliding_windows=7).sliding_windows == (7, 7)


def test_hybrid_dict_without_layer_types_and_kv_shared_layers():
    # Qwen3-Next's published config.json has full_attention_interval and no layer_types: every 4th layer is
    # attention (as transformers derives them); it was read as 48 attention layers and no state.
    qwen = dict(model_type="qwen3_next", num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                head_dim=256, hidden_size=2048, full_attention_interval=4, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32)
    s = KVShape.from_config(qwen)
    assert s.num_layers == 12 and s.state_layers == 36
    transformers = pytest.importorskip("transformers")
    obj = transformers.Qwen3NextConfig(**{k: v for k, v in qwen.items() if k != "model_type"})
    assert KVShape.from_config(obj) == s
    # Gemma 3n: the last num_kv_shared_layers layers reuse earlier layers' K/V (DynamicCache holds none for them)
    gemma = dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                 num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3)
    g = KVShape.from_config(gemma)
    assert g.num_layers == 4 and g.sliding_windows == (8, None, 8, None)
    with pytest.raises(ValueError, match=r"num_kv_shared_layers=6 leaves no layer of num_layers=6 caching K/V"):
        KVShape.from_config({**gemma, "num_kv_shared_layers": 6})


# ---------------------------------------------------------------- paged and contiguous views


def test_paged_view_by_hand():
    shape = KVShape(2, 2, 4)  # fp16: 2 layers * 2 heads * 4 * 4 bytes = 64 B per token
    r = memory.paged_memory(shape, [1, 16, 17], page_size=16)
    assert r.blocks_per_seq == (1, 1, 2) and r.num_blocks == 4
    assert r.used_bytes == (1 + 16 + 17) * 64 == 2176
    assert r.reserved_bytes == 4 * 16 * 64 == 4096
    assert r.waste_bytes == 4096 - 2176 == 1920
    assert r.waste_fraction == 1920 / 4096 == 0.46875
    text = str(r)
    assert "paged" in text and "page_size=16" in text and "4 blocks" in text and "46.9%" in text


def test_paged_batch_times_seq_len():
    shape = KVShape(2, 2, 4)  # 64 B per token
    r = memory.paged_memory(shape, 10, 8, batch_size=3)
    assert r.blocks_per_seq == (2, 2, 2)  # ceil(10 / 8) = 2 each
    assert (r.used_bytes, r.reserved_bytes) == (30 * 64, 6 * 8 * 64)


def test_paged_waste_is_zero_for_multiples_of_the_page_size():
    shape = KVShape(32, 8, 128)
    r = memory.paged_memory(shape, [16, 32, 0, 4096], page_size=16)
    assert r.blocks_per_seq == (1, 2, 0, 256)
    assert r.waste_bytes == 0 and r.waste_fraction == 0.0
    assert r.reserved_bytes == r.used_bytes == (16 + 32 + 4096) * 131072
    empty = memory.paged_memory(shape, [], page_size=16)
    assert (empty.num_blocks, empty.reserved_bytes, empty.waste_fraction) == (0, 0, 0.0)


def test_paged_sliding_window_frees_blocks_behind_the_window():
    shape = KVShape(2, 1, 1, sliding_windows=[4, None])  # int8: 2 B per token-layer
    r = memory.paged_memory(shape, [6, 8, 3], page_size=4, dtype="int8")
    # the window keeps W - 1 = 3 tokens
    # T=6: full layer ceil(6/4)=2; window keeps tokens 3..5 -> blocks 0 and 1 -> 2
    # T=8: full 2; window keeps 5..7 -> block 1 only -> 1
    # T=3: full 1; window 1
    assert r.blocks_per_seq == (4, 3, 2)
    assert r.used_bytes == 2 * ((6 + 8 + 3) + (3 + 3 + 3)) == 52
    assert r.reserved_bytes == 9 * 4 * 2 == 72
    assert r.waste_bytes == 20
    # T=5, page 4, window 2: the one live token (4) sits in block 1; window 1 keeps every token, as DynamicCache
    for window, blocks in ((2, (1,)), (1, (2,))):
        one = KVShape(1, 1, 1, sliding_windows=window)
        assert memory.paged_memory(one, [5], page_size=4).blocks_per_seq == blocks


def test_contiguous_view_by_hand():
    shape = KVShape(2, 2, 4)  # 64 B per token
    r = memory.contiguous_memory(shape, [1, 16, 17], max_len=32)
    assert r.reserved_bytes == 3 * 32 * 64 == 6144
    assert r.used_bytes == 34 * 64 == 2176
    assert r.waste_bytes == 6144 - 2176 == 3968
    assert memory.contiguous_memory(shape, [1, 16, 17]).reserved_bytes == 3 * 17 * 64
    assert "contiguous" in str(r) and "max_len=32" in str(r)
    paged = memory.paged_memory(shape, [1, 16, 17], page_size=16)
    assert paged.waste_bytes < r.waste_bytes
    windowed = KVShape(2, 1, 1, sliding_windows=[4, None])
    w = memory.contiguous_memory(windowed, [6], max_len=10, dtype="int8")
    assert (w.reserved_bytes, w.used_bytes) == (2 * (10 + 3), 2 * (6 + 3))  # the window: W - 1 = 3


# ---------------------------------------------------------------- formatting


def test_format_bytes():
    f = memory.format_bytes
    assert f(GiB) == "1.00 GiB" and f(512 * KiB) == "512.00 KiB"
    assert f(512) == "512 B" and f(0) == "0 B" and f(Fraction(9, 4)) == "2.25 B"
    assert f(1536) == "1.50 KiB" and f(3 * GiB // 2, precision=1) == "1.5 GiB"
    assert f(MiB - 1) == "1.00 MiB"  # 1023.999 KiB would print as 1024.00 KiB
    assert f(-2048) == "-2.00 KiB" and f(2**40) == "1.00 TiB" and f(1.5 * KiB) == "1.50 KiB"


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(num_layers=0, num_kv_heads=8, head_dim=128), "num_layers"),
        (dict(num_layers=True, num_kv_heads=8, head_dim=128), "num_layers"),
        (dict(num_layers=32, num_kv_heads=-1, head_dim=128), "num_kv_heads"),
        (dict(num_layers=32, num_kv_heads=8, head_dim=0), "head_dim"),
        (dict(num_layers=32, num_kv_heads=8, head_dim=128.0), "head_dim"),
        (dict(num_layers=2, num_kv_heads=1, head_dim=1, sliding_windows=[4]), "sliding_windows"),
        (dict(num_layers=2, num_kv_heads=1, head_dim=1, sliding_windows=[0, None]),
         r"sliding_windows\[0\]"),
        (dict(num_layers=2, num_kv_heads=1, head_dim=1, sliding_windows="4"), "sliding_windows"),
    ],
)  # fmt: skip
def test_bad_shapes_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        KVShape(**kwargs)


SHAPE = KVShape(2, 2, 4)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: memory.cache_bytes(SHAPE, -1), "lengths.*-1"),
        (lambda: memory.cache_bytes(SHAPE, [3, -2]), r"lengths\[1\].*-2"),
        (lambda: memory.cache_bytes(SHAPE, [3, 2.5]), r"lengths\[1\]"),
        (lambda: memory.cache_bytes(SHAPE, "12"), "lengths"),
        (lambda: memory.cache_bytes(SHAPE, 8, batch_size=0), "batch_size.*0"),
        (lambda: memory.cache_bytes(SHAPE, [8, 8], batch_size=2), "batch_size"),
        (lambda: memory.paged_memory(SHAPE, [8], 0), "page_size.*0"),
        (lambda: memory.paged_memory(SHAPE, [8], 12), "page_size.*12"),
        (lambda: memory.paged_memory(SHAPE, [8], -16), "page_size.*-16"),
        (lambda: memory.paged_memory(SHAPE, [8], 16.0), "page_size"),
        (lambda: memory.paged_memory(SHAPE, [-8], 16), r"lengths\[0\]"),
        (lambda: memory.contiguous_memory(SHAPE, [8], max_len=-1), "max_len.*-1"),
        (lambda: memory.contiguous_memory(SHAPE, [8, 20], max_len=16), "max_len"),
        (lambda: memory.bytes_per_token(SHAPE, dtype="float17"), "dtype.*float17"),
        (lambda: memory.bytes_per_token(SHAPE, k_bits="foo"), "k_bits.*foo"),
        (lambda: memory.bytes_per_token(SHAPE, v_bits=0), "v_bits.*0"),
        (lambda: memory.bytes_per_token(SHAPE, k_bits=-4), "k_bits.*-4"),
        (lambda: memory.bytes_per_token(SHAPE, k_bits=4.5), "k_bits"),
        (lambda: memory.bytes_per_token(SHAPE, k_meta_bytes_per_token_head=-1),
         "k_meta_bytes_per_token_head"),
        (lambda: memory.bytes_per_token(SHAPE, v_meta_bytes_per_token_head=math.nan),
         "v_meta_bytes_per_token_head"),
        (lambda: memory.cache_bytes((2, 8, 128), 5), r"shape must be a KVShape .*got tuple \(2, 8, 128\)"),
        (lambda: memory.bytes_per_token({}), r"shape must be a KVShape .*got dict"),
        (lambda: memory.paged_memory(None, [5], 16), r"shape must be a KVShape .*got NoneType None"),
        (lambda: memory.contiguous_memory("x", [5]), r"shape must be a KVShape .*got str"),
        (lambda: memory.state_bytes(3), r"shape must be a KVShape .*got int 3"),
        (lambda: memory.format_bytes("12"), "num_bytes"),
        (lambda: memory.format_bytes(math.inf), "num_bytes"),
        (lambda: memory.format_bytes(12, precision=-1), "precision"),
    ],
)  # fmt: skip
def test_bad_inputs_raise_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- properties and docs


@given(
    lengths=st.lists(st.integers(0, 5000), max_size=8),
    log_page=st.integers(0, 8),
    window=st.one_of(st.none(), st.integers(1, 3000)),
)
def test_paged_invariants(lengths, log_page, window):
    page = 2**log_page
    shape = KVShape(3, 2, 8, sliding_windows=[window, None, window])
    r = memory.paged_memory(shape, lengths, page)
    assert r.used_bytes == memory.cache_bytes(shape, lengths)
    assert 0 <= r.waste_bytes
    # each sequence wastes less than one block per layer group, two for a straddling window
    per_token_layer = 2 * 8 * 4
    assert r.waste_bytes <= len(lengths) * 3 * 2 * page * per_token_layer
    if window is None:
        assert r.blocks_per_seq == tuple(-(-t // page) for t in lengths)
        assert (r.waste_bytes == 0) == all(t % page == 0 for t in lengths)


@given(st.lists(st.integers(0, 10**6), max_size=6))
def test_cache_bytes_is_additive_over_sequences(lengths):
    shape = KVShape(4, 2, 16, sliding_windows=[None, 1000, None, 1000])
    kw = dict(k_bits=3, v_bits=5, v_meta_bytes_per_token_head=Fraction(1, 3))
    total = memory.cache_bytes(shape, lengths, **kw)
    assert total == sum((memory.cache_bytes(shape, t, **kw) for t in lengths), start=0)


def test_docstring_examples_run():
    result = doctest.testmod(memory, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0
