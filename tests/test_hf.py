"""kvcache.PagedCache as a transformers Cache: exactness against DynamicCache for every generation mode,
on small random models of five architectures, in dense (eager/sdpa) and fused ("kvcache") attention."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import kvcache  # noqa: E402
from generate_support import MODES, generate as _generate, inputs as _inputs, max_diff as _max_diff  # noqa: E402
from kvcache import hf  # noqa: E402

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*generation flags.*")


def _common():
    return dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256)


def _model(name: str):
    torch.manual_seed(0)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **_common()))
    elif name == "llama-d32":  # head_dim 32, for int4's groups of 32
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_key_value_heads=1, **{**_common(), "num_attention_heads": 2}))
    elif name == "mistral":  # a window shorter than the prompts, so it matters
        model = transformers.MistralForCausalLM(transformers.MistralConfig(num_key_value_heads=2, sliding_window=8,
                                                                           **_common()))
    elif name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=1, bos_token_id=1,
                                                                       eos_token_id=2, **_common()))
    elif name == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(num_key_value_heads=1, head_dim=16, **_common()))
    elif name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                                     n_positions=256))
    else:
        raise ValueError(name)
    return model.eval()


MODELS = ["llama", "mistral", "qwen2", "gemma", "gpt2"]
IMPLS = ["eager", "sdpa", "kvcache"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return _model(request.param)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("impl", IMPLS)
def test_generate_matches_dynamic_cache(model, impl, mode):
    kwargs = MODES[mode](*_inputs())
    # the reference is always DynamicCache with PyTorch's SDPA (or eager), never our kernels; transformers
    # 4.57 cannot roll a sliding-window DynamicCache back, so there it keeps every token (as ours does)
    sliding = getattr(model.config, "sliding_window", None)
    ref_cache = DynamicCache() if sliding and mode == "prompt_lookup" else DynamicCache(config=model.config)
    ref = _generate(model, ref_cache, "eager" if impl == "eager" else "sdpa", **kwargs)
    cache = kvcache.PagedCache(config=model.config)
    got = _generate(model, cache, impl, **kwargs)
    assert torch.equal(ref.sequences, got.sequences)
    if impl == "kvcache" or sliding:  # other kernel / DynamicCache keeps only the window: same math, other sums
        assert _max_diff(ref, got) <= 1e-5
    else:
        assert _max_diff(ref, got) == 0.0  # bit-identical
    assert got.past_key_values is cache and cache.get_seq_length() == got.sequences.shape[1] - 1


@pytest.mark.parametrize("cache_implementation", ["static", "dynamic"])
def test_kvcache_attention_over_transformers_own_caches_matches_sdpa(model, cache_implementation):
    """The "kvcache" attention with a cache that is not a PagedCache goes through PyTorch's attention, and must
    place each query where it is. A StaticCache hands back its whole preallocated buffer (a sliding-window
    model's static layers: the window's buffer), so its keys do not end at the last query: the 2-D padding mask
    with bottom-right causality attended unfilled slots (an outside-in probe: 0.86 off at the prefill)."""
    kwargs = dict(zip(("input_ids", "attention_mask"), _inputs()))
    run = dict(cache_implementation=cache_implementation, do_sample=False, **kwargs)
    if cache_implementation == "static":
        run["cache_config"] = {"max_cache_len": kwargs["input_ids"].shape[1] + 16}
    try:
        ref = _generate(model, None, "sdpa", **run)
    except (ValueError, TypeError, NotImplementedError) as err:  # (a model transformers gives no such cache)
        pytest.skip(f"transformers {transformers.__version__} has no {cache_implementation} cache for "
                    f"{type(model).__name__}: {err}")
    got = _generate(model, None, "kvcache", **run)
    assert type(got.past_key_values) is type(ref.past_key_values)
    assert not isinstance(got.past_key_values, kvcache.PagedCache)
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref, got) <= 1e-5


def test_fused_path_reads_the_pages_without_gathering(monkeypatch):
    """With "kvcache" attention and left padding, no layer ever falls back to a gathered copy."""
    model = _model("llama")

    def no_gather(*args, **kwargs):
        raise AssertionError("fused attention gathered K/V")

    monkeypatch.setattr(kvcache.PagedCache, "_dense", no_gather)
    ids, mask = _inputs()
    cache = kvcache.PagedCache(config=model.config)
    _generate(model, cache, "kvcache", input_ids=ids, attention_mask=mask, do_sample=False)
    assert cache.pads == [0, 5]  # the pads were never stored
    assert cache.stats()["tokens"] == 2 * cache.get_seq_length() - 5


def test_assisted_decoding_with_an_assistant_model():
    model, assistant = _model("llama"), _model("llama")
    ids = _inputs()[0][:1]
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, assistant_model=assistant,
                    do_sample=False)
    for impl in ("sdpa", "kvcache"):
        got = _generate(model, kvcache.PagedCache(config=model.config), impl, input_ids=ids,
                        assistant_model=assistant, do_sample=False)
        assert torch.equal(ref.sequences, got.sequences)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4", "k=int8,v=int4", "bf16"])
@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_quantized_formats_generate_in_every_mode(fmt, impl):
    """Every format works in every mode; the dense and fused paths see the same stored codes (quantized as
    written: the default 128-token window would hold these short texts in full precision)."""
    model = _model("llama-d32")
    ids, mask = _inputs()
    for mode, make in MODES.items():
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt, residual_length=0)
        out = _generate(model, cache, impl, **make(ids, mask))
        assert cache.stats()["format"] == fmt and out.sequences.shape[1] > ids.shape[1]
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, attention_mask=mask,
                    do_sample=False)
    dense = _generate(model, kvcache.PagedCache(config=model.config, kv_format=fmt, residual_length=0), "sdpa",
                      input_ids=ids, attention_mask=mask, do_sample=False)
    fused = _generate(model, kvcache.PagedCache(config=model.config, kv_format=fmt, residual_length=0), "kvcache",
                      input_ids=ids,
                      attention_mask=mask, do_sample=False)
    # the kernel and SDPA over the dequantized pages agree far more closely than either does with fp32
    assert _max_diff(dense, fused) <= 1e-4
    # and the first step's logits stay near full precision's, by the format's resolution
    rel = ((ref.logits[0] - dense.logits[0]).norm() / ref.logits[0].norm()).item()
    assert rel < {"bf16": 0.01, "int8": 0.02, "fp8_e4m3": 0.1, "int4": 0.2, "k=int8,v=int4": 0.2}[fmt]


@pytest.mark.parametrize("fmt", ["fp32", "int8", "fp8_e4m3", "int4"])
def test_crop_semantics_and_exact_rollback(fmt):
    """crop(-n) then writing the same K/V again leaves exactly the codes a single write leaves."""
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 2, 12, 32, generator=g), torch.randn(2, 2, 12, 32, generator=g)
    cache = kvcache.PagedCache(kv_format=fmt, page_size=4, num_layers=2)
    for layer in range(2):
        cache.update(k, v, layer)
    stored = [cache._dense(i, torch.float32) for i in range(2)]
    cache.crop(0)                    # transformers >= 5.14: a no-op
    assert cache.get_seq_length() == 12
    cache.crop(-5)                   # drop the newest 5 tokens (the cut is inside a page)
    assert cache.get_seq_length() == 7 and [len(r.blocks) for r in cache.rows] == [2, 2]
    for layer in range(2):
        cache.update(k[:, :, 7:], v[:, :, 7:], layer)
    for i in range(2):
        again = cache._dense(i, torch.float32)
        assert torch.equal(again[0], stored[i][0]) and torch.equal(again[1], stored[i][1])
    cache.crop(9)                    # transformers < 5.14: keep the first 9
    assert cache.get_seq_length() == 9 and [len(r.blocks) for r in cache.rows] == [3, 3]
    cache.crop(-100)                 # more than stored: empty
    assert cache.get_seq_length() == 0 and cache.stats()["blocks"] == 0
    assert cache.store.allocator.num_free == cache.store.allocator.num_blocks


def test_reorder_cache_shares_pages_copy_on_write():
    model = _model("llama")
    ids = _inputs()[0][:1].repeat(3, 1)
    cache = kvcache.PagedCache(config=model.config, page_size=4)
    with torch.no_grad():
        model(ids[:, :10], past_key_values=cache)
    used = cache.store.allocator.num_blocks - cache.store.allocator.num_free
    cache.reorder_cache(torch.tensor([0, 0, 2], dtype=torch.int32))
    assert cache.store.allocator.num_blocks - cache.store.allocator.num_free == used - 3  # row 1's pages freed
    assert torch.equal(cache.rows[0].blocks, cache.rows[1].blocks)   # rewired, not copied
    with torch.no_grad():
        model(ids[:, 10:11], past_key_values=cache)
    assert not torch.equal(cache.rows[0].blocks[-1:], cache.rows[1].blocks[-1:])  # partial page copied on write
    assert torch.equal(cache.rows[0].blocks[:2], cache.rows[1].blocks[:2])        # full pages still shared
    k0, v0 = cache._dense(0, torch.float32)
    assert torch.equal(k0[0], k0[1]) and torch.equal(v0[0], v0[1])
    with pytest.raises(IndexError, match="row index 3 is out of range for a cache of 3 rows"):
        cache.reorder_cache(torch.tensor([0, 1, 3]))
    assert len(cache.rows) == 3  # unchanged


@pytest.mark.parametrize("select", [[True, False, True], [2, 0], [-1, 0, -1], [1]], ids=str)
def test_batch_select_indices_selects_as_dynamic_cache_does(select):
    """batch_select_indices takes what DynamicCache's tensor indexing takes: a boolean mask (an outside-in probe
    found a mask read as the row indices [1, 0, 1]), indices, negative indices; the next forward's logits equal
    DynamicCache's exactly."""
    model = _model("llama")
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(5))
    nxt = torch.randint(0, 128, (3, 1), generator=torch.Generator().manual_seed(6))
    index = torch.tensor(select)
    logits = []
    for cache in (DynamicCache(config=model.config), kvcache.PagedCache(config=model.config, page_size=4)):
        with torch.no_grad():
            model(ids, past_key_values=cache)
            cache.batch_select_indices(index)
            logits.append(model(nxt[index], past_key_values=cache).logits)
    assert torch.equal(logits[0], logits[1])


def test_batch_select_indices_refuses_what_indexing_refuses():
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config, page_size=4)
    with torch.no_grad():
        model(torch.randint(0, 128, (3, 6)), past_key_values=cache)
    tables = [seq.blocks.clone() for seq in cache.rows]
    with pytest.raises(IndexError, match=r"boolean mask of shape \(2,\), but the cache holds 3 rows"):
        cache.batch_select_indices(torch.tensor([True, False]))
    with pytest.raises(IndexError, match=r"indices \[0, 3\] out of range for a cache of 3 rows"):
        cache.batch_select_indices(torch.tensor([0, 3]))
    with pytest.raises(IndexError, match="dtype torch.float32"):
        cache.batch_select_indices(torch.tensor([0.0, 1.0]))
    assert [torch.equal(a, seq.blocks) for a, seq in zip(tables, cache.rows)] == [True] * 3  # unchanged


def test_row_selections_that_would_leave_no_row_or_misread_indices_are_refused():
    """An outside-in probe: batch_repeat_interleave(0) or an empty batch_select_indices left no row but the layers'
    length, and the next forward read stale pages; a float beam_idx was truncated to rows, a 2-D one failed
    deep inside. Each is refused before anything moves, naming the argument."""
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config, page_size=4)
    with torch.no_grad():
        model(torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(2)), past_key_values=cache)
    alloc = cache.store.allocator
    tables, free = [seq.blocks.clone() for seq in cache.rows], alloc.num_free
    for call, err, match in (
            (lambda: cache.batch_repeat_interleave(0), ValueError, r"repeats must be >= 1, got 0"),
            (lambda: cache.batch_repeat_interleave(-1), ValueError, r"repeats must be >= 1, got -1"),
            (lambda: cache.batch_repeat_interleave(1.5), TypeError, r"repeats must be an integer, got 1.5"),
            (lambda: cache.batch_select_indices(torch.tensor([], dtype=torch.long)), ValueError,
             r"indices selects no row of the cache's 3"),
            (lambda: cache.batch_select_indices(torch.tensor([False, False, False])), ValueError,
             r"indices selects no row"),
            (lambda: cache.reorder_cache(torch.tensor([0.0, 1.7, 2.0])), TypeError,
             r"beam_idx must be a 1-D tensor of integer row indices, got shape \(3,\) and dtype torch.float32"),
            (lambda: cache.reorder_cache(torch.tensor([[0, 1, 2]])), TypeError, r"got shape \(1, 3\)"),
            (lambda: cache.reorder_cache(torch.tensor([], dtype=torch.long)), ValueError, r"beam_idx selects no row"),
            (lambda: cache.reorder_cache(torch.tensor([0, -1, 2])), IndexError,
             r"beam_idx: row index -1 is out of range for a cache of 3 rows"),
            (lambda: cache.crop(), TypeError, r"crop\(\) needs tokens_to_remove \(an integer\), got no argument")):
        with pytest.raises(err, match=match):
            call()
        assert cache.get_seq_length() == 6 and alloc.num_free == free
        assert [torch.equal(a, seq.blocks) for a, seq in zip(tables, cache.rows)] == [True] * 3  # unchanged
    cache.batch_repeat_interleave(2)  # and a valid repeat still works as DynamicCache's
    assert len(cache.rows) == 6 and torch.equal(cache.rows[0].blocks, cache.rows[1].blocks)


def test_num_layers_must_agree_with_the_config():
    model = _model("llama")
    assert len(kvcache.PagedCache(num_layers=3).layers) == 3
    assert len(kvcache.PagedCache(config=model.config, num_layers=model.config.num_hidden_layers).layers) == 2
    with pytest.raises(ValueError, match=r"num_layers=5 disagrees with the config's num_hidden_layers=2"):
        kvcache.PagedCache(config=model.config, num_layers=5)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=r"num_layers=.* must be a non-negative int"):
            kvcache.PagedCache(num_layers=bad)


@pytest.mark.parametrize("fmt", [None, "int8"])
@pytest.mark.parametrize("impl", ["eager", "sdpa", "kvcache"])
def test_gradients_reach_the_forwards_own_keys_and_values(impl, fmt):
    """With autograd recording, a forward through a PagedCache gives every parameter the gradient DynamicCache
    gives it (an outside-in probe found k_proj / v_proj, and with "kvcache" attention q_proj too, left without
    one, silently): this forward's K/V pass their gradient straight through the pages, and "kvcache" attention
    runs in PyTorch then (the kernel has no backward). With int8 pages (and the default full-precision window)
    the values are the same, so the gradients are too."""
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(8))
    grads = []
    for cache_of in (lambda m: DynamicCache(config=m.config), lambda m: kvcache.PagedCache(config=m.config, kv_format=fmt)):
        model = _model("llama")
        model.set_attn_implementation("eager" if impl == "eager" else "sdpa")
        cache = cache_of(model)
        if isinstance(cache, kvcache.PagedCache):
            model.set_attn_implementation(impl)
        model(ids, past_key_values=cache).logits.logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(g is not None for g in grads[1].values()), [n for n, g in grads[1].items() if g is None]
    worst = max(float((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max().clamp(min=1e-30))
                for n in grads[0])
    assert worst <= (0.0 if impl != "kvcache" else 1e-5), worst


@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_gradients_reach_tokens_of_earlier_recorded_forwards(impl):
    """Two recorded forwards (a prompt, then its continuation): the second one's loss reaches the first one's K/V
    through the cache, as through DynamicCache's concatenation, with the same gradients. A forward outside autograd
    leaves the history without a graph, as DynamicCache's does, silently; a crop or reorder drops it with a
    warning."""
    first, second = (torch.randint(0, 128, (2, n), generator=torch.Generator().manual_seed(n)) for n in (7, 3))
    grads = []
    for make in (lambda m: DynamicCache(config=m.config), lambda m: kvcache.PagedCache(config=m.config)):
        model = _model("llama")
        model.set_attn_implementation("sdpa")
        cache = make(model)
        model.set_attn_implementation(impl if isinstance(cache, kvcache.PagedCache) else "sdpa")
        model(first, past_key_values=cache)
        model(second, past_key_values=cache).logits.logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    worst = max(float((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max()) for n in grads[0])
    assert worst <= (0.0 if impl == "sdpa" else 1e-5), worst
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config)
    model(first, past_key_values=cache)
    with torch.no_grad():
        model(second[:, :1], past_key_values=cache)
    assert not cache._graph  # nothing recorded is kept past a forward outside autograd
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(second[:, 1:], past_key_values=cache)
    cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.warns(UserWarning, match="not those cached before a crop, reorder or batch selection"):
        model(second[:, :1], past_key_values=cache)
    cache.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(first, past_key_values=cache)
        model(second, past_key_values=cache)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2(hadamard)"])
def test_fp8_scales_are_taken_again_after_reset(fmt):
    """fp8 takes its per-head scales from the first tokens written; a reset() cache (or an Engine call without a
    prefix cache) takes them again from its next prompt, so that prompt is stored, and answered, as on a fresh
    cache (an outside-in probe found logits 1e-2 apart). While another cache still holds pages of the pool, the
    scales stay: those pages were stored with them."""
    model = _model("llama")
    model.set_attn_implementation("kvcache")
    a, b = (torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(s)) for s in (1, 2))

    def forward(cache, ids):
        with torch.no_grad():
            return model(ids, past_key_values=cache).logits

    fresh = kvcache.PagedCache(config=model.config, kv_format=fmt, residual_length=0)
    expect = forward(fresh, b)
    cache = kvcache.PagedCache(config=model.config, kv_format=fmt, residual_length=0)
    forward(cache, a)
    scales_a = cache.store.pools[0].k_scale.clone()
    assert not torch.equal(scales_a, fresh.store.pools[0].k_scale)
    other = copy.deepcopy(cache)  # holds a's pages
    cache.reset()
    forward(cache, b)
    assert torch.equal(cache.store.pools[0].k_scale, scales_a)  # kept: other's pages need them
    other.free()
    cache.reset()
    assert torch.equal(forward(cache, b), expect)
    assert torch.equal(cache.store.pools[0].k_scale, fresh.store.pools[0].k_scale)
    engine = kvcache.Engine(model, kv_format=fmt, residual_length=0, prefix_cache=False)
    engine.generate([a[0].tolist()], max_new_tokens=4, progress=False)
    again = engine.generate([b[0].tolist()], max_new_tokens=8, progress=False)[0].tokens
    alone = kvcache.Engine(model, kv_format=fmt, residual_length=0, prefix_cache=False)
    assert again == alone.generate([b[0].tolist()], max_new_tokens=8, progress=False)[0].tokens
    assert torch.equal(engine.store.pools[0].k_scale, alone.store.pools[0].k_scale)


def test_output_attentions_with_kvcache_attention_are_eagers():
    """output_attentions=True with the "kvcache" attention returns the weights eager attention returns (computed in
    PyTorch over the gathered pages for that forward), prefill and decode, with left padding; an outside-in probe
    found them silently empty."""
    model = _model("llama")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    runs = []
    for impl, cache in (("eager", DynamicCache(config=model.config)), ("kvcache", kvcache.PagedCache(config=model.config))):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            first = model(ids, attention_mask=mask, past_key_values=cache, output_attentions=True)
            step = model(first.logits[:, -1:].argmax(-1), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                         past_key_values=cache, output_attentions=True)
        runs.append((first, step))
    for eager, ours, real in zip(*runs, (mask.bool(), torch.ones(2, 1, dtype=torch.bool))):
        assert len(ours.attentions) == len(eager.attentions) == model.config.num_hidden_layers
        for a, b in zip(eager.attentions, ours.attentions):
            assert a.shape == b.shape
            assert (a - b).abs().max() <= 1e-6
        # (a pad query's output mixes the pad tokens' values, which DynamicCache stores and the pages do not)
        assert (eager.logits[real] - ours.logits[real]).abs().max() <= 1e-5


def _saved_prompt():
    """A Llama, a 40-token prompt, and a cache whose prefix cache holds that prompt's K/V."""
    model = _model("llama")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(12))
    source = kvcache.PagedCache(config=model.config, prefix_cache=True)
    with torch.no_grad():
        model(ids, past_key_values=source)
    source.save_prefix(ids[0])
    return model, ids, source


def test_load_prefix_takes_one_row_and_stats_know_the_model_dtype():
    """load_prefix starts a batch-1 cache: a 2-row input_ids is refused (it was flattened into one prompt), and
    right after it, before any forward, stats() sizes the equivalent DynamicCache in the model's dtype (float32
    here; it assumed 2 bytes)."""
    model, ids, source = _saved_prompt()
    cache = kvcache.PagedCache(config=model.config, store=source.store)
    with pytest.raises(ValueError, match=r"input_ids has shape \(2, 40\): load_prefix starts a batch-1 cache"):
        cache.load_prefix(ids.repeat(2, 1))
    assert not cache.rows
    n = cache.load_prefix(ids)
    cfg = model.config
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert n == 39 and cache.stats()["dynamic_cache_bytes"] == n * per_token


def test_refused_load_prefix_takes_nothing():
    """Regression: a cache with no layers (no config=, no num_layers=) took the matched prefix's blocks before it
    refused load_prefix, so the pages stayed held and a retry said "load_prefix needs an empty cache"."""
    model, ids, source = _saved_prompt()
    alloc = source.store.allocator
    refs = [alloc.refcount(b) for b in range(alloc.num_blocks)]
    cache = kvcache.PagedCache(store=source.store)
    with pytest.raises(ValueError, match=r"load_prefix needs the number of layers: PagedCache\(config=model.config\) "
                                         r"or PagedCache\(num_layers=...\)"):
        cache.load_prefix(ids)
    assert not cache.rows and [alloc.refcount(b) for b in range(alloc.num_blocks)] == refs
    assert kvcache.PagedCache(config=model.config, store=source.store).load_prefix(ids) == 39


def test_stats_count_shared_pages_once():
    """Regression: stats() summed each row's pages, so 8 rows sharing a 200-token prompt's 13 pages reported 104
    blocks and 8x the bytes (more than the pool holds)."""
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config, page_size=16)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    one = cache.stats()
    assert one["blocks"] == one["block_refs"] == 13 and one["waste_tokens"] == 13 * 16 - 200
    cache.batch_repeat_interleave(8)
    s = cache.stats()
    assert s["blocks"] == 13 and s["bytes"] == one["bytes"] <= s["pool_bytes"]
    assert s["block_refs"] == 8 * 13 and s["tokens"] == 8 * 200 and s["waste_tokens"] == 8 * (13 * 16 - 200)
    assert "blocks=13," in repr(cache)
    copy = cache.batch_select_indices(torch.tensor([0, 3])) or cache   # (in place)
    assert copy.stats()["blocks"] == 13 and copy.stats()["block_refs"] == 26


def test_config_must_be_a_transformers_config():
    """Regression: config=model (or a str, an int) was taken, and the cache silently ran dense."""
    model = _model("llama")
    with pytest.raises(TypeError, match=r"config must be the model's transformers config \(model.config\), got "
                                        r"LlamaForCausalLM \(pass model.config, not the model\)"):
        kvcache.PagedCache(config=model)
    for bad in ("llama", 42, {"num_hidden_layers": 2}):
        with pytest.raises(TypeError, match=rf"config must be .* got {type(bad).__name__}$"):
            kvcache.PagedCache(config=bad)


@pytest.mark.parametrize("fmt", ["int8", "kivi2"])
@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_deepcopy_of_a_quantized_cache_does_not_depend_on_the_original(fmt, impl):
    """A copy of a cache with a full-precision window reads the same, and continues to the same logits, whether
    or not the original went on first (an outside-in probe: the original sealed the pages they shared, and the
    copy then read quantized the tokens of its own window). Rows that shared a page share its copy; every
    block goes back to the allocator."""
    model = _model("llama-d32")  # (KIVI: head_dim a multiple of 32)
    model.set_attn_implementation(impl)
    g = torch.Generator().manual_seed(3)
    prompt, more, next_ids = (torch.randint(0, 128, (2, n), generator=g) for n in (40, 30, 5))

    def forward(cache, ids):
        with torch.no_grad():
            return model(ids, past_key_values=cache).logits

    def copy_then(original_goes_on: bool):
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt, residual_length=16, page_size=8)
        forward(cache, prompt)
        forward(cache, next_ids[:, :1])  # seals the pages older than the window: (40 - 16) // 8 = 3
        cache.reorder_cache(torch.tensor([0, 0]))  # both rows share every page, as beams do
        other = copy.deepcopy(cache)
        assert torch.equal(other.rows[0].blocks, other.rows[1].blocks)
        assert torch.equal(other.rows[0].blocks[:3], cache.rows[0].blocks[:3])  # sealed pages: still shared
        assert not set(other.rows[0].blocks[3:].tolist()) & set(cache.rows[0].blocks.tolist())
        keys = other.layers[0].keys
        if original_goes_on:  # (the second forward seals the pages 30 tokens pushed out of the window)
            forward(cache, more)
            forward(cache, next_ids[:, :1])
        assert torch.equal(other.layers[0].keys, keys)
        logits = forward(other, next_ids)
        alloc = cache.store.allocator
        cache.free(), other.free()
        assert alloc.num_free == alloc.num_blocks
        return logits

    assert torch.equal(copy_then(True), copy_then(False))


def test_deepcopy_reuse_and_multi_turn():
    """The documented prefix-reuse pattern: deepcopy a prompt cache per request; and one cache across turns."""
    model = _model("qwen2")
    ids = _inputs()[0][:1]
    for impl in ("sdpa", "kvcache"):
        model.set_attn_implementation(impl)
        prompt_cache = kvcache.PagedCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :8], past_key_values=prompt_cache)
        blocks_before = prompt_cache.rows[0].blocks.clone()
        ref = _generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, do_sample=False)
        for _ in range(2):
            got = _generate(model, copy.deepcopy(prompt_cache), impl, input_ids=ids, do_sample=False)
            assert torch.equal(ref.sequences, got.sequences)
        assert torch.equal(prompt_cache.rows[0].blocks, blocks_before) and prompt_cache.get_seq_length() == 8
        # multi-turn: the same cache, the whole conversation as input each time
        cache, ref_cache = kvcache.PagedCache(config=model.config), DynamicCache(config=model.config)
        conversation = ref_conversation = ids
        for turn in range(3):
            conversation = _generate(model, cache, impl, input_ids=conversation, do_sample=False).sequences
            ref_conversation = _generate(model, ref_cache, "sdpa", input_ids=ref_conversation,
                                         do_sample=False).sequences
            assert torch.equal(conversation, ref_conversation)
            conversation = torch.cat([conversation, ids[:, :3]], 1)
            ref_conversation = torch.cat([ref_conversation, ids[:, :3]], 1)


def test_reset_free_stats_and_repr():
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config, page_size=8)
    with torch.no_grad():
        model(_inputs()[0], past_key_values=cache)
    s = cache.stats()
    assert s["tokens"] == 24 and s["blocks"] == 4 and s["waste_tokens"] == 8
    assert s["dynamic_cache_bytes"] == 2 * 2 * 2 * 12 * 2 * 16 * 4  # layers, K+V, rows, tokens, heads, dim, fp32
    assert s["bytes"] == 4 * 2 * 2 * 8 * 2 * 16 * 4
    assert "PagedCache(layers=2, rows=2, seq_length=12, format=fp32" in repr(cache)
    assert "<table>" in cache._repr_html_()
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.stats()["blocks"] == 0 and cache.store.pools
    with kvcache.PagedCache(config=model.config) as c2, torch.no_grad():
        model(_inputs()[0], past_key_values=c2)
        assert c2.store.nbytes > 0
    assert c2.store.nbytes == 0 and c2.get_seq_length() == 0


def test_max_tokens_bounds_the_pool_with_a_clear_error():
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config, max_tokens=16, page_size=8)
    with torch.no_grad():
        model(_inputs()[0][:1, :10], past_key_values=cache)
        with pytest.raises(kvcache.OutOfBlocksError, match="out of blocks"):
            model(_inputs()[0][:, :10], past_key_values=kvcache.PagedCache(config=model.config,
                                                                           store=cache.store))
    assert cache.get_seq_length() == 10 and cache.store.pools[0].num_blocks == 2


def test_batch_mismatch_is_a_clear_error():
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config)
    with torch.no_grad():
        model(_inputs()[0][:1], past_key_values=cache)
        with pytest.raises(ValueError, match="batch 2 but the cache holds 1 rows"):
            model(_inputs()[0][:, :1], past_key_values=cache)
    assert cache.get_seq_length() == 12


def test_sink_tokens_with_a_sliding_window_keep_the_first_tokens_visible():
    """StreamingLLM: with sinks, the kernel attends to the first tokens plus the window, which equals
    eager attention under the same mask."""
    model = _model("mistral")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = kvcache.PagedCache(config=model.config, sink_tokens=2)
    model.set_attn_implementation("kvcache")
    with torch.no_grad():
        got = model(ids, past_key_values=cache).logits
    layer = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 20, 16)
    k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    i, j = torch.arange(20).unsqueeze(1), torch.arange(20).unsqueeze(0)
    allowed = (j <= i) & ((j > i - 8) | (j < 2))
    expect = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                              attn_mask=allowed).transpose(1, 2)
    sinks = kvcache.PagedCache(config=model.config, sink_tokens=2)
    with torch.no_grad():
        tagged, _ = sinks.update(k, v, 0)
        out, _ = hf.kvcache_attention(layer, q, tagged, v, None, scaling=16 ** -0.5, sliding_window=8)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    assert got.isfinite().all()


def test_attention_is_registered_on_import():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["kvcache"] is hf.kvcache_attention
    assert AttentionMaskInterface._global_mapping["kvcache"] is hf.kvcache_mask


def test_kvcache_attention_without_a_paged_cache_falls_back_exactly():
    model = _model("llama")
    ids, mask = _inputs()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("kvcache")
        got = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, 5:], ref[1, 5:], atol=1e-5, rtol=0)


def test_save_prefix_takes_the_rows_ids_from_a_batch_and_names_a_bad_row():
    """save_prefix(batch_ids, row) caches row `row`'s ids (a [batch, n] input_ids was flattened, and row 1's
    K/V were filed under row 0's ids); a row the batch does not have, or ids of another batch, are refused
    before anything is cached."""
    model = _model("llama")
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(21))
    cache = kvcache.PagedCache(config=model.config, prefix_cache=True, page_size=8)
    with pytest.raises(ValueError, match="save_prefix needs a cache that holds tokens"):
        cache.save_prefix(ids, 0)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    tree = cache.store.prefix_cache
    for bad in (2, -1, True, 1.0):
        with pytest.raises(IndexError, match=f"row={bad!r} is not a row of this cache's batch of 2"):
            cache.save_prefix(ids, bad)
    with pytest.raises(ValueError, match=r"input_ids has shape \(3, 24\): give row 1's ids"):
        cache.save_prefix(ids.repeat(2, 1)[:3], 1)
    assert tree.stats()["device_tokens"] == 0
    assert cache.save_prefix(ids, 1) == 0

    def cached(row_ids):  # (load_prefix leaves the last token to compute)
        return kvcache.PagedCache(config=model.config, store=cache.store).load_prefix(row_ids)

    assert cached(ids[1]) == 23 and cached(ids[0]) == 0
    assert cache.save_prefix(ids[0:1], 0) == 0          # one row's ids as [1, n]
    assert cached(ids[0]) == 23


@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_save_prefix_with_the_attention_mask_leaves_padding_out_or_refuses_pads_stored_as_tokens(impl):
    """Under eager/sdpa the cache never sees the mask: a left-padded row's pages hold its pads as tokens, and
    save_prefix filed the row under its ids with the pads in front. Given the attention_mask it refuses that row,
    naming attention_mask; with the "kvcache" attention (which leaves pads out) the row is cached unpadded.
    Trailing zeros (right padding) are left out, a hole between tokens and a mask of another shape refused."""
    model = _model("llama")
    ids, mask = _inputs(20)  # row 1: 5 left pads
    cache = kvcache.PagedCache(config=model.config, prefix_cache=True, page_size=8)
    model.set_attn_implementation(impl)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    tree = cache.store.prefix_cache

    def cached(row_ids):  # (load_prefix leaves the last token to compute)
        return kvcache.PagedCache(config=model.config, store=cache.store).load_prefix(row_ids)

    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 19\); it must be shaped as input_ids"):
        cache.save_prefix(ids, 1, attention_mask=mask[:, 1:])
    holed = mask.clone()
    holed[0, 4] = 0
    with pytest.raises(ValueError, match=r"attention_mask row 0 has zeros between its tokens"):
        cache.save_prefix(ids, 0, attention_mask=holed)
    if impl == "sdpa":
        with pytest.raises(ValueError, match=r"attention_mask shows 5 left pads in row 1, but its pages hold them as "
                                             r"tokens .*nothing was cached"):
            cache.save_prefix(ids, 1, attention_mask=mask)
        assert tree.stats()["device_tokens"] == 0
    else:
        other = mask.clone()
        other[1, 4] = 1
        with pytest.raises(ValueError, match=r"attention_mask shows 4 left pads in row 1, but this cache saw 5 pads"):
            cache.save_prefix(ids, 1, attention_mask=other)
        assert cache.save_prefix(ids, 1, attention_mask=mask) == 0
        assert cached(ids[1, 5:]) == 14 and cached(ids[1]) == 0  # the unpadded ids, not the pads in front
    right = mask.clone()
    right[0, -3:] = 0  # row 0 as if its last 3 ids were right padding
    assert cache.save_prefix(ids, 0, attention_mask=right) == 0
    assert cached(ids[0, :17]) == 16 and cached(ids[0]) == 17      # the right pads were left out


def test_prefix_cache_lets_a_new_cache_skip_the_shared_prompt():
    model = _model("llama")
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 128, (1, 37), generator=g)
    question = torch.randint(3, 128, (1, 6), generator=g)
    first = kvcache.PagedCache(config=model.config, prefix_cache=True, page_size=8)
    _generate(model, first, "kvcache", input_ids=system, do_sample=False)
    assert first.save_prefix(system) == 0
    ids = torch.cat([system, question], 1)
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, do_sample=False)
    for impl in ("sdpa", "kvcache"):
        second = kvcache.PagedCache(config=model.config, store=first.store)
        assert second.load_prefix(ids) == 37       # ends inside a page: that page is copied on write
        got = _generate(model, second, impl, input_ids=ids, do_sample=False)
        assert torch.equal(got.sequences, ref.sequences)
        assert torch.equal(first.rows[0].blocks[:4], second.rows[0].blocks[:4])  # full pages shared
    stats = first.store.prefix_cache.stats()
    assert stats["hit_tokens"] == 2 * 37
    with pytest.raises(ValueError, match="load_prefix needs an empty cache"):
        second.load_prefix(ids)
    with pytest.raises(ValueError, match="no prefix cache"):
        kvcache.PagedCache(config=model.config).load_prefix(ids)


def test_shared_allocator_bounds_the_pool():
    alloc = kvcache.BlockAllocator(num_blocks=4, page_size=8)
    cache = kvcache.PagedCache(num_layers=1, page_size=8, allocator=alloc)
    k = torch.randn(1, 2, 30, 32)
    cache.update(k, k, 0)
    assert alloc.num_free == 0 and cache.store.pools[0].num_blocks == 4
    with pytest.raises(kvcache.OutOfBlocksError):
        cache.update(k[:, :, :3], k[:, :, :3], 0)
    with pytest.raises(ValueError, match="page_size=16 differs from page_size=8"):
        kvcache.PagedCache(num_layers=1, page_size=8, allocator=kvcache.BlockAllocator(4, 16))


def test_sink_tokens_hold_in_the_pytorch_paths_of_the_kvcache_attention():
    """Regression: output_attentions=True and autograd-recording forwards run the "kvcache" attention in PyTorch,
    which dropped the cache's sink_tokens (logits 5.8 off the StreamingLLM reference, silently)."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(num_key_value_heads=2, sliding_window=8, initializer_range=0.2, **_common())
    model = transformers.MistralForCausalLM(cfg).eval()
    model.set_attn_implementation("kvcache")
    try:
        ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(4))
        mask = torch.ones(2, 17, dtype=torch.long)
        mask[1, :3] = 0                                       # row 1 left-padded: its sinks start after the pads

        def step(sinks, **kw):
            cache = kvcache.PagedCache(config=model.config, sink_tokens=sinks)
            with torch.no_grad():
                model(input_ids=ids[:, :16], attention_mask=mask[:, :16], past_key_values=cache)
            if kw.pop("grad", False):
                emb = model.get_input_embeddings()(ids[:, 16:17]).detach().requires_grad_(True)
                return model(inputs_embeds=emb, attention_mask=mask, past_key_values=cache).logits[:, -1].detach()
            with torch.no_grad():
                return model(input_ids=ids[:, 16:17], attention_mask=mask, past_key_values=cache, **kw).logits[:, -1]

        plain, without = step(4), step(0)
        assert (plain - without).abs().max() > 0.1            # the sinks matter at this length
        assert (step(4, output_attentions=True) - plain).abs().max() < 1e-5
        assert (step(4, grad=True) - plain).abs().max() < 1e-5
    finally:
        model.set_attn_implementation("sdpa")


def test_softcapped_attention_of_a_padded_batch_stays_finite_in_pytorch():
    """Regression: the soft-capped PyTorch path (Gemma 2) masked with -inf, so a left-padded row's padding queries
    had nothing to see, their softmax was NaN, and the NaN reached the row's real tokens in the next layer (and the
    loss and every gradient in training)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0,
                                    **_common())
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    logits = {}
    try:
        for impl in ("eager", "kvcache"):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                logits[impl] = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache()).logits
        model.set_attn_implementation("kvcache")
        model.train()
        labels = ids.masked_fill(mask == 0, -100)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    finally:
        model.eval()
    assert torch.isfinite(logits["kvcache"]).all()
    real = mask.bool()
    assert (logits["kvcache"][real] - logits["eager"][real]).abs().max() < 1e-5


def test_sink_tokens_work_in_every_generate_mode_and_need_the_kernel():
    model = _model("mistral")
    ids, mask = _inputs()
    for mode, make in MODES.items():
        cache = kvcache.PagedCache(config=model.config, sink_tokens=2)
        out = _generate(model, cache, "kvcache", **make(ids, mask))
        assert out.sequences.shape[1] > ids.shape[1]
    with pytest.raises(ValueError, match=r"sink_tokens=2 needs the kernel's attention .*set_attn_implementation"):
        _generate(model, kvcache.PagedCache(config=model.config, sink_tokens=2), "sdpa", input_ids=ids[:1])
    # a cache built without config= cannot see the model's attention: the error says so (an outside-in probe:
    # it told the user to set the attention implementation they had set)
    with pytest.raises(ValueError, match=r"sink_tokens=2 needs the kernel's attention .*without config="):
        _generate(model, kvcache.PagedCache(sink_tokens=2), "kvcache", input_ids=ids[:1])
    # on a model with no sliding window every token is visible: sinks change nothing, and the cache says so
    with pytest.warns(UserWarning, match=r"sink_tokens=2: LlamaConfig has no sliding window"):
        kvcache.PagedCache(config=_model("llama").config, sink_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvcache.PagedCache(config=model.config, sink_tokens=2)  # (Mistral's window: no warning)


@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_compiled_model_decodes_the_same_tokens(impl):
    """torch.compile(model) (CPU, default mode) with a PagedCache: the same greedy tokens as eager. The step's
    planning graph-breaks (the allocator, the plan); the per-layer writes and attention are custom ops."""
    torch._dynamo.reset()
    model = _model("llama")
    model.set_attn_implementation(impl)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))

    def decode(forward):
        cache = kvcache.PagedCache(config=model.config)
        with torch.no_grad():
            logits = forward(ids, past_key_values=cache, use_cache=True).logits
            tokens = [logits[:, -1].argmax(-1)]
            for i in range(4):
                pos = torch.full((2, 1), ids.shape[1] + i)
                logits = forward(tokens[-1].view(2, 1), past_key_values=cache, use_cache=True,
                                 position_ids=pos).logits
                tokens.append(logits[:, -1].argmax(-1))
        return torch.stack(tokens, 1)

    assert torch.equal(decode(torch.compile(model)), decode(model))


# Where a compiled decode step may break its graph: before the model's layer loop only. The layer's
# get_mask_sizes hands the cache to the mask function (a context variable: _leave_for_mask, compile-disabled),
# and the mask function plans the step there (kvcache_mask: its padding handover and _plan_ahead).
PER_STEP_BREAKS = {"get_mask_sizes", "kvcache_mask"}
# torch < 2.14 (kvcache.hf_cache.PLAN_AHEAD off: its inductor loses a length symbol of the compiled loop): the step
# is planned at the first layer, whose reads of the padding and calls of the compile-disabled _new_step_plan and
# _new_kernel_plan break the graph there, inside the loop (the per-layer writes and attention still trace)
FIRST_LAYER_BREAKS = {"kvcache_mask", "_take_padding", "_step_plan", "kernel_plan", "kernel_plans"}


def _decode_step(layers: int, fmt=None, residual=None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_key_value_heads=2, **{**_common(), "num_hidden_layers": layers})).eval()
    model.set_attn_implementation("kvcache")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    cache = kvcache.PagedCache(config=model.config, kv_format=fmt, residual_length=residual, page_size=4)
    with torch.no_grad():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1).view(2, 1)
        explained = torch._dynamo.explain(model)(token, past_key_values=cache, use_cache=True,
                                                 position_ids=torch.full((2, 1), ids.shape[1]))
    sites = []
    for b in explained.break_reasons:
        ours = [f.name for f in b.user_stack if "kvcache" in f.filename]
        sites.append(ours[-1] if ours else b.user_stack[-1].name)
    return sorted(sites), explained.graph_count


@pytest.mark.parametrize("fmt, residual", [(None, None), ("int8", None), ("int8", 0)])
def test_compiled_decode_step_breaks_only_before_the_layer_loop(fmt, residual):
    """torch._dynamo.explain of one decode step with a PagedCache and "kvcache" attention: every graph break is
    before the layer loop (the mask code, where the step is planned ahead), so dynamo compiles the loop: a
    deeper model has the same breaks and the same number of graphs (a break inside the loop, where the first
    layer used to plan, made dynamo run the loop eagerly and compile each layer's attention on its own)."""
    (two, graphs_two), (four, graphs_four) = _decode_step(2, fmt, residual), _decode_step(4, fmt, residual)
    if not kvcache.hf_cache.PLAN_AHEAD:
        assert set(two) <= FIRST_LAYER_BREAKS, set(two) - FIRST_LAYER_BREAKS
        assert four == two  # the same break sites, as many: none per layer
        return
    assert set(two) <= PER_STEP_BREAKS, set(two) - PER_STEP_BREAKS
    assert four == two and graphs_four == graphs_two, (two, four, graphs_two, graphs_four)


@pytest.mark.parametrize("fmt, residual", [(None, None), ("int8", None), ("int8", 0), ("int4", 0), ("kivi2", None)])
@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_layer_keys_and_values_read_the_pages(impl, fmt, residual):
    """``cache.layers[i].keys`` / ``.values`` (and transformers 4.x's ``cache[i]``) hold what DynamicCache holds
    (they were None, so a notebook reading the cache got nothing): bit for bit in full precision and inside the
    full-precision window, within the format's rounding without it, after a crop and a reorder too. Padded
    positions the "kvcache" attention does not store read as zero; assigning to them is refused."""
    model = _model("llama-d32")
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    more = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], 1)
    ref, cache = DynamicCache(config=model.config), kvcache.PagedCache(config=model.config, kv_format=fmt,
                                                                        residual_length=residual, page_size=4)
    assert cache.layers[0].keys is None and cache.layers[0].values is None
    with torch.no_grad():
        for c, attn in ((ref, "sdpa"), (cache, impl)):
            model.set_attn_implementation(attn)
            model(ids, attention_mask=mask, past_key_values=c)
            model(ids[:, :2], attention_mask=more, past_key_values=c)
    tol = 0.0 if fmt is None or residual is None else {"int8": 0.02, "int4": 0.2}[fmt]
    stored = slice(4, None) if impl == "kvcache" else slice(None)  # (row 0's pads are not stored then)

    def check(length: int, layers=range(2)):
        for i in layers:
            for got, want in ((cache.layers[i].keys, ref.layers[i].keys), (cache.layers[i].values, ref.layers[i].values)):
                assert got.shape == want.shape == (2, 1, length, 32) and got.dtype == want.dtype
                scale = float(want.abs().max())
                assert float((got[1] - want[1]).abs().max()) <= tol * scale
                assert float((got[0, :, stored] - want[0, :, stored]).abs().max()) <= tol * scale
                if impl == "kvcache" and stored.start:
                    assert not got[0, :, :4].any()

    # layer 1's input went through the kernel's attention (not SDPA's) with "kvcache": compare layer 0 there
    check(23, range(2) if impl == "sdpa" else range(1))
    cache.crop(-5)
    ref.crop(-5)
    check(18, range(2) if impl == "sdpa" else range(1))
    cache.reorder_cache(torch.tensor([1, 1]))
    ref.reorder_cache(torch.tensor([1, 1]))
    stored = slice(None)  # (both rows are the unpadded one now)
    check(18, range(2) if impl == "sdpa" else range(1))
    if hasattr(transformers.Cache, "__getitem__"):  # transformers 4.x: past_key_values[i] is (keys, values)
        assert torch.equal(cache[0][0], cache.layers[0].keys) and torch.equal(cache[0][1], cache.layers[0].values)
    # iterating yields what DynamicCache's iteration yields, item for item (transformers 5 dropped Cache.__iter__:
    # `for k, v, _ in cache` raised TypeError); (keys, values[, window]) per layer
    items, want = list(cache), list(ref)
    assert len(items) == len(want) == 2 and all(len(a) == len(b) for a, b in zip(items, want))
    for i, (got, exp) in enumerate(zip(items, want)):
        assert torch.equal(got[0], cache.layers[i].keys) and torch.equal(got[1], cache.layers[i].values)
        assert got[0].shape == exp[0].shape and all(g is None for g, e in zip(got[2:], exp[2:]) if e is None)
    keys = cache.layers[0].keys
    keys.zero_()  # a copy: the cache is unchanged
    assert cache.layers[0].keys.abs().max() > 0
    with pytest.raises(AttributeError, match="keys is read from the pages"):
        cache.layers[0].keys = keys


def test_shallow_copy_is_an_independent_cache():
    """copy.copy shared the rows: dropping the copy gave the original's pages back (0 blocks held, the next
    forward read freed pages, other tokens, silently). It is the copy-on-write fork deepcopy makes."""
    import gc
    model = _model("llama")
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, do_sample=False)
    cache = kvcache.PagedCache(config=model.config, page_size=4)
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=cache)
    held = cache.store.allocator.num_blocks - cache.store.allocator.num_free
    other = copy.copy(cache)
    assert other.rows is not cache.rows and other.get_seq_length() == cache.get_seq_length() == 19
    del other
    gc.collect()
    assert cache.store.allocator.num_blocks - cache.store.allocator.num_free == held
    got = _generate(model, cache, "sdpa", input_ids=ids, do_sample=False)
    assert torch.equal(ref.sequences, got.sequences) and _max_diff(ref, got) <= 1e-5  # (prefilled apart: 1e-7)
    import pickle
    with pytest.raises(TypeError, match="PagedCache cannot be pickled"):
        pickle.dumps(cache)


def test_a_failed_first_forward_leaves_the_cache_empty():
    """A first forward refused by a full pool left two rows of nothing behind: the cache said length 0, and a
    retry with one row failed on 'the cache holds 2 rows'. The rows go back; the retry runs."""
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config, max_tokens=32, page_size=16)
    with pytest.raises(kvcache.OutOfBlocksError), torch.no_grad():
        model(torch.randint(0, 128, (2, 40)), past_key_values=cache)
    assert cache.rows == [] and cache.get_seq_length() == 0
    assert cache.store.allocator.num_free == cache.store.allocator.num_blocks
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, do_sample=False)
    got = _generate(model, cache, "sdpa", input_ids=ids, do_sample=False)
    assert torch.equal(ref.sequences, got.sequences)


def test_a_batch_too_big_for_the_pool_is_refused_whole():
    """Rows took their blocks one after another: the last row's refusal named its own need against a pool its
    batch-mates had just emptied, and the rows before it kept their new blocks."""
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config, max_tokens=80)  # 5 pages of 16
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids, past_key_values=cache)  # 2 pages per row: 1 left
        tables = [(row.blocks.tolist(), row.num_tokens) for row in cache.rows]
        with pytest.raises(kvcache.OutOfBlocksError, match=r"out of blocks: this forward's 2 rows need 2 more blocks of 16 tokens "
                                                           r"\(per row: \[1, 1\]\), but 1 of the pool's 5 are free"):
            model(ids, past_key_values=cache)
    assert [(row.blocks.tolist(), row.num_tokens) for row in cache.rows] == tables
    assert cache.store.allocator.num_free == 1 and cache.get_seq_length() == 20


@pytest.mark.parametrize("bad", [2.5, "3", True, None])
def test_crop_refuses_what_is_not_an_integer(bad):
    """crop(2.5) kept 2 tokens (int() truncated), silently; DynamicCache refuses it."""
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 9)), past_key_values=cache)
    with pytest.raises((TypeError, StopIteration)):
        cache.crop(bad)
    assert cache.get_seq_length() == 9
    cache.crop(torch.tensor(-2))  # an integer tensor is an integer
    assert cache.get_seq_length() == 7


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_cache_made_for_kvcache_attention_refuses_a_model_attending_otherwise(name):
    """A cache whose config says "kvcache" hands each layer only the forward's own K/V (the kernel reads the pages);
    a model attending with sdpa then saw none of the cache, silently (an outside-in probe found wrong logits). Now
    the next layer refuses, the cache is emptied, and the same cache then serves the model correctly."""
    model = _model(name)
    model.set_attn_implementation("sdpa")
    fused_config = copy.deepcopy(model.config)
    fused_config._attn_implementation = "kvcache"
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = kvcache.PagedCache(config=fused_config)
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache)  # a prompt alone: its own tokens are all there is to see
        with pytest.raises(RuntimeError, match=r"layer 0 .*\"kvcache\" attention.*another implementation"):
            model(ids[:, 8:9], past_key_values=cache)  # a decode step (no mask: SDPA's causal skip) missed the prompt
        assert cache.get_seq_length() == 0 and not cache.rows
        assert cache.store.allocator.num_free == cache.store.allocator.num_blocks
        # the model run with the attention the cache was made for, on the same cache: as DynamicCache
        model.set_attn_implementation("kvcache")
        try:
            got = [model(ids[:, :8], past_key_values=cache).logits, model(ids[:, 8:9], past_key_values=cache).logits]
        finally:
            model.set_attn_implementation("sdpa")
        ref_cache = DynamicCache()
        want = [model(ids[:, :8], past_key_values=ref_cache).logits,
                model(ids[:, 8:9], past_key_values=ref_cache).logits]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_a_forward_stopped_part_way_is_rolled_back_at_the_next_use(impl):
    """A forward that raises in layer 1 (an exception or Ctrl-C in a hook, a later layer's error) leaves layer 0
    holding its token and layer 1 not: the next forward wrote after that token in layer 0 and before it in layer 1
    (other tokens from then on), crop refused ("layers hold different lengths"), and save_prefix cached the token
    layer 1 never stored. Now get_seq_length says what every layer holds, and the next forward, crop or save_prefix
    rolls the stopped forward back: the retried step is bit for bit the run that never stopped."""
    model = _model("llama")
    model.set_attn_implementation(impl)
    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(8))

    class Stop(Exception):
        pass

    def stop(module, args, kwargs):
        raise Stop

    def decode(cache, steps, stop_at=None):
        logits = [model(prompt, past_key_values=cache).logits[0, -1]]
        while len(logits) <= steps:
            hook = model.model.layers[1].register_forward_pre_hook(stop, with_kwargs=True) \
                if len(logits) == stop_at else None
            try:
                logits.append(model(logits[-1].argmax().view(1, 1), past_key_values=cache).logits[0, -1])
            except Stop:
                assert [layer.length for layer in cache.paged_layers] == [19 + stop_at + 1, 19 + stop_at]
                assert cache.get_seq_length() == 19 + stop_at and cache.stats()["seq_length"] == 19 + stop_at
                stop_at = None
            finally:
                if hook is not None:
                    hook.remove()
        return torch.stack(logits)

    with torch.no_grad():
        want = decode(kvcache.PagedCache(config=model.config), 5)
        assert torch.equal(decode(kvcache.PagedCache(config=model.config), 5, stop_at=2), want)
        # crop and save_prefix after a stopped forward: from what every layer holds
        cache = kvcache.PagedCache(config=model.config, prefix_cache=True, page_size=8)
        first = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
        hook = model.model.layers[1].register_forward_pre_hook(stop, with_kwargs=True)
        with pytest.raises(Stop):
            model(first, past_key_values=cache)
        hook.remove()
        assert cache.save_prefix(torch.cat([prompt, first], 1)) == 0
        assert kvcache.PagedCache(config=model.config, store=cache.store).load_prefix(
            torch.cat([prompt, first, first], 1)) == 20  # the prompt's 20, not the stopped forward's token
        with pytest.raises(Stop):
            hook = model.model.layers[1].register_forward_pre_hook(stop, with_kwargs=True)
            try:
                model(first, past_key_values=cache)
            finally:
                hook.remove()
        cache.crop(-1)
        assert [layer.length for layer in cache.paged_layers] == [19, 19]


class _Stop(Exception):
    pass


def _stop_in(model, layer: int):
    """Raises _Stop at the next forward of decoder layer ``layer`` (an exception or Ctrl-C part-way through a
    forward: the layers before it have written their K/V, the later ones have not)."""
    def stop(module, args, kwargs):
        handle.remove()
        raise _Stop

    handle = model.model.layers[layer].register_forward_pre_hook(stop, with_kwargs=True)
    return handle


def _llama3():  # three layers: a stop in the middle leaves a layer written and one never written
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_key_value_heads=2, **{**_common(), "num_hidden_layers": 3})).eval()


@pytest.mark.parametrize("fmt", [None, "int8"])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_first_forward_stopped_part_way_is_undone(impl, fmt):
    """A prompt's forward stopped in a layer (Ctrl-C in a notebook, most likely during a long prefill) left the
    layers before it holding the prompt and the later ones nothing: the cache said length 40, and the retried
    prompt ran as a continuation of itself (sdpa: a RuntimeError in the mask; the "kvcache" attention: logits
    0.41 off, silently). Now the cache says 0 and the next forward starts it anew: the retry is bit for bit a
    fresh cache's forward, and every page of the stopped one went back."""
    model = _llama3()
    model.set_attn_implementation(impl)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    nxt = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        fresh = kvcache.PagedCache(config=model.config, kv_format=fmt)
        want = [model(ids, past_key_values=fresh).logits, model(nxt, past_key_values=fresh).logits]
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt)
        for stop_at in (1, 2):
            _stop_in(model, stop_at)
            with pytest.raises(_Stop):
                model(ids, past_key_values=cache)
            assert [layer.length for layer in cache.paged_layers][:stop_at] == [40] * stop_at
            assert cache.get_seq_length() == 0 and cache.stats()["seq_length"] == 0
        got = [model(ids, past_key_values=cache).logits, model(nxt, past_key_values=cache).logits]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    alloc = cache.store.allocator
    assert alloc.num_blocks - alloc.num_free == fresh.store.allocator.num_blocks - fresh.store.allocator.num_free
    # crop and save_prefix after such a stop see an empty cache
    cache = kvcache.PagedCache(config=model.config, kv_format=fmt, prefix_cache=True)
    _stop_in(model, 2)
    with pytest.raises(_Stop), torch.no_grad():
        model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match="save_prefix needs a cache that holds tokens"):
        cache.save_prefix(ids)
    assert cache.store.prefix_cache.stats()["inserts"] == 0 and cache.rows == [] and cache.store.allocator.num_free == cache.store.allocator.num_blocks


@pytest.mark.parametrize("impl", IMPLS)
def test_a_cache_without_its_layers_refuses_the_forward_after_a_stopped_first_one(impl):
    """Built without config= (layers come as the model reaches them), the cache cannot tell a first forward that
    stopped part-way from a whole one until the next forward reaches a layer never written: that layer's K/V
    would have sat after positions it never held. Refused there, naming the layer, with the cache emptied, so that
    running the prompt again gives a fresh cache's logits."""
    model = _llama3()
    model.set_attn_implementation(impl)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = kvcache.PagedCache()
    with torch.no_grad():
        _stop_in(model, 2)
        with pytest.raises(_Stop):
            model(ids, past_key_values=cache)
        with pytest.raises(RuntimeError, match=r"layer 2 gets its first K/V while layers \[0, 1\] hold"):
            model(ids, past_key_values=cache)
        assert cache.rows == [] and cache.get_seq_length() == 0
        assert cache.store.allocator.num_free == cache.store.allocator.num_blocks
        got = model(ids, past_key_values=cache).logits
        want = model(ids, past_key_values=kvcache.PagedCache()).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", [None, "int8"])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_multi_token_forward_after_a_stopped_one_is_masked_over_what_every_layer_holds(impl, fmt):
    """After a decode step stopped part-way, the next forward of several tokens (a new chat turn, a speculative
    check) was masked over the stopped step's tokens too: get_mask_sizes read its own layer's length (46 keys
    where the layers held 43: a RuntimeError in every attention). Its mask now spans what the forward continues
    from, and its logits are bit for bit those of the run that never stopped."""
    model = _llama3()
    model.set_attn_implementation(impl)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    step = torch.randint(3, 128, (1, 1), generator=torch.Generator().manual_seed(6))
    turn = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        fresh = kvcache.PagedCache(config=model.config, kv_format=fmt)
        want = [model(ids, past_key_values=fresh).logits, model(turn, past_key_values=fresh).logits]
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt)
        got = [model(ids, past_key_values=cache).logits]
        _stop_in(model, 2)
        with pytest.raises(_Stop):
            model(step, past_key_values=cache)
        assert [layer.length for layer in cache.paged_layers] == [41, 41, 40] and cache.get_seq_length() == 40
        got.append(model(turn, past_key_values=cache).logits)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert cache.get_seq_length() == 43


@pytest.mark.parametrize("fork", ["deepcopy", "batch_repeat_interleave"])
def test_a_step_planned_and_stopped_before_any_layer_is_not_counted(fork):
    """The "kvcache" mask function plans a step (its pages taken, the rows counting its token) before the layers
    run; stopped before layer 0 wrote (a hook on its norm, the rotary embedding), every layer kept its length and
    nothing rolled the rows back. A fork then shared the step's page without copy-on-write: deepcopy's original
    read the copy's token (logits 0.05 off, silently), batch_repeat_interleave wrote one slot twice. Now the next
    use rolls the rows back too; stats() of the stopped cache equal those of one that never ran the step."""
    model = _llama3()
    model.set_attn_implementation("kvcache")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    a, b = torch.tensor([[5]]), torch.tensor([[9]])

    def run(stop: bool):
        cache = kvcache.PagedCache(config=model.config)
        model(ids, past_key_values=cache)
        if stop:
            def raise_stop(module, args):
                handle.remove()
                raise _Stop

            handle = model.model.layers[0].input_layernorm.register_forward_pre_hook(raise_stop)
            with pytest.raises(_Stop):
                model(a, past_key_values=cache)
        stats = cache.stats()
        if fork == "deepcopy":  # (the copy writes first: the original then reads its slot)
            other = copy.deepcopy(cache)
            return stats, [model(b, past_key_values=other).logits, model(a, past_key_values=cache).logits,
                           model(a, past_key_values=other).logits, model(b, past_key_values=cache).logits]
        cache.batch_repeat_interleave(2)
        return stats, [model(torch.cat([a, b]), past_key_values=cache).logits]

    with torch.no_grad():
        (want_stats, want), (got_stats, got) = run(False), run(True)
    assert got_stats == want_stats
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_after_a_stopped_first_forward_every_use_sees_an_empty_cache():
    """get_seq_length said 0 after a stopped first forward, but stats() and repr still counted its rows and pages,
    load_prefix refused ("needs an empty cache"), and a row selection made the stopped prompt's 20 tokens the
    cache's again. Every use now sees the empty cache the next forward would."""
    model = _llama3()
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for use in ("stats", "select", "load_prefix"):
            cache = kvcache.PagedCache(config=model.config, prefix_cache=True)
            if use == "load_prefix":
                model(ids[:1], past_key_values=cache)
                cache.save_prefix(ids[:1])
                cache = kvcache.PagedCache(config=model.config, store=cache.store)
            _stop_in(model, 2)
            with pytest.raises(_Stop):
                model(ids, past_key_values=cache)
            if use == "stats":
                s = cache.stats()
                assert (s["rows"], s["blocks"], s["bytes"]) == (0, 0, 0) and "rows=0" in repr(cache)
            elif use == "select":  # (on an empty cache, as on a fresh one: nothing to select)
                cache.batch_select_indices(torch.tensor([1]))
                assert cache.get_seq_length() == 0 and cache.rows == []
                fresh = kvcache.PagedCache(config=model.config)
                assert torch.equal(model(ids[1:], past_key_values=cache).logits,
                                   model(ids[1:], past_key_values=fresh).logits)
            else:
                assert cache.load_prefix(ids[0]) == 19
                want = model(ids[:1, 19:], past_key_values=cache).logits
                fresh = kvcache.PagedCache(config=model.config)
                # (the prefix's last token computed apart from the rest: other sums, as any prefix hit)
                torch.testing.assert_close(want, model(ids[:1], past_key_values=fresh).logits[:, -1:],
                                           atol=1e-5, rtol=1e-5)


def test_meta_key_states_are_refused_and_leave_the_cache_usable():
    """K/V on the meta device (a model not materialized) failed inside the first op and left a pool on meta and
    the layer's device behind: every later forward on CPU failed ("Cannot copy out of meta tensor"), even after
    free(). Refused up front now, naming the device, and the cache works on CPU afterwards."""
    model = _model("llama")
    cache = kvcache.PagedCache(config=model.config)
    k = torch.empty(1, 2, 3, 16, device="meta")
    with pytest.raises(ValueError, match="key_states is on the meta device"):
        cache.update(k, k, 0)
    assert not cache.store.pools and cache.get_seq_length() == 0
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        got = model(ids, past_key_values=cache).logits
        want = model(ids, past_key_values=DynamicCache(config=model.config)).logits
    assert torch.equal(got, want)


def test_gemma3n_shared_kv_layers_keep_the_cache_length():
    """Gemma 3n's last num_kv_shared_layers layers read an earlier layer's K/V and never write: their pages hold
    nothing, and the cache's length is what the writing layers hold (a length taken over every layer was 0 there,
    and generation failed in the second forward). Greedy tokens equal DynamicCache's."""
    torch.manual_seed(0)
    config = transformers.Gemma3nTextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
        altup_num_inputs=2, laurel_rank=4, activation_sparsity_pattern=[0.0] * 4)
    model = transformers.Gemma3nForCausalLM(config).eval()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = kvcache.PagedCache(config=model.config)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=DynamicCache(config=model.config))
        got = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=cache)
    assert torch.equal(got, want)
    assert [layer.length for layer in cache.paged_layers] == [21, 21, 0, 0] and cache.get_seq_length() == 21
    # num_layers= without the config does not say which layers are shared: the shared ones, never written, did
    # not make every complete prompt look like a stopped one (each forward undone: other tokens, 0.6 off)
    cache = kvcache.PagedCache(num_layers=4)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=cache), want)
