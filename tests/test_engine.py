"""kvcache.Engine: packed batches over the pages give what HF generate gives, prompt by prompt, and the
prefix cache removes the shared part of the prefill."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvcache  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 128, (40,), generator=g).tolist()
    return [system + torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 17, 1, 12)]


def _reference(model, prompt, n):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kv_format", [None, "int8"])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_engine_greedy_equals_hf_generate(model, kv_format, prefix_cache):
    prompts = _prompts()
    engine = kvcache.Engine(model, kv_format=kv_format, prefix_cache=prefix_cache, page_size=8, max_batch=4)
    results = engine.generate(prompts, max_new_tokens=6)
    if kv_format is None:  # full precision: exactly HF's greedy tokens, prompt by prompt
        assert [r.tokens for r in results] == [_reference(model, p, 6) for p in prompts]
    else:                  # int8: the same tokens as a PagedCache with the same format under HF generate
        for p, r in zip(prompts, results):
            cache = kvcache.PagedCache(config=model.config, kv_format="int8")
            model.set_attn_implementation("kvcache")
            with torch.no_grad():
                ref = model.generate(torch.tensor([p]), past_key_values=cache, max_new_tokens=6, do_sample=False,
                                     pad_token_id=0)
            assert r.tokens == ref[0, len(p):].tolist()
    s = engine.stats()
    assert s["generated_tokens"] == 36 and s["prompt_tokens"] == sum(map(len, prompts))
    if prefix_cache:  # the 40-token system prompt is computed once: 5 later requests reuse it
        assert s["prefix_hit_tokens"] == 5 * 40 and s["prefill_tokens"] == s["prompt_tokens"] - 200
    else:
        assert s["prefix_hit_tokens"] == 0 and s["prefill_tokens"] == s["prompt_tokens"]
    alloc = engine.store.allocator
    held = len(engine.store.prefix_cache.block_references()) if prefix_cache else 0
    assert alloc.num_blocks - alloc.num_free == held  # every request gave its pages back
    if prefix_cache:  # and the locks its admission took (one batched lookup a step)
        assert engine.store.prefix_cache.stats()["locked_nodes"] == 0
        engine.store.prefix_cache.check()


def test_engine_reuses_prefixes_across_calls_and_reports(model):
    engine = kvcache.Engine(model, page_size=8)
    prompts = _prompts()
    engine.generate(prompts[:1], max_new_tokens=2)
    results = engine.generate(prompts[1:3], max_new_tokens=2)
    assert [r.cached_tokens for r in results] == [40, 40]
    s = engine.stats()
    assert s["ttft_s"] > 0 and s["tokens_per_s"] > 0 and 0 < s["kv_bytes"]
    assert s["prefix_hit_rate"] == pytest.approx(80 / s["prompt_tokens"])
    assert "Engine(model=LlamaForCausalLM" in repr(engine)


def test_engine_sampling_is_seeded_and_stops_at_eos(model):
    engine = kvcache.Engine(model, prefix_cache=False)
    prompts = _prompts()[:2]
    a = engine.generate(prompts, max_new_tokens=5, do_sample=True, top_k=10, seed=3)
    b = engine.generate(prompts, max_new_tokens=5, do_sample=True, top_k=10, seed=3)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    first = _reference(model, prompts[0], 3)
    stop = engine.generate(prompts[:1], max_new_tokens=5, eos_token_id=first[1])
    assert stop[0].tokens == first[:2]


def test_engine_sampling_per_request_does_not_depend_on_the_batch(model):
    """Each request samples from its own generator (seed, index): the same tokens decoded alone, in one batch, one
    request at a time, or in a pool so small that requests are preempted; identical prompts get different draws."""
    prompts = _prompts()[:4]
    kw = dict(max_new_tokens=6, do_sample=True, top_k=20, seed=11, progress=False)
    together = [r.tokens for r in kvcache.Engine(model, prefix_cache=False).generate(prompts, **kw)]
    one_by_one = [r.tokens for r in kvcache.Engine(model, prefix_cache=False, max_batch=1).generate(prompts, **kw)]
    small = kvcache.Engine(model, prefix_cache=False, page_size=8, max_tokens=8 * 13)
    squeezed = [r.tokens for r in small.generate(prompts, **kw)]
    assert small.stats()["preemptions"] > 0  # the pool was too small for all four at once
    assert one_by_one == together and squeezed == together
    alone = kvcache.Engine(model, prefix_cache=False).generate(prompts[:1], **kw)[0].tokens
    assert alone == together[0]
    twins = kvcache.Engine(model, prefix_cache=False).generate([prompts[0]] * 2, **kw)
    assert twins[0].tokens == together[0] and twins[1].tokens != twins[0].tokens


def test_engine_stops_at_any_eos_id_and_by_default_at_the_generation_configs(model):
    """eos_token_id as HF generate takes it: an int, a list / tuple or a tensor of ids, any of which ends the
    request (kept as its last token); by default the model's generation_config.eos_token_id, as HF stops at."""
    engine = kvcache.Engine(model, prefix_cache=False)
    prompt = _prompts()[1]
    unstopped = engine.generate([prompt], max_new_tokens=8, eos_token_id=[])[0]
    free = unstopped.tokens
    stop, never = free[3], next(t for t in range(128) if t not in free)
    cut = free[:free.index(stop) + 1]
    assert len(cut) < 8
    for eos in (stop, [stop], (never, stop), torch.tensor([stop]), torch.tensor(stop)):
        assert engine.generate([prompt], max_new_tokens=8, eos_token_id=eos)[0].tokens == cut, eos
    # why each stopped: the end-of-sequence token (also when it is the max_new_tokens-th), else the length
    assert unstopped.finish_reason == "length"
    assert engine.generate([prompt], max_new_tokens=8, eos_token_id=stop)[0].finish_reason == "stop"
    assert engine.generate([prompt], max_new_tokens=len(cut), eos_token_id=stop)[0].finish_reason == "stop"
    assert engine.generate([prompt], max_new_tokens=len(cut) - 1, eos_token_id=stop)[0].finish_reason == "length"
    before = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [never, stop]
    try:
        assert engine.generate([prompt], max_new_tokens=8)[0].tokens == cut == _reference(model, prompt, 8)
        assert engine.generate([prompt], max_new_tokens=8, eos_token_id=[])[0].tokens == free
    finally:
        model.generation_config.eos_token_id = before
    for bad, pattern in ((1.5, r"eos_token_id=1\.5 must be an int, a list / tuple of ints or an int tensor"),
                         ("2", r"eos_token_id='2' must be an int"), ([2, 1.0], r"eos_token_id=\[2, 1\.0\]: 1\.0 is not a "
                                                                      r"token id"),
                         (torch.tensor([2.0]), r"eos_token_id: .*torch\.float32")):
        with pytest.raises(TypeError, match=pattern):
            engine.generate([prompt], max_new_tokens=8, eos_token_id=bad)
    for bad, pattern in ((-1, r"eos_token_id=-1: -1 is not a token id"),
                         ([2, -3], r"eos_token_id=\[2, -3\]: -3 is not a token id")):
        with pytest.raises(ValueError, match=pattern):  # an int of the wrong value: a ValueError, as elsewhere
            engine.generate([prompt], max_new_tokens=8, eos_token_id=bad)


def test_engine_bad_input(model):
    engine = kvcache.Engine(model)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="string prompts need Engine"):
        engine.generate(["hello"])
    small = kvcache.Engine(model, max_tokens=32, page_size=8, prefix_cache=False)
    with pytest.raises(kvcache.OutOfBlocksError):
        small.generate([list(range(1, 60))], max_new_tokens=2)
    assert small.store.allocator.num_free == small.store.allocator.num_blocks  # nothing leaked


class _CharTokenizer:
    """A tokenizer of one id per character (mod 128), enough for the Engine's string prompts."""

    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % 128 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_engine_refuses_bad_arguments_by_name_before_any_work(model):
    """Each bad argument is refused with its name and value before anything runs: the pool, the prefix cache and
    the next call are as if it had not been made."""
    with pytest.raises(ValueError, match=r"max_batch=0 must be >= 1"):
        kvcache.Engine(model, max_batch=0)
    with pytest.raises(TypeError, match=r"max_batch=2\.5 must be an int"):
        kvcache.Engine(model, max_batch=2.5)
    engine = kvcache.Engine(model, _CharTokenizer(), page_size=4)
    ok = engine.generate(["hello"], max_new_tokens=3)[0].tokens
    state = (engine.store.allocator.num_free, engine.store.prefix_cache.stats()["device_blocks"])
    cases = [
        (ValueError, r"prompts\[0\]='': the tokenizer gives no tokens", dict(prompts=[""])),
        (ValueError, r"prompts\[1\]='': the tokenizer gives no tokens", dict(prompts=["hello", ""])),
        (IndexError, r"prompts\[0\]\[2\]=128 is not a token id of the model's vocabulary of 128",
         dict(prompts=[[1, 2, 128]])),
        (IndexError, r"prompts\[1\]\[0\]=-3 is not a token id .* \(0 <= id < 128\)", dict(prompts=[[1], [-3, 2]])),
        (TypeError, r"prompts\[0\]\[0\]=1\.7: token ids must be ints, not float", dict(prompts=[[1.7, 2.2]])),
        (TypeError, r"prompts\[0\]: token ids must be integers, got a tensor of torch\.float32",
         dict(prompts=[torch.tensor([1.0, 2.0])])),
        (TypeError, r"prompts\[0\]=1: a prompt is a list of token ids", dict(prompts=[1, 2, 3])),
        (TypeError, r"max_new_tokens=2\.5 must be an int", dict(prompts=[[1, 2]], max_new_tokens=2.5)),
        (ValueError, r"max_new_tokens=0 must be >= 1", dict(prompts=[[1, 2]], max_new_tokens=0)),
    ]
    for error, pattern, kw in cases:
        with pytest.raises(error, match=pattern):
            engine.generate(**kw)
        assert (engine.store.allocator.num_free, engine.store.prefix_cache.stats()["device_blocks"]) == state, kw
    assert engine.generate(["hello"], max_new_tokens=3)[0].tokens == ok


@pytest.mark.parametrize("kv_format", [None, "int8"])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_bounded_pool_preempts_and_every_request_finishes(model, kv_format, prefix_cache):
    """Six requests that each fit the pool but not together: the youngest running one gives its pages back and
    resumes later (computing its tokens again), so every request finishes with the tokens it gets alone."""
    # short prompts that grow: 6 admitted at once (2 pages each), 4-6 pages each by the end, in a pool of 16
    prompts = [p[-n:] for p, n in zip(_prompts(), (3, 12, 7, 9, 4, 10))]
    grow = dict(max_new_tokens=36, eos_token_id=[])  # every request grows to its full length (no early stop)
    free = kvcache.Engine(model, kv_format=kv_format, prefix_cache=False, page_size=8)
    want = [r.tokens for r in free.generate(prompts, **grow)]
    engine = kvcache.Engine(model, kv_format=kv_format, prefix_cache=prefix_cache, page_size=8, max_tokens=128,
                            max_batch=6)
    fed = []  # tokens of each forward
    hook = model.register_forward_pre_hook(lambda m, args, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        results = engine.generate(prompts, **grow)
    finally:
        hook.remove()
    assert [r.tokens for r in results] == want
    s = engine.stats()
    assert s["preemptions"] >= 1 and s["recomputed_tokens"] > 0
    # every token fed is a prompt token computed once, a generated one fed once, or one computed again
    assert sum(fed) == s["prefill_tokens"] + sum(len(r.tokens) - 1 for r in results) + s["recomputed_tokens"]
    assert sum(r.preemptions for r in results) == s["preemptions"]
    assert s["peak_blocks"] <= 16 and s["generated_tokens"] == 6 * 36
    assert f"{s['preemptions']} ({s['recomputed_tokens']} tokens computed again)" in engine._repr_html_()
    alloc = engine.store.allocator
    held = len(engine.store.prefix_cache.block_references()) if prefix_cache else 0
    assert alloc.num_blocks - alloc.num_free == held
    if prefix_cache:
        assert engine.store.prefix_cache.stats()["locked_nodes"] == 0
        engine.store.prefix_cache.check()
    # the same requests one at a time never need a preemption
    one = kvcache.Engine(model, kv_format=kv_format, prefix_cache=prefix_cache, page_size=8, max_tokens=128,
                         max_batch=1)
    assert [r.tokens for r in one.generate(prompts, **grow)] == want
    assert one.stats()["preemptions"] == 0


def test_bounded_pool_refuses_a_request_that_never_fits_before_any_work(model):
    engine = kvcache.Engine(model, page_size=8, max_tokens=64)
    ok = _prompts()[0]                                # 45 tokens + 19 = 63 <= 64 slots: fits alone
    assert len(engine.generate([ok], max_new_tokens=20)[0].tokens) == 20
    before = engine.store.prefix_cache.stats()
    with pytest.raises(kvcache.OutOfBlocksError,
                       match=r"prompts\[1\]: 45 tokens \+ max_new_tokens=21 need up to 9 pages of 8 tokens, more than "
                             r"the pool's 8 \(max_tokens=64, in whole pages\)"):
        engine.generate([[5, 6, 7], ok], max_new_tokens=21)
    after = engine.store.prefix_cache.stats()
    assert (after["lookups"], after["nodes"]) == (before["lookups"], before["nodes"])  # nothing ran
    odd = kvcache.Engine(model, page_size=8, max_tokens=60)  # 7.5 pages: the pool has 8, the message the 60 asked
    with pytest.raises(kvcache.OutOfBlocksError, match=r"more than the pool's 8 \(max_tokens=60, in whole pages\)"):
        odd.generate([ok], max_new_tokens=21)


@pytest.mark.parametrize("residual_length", [0, None])
def test_engine_kv_bytes_count_the_full_precision_window(model, residual_length):
    """kv_bytes: the pages in use at the peak, and with a quantized format's window also the full-precision copies
    of its open pages (held beside their int8 blocks); without the window, the int8 pages alone."""
    engine = kvcache.Engine(model, kv_format="int8", residual_length=residual_length, prefix_cache=False, page_size=8)
    engine.generate([list(range(3, 40))], max_new_tokens=4)      # 40 tokens written: 5 pages
    s, store = engine.stats(), engine.store
    assert s["peak_blocks"] == 5
    if residual_length == 0:
        assert store.residual is None and s["kv_bytes"] == 5 * store.bytes_per_block()
    else:  # 40 tokens, all within the 128-token window: every page is open, so held twice
        assert s["kv_bytes"] == 5 * (store.bytes_per_block() + store.residual_bytes_per_block())
        assert s["kv_bytes"] > s["dynamic_cache_bytes"]  # a short request gains nothing from int8 with the window


def test_pool_held_elsewhere_raises_and_gives_everything_back(model):
    """A PrefixCache's allocator shared with other code: when the rest of the pool is held there, a request that
    fits the pool alone cannot start; the error says so, and the engine holds nothing afterwards."""
    alloc = kvcache.BlockAllocator(8, 8)
    engine = kvcache.Engine(model, prefix_cache=kvcache.PrefixCache(alloc), page_size=8)
    held = alloc.allocate(6)                          # someone else's pages
    with pytest.raises(kvcache.OutOfBlocksError, match=r"prompts\[0\]: its 45 tokens to compute do not fit the pool "
                                                       r"even alone: 2 of its 8 pages are free"):
        engine.generate([_prompts()[0]], max_new_tokens=2)
    assert alloc.num_free == 2 and engine.store.prefix_cache.stats()["locked_nodes"] == 0
    alloc.free(held)
    assert len(engine.generate([_prompts()[0]], max_new_tokens=2)[0].tokens) == 2


def test_bounded_pool_alone_request_evicts_its_own_matched_prefix(model):
    """A request that needs the whole pool, whose cached prefix ends inside a page: the shared partial page is
    copied before writing, which takes one more block than the pool has unless the request's own prefix, locked
    since its lookup, may be evicted (its sequence keeps those pages)."""
    prompt = _prompts()[0][:42]                       # 5 pages of 8 + 2 tokens: cached in 6 blocks
    engine = kvcache.Engine(model, page_size=8, max_tokens=64)
    engine.generate([prompt], max_new_tokens=1)
    assert engine.store.prefix_cache.stats()["device_blocks"] == 6
    longer = prompt + [7, 8, 9]                       # matches all 42 tokens; 45 + 19 = 64 slots: every block
    got = engine.generate([longer], max_new_tokens=20)[0]
    assert got.cached_tokens == 42
    free = kvcache.Engine(model, prefix_cache=False, page_size=8)
    assert got.tokens == free.generate([longer], max_new_tokens=20)[0].tokens
    engine.store.prefix_cache.check()
    assert engine.store.prefix_cache.stats()["locked_nodes"] == 0


def test_engine_progress_bar_counts_requests_and_turns_off(model, capsys, monkeypatch):
    engine = kvcache.Engine(model, page_size=4)
    prompts = _prompts()[:3]
    monkeypatch.setattr(kvcache.engine, "PROGRESS_DELAY_S", 60.0)
    engine.generate(prompts, max_new_tokens=2)              # done before the bar's delay: no bar
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(kvcache.engine, "PROGRESS_DELAY_S", 0.0)
    engine.generate(prompts, max_new_tokens=2)
    err = capsys.readouterr().err
    assert "kvcache.Engine" in err and f"/{len(prompts)} " in err   # the bar counts requests out of 3
    quiet = engine.generate(prompts, max_new_tokens=2, progress=False)
    assert capsys.readouterr().err == "" and len(quiet) == 3
    engine.generate(prompts[:1], max_new_tokens=2)        # one prompt: no bar
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kv_format, residual", [("int8", None), ("int8", 4)])
def test_sliding_window_model_with_a_full_precision_window(kv_format, residual):
    """A sliding-window model (Mistral) in the Engine with a quantized format and its full-precision window (the
    default): the kernel cannot take a window across the two pools, and the fallback read the PagedCache's own
    step plan, which the Engine's packed steps do not make: AttributeError on the first step. It now attends in
    PyTorch over the packed history with the window on top of the rows' mask: the tokens of HF generate on a
    PagedCache of the same format, request by request."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=256)).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (20, 13, 30)]
    results = kvcache.Engine(model, kv_format=kv_format, residual_length=residual, page_size=4,
                             max_batch=3).generate(prompts, max_new_tokens=8, progress=False)
    model.set_attn_implementation("sdpa")
    for prompt, res in zip(prompts, results):
        cache = kvcache.PagedCache(config=model.config, kv_format=kv_format, residual_length=residual, page_size=4)
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=8, do_sample=False,
                                  pad_token_id=0)
        assert want[0, len(prompt):].tolist() == res.tokens


def test_engines_given_one_prefix_cache_share_its_pages(model):
    """A PrefixCache's block ids hold K/V in one store's pools: a second Engine given the cache shares that store
    (its prefix hits read the pages the first engine wrote, so its tokens are the model's), and what cannot share
    them is refused before any work, leaving the cache and the first engine as they were."""
    cache = kvcache.PrefixCache(kvcache.BlockAllocator(64, 4))
    a = kvcache.Engine(model, page_size=4, prefix_cache=cache)
    b = kvcache.Engine(model, page_size=4, prefix_cache=cache)
    assert a.store is b.store is cache.store
    system = _prompts()[0][:29]
    a.generate([system + [40]], max_new_tokens=6)
    got = b.generate([system + [50]], max_new_tokens=6)[0]
    assert got.cached_tokens == 29 and got.tokens == _reference(model, system + [50], 6)

    with pytest.raises(ValueError, match=r"prefix_cache: its pages are stored as model dtype.*asks for int8"):
        kvcache.Engine(model, page_size=4, prefix_cache=cache, kv_format="int8")
    with pytest.raises(ValueError, match=r"prefix_cache: its pages are 4 tokens .* not page_size=8"):
        kvcache.Engine(model, page_size=8, prefix_cache=cache)
    torch.manual_seed(1)
    narrow = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match=r"prefix_cache: .*another model geometry: this model has k_dim=8 \(its "
                                         r"pages: 16\), v_dim=8 \(its pages: 16\)"):
        kvcache.Engine(narrow, page_size=4, prefix_cache=cache)
    with pytest.raises(ValueError, match=r"prefix_cache: this PrefixCache already caches the pages of another "
                                         r"PagedStore.*store=prefix_cache.store"):
        kvcache.PagedCache(model.config, prefix_cache=cache, page_size=4)
    assert kvcache.PagedCache(model.config, store=cache.store).store is a.store

    # other weights under the same default namespace (no name_or_path: the class name) would hit a's prefixes
    torch.manual_seed(5)
    other = transformers.LlamaForCausalLM(model.config).eval()
    with pytest.raises(ValueError, match=r"namespace: this model has no name_or_path.*'LlamaForCausalLM'"):
        kvcache.Engine(other, page_size=4, prefix_cache=cache)
    c = kvcache.Engine(other, page_size=4, prefix_cache=cache, namespace=kvcache.Namespace(model="other"))
    mine = c.generate([system + [60]], max_new_tokens=6)[0]
    assert mine.cached_tokens == 0 and mine.tokens == _reference(other, system + [60], 6)

    assert cache.store is a.store  # the refusals changed nothing
    again = a.generate([system + [80]], max_new_tokens=6)[0]
    assert again.cached_tokens == 29 and again.tokens == _reference(model, system + [80], 6)
    cache.check()


def _llama(seed: int, name: str = "", **kw):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), **kw})
    config._name_or_path = name
    return transformers.LlamaForCausalLM(config).eval()


def test_a_paged_cache_on_an_engines_store_reads_only_its_own_models_prefixes():
    """Regression: a PagedCache keyed its prefixes by the store's namespace whatever its model, so a PagedCache for
    model B on model A's Engine store loaded A's K/V (B then generated other tokens, or failed in its forward
    when its heads differed); two unnamed models of one class sharing a store through PagedCaches did the same."""
    a, b = _llama(0, "org/model-a"), _llama(1, "org/model-b")
    prompt = _prompts()[0]
    engine = kvcache.Engine(a, page_size=8, prefix_cache=True)
    engine.generate([prompt], max_new_tokens=2)
    ids = torch.tensor([prompt])
    assert kvcache.PagedCache(config=a.config, store=engine.store).load_prefix(ids) == len(prompt) - 1  # A: shared
    cache = kvcache.PagedCache(config=b.config, store=engine.store)
    assert cache.load_prefix(ids) == 0
    b.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = b.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == _reference(b, prompt, 4)
    with pytest.raises(ValueError, match=r"store: its pools hold pages of another model geometry: this model has "
                                         r"kv_heads=4 \(its pages: 2\)"):
        kvcache.PagedCache(config=_llama(2, "org/model-c", num_key_value_heads=4).config, store=engine.store)
    # two unnamed models of one class: one default namespace (the config's class), so the second is refused
    x, y = _llama(3), _llama(4)
    cx = kvcache.PagedCache(config=x.config, prefix_cache=True, page_size=8)
    with torch.no_grad():
        x(ids, past_key_values=cx)
    cx.save_prefix(ids)
    cy = kvcache.PagedCache(config=y.config, store=cx.store)
    with pytest.raises(ValueError, match=r"namespace: this model has no name_or_path, so its prefixes would be cached "
                                         r"under 'LlamaConfig'.*namespace=kvcache.Namespace"):
        cy.load_prefix(ids)
    assert kvcache.PagedCache(config=y.config, store=cx.store, namespace=kvcache.Namespace(model="y")).load_prefix(ids) == 0
    assert kvcache.PagedCache(config=x.config, store=cx.store).load_prefix(ids) == len(prompt) - 1
    with pytest.raises(TypeError, match=r"namespace='y' must be a kvcache.Namespace"):
        kvcache.PagedCache(config=y.config, namespace="y")


def test_a_format_the_heads_cannot_take_is_refused_before_anything_is_bound():
    """Regression: Engine(kv_format="int4") on head_dim 16 failed only at the first generate, and the given
    PrefixCache stayed bound to that dead Engine's int4 store (a corrected Engine on it was refused)."""
    narrow = _llama(0, "org/narrow", hidden_size=64, num_attention_heads=4)  # head_dim 16
    cache = kvcache.PrefixCache(kvcache.BlockAllocator(64, 8))
    for fmt, match in (("int4", r"K rows: head_dim=16 must be a multiple of 32 for int4"),
                       ("kivi2", r"K rows: head_dim=16 must be a multiple of 32 for kivi2"),
                       ("int8(hadamard)", None)):
        if match is None:  # 16 is a power of two: the Hadamard rotation takes it
            kvcache.Engine(narrow, kv_format=fmt, page_size=8)
            continue
        with pytest.raises(ValueError, match=match):
            kvcache.Engine(narrow, kv_format=fmt, prefix_cache=cache, page_size=8)
        assert cache.store is None
    engine = kvcache.Engine(narrow, kv_format="int8", prefix_cache=cache, page_size=8)
    assert engine.generate([_prompts()[0]], max_new_tokens=2)[0].tokens


def test_explain_changes_nothing(model):
    """Regression: explain() matched through the tree, so it counted hits (the prefix cache's hit rate rose with
    every explain) and made the prefix the most recently used (explain(A) got B evicted instead of A)."""
    prompts = _prompts()
    engine = kvcache.Engine(model, page_size=8, prefix_cache=True)
    engine.generate(prompts[:2], max_new_tokens=2)
    tree = engine.store.prefix_cache
    before, refs = tree.stats(), sorted(tree.block_references())
    for _ in range(3):
        assert engine.explain(prompts[0])["local_tokens"] == tree.cached_length(prompts[0], engine.namespace) > 0
    after = tree.stats()
    assert (after["lookups"], after["hit_tokens"]) == (before["lookups"], before["hit_tokens"])
    assert sorted(tree.block_references()) == refs
    # the recency order is untouched: the least recently used prefix (prompt 0's branch) goes first
    order = {}
    for explained in (False, True):
        e = kvcache.Engine(model, page_size=8, prefix_cache=True)
        e.generate([prompts[0]], max_new_tokens=1)
        e.generate([prompts[1][40:] + [5] * 8], max_new_tokens=1)  # another prefix, used later
        if explained:
            e.explain(prompts[0])
        e.store.prefix_cache.evict(1)
        order[explained] = e.explain(prompts[0])["local_tokens"]
    assert order[True] == order[False]


def test_tpot_leaves_out_requests_of_one_token(model):
    """Regression: a request that stopped at its first token has no time between tokens; counted as 0 it
    pulled the mean time per output token down (4x with three of four such requests)."""
    prompts = _prompts()
    first = {i: _reference(model, p, 6) for i, p in enumerate(prompts)}
    # a long request whose tokens avoid another prompt's first token, which then ends that prompt at once
    long_i, stop_i = next((a, b) for a in first for b in first if a != b and first[b][0] not in first[a])
    engine = kvcache.Engine(model, page_size=8)
    out = engine.generate([prompts[long_i], prompts[stop_i]], max_new_tokens=6, eos_token_id=first[stop_i][0])
    assert [len(r.tokens) for r in out] == [6, 1]
    assert engine.stats()["tpot_s"] == pytest.approx(out[0].time_per_output_token) and out[0].time_per_output_token > 0
    engine.generate([prompts[stop_i]], max_new_tokens=6, eos_token_id=first[stop_i][0])
    assert engine.stats()["tpot_s"] == 0.0                 # only one-token requests: no time between tokens


def test_requests_sharing_a_cached_prefix_are_batched_together(model):
    """Cache-aware scheduling holds back a request only for what it would share with a prompt prefilled in the
    same step and not cached yet: once the shared system prompt is cached, 32 requests over max_batch=16 run in
    two batches (as without a prefix cache), not one admission per step, and give the same tokens."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 128, (20,), generator=g).tolist()
    prompts = [system + torch.randint(3, 128, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 7, (32,), generator=g)]
    plain = kvcache.Engine(model, page_size=4, max_batch=16, prefix_cache=False)
    expected = [r.tokens for r in plain.generate(prompts, max_new_tokens=4)]
    assert plain.stats()["steps"] == 8  # 2 batches x 4 tokens
    engine = kvcache.Engine(model, page_size=4, max_batch=16)
    first = engine.generate(prompts, max_new_tokens=4)
    # the first call: the system prompt is computed once (the others wait a step for it), then hit 31 times
    assert engine.stats()["prefix_hit_tokens"] >= 31 * 20 and engine.stats()["steps"] <= 9
    second = engine.generate(prompts, max_new_tokens=4)
    s = engine.stats()
    assert s["steps"] == 8 and s["prefix_hit_tokens"] == sum(len(p) - 1 for p in prompts)
    assert [r.tokens for r in first] == [r.tokens for r in second] == expected


def test_max_tokens_conflicting_with_a_given_prefix_cache_is_refused(model):
    """A given PrefixCache's allocator is the pool (its size fixed when it was made, maybe shared): a max_tokens for
    another number of pages used to be ignored without a word, and a request too long for the pool was then refused
    quoting a max_tokens the caller never gave. Now the conflict is refused naming both sizes, before the cache is
    bound; a max_tokens of the allocator's pages is taken, and the too-long message names the real bound."""
    cache = kvcache.PrefixCache(kvcache.BlockAllocator(8, 8))
    with pytest.raises(ValueError, match=r"max_tokens=1000 \(125 pages of 8 tokens\) conflicts with prefix_cache, whose "
                                         r"allocator is the pool: 8 pages \(64 tokens\)"):
        kvcache.Engine(model, page_size=8, prefix_cache=cache, max_tokens=1000)
    with pytest.raises(ValueError, match=r"max_tokens=32 \(4 pages of 8 tokens\) conflicts .* 8 pages \(64 tokens\)"):
        kvcache.Engine(model, page_size=8, prefix_cache=cache, max_tokens=32)
    assert cache.store is None  # refused before the cache was bound to a store

    long = _prompts()[0] + [9] * 30                  # 75 tokens: more than the 64 the allocator holds
    plain = kvcache.Engine(model, page_size=8, prefix_cache=cache)  # no max_tokens: the allocator bounds the pool
    with pytest.raises(kvcache.OutOfBlocksError, match=r"more than the pool's 8 \(the size of prefix_cache's "
                                                       r"allocator\); nothing was run"):
        plain.generate([long], max_new_tokens=2)
    same = kvcache.Engine(model, page_size=8, prefix_cache=cache, max_tokens=60)  # 8 pages too: agrees
    assert same.store is plain.store and same.store.allocator is cache.allocator
    with pytest.raises(kvcache.OutOfBlocksError, match=r"more than the pool's 8 \(max_tokens=60, in whole pages\)"):
        same.generate([long], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"max_tokens=128 \(16 pages of 8 tokens\) conflicts"):  # bound cache too
        kvcache.Engine(model, page_size=8, prefix_cache=cache, max_tokens=128)
    assert cache.store is plain.store and len(same.generate([_prompts()[0]], max_new_tokens=2)[0].tokens) == 2

    grows = kvcache.Engine(model, page_size=8)  # a store whose pool grows: a second Engine cannot bound it
    with pytest.raises(ValueError, match=r"max_tokens=64 conflicts with prefix_cache, whose pool .* grows without a "
                                         r"bound"):
        kvcache.Engine(model, page_size=8, prefix_cache=grows.store.prefix_cache, max_tokens=64)


@pytest.mark.parametrize("name, bad", [
    ("page_size", 2.0), ("page_size", True), ("page_size", "8"), ("max_tokens", 16.5), ("max_tokens", 64.0),
    ("max_tokens", True), ("max_batch", True), ("max_batch", torch.tensor(2.0)), ("residual_length", 1.5),
    ("residual_sink_tokens", 4.0), ("chunk_tokens", 256.0),
])
def test_engine_refuses_sizes_that_are_not_ints(model, name, bad):
    """A float size was truncated (page_size=2.0 made pages of 2, max_tokens=16.5 a pool of 16.5 tokens' pages) and a
    bool read as 1; now a TypeError names the argument and the value, before a given PrefixCache is bound."""
    cache = kvcache.PrefixCache(kvcache.BlockAllocator(8, 8))
    # (with max_tokens, a given cache's allocator sizes the pool: only its own store is tried)
    for prefix_cache in (True,) if name == "max_tokens" else (True, cache):
        with pytest.raises(TypeError, match=rf"^{name}={re.escape(repr(bad))} must be an int \(.*\), not "
                                            rf"{type(bad).__name__}$"):
            kvcache.Engine(model, kv_format="int8", **{"page_size": 8, "prefix_cache": prefix_cache, name: bad})
    assert cache.store is None


def test_engine_takes_numpy_and_torch_integer_sizes(model):
    """Integer scalars of numpy / torch are taken as Python ints: a np.uint8(8) of sink tokens used to reach the
    store's page arithmetic as is, where -np.uint8(8) wraps around: 225 sink pages instead of 1."""
    engine = kvcache.Engine(model, page_size=np.int64(8), max_tokens=torch.tensor(64), max_batch=np.int32(2),
                            kv_format="int8", residual_length=torch.tensor(16, dtype=torch.int32),
                            residual_sink_tokens=np.uint8(8))
    store = engine.store
    assert (store.page_size, store.allocator.num_blocks, engine.max_batch) == (8, 8, 2)
    assert type(store.page_size) is int and type(engine.max_batch) is int
    assert (store.residual.window, store.residual.sink_pages) == (16, 1)
    with pytest.raises(ValueError, match=r"page_size=0 must be >= 1"):
        kvcache.Engine(model, page_size=0)
    with pytest.raises(ValueError, match=r"max_tokens=0 must be >= 1"):
        kvcache.Engine(model, max_tokens=np.int64(0))
    with pytest.raises(TypeError, match=r"prefix_cache='yes' must be True, False or a kvcache.PrefixCache"):
        kvcache.Engine(model, prefix_cache="yes")


@pytest.mark.parametrize("kw, error, pattern", [
    (dict(top_k=1.5, do_sample=True), TypeError, r"top_k=1\.5 must be an int"),
    (dict(top_k=1.5), TypeError, r"top_k=1\.5 must be an int"),          # greedy: it was ignored
    (dict(top_k=True, do_sample=True), TypeError, r"top_k=True must be an int"),
    (dict(top_k=torch.tensor(3.0), do_sample=True), TypeError, r"top_k=tensor\(3\.\) must be an int"),
    (dict(temperature="0.7", do_sample=True), TypeError, r"temperature='0\.7' must be a number"),
    (dict(temperature=None, do_sample=True), TypeError, r"temperature=None must be a number"),
    (dict(temperature=float("nan"), do_sample=True), ValueError, r"temperature=nan must be > 0 when sampling, and "
                                                                  r"finite"),
    (dict(temperature=float("inf"), do_sample=True), ValueError, r"temperature=inf must be > 0"),
    (dict(do_sample="yes"), TypeError, r"do_sample='yes' must be True or False, not str"),
    (dict(do_sample=None), TypeError, r"do_sample=None must be True or False"),
    (dict(seed=1.5, do_sample=True), TypeError, r"seed=1\.5 must be an int"),
    (dict(seed=2 ** 64, do_sample=True), ValueError, r"seed=18446744073709551616 must be in \[-2\*\*63, 2\*\*64\)"),
    (dict(progress="no"), TypeError, r"progress='no' must be True or False"),
    (dict(max_new_tokens=3.0), TypeError, r"max_new_tokens=3\.0 must be an int"),
    (dict(max_new_tokens=True), TypeError, r"max_new_tokens=True must be an int"),
])
def test_engine_refuses_bad_sampling_arguments_before_any_work(model, kw, error, pattern):
    """top_k=1.5 used to pass the up-front checks and fail in torch.topk after the first forward (or be ignored
    when greedy); the others were read by truthiness or failed late. Now each is refused naming the argument and
    its value, before a forward, a lookup or a page."""
    engine = kvcache.Engine(model, page_size=4)
    prompts = [_prompts()[0], _prompts()[1]]
    engine.generate(prompts[:1], max_new_tokens=2)
    before = (engine.store.allocator.num_free, engine.store.prefix_cache.stats())
    forwards = []
    hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(error, match=pattern):
            engine.generate(prompts, **{"max_new_tokens": 4, **kw})
    finally:
        hook.remove()
    assert forwards == [] and (engine.store.allocator.num_free, engine.store.prefix_cache.stats()) == before


def test_engine_takes_numpy_and_torch_sampling_arguments(model):
    """Integer scalars of numpy / torch are ints: the same tokens as the plain ints (np.int64 seeds used to fail in
    torch.Generator.manual_seed)."""
    engine = kvcache.Engine(model, prefix_cache=False)
    prompts = _prompts()[:2]
    want = [r.tokens for r in engine.generate(prompts, max_new_tokens=4, do_sample=True, top_k=10, seed=3,
                                              temperature=0.7)]
    got = engine.generate(prompts, max_new_tokens=torch.tensor(4), do_sample=np.bool_(True), top_k=np.int64(10),
                          seed=np.int64(3), temperature=np.float64(0.7), progress=np.bool_(False))
    assert [r.tokens for r in got] == want


def test_engine_refuses_a_disk_path_that_is_a_file(model, tmp_path):
    """disk= naming an existing regular file (or a path below one) raised the tier's raw FileExistsError /
    NotADirectoryError after a given PrefixCache had been bound; now a ValueError names disk and the path, and the
    cache is left unbound (a bad remote= URL too)."""
    file = tmp_path / "prefixes.bin"
    file.write_bytes(b"not a directory")
    cache = kvcache.PrefixCache(kvcache.BlockAllocator(64, 8))
    with pytest.raises(ValueError, match=rf"disk={re.escape(repr(str(file)))} must be a directory \(made if missing\), "
                                         rf"but it is a file"):
        kvcache.Engine(model, page_size=8, prefix_cache=cache, disk=file)
    below = file / "tier"
    with pytest.raises(ValueError, match=rf"disk={re.escape(repr(str(below)))} must be a directory .*, but "
                                         rf"{re.escape(repr(str(file)))} exists and is not a directory"):
        kvcache.Engine(model, page_size=8, prefix_cache=cache, disk=str(below))
    with pytest.raises(ValueError, match=r"remote='http://localhost' must be a redis:// URL"):
        kvcache.Engine(model, page_size=8, prefix_cache=cache, remote="http://localhost")
    # the same refusal where a disk tier is made without an Engine: on the tree, or by hand
    with pytest.raises(ValueError, match=rf"disk={re.escape(repr(str(file)))} must be a directory"):
        kvcache.PrefixCache(kvcache.BlockAllocator(64, 8), disk=file, chunk_tokens=16)
    with pytest.raises(ValueError, match=rf"disk={re.escape(repr(str(below)))} must be a directory"):
        kvcache.tiers.DiskTier(below)
    assert cache.store is None and file.read_bytes() == b"not a directory"
    engine = kvcache.Engine(model, page_size=8, prefix_cache=cache, disk=tmp_path / "tier", chunk_tokens=np.int64(16),
                            namespace=kvcache.Namespace(model="test-llama"))  # (tiers need a named model)
    assert (tmp_path / "tier").is_dir() and engine.tiers.chunk_tokens == 16
    engine.close()


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("opt", marks=pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="transformers 4.x's OPT builds its own 4-D mask, which the Engine refuses"))])
def test_engine_refuses_positions_past_learned_position_embeddings(arch):
    """A model with a learned table of positions (GPT-2's wpe, OPT's embed_positions with its offset of 2) has no
    row past max_position_embeddings: a request that would feed such a position is refused before any work,
    naming the prompt and the limit (it failed inside the embedding, mid-batch); one that ends at the last row
    runs, and a rotary model (which extrapolates) is not limited."""
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=24,
                                         bos_token_id=1, eos_token_id=2)
        model = transformers.GPT2LMHeadModel(config).eval()
    else:
        config = transformers.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        ffn_dim=64, max_position_embeddings=24, word_embed_proj_dim=32,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = transformers.OPTForCausalLM(config).eval()
    engine = kvcache.Engine(model, page_size=4, prefix_cache=False)
    prompts = [[5] * 6, list(range(3, 23))]
    with pytest.raises(ValueError, match=r"prompts\[1\]: 20 tokens \+ max_new_tokens=6 feed positions up to 24, but "
                                         r"\w+ learns position embeddings for positions 0 to 23 "
                                         r"\(config.max_position_embeddings=24\); nothing was run"):
        engine.generate(prompts, max_new_tokens=6, eos_token_id=[], progress=False)
    assert engine.store.allocator.num_free == engine.store.allocator.num_blocks
    out = engine.generate(prompts, max_new_tokens=5, eos_token_id=[], progress=False)  # last fed position: 23
    assert [len(r.tokens) for r in out] == [5, 5]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model.generate(torch.tensor([prompts[1]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out[1].tokens == want[0, 20:].tolist()


def test_engine_does_not_limit_rotary_models_to_max_position_embeddings(model):
    assert model.config.max_position_embeddings < 4096
    small = transformers.LlamaConfig(**{**model.config.to_dict(), "max_position_embeddings": 16})
    rotary = transformers.LlamaForCausalLM(small).eval()
    out = kvcache.Engine(rotary, prefix_cache=False).generate([list(range(3, 23))], max_new_tokens=3, eos_token_id=[],
                                                               progress=False)
    assert len(out[0].tokens) == 3


def test_engine_interrupted_anywhere_keeps_no_lock_page_or_mark(model, monkeypatch):
    """Ctrl-C inside generate: between a request's admission (its prefix locked, pages taken) and its joining the
    running batch, the lock and pages were never given back (a bounded pool shrank for good, clear() freed nothing);
    inside a layer's "kvcache" attention, the layer's not-yet-attended mark stayed and the next call raised a false
    "attended with another implementation". Now nothing outlives the interrupted call: the next one gives a fresh
    engine's tokens and the pool is all free after clear()."""
    prompts = _prompts()[:3]
    want = [r.tokens for r in kvcache.Engine(model, page_size=8).generate(prompts, max_new_tokens=4, progress=False)]
    engine = kvcache.Engine(model, page_size=8, max_tokens=8 * 40)
    engine.generate(prompts[:1], max_new_tokens=2, progress=False)  # a cached prefix for the next admission to lock
    tree, alloc = engine.store.prefix_cache, engine.store.allocator
    take = kvcache.Engine._take_pages

    def interrupted(self, req):
        monkeypatch.setattr(kvcache.Engine, "_take_pages", take)
        raise KeyboardInterrupt

    monkeypatch.setattr(kvcache.Engine, "_take_pages", interrupted)
    assert engine.stats()["requests"] == 1
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, max_new_tokens=4, progress=False)
    assert engine.stats() == {}  # (the previous call's figures read as this one's)
    assert tree.stats()["locked_nodes"] == 0
    assert alloc.num_blocks - alloc.num_free == len(tree.block_references())
    tree.check()

    mapping = transformers.AttentionInterface._global_mapping  # where transformers finds the "kvcache" attention
    attend = mapping["kvcache"]

    def interrupted_attention(*args, **kwargs):
        mapping["kvcache"] = attend
        raise KeyboardInterrupt

    monkeypatch.setitem(mapping, "kvcache", interrupted_attention)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, max_new_tokens=4, progress=False)
    assert [r.tokens for r in engine.generate(prompts, max_new_tokens=4, progress=False)] == want
    tree.clear()
    assert alloc.num_free == alloc.num_blocks


def test_engine_interrupted_while_recomputing_a_preempted_prompt_publishes_none_of_it(model, monkeypatch, tmp_path):
    """A bounded pool preempts a request; the forward that recomputes its prompt (and its tokens) stops in layer 1.
    generate()'s cleanup published that request's prompt pages to the disk tier, which only layer 0 had written:
    a later engine on the directory loaded them and generated other tokens (zeros, or stale page contents). Pages
    are published only once a forward has written the whole prompt; the later engine's tokens are a fresh one's."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (40, 36, 33, 45)]
    kw = dict(max_tokens=112, namespace=kvcache.Namespace(model="recompute-test"))  # 7 pages of 16: preemptions
    gen = dict(max_new_tokens=16, eos_token_id=[], progress=False)
    want = [r.tokens for r in kvcache.Engine(model, **kw).generate(prompts, **gen)]
    forward = kvcache.Engine._forward
    stopped = []

    def stop_recompute(self, running, stats):
        if not stopped and any(r.result.tokens and len(r.pending) > 1 for r in running):  # a preempted one resumes
            def stop(module, args):
                handle.remove()
                stopped.append(True)
                raise KeyboardInterrupt

            handle = model.model.layers[1].register_forward_pre_hook(stop)
        return forward(self, running, stats)

    monkeypatch.setattr(kvcache.Engine, "_forward", stop_recompute)
    engine = kvcache.Engine(model, disk=tmp_path, chunk_tokens=16, **kw)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, **gen)
    assert stopped
    engine.close()
    monkeypatch.setattr(kvcache.Engine, "_forward", forward)
    later = kvcache.Engine(model, disk=tmp_path, chunk_tokens=16, **kw)
    assert [r.tokens for r in later.generate(prompts, **gen)] == want
    later.close()


def test_engine_short_of_a_pool_held_elsewhere_names_the_request():
    """A shared PrefixCache whose pages another cache holds: a running request that cannot take its next page even
    alone was refused with the allocator's own message (no request, no hint); it now names the request and the
    likely cause, as admission's refusal does, and the engine works once the other cache lets go."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = transformers.LlamaForCausalLM(config).eval()
    alloc = kvcache.BlockAllocator(12, 4)
    tree = kvcache.PrefixCache(alloc)
    engine = kvcache.Engine(model, prefix_cache=tree, page_size=4)
    prompts = [torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    hog = kvcache.PagedCache(config=model.config, store=tree.store)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 30)), past_key_values=hog)
    with pytest.raises(kvcache.OutOfBlocksError, match=r"prompts\[\d\]: its next 1 token\(s\) do not fit the pool even "
                                                        r"alone: 0 of its 12 pages are free .*in use elsewhere"):
        engine.generate(prompts, max_new_tokens=12, progress=False)
    assert tree.stats()["locked_nodes"] == 0
    hog.free()
    tree.clear()
    assert alloc.num_free == alloc.num_blocks
    want = [r.tokens for r in kvcache.Engine(model, page_size=4, max_tokens=48).generate(prompts, max_new_tokens=12,
                                                                                          progress=False)]
    assert [r.tokens for r in engine.generate(prompts, max_new_tokens=12, progress=False)] == want


def _tiny(kind: str, **extra):
    torch.manual_seed(0)
    if kind == "gptj":
        config = transformers.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256,
                                         **extra)
        return transformers.GPTJForCausalLM(config).eval()
    if kind == "codegen":
        config = transformers.CodeGenConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                            n_positions=256, n_ctx=256, **extra)
        return transformers.CodeGenForCausalLM(config).eval()
    if kind == "gpt_bigcode":
        config = transformers.GPTBigCodeConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, **extra)
        return transformers.GPTBigCodeForCausalLM(config).eval()
    if kind == "falcon_alibi":
        config = transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           alibi=True, **extra)
        return transformers.FalconForCausalLM(config).eval()
    if kind == "bloom":
        config = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, **extra)
        return transformers.BloomForCausalLM(config).eval()
    config = transformers.GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, window_size=8,
                                       max_position_embeddings=256, attention_types=[[["global", "local"], 1]],
                                       **extra)
    return transformers.GPTNeoForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["gptj", "codegen", "gpt_bigcode"])
def test_engine_greedy_equals_hf_generate_on_models_that_ignore_logits_to_keep(kind):
    """transformers 4.x's GPT-J, CodeGen and GPTBigCode take logits_to_keep into **kwargs and return every position's
    logits: request i sampled from packed position i (the first prompt's early tokens), silently other tokens.
    The engine now picks each request's last position itself when a model returns them all."""
    model = _tiny(kind, bos_token_id=1, eos_token_id=2)
    prompts = [p[:n] for p, n in zip(_prompts(), (17, 23, 9))]
    results = kvcache.Engine(model, page_size=8, prefix_cache=False).generate(prompts, max_new_tokens=5,
                                                                              eos_token_id=[], progress=False)
    model.set_attn_implementation("eager")
    for p, r in zip(prompts, results):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)
        assert r.tokens == want[0, len(p):].tolist()


def test_engine_selects_the_last_positions_when_a_forward_returns_every_logit(model, monkeypatch):
    """The same on this transformers: a forward that drops logits_to_keep (as 4.x's models above do) gives the
    tokens of one that honours it."""
    prompts = _prompts()[:3]
    want = [r.tokens for r in kvcache.Engine(model, prefix_cache=False).generate(prompts, max_new_tokens=4,
                                                                               progress=False)]
    forward = type(model).forward

    def every_logit(self, *args, logits_to_keep=0, **kwargs):
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", every_logit)
    engine = kvcache.Engine(model, prefix_cache=False)
    got = engine.generate(prompts, max_new_tokens=4, progress=False)
    assert [r.tokens for r in got] == want


@pytest.mark.parametrize("kind, why", [
    ("falcon_alibi", "its ALiBi position biases are built from the attention mask's positions"),
    ("bloom", "its ALiBi position biases"),
    ("gpt_neo_local", "its local attention layers apply their window over the packed row's positions"),
])
def test_engine_refuses_models_whose_masks_the_packed_step_cannot_carry(kind, why):
    """ALiBi models crashed inside transformers on the packed step, GPT-Neo's local layers gave other tokens in a
    batch (its window over the packed row's positions): refused when the Engine is made, naming the way that
    works (model.generate with a PagedCache, which runs them exactly)."""
    model = _tiny(kind)
    with pytest.raises(ValueError, match=f"kvcache.Engine does not run {type(model).__name__}: {why}.*use "
                                         f"model.generate with kvcache.PagedCache"):
        kvcache.Engine(model)


def _rope(kind: str) -> dict:
    if int(transformers.__version__.split(".")[0]) < 5:  # (4.x: rope_scaling, Phi-3's with exactly three fields)
        return {"rope_scaling": {"rope_type": kind, "factor": 4.0} if kind == "dynamic" else
                {"type": kind, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}}
    params = {"rope_type": kind, "factor": 4.0} if kind == "dynamic" else {
        "rope_type": kind, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8, "original_max_position_embeddings": 32}
    return {"rope_parameters": {**params, "rope_theta": 10000.0}}


@pytest.mark.parametrize("kind, why", [
    ("dynamic", "its rotary frequencies depend on the longest position of a forward \\(rope_type 'dynamic'\\)"),
    ("longrope", "its rotary frequencies depend on the longest position of a forward \\(rope_type 'longrope'\\)"),
    ("diffllama", "its attention splits V after the cache"),
    ("jetmoe", "its attention does not go through transformers' attention interface"),
])
def test_engine_refuses_models_whose_attention_the_packed_step_would_change(kind, why):
    """Found by an outside audit: rotary frequencies picked from a forward's largest position (dynamic NTK, Phi-3's
    longrope) changed a short request's tokens when a long one shared its packed step; DiffLlama's split of V after
    the cache gave other tokens from the first; JetMoe's attention never reaches the kernel (a false error about the
    attention implementation). Refused when the Engine is made."""
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if kind == "dynamic":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, max_position_embeddings=32,
                                                                       **_rope(kind)))
    elif kind == "longrope":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, max_position_embeddings=256,
                                                                     original_max_position_embeddings=32,
                                                                     pad_token_id=0, **_rope(kind)))
    elif kind == "diffllama":
        model = transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(**common))
    else:
        model = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
            intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256))
    with pytest.raises(ValueError, match=f"kvcache.Engine does not run {type(model).__name__}: {why}"):
        kvcache.Engine(model.eval())
