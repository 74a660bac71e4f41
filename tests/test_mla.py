"""MLA models (DeepSeek-V2/V3) on kvcache: their latents (kv_nope, k_rot) have rows of two widths, which the
pages do not hold yet; PagedCache says so clearly instead of failing inside a kernel."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvcache  # noqa: E402

if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip(f"DeepseekV3ForCausalLM is not in transformers {transformers.__version__}", allow_module_level=True)


def _deepseek_v3():
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)
    return transformers.DeepseekV3ForCausalLM(config).eval()


def test_mla_latents_of_two_widths_are_refused_clearly():
    model = _deepseek_v3()
    cache = kvcache.PagedCache(config=model.config)
    with pytest.raises(ValueError, match=r"layer 0: value heads/head_dim .* differ from the key's .*MLA model"):
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
