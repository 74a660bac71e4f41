"""What Jupyter shows for kvcache's objects (their ``_repr_html_``): the figures a user looks for."""

from __future__ import annotations

import re

import pytest
import torch

import kvcache


def _cells(html: str) -> dict[str, str]:
    """The two-column table as {label: value}."""
    return dict(re.findall(r"<tr><td[^>]*>(.*?)</td><td[^>]*>(.*?)</td></tr>", html))


def test_kvpool_shows_format_bytes_and_bits_per_value():
    pool = kvcache.KVPool.allocate(4, 16, 2, 64, "int8")
    cells = _cells(pool._repr_html_())
    assert "kvcache.KVPool" in pool._repr_html_()
    assert cells["format"] == "int8"
    assert cells["blocks x page_size"] == "4 x 16 = 64 token slots"
    # int8: 64 codes + one float32 scale per (token, head): 68 bytes for 64 values
    assert cells["bits per value (scales included)"] == f"{8 * 68 / 64:.2f}"
    assert cells["bytes"] == f"{pool.nbytes / 1024:.1f} KiB"
    assert cells["bytes in bf16"] == f"{2 * 2 * 64 * 2 * 64 / 1024:.1f} KiB"


def test_an_empty_kvpool_displays():
    pool = kvcache.KVPool.allocate(0, 16, 2, 32, "int8")  # (its display divided by its 0 values)
    assert _cells(pool._repr_html_())["bits per value (scales included)"] == "- (no blocks)"


def test_block_allocator_shows_use_and_waste():
    alloc = kvcache.BlockAllocator(8, 4, bytes_per_block=1024)
    seq = alloc.sequence()
    alloc.append(seq, 5)                       # 2 blocks, 3 unwritten slots
    alloc.fork(seq)
    cells = _cells(alloc._repr_html_())
    assert cells["free / used / shared"] == "6 / 2 / 2"
    assert cells["tokens held"] == "5"          # the fork shares them
    assert cells["unwritten slots in used blocks"] == "3 (37.5%)"
    assert cells["bytes used"] == "2.0 KiB"


def test_prefix_cache_shows_its_hit_rate():
    alloc = kvcache.BlockAllocator(8, 4)
    cache = kvcache.PrefixCache(alloc, policy="lfu")
    cache.insert([1, 2, 3, 4, 5, 6], alloc.allocate(2))
    cache.match([1, 2, 3, 4, 9, 9, 9, 9])      # 4 of 8 tokens hit
    cells = _cells(cache._repr_html_())
    assert cells["policy"] == "lfu"
    assert cells["hit rate"] == "50.0% (4 of 8 tokens)"
    assert cells["cached tokens"] == "6" and cells["cached blocks"] == "2"


def test_paged_cache_and_engine_show_tokens_bytes_and_hits():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    cache = kvcache.PagedCache(config=config, kv_format="int8", residual_length=0)
    with torch.no_grad():
        model(torch.arange(1, 21)[None], past_key_values=cache)
    cells = _cells(cache._repr_html_())
    s = cache.stats()
    assert cells["format"] == "int8" and cells["tokens"] == "20" and cells["blocks"] == str(s["blocks"])
    assert cells["dynamic_cache_bytes"] == f"{s['dynamic_cache_bytes'] / 1024:.1f} KiB"

    engine = kvcache.Engine(model, page_size=4)
    html = engine._repr_html_()
    assert "last generate" not in html       # nothing run yet
    system = list(range(1, 20))
    engine.generate([system + [30], system + [40, 41]], max_new_tokens=2, progress=False)
    cells = _cells(engine._repr_html_())
    st = engine.stats()
    assert cells["prefix cache"] == "on"
    assert cells["last generate"] == f"2 requests, {st['prompt_tokens']} prompt tokens, 4 generated"
    assert cells["prefix hits"] == f"{st['prefix_hit_tokens']} tokens ({100 * st['prefix_hit_rate']:.1f}%)"
    assert st["prefix_hit_tokens"] > 0


def test_reprs_are_one_short_line_without_the_tensors():
    """repr() of a pool or a step plan says what it is in one line; the dataclass default printed every page."""
    pool = kvcache.KVPool.allocate(64, 16, 8, 128, "int8")
    text = repr(pool)
    assert text == (f"KVPool(format=int8, num_blocks=64, page_size=16, num_kv_heads=8, head_dim=128, device=cpu, "
                    "2.1 MiB)")
    assert pool.nbytes == 64 * 16 * 8 * 2 * (128 + 4)    # int8 codes + a float32 scale per (token, head)
    mla = kvcache.KVPool.allocate(4, 16, 1, 576, "bf16", v_head_dim=512)
    assert "head_dim=576, v_head_dim=512" in repr(mla) and "\n" not in repr(mla)

    kivi = kvcache.KIVIPool.allocate(32, 16, 2, 64, "kivi2", residual_blocks=4, window=32)
    text = repr(kivi)
    assert text.startswith("KIVIPool(format=kivi2, num_blocks=32, residual_blocks=4, page_size=16, ")
    assert "window=32" in text and "torch.bfloat16" in text and "\n" not in text and "tensor(" not in text
    cells = _cells(kivi._repr_html_())
    assert cells["sealed blocks x page_size"] == "32 x 16"
    assert cells["full-precision window"] == "32 tokens + 0 sink pages"

    alloc = kvcache.BlockAllocator(64, 16)
    rows = [alloc.sequence(), alloc.sequence()]
    for seq, n in zip(rows, (40, 700)):
        alloc.append(seq, n)
    from kvcache.step import plan_step

    plan = plan_step(rows, [39, 699], [1, 1], packed=False, page_size=16)
    text = repr(plan)
    assert text == (f"StepPlan(batch=2, length=0, q_len=1, slot_mapping=[2, 1], stored_queries=2, "
                    f"num_blocks={plan.num_blocks}, version=0, device=cpu)")


def test_a_fresh_caches_repr_reads_the_configs_dtype_not_the_deprecated_torch_dtype(monkeypatch):
    """transformers 5 warns whenever config.torch_dtype is read; a cache that has seen no forward takes its
    model dtype from config.dtype (repr and stats print it) and must not touch the deprecated name."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    if not hasattr(config, "dtype"):
        pytest.skip("this transformers has no config.dtype (4.x): torch_dtype is the only name")
    reads = []

    def torch_dtype(self):
        reads.append(1)
        return self.dtype

    monkeypatch.setattr(type(config), "torch_dtype", property(torch_dtype), raising=False)
    for dtype in (None, torch.bfloat16):  # a config made in code has none (the case that read torch_dtype)
        config.dtype = dtype
        cache = kvcache.PagedCache(config=config, kv_format="int8")
        repr(cache)
        cache._repr_html_()
        cache.stats()
        assert cache._model_dtype() == dtype
    assert reads == []
