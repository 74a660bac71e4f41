"""Hybrid models on a transformers without hybrid cache layers (the CPU-only environment's 4.57; tests/test_hybrid.py
covers >= 5.5): PagedCache refuses them when it is made, naming the version, rather than failing in a forward."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvcache  # noqa: E402

if hasattr(transformers.cache_utils, "LinearAttentionCacheLayerMixin"):
    pytest.skip("transformers >= 5.5 has hybrid cache layers: tests/test_hybrid.py", allow_module_level=True)


def _configs():
    # Jamba names its Mamba layers in layers_block_type (no layer_types in 4.x): it was accepted, and its first
    # forward failed inside PagedCache ('PagedLayer' object has no attribute 'device')
    yield transformers.JambaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                   attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                   mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                                   use_mamba_kernels=False)
    if hasattr(transformers, "Qwen3NextConfig"):
        yield transformers.Qwen3NextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


@pytest.mark.parametrize("config", list(_configs()), ids=lambda c: type(c).__name__)
def test_hybrid_models_are_refused_naming_the_version(config):
    with pytest.raises(ValueError, match=rf"{type(config).__name__} has linear-attention/Mamba layers, whose cache "
                                         rf"layers need transformers >= 5.5 \(installed: {transformers.__version__}\)"):
        kvcache.PagedCache(config=config)
    if isinstance(config, transformers.JambaConfig):
        torch.manual_seed(0)
        model = transformers.JambaForCausalLM(config).eval()
        with pytest.raises(ValueError, match="transformers >= 5.5"):
            kvcache.Engine(model)


@pytest.mark.skipif(not hasattr(transformers, "Qwen3NextConfig"), reason="no Qwen3-Next in this transformers")
@pytest.mark.parametrize("kwargs", [{}, {"num_layers": 2}], ids=["no config", "num_layers"])
def test_a_cache_made_without_the_config_names_what_the_hybrid_model_asks_for(kwargs):
    """Made without config=, the cache cannot see the model is hybrid: its first forward failed on a bare
    "'PagedCache' object has no attribute 'has_previous_state'". The AttributeError now says what asked for it
    and what to use; other missing attributes stay plain AttributeErrors (hasattr keeps working)."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"])
    model = transformers.Qwen3NextForCausalLM(config).eval()
    cache = kvcache.PagedCache(**kwargs)
    with pytest.raises(AttributeError, match=r"has no 'has_previous_state': the model is a hybrid .* transformers "
                                             r">= 5.5 and PagedCache\(config=model.config\)"), torch.no_grad():
        model(torch.randint(2, 128, (1, 6)), past_key_values=cache)
    assert not hasattr(cache, "no_such_attribute") and cache.get_seq_length() == 0
