"""MLA models on transformers 4.x (the CPU-only environment's 4.57), which hands the cache DeepSeek's expanded
per-head K (nope + rope) and V rather than the latents (tests/test_mla.py covers transformers >= 5): the pages
hold those rows of two widths, and both the eager/sdpa and the "kvcache" attention read them through the dense
path (the absorbed kernel needs latents), giving DynamicCache's tokens."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import kvcache  # noqa: E402
from generate_support import generate as _generate, inputs as _inputs, max_diff as _max_diff  # noqa: E402

if int(transformers.__version__.split(".")[0]) >= 5:
    pytest.skip("transformers >= 5 hands the cache the latents: tests/test_mla.py", allow_module_level=True)
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip(f"DeepseekV3ForCausalLM is not in transformers {transformers.__version__}", allow_module_level=True)

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*generation flags.*")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    return transformers.DeepseekV3ForCausalLM(config).eval()


@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_expanded_rows_of_two_widths_give_dynamic_cache_tokens(model, impl):
    ids, mask = _inputs()
    ref = _generate(model, DynamicCache(), "sdpa", input_ids=ids, attention_mask=mask, do_sample=False)
    cache = kvcache.PagedCache(config=model.config, page_size=4)
    try:
        got = _generate(model, cache, impl, input_ids=ids, attention_mask=mask, do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref, got) <= 1e-4
    pool = cache.store.pools[0]  # per-head K (nope + rope) and V rows, as this transformers hands them
    assert (pool.num_kv_heads, pool.head_dim, pool.v_head_dim) == (4, 24, 16)


def test_expanded_rows_as_wide_as_latents_are_not_read_as_latents():
    """kv_lora_rank = qk_nope + qk_rope and v_head_dim = qk_rope: the expanded K and V rows have the latents'
    widths. The "kvcache" attention took them for latents (the absorbed kernel over per-head K/V): the prefill
    was right and every decode step wrong (audit: logits 0.43 off, other tokens, in generate and the Engine)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, q_lora_rank=32, kv_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    ids, mask = _inputs()
    ref = _generate(model, DynamicCache(), "sdpa", input_ids=ids, attention_mask=mask, do_sample=False)
    cache = kvcache.PagedCache(config=model.config)
    try:
        got = _generate(model, cache, "kvcache", input_ids=ids, attention_mask=mask, do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    pool = cache.store.pools[0]
    assert (pool.num_kv_heads, pool.head_dim, pool.v_head_dim) == (4, config.kv_lora_rank, config.qk_rope_head_dim)
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref, got) <= 1e-4
    engine = kvcache.Engine(model, max_batch=2)
    prompts = [ids[1, mask[1].bool()].tolist(), ids[0, mask[0].bool()].tolist()]
    for prompt, out in zip(prompts, engine.generate(prompts, max_new_tokens=6, eos_token_id=[])):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert out.tokens == want
