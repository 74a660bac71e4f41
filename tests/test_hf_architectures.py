"""kvcache.PagedCache against DynamicCache on ten more transformers architectures than test_hf's five, each
with what sets it apart from Llama: QK norms (Qwen3, OLMo2, Cohere), soft-capped logits and alternating
sliding windows (Gemma 2 / 3), partial rotary (StableLM, Phi-3's fused projections), scaled residuals
(Granite), biases and a window (Starcoder2), and mixture-of-experts MLPs (Qwen2-MoE). Small random models;
the same rules as test_hf: identical tokens, bit-identical logits with eager / SDPA, 1e-5 with our kernel
or a sliding window (DynamicCache then keeps only the window: the same math, other sums)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

import kvcache  # noqa: E402
from generate_support import generate, inputs, max_diff  # noqa: E402

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*generation flags.*")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
ARCHITECTURES = {
    "phi3": dict(partial_rotary_factor=0.5),
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "stablelm": dict(partial_rotary_factor=0.25),
    "olmo2": dict(),
    "granite": dict(residual_multiplier=0.5, attention_multiplier=0.2),
    "cohere": dict(use_qk_norm=True),
    "starcoder2": dict(sliding_window=8, use_bias=True),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2),
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model(request):
    try:
        config = AutoConfig.for_model(request.param, **{**BASE, **ARCHITECTURES[request.param]})
    except (KeyError, ValueError) as e:  # an architecture this transformers does not have
        pytest.skip(f"transformers {transformers.__version__} has no {request.param}: {e}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _dense(model) -> str:
    """PyTorch's attention for the reference: SDPA, or eager where transformers has no SDPA path (Gemma 2)."""
    return "sdpa" if model._supports_sdpa else "eager"


def _sliding(model) -> bool:
    return bool(getattr(model.config, "sliding_window", None))


@pytest.mark.parametrize("impl", ["eager", "sdpa", "kvcache"])
def test_left_padded_greedy_matches_dynamic_cache(model, impl):
    if impl == "sdpa" and not model._supports_sdpa:
        pytest.skip(f"transformers has no SDPA path for {type(model).__name__}")
    ids, mask = inputs(20)
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    ref = generate(model, DynamicCache(config=model.config), "eager" if impl == "eager" else _dense(model), 8,
                   **kwargs)
    cache = kvcache.PagedCache(config=model.config)
    got = generate(model, cache, impl, 8, **kwargs)
    assert torch.equal(ref.sequences, got.sequences)
    if impl == "kvcache" or _sliding(model):
        assert max_diff(ref, got) <= 1e-5
    else:
        assert max_diff(ref, got) == 0.0
    assert cache.get_seq_length() == got.sequences.shape[1] - 1


def test_beam_search_matches_dynamic_cache(model):
    """Beams reorder the cache every step (reorder_cache / the beam indices)."""
    ids = inputs(20)[0][:1]
    kwargs = dict(input_ids=ids, num_beams=3, num_return_sequences=2, do_sample=False)
    ref = generate(model, DynamicCache(config=model.config), _dense(model), 6, **kwargs)
    for impl in (_dense(model), "kvcache"):
        got = generate(model, kvcache.PagedCache(config=model.config), impl, 6, **kwargs)
        assert torch.equal(ref.sequences, got.sequences), impl


def test_int8_pages_stay_near_full_precision(model):
    """Quantized pages on these architectures too. By default int8 keeps its recent 128 tokens exact, which
    here is every token; with residual_length=0 every token is stored as int8 codes."""
    ids, mask = inputs(20)
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    ref = generate(model, DynamicCache(config=model.config), _dense(model), 4, **kwargs)
    default = kvcache.PagedCache(config=model.config, kv_format="int8")
    got = generate(model, default, "kvcache", 4, **kwargs)
    assert default.stats()["format"] == "int8+residual=128" and max_diff(ref, got) <= 1e-5
    codes = kvcache.PagedCache(config=model.config, kv_format="int8", residual_length=0)
    got = generate(model, codes, "kvcache", 4, **kwargs)
    rel = ((ref.logits[0] - got.logits[0]).norm() / ref.logits[0].norm()).item()
    assert codes.stats()["format"] == "int8" and 0 < rel < 0.02


@pytest.mark.parametrize("kv_format", [None, "int8"])
def test_learned_attention_sinks_of_gpt_oss(kv_format):
    """gpt-oss hands the attention function its learned per-head sink logits (``s_aux``): one more softmax term.
    The "kvcache" attention dropped them silently (its kernel has no such term; logits off by ~0.8, other
    tokens), with or without a cache, and in the Engine. It now attends in PyTorch with them: eager +
    DynamicCache's tokens and logits, as eager/sdpa with the pages; the Engine too."""
    try:
        config = AutoConfig.for_model("gpt_oss", **{**BASE, "head_dim": 16, "sliding_window": 8,
                                                    "layer_types": ["sliding_attention", "full_attention"],
                                                    "num_local_experts": 4, "num_experts_per_tok": 2})
    except (KeyError, ValueError) as e:
        pytest.skip(f"transformers {transformers.__version__} has no gpt_oss: {e}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)  # sinks that matter
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False)
    ref = generate(model, DynamicCache(config=model.config), "eager", **kwargs)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
    try:
        got = generate(model, kvcache.PagedCache(config=model.config, kv_format=kv_format), "kvcache", **kwargs)
        with torch.no_grad():
            uncached = model(ids, use_cache=False).logits
        results = kvcache.Engine(model, kv_format=kv_format, page_size=4, max_batch=2).generate(
            ids.tolist(), max_new_tokens=8, progress=False)
    finally:
        model.set_attn_implementation("eager")
    assert torch.equal(ref.sequences, got.sequences)
    assert max_diff(ref, got) <= 1e-5
    assert float((plain - uncached).abs().max()) <= 1e-5
    assert [r.tokens for r in results] == ref.sequences[:, ids.shape[1]:].tolist()


def test_chunked_attention_of_llama4():
    """Llama 4's local layers attend within chunks of ``attention_chunk_size`` tokens. The "kvcache" mask function
    kept only the padding and the kernel attended causally across chunks (logits off by ~0.7, other tokens,
    with a PagedCache or a DynamicCache): the chunked layers now get the whole mask and attend in PyTorch over
    the pages, the full layers through the kernel. The Engine refuses such a model with a clear error."""
    try:
        config = AutoConfig.for_model("llama4_text", **{**BASE, "head_dim": 16, "attention_chunk_size": 8,
                                                        "no_rope_layers": [1, 0], "intermediate_size_mlp": 128,
                                                        "num_local_experts": 2, "num_experts_per_tok": 1,
                                                        "layer_types": ["chunked_attention", "full_attention"]})
    except (KeyError, ValueError) as e:
        pytest.skip(f"transformers {transformers.__version__} has no llama4_text: {e}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False)
    ref = generate(model, DynamicCache(config=model.config), "sdpa", **kwargs)
    try:
        for cache in (kvcache.PagedCache(config=model.config), DynamicCache(config=model.config)):
            got = generate(model, cache, "kvcache", **kwargs)
            assert torch.equal(ref.sequences, got.sequences) and max_diff(ref, got) <= 1e-5, type(cache).__name__
        with pytest.raises(ValueError, match="attention_chunk_size=8"):
            kvcache.Engine(model, page_size=4).generate(ids.tolist(), max_new_tokens=2, progress=False)
    finally:
        model.set_attn_implementation("sdpa")


def _tiny_or_skip(name: str, **kwargs):
    try:
        config = AutoConfig.for_model(name, **kwargs)
    except (KeyError, ValueError) as e:
        pytest.skip(f"transformers {transformers.__version__} has no {name}: {e}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_window_given_as_none_is_no_window():
    """Exaone 4 keeps sliding_window on every attention module and passes sliding_window=None to its global layers:
    the "kvcache" attention took the module's window for them (a None argument read as "not given"), so the global
    layer attended to 5 tokens and the tokens differed from the 5th on. A None given is now no window."""
    model = _tiny_or_skip("exaone4", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, sliding_window=5, initializer_range=0.2,
                          layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    ids = torch.randint(3, 128, (1, 17), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
        model.set_attn_implementation("kvcache")
        got = model.generate(ids, past_key_values=kvcache.PagedCache(config=model.config), **kw)
    assert torch.equal(got, want)
    engine = kvcache.Engine(model, prefix_cache=False)
    assert engine.generate([ids[0].tolist()], eos_token_id=[], progress=False, max_new_tokens=10)[0].tokens == \
        want[0, 17:].tolist()


def test_a_value_transformed_after_the_cache_is_refused_by_the_kvcache_attention():
    """DiffLlama splits V after the cache's update and calls attention twice with halves of it; the "kvcache"
    attention reads V from the pages, so it attended to the untransformed V (other tokens from the first). Refused,
    naming the model and the way that works (eager/sdpa, with which its K/V are paged all the same)."""
    model = _tiny_or_skip("diffllama", **{**BASE, "num_attention_heads": 4, "num_key_value_heads": 2})
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
        assert torch.equal(model.generate(ids, past_key_values=kvcache.PagedCache(config=model.config), **kw), want)
        if int(transformers.__version__.split(".")[0]) < 5:
            return  # (4.x's DiffLlama does not go through the attention interface: it cannot be switched to "kvcache")
        model.set_attn_implementation("kvcache")
        with pytest.raises(ValueError, match=r"DiffLlamaAttention \(layer 0\) hands its attention other value states "
                                             r"than the cache's update returned .*run it with eager or sdpa"):
            model.generate(ids, past_key_values=kvcache.PagedCache(config=model.config), **kw)
