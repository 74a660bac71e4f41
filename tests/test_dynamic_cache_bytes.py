"""``dynamic_cache_bytes`` (PagedCache.stats(), Engine.stats(), the reprs) and kvcache.memory against the
bytes real ``DynamicCache(config=config)`` objects hold, on tiny random models of transformers' own classes:
full attention (Llama), a window on every layer (Mistral), alternating sliding / full layers (Gemma 2 and 3)
and Qwen2's sliding layers above ``max_window_layers``. DynamicCache keeps only ``sliding_window - 1`` tokens
of a sliding layer, while kvcache's pages hold every token."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import kvcache  # noqa: E402
from kvcache import _html, memory  # noqa: E402

transformers.logging.set_verbosity_error()

WINDOW = 8
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, pad_token_id=0)
MODELS = {  # name: (model_type, config overrides, attention implementation)
    "llama": ("llama", dict(num_hidden_layers=2), "sdpa"),
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=WINDOW), "sdpa"),
    "gemma2": ("gemma2", dict(num_hidden_layers=3, sliding_window=WINDOW), "eager"),  # sliding, full, sliding
    "gemma3": ("gemma3_text", dict(num_hidden_layers=3, sliding_window=WINDOW, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"]), "sdpa"),
    "qwen2": ("qwen2", dict(num_hidden_layers=3, sliding_window=WINDOW, use_sliding_window=True,
                            max_window_layers=1), "sdpa"),  # layer 0 full, 1 and 2 sliding
}
# per model, how many of its layers DynamicCache keeps a window for (the test's own premise, checked below)
SLIDING_LAYERS = {"llama": 0, "mistral": 2, "gemma2": 2, "gemma3": 2, "qwen2": 2}


def _model(name):
    kind, overrides, impl = MODELS[name]
    config = transformers.AutoConfig.for_model(kind, **{**BASE, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation(impl)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def named_model(request):
    return request.param, _model(request.param)


def _held_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def _run(model, cache, ids, steps):
    """A prefill of ``ids`` then ``steps`` one-token forwards (greedy), into ``cache``."""
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("prompt_len, steps", [(3, 2), (20, 5)])  # inside the window, then well beyond it
def test_paged_cache_stats_match_a_real_dynamic_cache(named_model, prompt_len, steps):
    name, model = named_model
    ids = torch.randint(1, 128, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    dense, paged = DynamicCache(config=model.config), kvcache.PagedCache(config=model.config)
    _run(model, dense, ids, steps)
    _run(model, paged, ids, steps)
    sliding = sum(getattr(layer, "is_sliding", False) for layer in dense.layers)
    assert sliding == SLIDING_LAYERS[name]
    real = _held_bytes(dense)
    s = paged.stats()
    assert s["dynamic_cache_bytes"] == real
    length = prompt_len + steps
    per_token_layer_row = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, float32
    full_bytes = model.config.num_hidden_layers * 2 * length * per_token_layer_row  # every token, 2 rows
    if length > WINDOW and sliding:  # the window drops tokens: fewer bytes than every token of every layer
        assert real == full_bytes - sliding * 2 * (length - (WINDOW - 1)) * per_token_layer_row < full_bytes
        assert s["bytes"] > real  # the pages hold every token of the sliding layers too
    else:
        assert real == full_bytes
    # the repr and the notebook table show the same figure
    assert f"vs DynamicCache {_html.human_bytes(real)}," in repr(paged)
    assert _html.human_bytes(real) in paged._repr_html_()
    # kvcache.memory's calculator gives the same bytes from the config alone
    shape = memory.KVShape.from_config(model.config)
    assert memory.cache_bytes(shape, [length, length], dtype="float32") == real


def test_engine_stats_match_real_dynamic_caches(named_model):
    """Engine.stats()['dynamic_cache_bytes']: the requests' peak, one DynamicCache per request."""
    name, model = named_model
    if name == "gemma2":
        pytest.skip("the Engine attends with the kernel or sdpa; Gemma 2's soft-capping is eager-only")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (21, 6)]
    engine = kvcache.Engine(model, prefix_cache=False)
    new = 4
    results = engine.generate(prompts, max_new_tokens=new, progress=False)
    real = 0
    for prompt, result in zip(prompts, results):  # the last step's tokens: the prompt and all but the newest
        assert len(result.tokens) == new
        dense = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([prompt + result.tokens[:-1]]), past_key_values=dense, use_cache=True)
        real += _held_bytes(dense)
    s = engine.stats()
    assert s["dynamic_cache_bytes"] == real
    if SLIDING_LAYERS[name]:  # the 24-token request holds every token in the pages, DynamicCache 7 of them
        assert s["kv_bytes"] > real
    assert _html.human_bytes(real) in engine._repr_html_()


def test_memory_windows_hold_window_minus_one_tokens():
    """kvcache.memory counts W - 1 tokens per sliding layer, as DynamicCache keeps them."""
    shape = memory.KVShape(2, 1, 4, sliding_windows=[WINDOW, None])  # int8: 8 bytes per token and layer
    assert memory.cache_bytes(shape, [40], dtype="int8") == 8 * (WINDOW - 1) + 8 * 40
    assert memory.cache_bytes(shape, [WINDOW - 1], dtype="int8") == 2 * 8 * (WINDOW - 1)
    assert memory.contiguous_memory(shape, [40], dtype="int8").reserved_bytes == 8 * (WINDOW - 1 + 40)
    report = memory.paged_memory(shape, [40], page_size=4, dtype="int8")
    assert report.used_bytes == memory.cache_bytes(shape, [40], dtype="int8")
    assert report.blocks_per_seq == (10 + 2,)  # tokens 33..39 of the window: blocks 8 and 9
