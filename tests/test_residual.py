"""Residual pages (kvcache.residual): quantized PagedCaches that keep the newest tokens (and optionally
the first pages) in full precision, as HF's QuantizedCache and KIVI do; KIVI formats through PagedCache.

What is stored is checked against the reference quantization page by page (sealed pages hold exactly
the reference's dequantized values, open pages the values written), attention against a float64
reference over those values, and the plumbing (generate modes, crop, copy-on-write, prefix reuse, the
Engine) by exactness where nothing is sealed and by the dense and fused paths agreeing where pages are."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvcache
from kvcache import reference as ref
from kvcache import residual
from kvcache.pool import format_id
from generate_support import MODES as GENERATE_MODES, generate, inputs, max_diff as _max_diff

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*generation flags.*")

PAGE = 16


def _quantized_page(k: torch.Tensor, v: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sealed page stands for: ``k``/``v`` ``[heads, page, dim]`` through the reference quantizer."""
    heads, page, dim = k.shape
    pool = kvcache.KVPool.allocate(1, page, heads, dim, fmt)   # only for its tensors' shapes and dtypes
    slots = torch.arange(page).view(1, page)
    pk, pv = torch.zeros_like(pool.k), torch.zeros_like(pool.v)
    ks, vs = torch.zeros_like(pool.k_scale), torch.zeros_like(pool.v_scale)
    f = pool.format
    ref.append_quantized(k[None], v[None], pk, pv, slots, ks, vs, format_id(f.k), format_id(f.v))
    return ref.dequantize_pool(pk, ks, format_id(f.k))[0], ref.dequantize_pool(pv, vs, format_id(f.v))[0]


def _expected(keys, values, fmt, sealed_pages: int, sink_pages: int):
    """One row's effective K/V ``[heads, n, dim]``: pages [sink_pages, sink_pages + sealed_pages) quantized."""
    k, v = keys.clone(), values.clone()
    for p in range(sink_pages, sink_pages + sealed_pages):
        s = slice(p * PAGE, (p + 1) * PAGE)
        k[:, s], v[:, s] = _quantized_page(keys[:, s], values[:, s], fmt)
    return k, v


@pytest.mark.parametrize("window, sinks", [(0, 0), (20, 0), (40, 16), (0, 24)])
@pytest.mark.parametrize("fmt", ["int8", "int4", "kivi4", "kivi2", "k=kivi4,v=kivi2"])
def test_pages_seal_as_they_age_and_attention_is_exact(fmt, window, sinks):
    g = torch.Generator().manual_seed(window + sinks)
    heads, dim, layers, total = 2, 64, 2, 150
    sink_pages = -(-sinks // PAGE)
    keys = torch.randn(layers, 2, heads, total, dim, generator=g) * 2
    keys[..., 7] += 8.0                                         # an outlier channel
    values = torch.randn(layers, 2, heads, total, dim, generator=g)
    cache = kvcache.PagedCache(kv_format=fmt, page_size=PAGE, num_layers=layers, residual_length=window,
                               residual_sink_tokens=sinks)
    if "kivi" not in fmt and not window and not sinks:  # nothing to keep: quantized as written, no residual
        assert cache.store.residual is None
        return
    n = 0
    for step in (37, 5, 1, 1, 30, 1, 16, 1, 50):
        for layer in range(layers):
            cache.update(keys[layer, :, :, n:n + step], values[layer, :, :, n:n + step], layer)
        before, n = n, n + step
        # every page older than the window as of before this step (past the sinks) is sealed, nothing else
        sealed = max(0, (before - window) // PAGE - sink_pages)
        assert [cache.store.residual.sealed_pages(r.blocks.tolist(), n) for r in cache.rows] == [sealed] * 2
        plan = cache._plan
        q = torch.randn(2 * step, 4, dim, generator=g)
        for layer in range(layers):
            pool, res_pool = cache.store.pools[layer], cache.store.residual_pools[layer]
            k_hat, v_hat = cache._dense(layer, torch.float32)
            out, lse = residual.attention(plan.residual, pool, res_pool, q, plan.cu_q_lens, dim ** -0.5,
                                          return_lse=True)
            for b in range(2):
                ek, ev = _expected(keys[layer, b, :, :n], values[layer, b, :, :n], fmt, sealed, sink_pages)
                assert torch.equal(k_hat[b], ek) and torch.equal(v_hat[b], ev)
                rows = slice(b * step, (b + 1) * step)
                o64, l64 = ref.attention(q[rows].double(), ek.transpose(0, 1).double(), ev.transpose(0, 1).double(),
                                         dim ** -0.5, compute_dtype=torch.float64)
                assert (out[rows].double() - o64).abs().max() < 1e-5
                assert (lse[rows].double() - l64).abs().max() < 1e-4
    # the residual pools hold the open pages only: slots are reused as pages seal
    open_pages = sum(len(r.blocks) - cache.store.residual.sealed_pages(r.blocks.tolist(), n) for r in cache.rows)
    assert cache.stats()["residual_blocks"] == open_pages
    assert cache.store.residual.num_slots <= open_pages + 2 * -(-50 // PAGE) + 2


def test_crop_into_sealed_pages_reopens_them():
    """A crop that cuts into a sealed page: the next write reopens it with its dequantized values."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 70, 32, generator=g), torch.randn(1, 2, 70, 32, generator=g)
    cache = kvcache.PagedCache(kv_format="int4", page_size=PAGE, num_layers=1, residual_length=8)
    cache.update(k[:, :, :60], v[:, :, :60], 0)
    cache.update(k[:, :, 60:61], v[:, :, 60:61], 0)            # seals pages 0-2 (60 - 8 = 52 tokens old)
    sealed_k, sealed_v = cache._dense(0, torch.float32)
    assert cache.store.residual.sealed_pages(cache.rows[0].blocks.tolist(), 61) == 3
    cache.crop(-21)                                             # 40 tokens: the cut is inside sealed page 2
    cache.update(k[:, :, 40:45], v[:, :, 40:45], 0)
    got_k, got_v = cache._dense(0, torch.float32)
    assert torch.equal(got_k[:, :, :40], sealed_k[:, :, :40]) and torch.equal(got_v[:, :, :40], sealed_v[:, :, :40])
    assert torch.equal(got_k[:, :, 40:45], k[:, :, 40:45]) and torch.equal(got_v[:, :, 40:45], v[:, :, 40:45])
    assert cache.store.residual.sealed_pages(cache.rows[0].blocks.tolist(), 45) == 2  # page 2 is open again


def _llama(head_dim_32: bool = True):
    torch.manual_seed(0)
    heads = 2 if head_dim_32 else 4
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


def _inputs():
    return inputs(20)


MODES = {name: make for name, make in GENERATE_MODES.items() if name != "sampling"}


def _generate(model, cache, impl, new_tokens=10, **kwargs):
    return generate(model, cache, impl, new_tokens=new_tokens, **kwargs)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fmt", ["int8", "kivi2"])
def test_a_window_longer_than_the_text_is_full_precision(fmt, mode):
    """Nothing ever ages out of a 256-token window: every mode gives full precision's tokens and logits."""
    model = _llama()
    kwargs = MODES[mode](*_inputs())
    for impl in ("sdpa", "kvcache"):
        full = _generate(model, kvcache.PagedCache(config=model.config), impl, **kwargs)
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt, residual_length=256)
        got = _generate(model, cache, impl, **kwargs)
        assert torch.equal(full.sequences, got.sequences)
        assert _max_diff(full, got) <= (0.0 if impl == "sdpa" else 1e-5)
        s = cache.stats()
        assert s["residual_blocks"] == s["blocks"] and s["format"] == f"{fmt}+residual=256"


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4", "kivi4", "kivi2"])
def test_short_windows_seal_pages_in_every_mode(fmt):
    """With an 8-token window pages do seal; SDPA over the gathered pages and the kernel over both pools
    see the same values in every generate mode."""
    model = _llama()
    ids, mask = _inputs()
    for mode, make in MODES.items():
        runs = {}
        for impl in ("sdpa", "kvcache"):
            cache = kvcache.PagedCache(config=model.config, kv_format=fmt, page_size=4, residual_length=8)
            runs[impl] = _generate(model, cache, impl, **make(ids, mask))
            s = cache.stats()
            assert 0 < s["residual_blocks"] < s["blocks"]
        a, b = runs["sdpa"], runs["kvcache"]
        if mode == "left_padding":  # dense mode stores the pads, so row 1's pages hold other tokens: row 0 only
            if not fmt.startswith("fp8"):  # (fp8's per-head scale comes from the first pages sealed: both rows')
                assert max((x[0] - y[0]).abs().max().item() for x, y in zip(a.logits, b.logits)) <= 1e-4
        else:
            assert _max_diff(a, b) <= 1e-4, mode


def test_sliding_window_models_fall_back_to_the_dense_path():
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    model = transformers.MistralForCausalLM(config).eval()
    ids = _inputs()[0][:1]
    runs = [_generate(model, kvcache.PagedCache(config=model.config, kv_format="int8", page_size=4,
                                                residual_length=4), impl, input_ids=ids, do_sample=False)
            for impl in ("sdpa", "kvcache")]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and _max_diff(*runs) <= 1e-5


def test_prefix_reuse_shares_open_and_sealed_pages():
    """A second cache reusing a cached prompt sees exactly what the first one stored (open and sealed)."""
    model = _llama()
    model.set_attn_implementation("kvcache")
    ids = _inputs()[0][:1]
    first = kvcache.PagedCache(config=model.config, kv_format="kivi4", page_size=4, residual_length=6,
                               prefix_cache=True)
    with torch.no_grad():
        model(ids[:, :12], past_key_values=first)
        model(ids[:, 12:13], past_key_values=first)   # seals page 0 (older than 12 - 6 tokens)
    first.save_prefix(ids[0, :13])
    second = kvcache.PagedCache(store=first.store, config=model.config)
    assert second.load_prefix(ids[0, :20]) == 13
    with torch.no_grad():
        out2 = model(ids[:, 13:20], past_key_values=second)
        out1 = model(ids[:, 13:20], past_key_values=first)
    assert torch.equal(out1.logits, out2.logits)   # the same stored values, the same kernels
    assert first.rows[0].blocks[3] != second.rows[0].blocks[3]   # the shared partial page was copied on write
    assert torch.equal(first.rows[0].blocks[:3], second.rows[0].blocks[:3])
    residual_pages = first.store.residual
    assert residual_pages.sealed_pages(second.rows[0].blocks.tolist(), 20) == 1  # sealing looks at 13 - 6


def test_engine_with_residual_pages_equals_generate():
    """Packed batches seal and attend exactly as generate() does, request by request."""
    model = _llama()
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 128, (40,), generator=g).tolist()
    prompts = [system + torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 17)]
    engine = kvcache.Engine(model, kv_format="kivi2", page_size=8, max_batch=2, residual_length=16,
                            prefix_cache=False)
    results = engine.generate(prompts, max_new_tokens=8)
    model.set_attn_implementation("kvcache")
    for p, r in zip(prompts, results):
        cache = kvcache.PagedCache(config=model.config, kv_format="kivi2", page_size=8, residual_length=16)
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), past_key_values=cache, max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
        assert r.tokens == out[0, len(p):].tolist()
    # with the prefix cache, later requests share the system prompt's pages (open or sealed) and skip it
    engine = kvcache.Engine(model, kv_format="kivi2", page_size=8, max_batch=2, residual_length=16)
    results = engine.generate(prompts, max_new_tokens=8, eos_token_id=[])  # all 8 tokens (no stop at eos)
    assert engine.stats()["prefix_hit_tokens"] == 3 * 40 and all(len(r.tokens) == 8 for r in results)
    assert engine.store.residual.num_slots < sum(-(-(len(p) + 8) // 8) for p in prompts)


@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
@pytest.mark.parametrize("fmt", ["int8", "kivi2"])
def test_residual_pools_shrink_once_a_long_prompt_is_sealed(fmt, impl, monkeypatch):
    """A prompt's pages sit in the residual pools until the next forward seals all but the window's; the pools
    then shrink back to about those pages (an outside-in probe found a 4,096-token int8 prompt keeping 6.25 MiB
    of residual pools against DynamicCache's 4 MiB). Compaction only moves pages between slots: the logits equal
    those of a cache that never compacts, bit for bit."""
    model = _llama()
    model.set_attn_implementation(impl)
    prompt = torch.randint(0, 128, (2, 1000), generator=torch.Generator().manual_seed(4))

    def run():
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt, page_size=PAGE)  # the default window, 128
        logits = []
        with torch.no_grad():
            token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
            for _ in range(6):
                logits.append(model(token, past_key_values=cache).logits)
                token = logits[-1][:, -1:].argmax(-1)
        return cache, torch.cat(logits, 1)

    cache, got = run()
    open_pages = len(cache.store.residual.slot_of)
    assert open_pages <= 2 * (128 // PAGE + 1)
    assert all(pool.num_blocks <= max(16, 2 * open_pages) for pool in cache.store.residual_pools.values())
    monkeypatch.setattr(residual, "COMPACT_MIN_SLOTS", 10**9)
    never, expect = run()
    assert all(pool.num_blocks >= 2 * (1000 // PAGE) for pool in never.store.residual_pools.values())
    assert torch.equal(got, expect)


def test_engine_residual_pools_shrink_and_tokens_stay(monkeypatch):
    """The Engine compacts its residual pools before planning a step, with the same tokens as without."""
    model = _llama()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (700, 500, 650)]

    def run():
        engine = kvcache.Engine(model, kv_format="int8", page_size=PAGE, prefix_cache=False)
        tokens = [r.tokens for r in engine.generate(prompts, max_new_tokens=6)]
        return engine, tokens

    engine, got = run()
    assert all(pool.num_blocks <= 64 for pool in engine.store.residual_pools.values())
    monkeypatch.setattr(residual, "COMPACT_MIN_SLOTS", 10**9)
    never, expect = run()
    assert all(pool.num_blocks >= sum(n // PAGE for n in (700, 500, 650)) for pool in never.store.residual_pools.values())
    assert got == expect


def test_bad_residual_arguments():
    with pytest.raises(ValueError, match=r"residual_length=-1 and residual_sink_tokens=0 must be >= 0"):
        kvcache.PagedCache(kv_format="int8", residual_length=-1, num_layers=1)
    # (outside-in probes: 1.5 and True were taken as 1, and kv_format=123 failed in re's words)
    for bad in (1.5, True, "16"):
        with pytest.raises(TypeError, match=rf"residual_length={bad!r} must be an int"):
            kvcache.PagedCache(kv_format="int8", residual_length=bad, num_layers=1)
    with pytest.raises(TypeError, match=r"residual_sink_tokens=2.0 must be an int"):
        kvcache.PagedCache(kv_format="int8", residual_sink_tokens=2.0, num_layers=1)
    with pytest.raises(TypeError, match=r"kv_format: a KV format is a str .* got 123 \(int\)"):
        kvcache.PagedCache(kv_format=123, num_layers=1)
    with pytest.raises(ValueError, match=r"sink_tokens=4 .* cannot be combined with residual pages.*pass residual_length=0"):
        kvcache.PagedCache(kv_format="int8", residual_length=16, sink_tokens=4, num_layers=1)
    # (KIVI keeps its open page whatever residual_length says: the advice to pass residual_length=0 was no help)
    with pytest.raises(ValueError, match=r"a KIVI format always has them .* int8 / fp8 / int4 with residual_length=0"):
        kvcache.PagedCache(kv_format="kivi2", residual_length=0, sink_tokens=4, num_layers=1)
    # sizes and flags of the wrong type were taken (max_tokens=True: a one-page pool; page_size=True: pages of 1)
    for name, bad in (("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", 64.0), ("max_tokens", "64"),
                      ("page_size", True), ("page_size", 16.0), ("sink_tokens", 2.0)):
        with pytest.raises(TypeError, match=rf"{name}={bad!r} must be an int"):
            kvcache.PagedCache(**{name: bad}, num_layers=1)
    with pytest.raises(TypeError, match=r"prefix_cache='yes' must be a bool or a kvcache.PrefixCache"):
        kvcache.PagedCache(prefix_cache="yes", num_layers=1)
    assert kvcache.PagedCache(max_tokens=torch.tensor(64), page_size=torch.tensor(16), num_layers=1).store.max_tokens == 64
    # full precision has nothing to keep: no residual pools, no label
    cache = kvcache.PagedCache(residual_length=16, num_layers=1)
    assert cache.store.residual is None and cache.store.residual_label == ""
    # residual_length=0 quantizes as written (KIVI still keeps its open page in full precision)
    assert kvcache.PagedCache(kv_format="int4", residual_length=0, num_layers=1).store.residual is None
    assert kvcache.PagedCache(kv_format="kivi4", residual_length=0, num_layers=1).store.residual.window == 0


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3", "fp8_e5m2", "kivi2", "kivi4", "k=int8,v=int4",
                                 "k=kivi2,v=kivi4"])
def test_every_quantized_format_defaults_to_the_128_token_window(fmt):
    """The accurate configuration is the default (issue #21): HF QuantizedCache's residual_length=128, in the
    cache, the store and the Engine, and it is part of the prefix cache's namespace."""
    cache = kvcache.PagedCache(kv_format=fmt, num_layers=1)
    assert cache.store.residual.window == 128 and cache.store.residual_label == "residual=128"
    engine = kvcache.Engine(_llama(), kv_format=fmt)
    assert engine.store.residual.window == 128
    assert "residual=128" in engine.namespace.kv_format
    for full in (None, "bf16", torch.float32):  # full precision has no window
        assert kvcache.PagedCache(kv_format=full, num_layers=1).store.residual is None


class _Stop(Exception):
    pass


def _stop_layer(model, layer: int, at_call: int):
    """A pre-hook that raises in decoder layer ``layer`` at its ``at_call``-th forward (an exception or Ctrl-C
    part-way through a forward: the layers before it have written their K/V, the later ones have not)."""
    calls = {"n": 0}

    def hook(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise _Stop

    return model.model.layers[layer].register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
@pytest.mark.parametrize("fmt", ["int8", "kivi2"])
def test_a_forward_stopped_part_way_seals_every_layer_and_is_rolled_back(fmt, impl):
    """A forward that stops inside a layer, at a step that seals aged pages: the pages' bookkeeping changed for every
    layer when the step was planned, but the layers after the stop never quantized them (their sealed pages read as
    zeros from then on: 0 vs 0.7 max |k|, other tokens, served to the prefix cache and the tiers). Now every layer
    seals at the step's first write, and the next forward rolls back the stopped one: the retried step and the rest
    are bit for bit the run that never stopped, and a prefix saved before the stop loads the same K/V."""
    model = _llama()
    model.set_attn_implementation(impl)
    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))

    def run(stop: bool):
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt, page_size=4, residual_length=8,
                                   prefix_cache=True)
        logits = [model(prompt, past_key_values=cache).logits[0, -1]]
        cache.save_prefix(prompt)
        hook = _stop_layer(model, 1, 1) if stop else None  # the first decode step, which seals 3 pages
        try:
            while len(logits) < 6:
                token = logits[-1].argmax().view(1, 1)
                try:
                    logits.append(model(token, past_key_values=cache).logits[0, -1])
                except _Stop:
                    assert [layer.length for layer in cache.paged_layers] == [21, 20]
                    assert cache.get_seq_length() == 20  # what the retry continues from
        finally:
            if hook is not None:
                hook.remove()
        saved = kvcache.PagedCache(config=model.config, store=cache.store)
        assert saved.load_prefix(prompt) == 19
        prefix = [saved.layers[i].keys[0, :, :16].clone() for i in range(2)]
        return torch.stack(logits), prefix

    with torch.no_grad():
        want, want_prefix = run(stop=False)
        got, got_prefix = run(stop=True)
    assert torch.equal(got, want)
    for layer, (a, b) in enumerate(zip(got_prefix, want_prefix)):
        assert b.abs().max() > 0.1 and torch.equal(a, b), layer


def test_slot_collection_is_amortized_and_still_reclaims():
    """Opening a slot when none is free asks the allocator about open blocks (collect) only after as many
    opens as there were open blocks: a long prompt's pages (or an Engine's cached prompts, whose open pages
    stay live) cost O(1) queries per page, not O(open pages) (a 16k-token int8 prefill ran 2-3x a
    full-precision one, in Python). Freed blocks' slots are still reclaimed, within ~2x the slots in use."""
    pages = residual.ResidualPages(PAGE, window=128)
    live, queries = set(), [0]

    def is_live(block):
        queries[0] += 1
        return block in live

    pages.is_live = is_live
    n = 4096
    for blk in range(n):  # one long prompt: every page opens, all stay live
        live.add(blk)
        pages.open(blk)
    assert pages.num_slots == n
    assert queries[0] <= 4 * n, f"{queries[0]} allocator queries for {n} opens"
    # requests come and go: their blocks die, and new ones reuse the slots instead of growing the pools
    live.clear()
    queries[0] = 0
    for blk in range(n, 3 * n):
        live.add(blk)
        pages.open(blk)
        if blk % 8 == 7:  # a request of 8 pages finishes
            live.difference_update(range(blk - 7, blk + 1))
    assert pages.num_slots <= 2 * n, pages.num_slots
    assert queries[0] <= 8 * n
    # a full fixed-size pool collects at once rather than give up
    fixed = residual.ResidualPages(PAGE, window=128, max_slots=4)
    alive = {0, 1, 2, 3}
    fixed.is_live = lambda block: block in alive
    for blk in range(4):
        fixed.open(blk)
    alive.discard(2)
    assert fixed.open(9) == fixed.slot_of.get(9) and 2 not in fixed.slot_of and fixed.num_slots == 4
    alive.add(9)
    with pytest.raises(RuntimeError, match="out of residual blocks"):
        fixed.open(10)
    # a plan's up-front count of free slots collects too before it refuses (the takes before it may not have)
    planned = residual.ResidualPages(PAGE, max_slots=4)
    held = {0, 1, 2}
    planned.is_live = lambda block: block in held
    for blk in range(3):
        planned.open(blk)
    held -= {0, 1}
    plan = planned.plan([[10, 11]], [0], [2 * PAGE], torch.arange(2 * PAGE).view(1, -1),
                        torch.ones(1, 2 * PAGE, dtype=torch.bool))
    assert {10, 11} <= set(planned.slot_of) and planned.num_slots <= 4 and plan.slot_mapping.shape == (1, 2 * PAGE)
