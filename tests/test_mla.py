"""MLA models (DeepSeek-V2/V3) on kvcache: transformers hands the cache their latents, kv_nope
[b, 1, s, kv_lora_rank] as the key and the rotated k_rot [b, 1, s, qk_rope_head_dim] as the value. The pages
hold rows of those two widths (PageLayout.v_head_dim), so the models run unchanged with eager/sdpa attention:
bit-identical to DynamicCache in full precision in every generate mode, close with int8 latents, prefix-shared
through the Engine. With the "kvcache" attention the layers attend through the absorbed kernel over the latent
pages (kvcache.hf_mla, kvcache.mla_attention): DynamicCache's greedy tokens, and the history never expanded."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import kvcache  # noqa: E402
from generate_support import MODES, generate as _generate, inputs as _inputs, max_diff as _max_diff  # noqa: E402

if int(transformers.__version__.split(".")[0]) < 5:  # the CPU-only environment pins 4.57
    pytest.skip(f"transformers {transformers.__version__} hands DeepSeek's cache per-head K (nope + rope) and V, "
                "not the latents these tests page (transformers >= 5)", allow_module_level=True)
for _name in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
    if not hasattr(transformers, _name):
        pytest.skip(f"{_name} is not in transformers {transformers.__version__}", allow_module_level=True)

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*generation flags.*")

_MLA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, max_position_embeddings=256)


def _model(name: str, kv_lora_rank: int = 16, rope: int = 8):
    torch.manual_seed(0)
    if name == "deepseek_v3":
        config = transformers.DeepseekV3Config(q_lora_rank=32, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope,
                                               qk_nope_head_dim=16, v_head_dim=16, **_MLA)
        return transformers.DeepseekV3ForCausalLM(config).eval()
    if name == "deepseek_v2":  # no query LoRA (DeepSeek-V2-Lite), complex rotary embedding
        config = transformers.DeepseekV2Config(q_lora_rank=None, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope,
                                               qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1, **_MLA)
        return transformers.DeepseekV2ForCausalLM(config).eval()
    raise ValueError(name)


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def model(request):
    return _model(request.param)


def test_cache_geometry_reads_the_latent_widths(model):
    assert kvcache.hf_cache.cache_geometry(model.config) == (1, 16, 8)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_generate_matches_dynamic_cache_bit_for_bit(model, impl, mode):
    kwargs = MODES[mode](*_inputs())
    ref = _generate(model, DynamicCache(config=model.config), impl, **kwargs)
    cache = kvcache.PagedCache(config=model.config, page_size=4)
    got = _generate(model, cache, impl, **kwargs)
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref, got) == 0.0  # bit-identical logits: the pages hand back exactly the latents stored
    assert got.past_key_values is cache and cache.get_seq_length() == got.sequences.shape[1] - 1
    # the pages hold the latents, not expanded K/V: one kv head, rows of kv_lora_rank and qk_rope_head_dim
    pool = cache.store.pools[0]
    assert (pool.num_kv_heads, pool.head_dim, pool.v_head_dim) == (1, 16, 8)
    assert tuple(pool.k.shape[1:]) == (1, 4, 16) and tuple(pool.v.shape[1:]) == (1, 4, 8)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_assisted_decoding_with_an_assistant_model(model, impl):
    assistant = _model("deepseek_v3")  # a draft model of the same vocabulary (its own cache: DynamicCache)
    ids = _inputs()[0][:1]
    ref = _generate(model, DynamicCache(config=model.config), impl, input_ids=ids, assistant_model=assistant,
                    do_sample=False)
    got = _generate(model, kvcache.PagedCache(config=model.config, page_size=4), impl, input_ids=ids,
                    assistant_model=assistant, do_sample=False)
    assert torch.equal(ref.sequences, got.sequences)


def test_pages_hold_the_latents_dynamic_cache_holds(model):
    ids, _ = _inputs()
    ref, cache = DynamicCache(config=model.config), kvcache.PagedCache(config=model.config, page_size=4)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model(ids[:1], past_key_values=ref, use_cache=True)
        model(ids[:1], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == ref.get_seq_length() == 12
    for layer in range(model.config.num_hidden_layers):
        k, v = cache._dense(layer, torch.float32)
        assert torch.equal(k, ref.layers[layer].keys) and torch.equal(v, ref.layers[layer].values)
    s = cache.stats()
    assert s["dynamic_cache_bytes"] == 2 * 12 * (16 + 8) * 4  # layers x tokens x (latent + rope) x fp32
    assert s["bytes"] == s["blocks"] * 2 * 4 * (16 + 8) * 4   # 3 pages of 4 tokens, both layers


@pytest.mark.parametrize("impl", ["eager", "sdpa", "kvcache"])
def test_deepcopy_and_multi_turn(model, impl):
    """A prompt cache deep-copied per request (pages shared copy-on-write), and one cache across turns."""
    ids = _inputs()[0][:1]
    model.set_attn_implementation(impl)
    prompt_cache = kvcache.PagedCache(config=model.config, page_size=4)
    with torch.no_grad():
        model(ids[:, :7], past_key_values=prompt_cache)
    blocks_before = prompt_cache.rows[0].blocks.clone()
    ref = _generate(model, DynamicCache(config=model.config), impl, input_ids=ids, do_sample=False)
    for _ in range(2):
        got = _generate(model, copy.deepcopy(prompt_cache), impl, input_ids=ids, do_sample=False)
        assert torch.equal(ref.sequences, got.sequences) and _max_diff(ref, got) <= 1e-5
    assert torch.equal(prompt_cache.rows[0].blocks, blocks_before) and prompt_cache.get_seq_length() == 7
    cache, ref_cache = kvcache.PagedCache(config=model.config, page_size=4), DynamicCache(config=model.config)
    conversation = ref_conversation = ids
    for _ in range(3):
        conversation = _generate(model, cache, impl, input_ids=conversation, do_sample=False).sequences
        ref_conversation = _generate(model, ref_cache, impl, input_ids=ref_conversation, do_sample=False).sequences
        assert torch.equal(conversation, ref_conversation)
        conversation = torch.cat([conversation, ids[:, :3]], 1)
        ref_conversation = torch.cat([ref_conversation, ids[:, :3]], 1)


def test_int8_latents_run_and_stay_close(model):
    ids, mask = _inputs()
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, attention_mask=mask,
                    do_sample=False)
    for fmt, residual in (("int8", 0), ("int8", 4), ("k=int8,v=fp8_e4m3", 0)):
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt, page_size=4, residual_length=residual)
        got = _generate(model, cache, "sdpa", input_ids=ids, attention_mask=mask, do_sample=False)
        assert cache.store.pools[0].k.dtype == torch.int8
        diff = _max_diff(ref, got)
        scale = max(x.abs().max().item() for x in ref.logits)
        assert 0 < diff <= 0.05 * scale, (fmt, residual, diff, scale)  # quantized, and close


def test_int4_and_kivi_latents_need_widths_of_multiples_of_32():
    model = _model("deepseek_v3")  # latents of 16 and 8 dims
    ids, _ = _inputs()
    for fmt, side, name, width, kind in (("int4", "K", "head_dim", 16, "int4"), ("k=int8,v=int4", "V", "v_head_dim", 8, "int4"),
                                         ("kivi4", "K", "head_dim", 16, "kivi4")):
        cache = kvcache.PagedCache(config=model.config, kv_format=fmt, page_size=4, residual_length=0)
        model.set_attn_implementation("sdpa")
        # (the widths named as the model's: "head_dim" was the latents' kv_lora_rank here)
        with pytest.raises(ValueError, match=rf"layer 0: the model hands the cache K rows of 16 and V rows of 8 values "
                                             rf"\(MLA: kv_lora_rank and qk_rope_head_dim\); {side} rows: {name}={width} "
                                             rf"must be a multiple of 32 for {kind}"):
            with torch.no_grad():
                model(ids[:1], past_key_values=cache, use_cache=True)
        assert not cache.store.pools  # nothing allocated
    wide = _model("deepseek_v3", kv_lora_rank=64, rope=32)  # widths int4 and KIVI can take
    ref = _generate(wide, DynamicCache(config=wide.config), "sdpa", input_ids=ids[:1], do_sample=False)
    diffs = {}
    for fmt in ("int8", "int4", "kivi4"):
        cache = kvcache.PagedCache(config=wide.config, kv_format=fmt, page_size=4, residual_length=4)
        got = _generate(wide, cache, "sdpa", input_ids=ids[:1], do_sample=False)
        pool = cache.store.pools[0]
        assert (pool.head_dim, pool.v_head_dim, pool.k.shape[-1]) == (64, 32, 64 // pool.format.k.dims_per_code)
        assert all(bool(torch.isfinite(x).all()) for x in got.logits)
        diffs[fmt] = _max_diff(ref, got)
    assert 0 < diffs["int8"] < min(diffs["int4"], diffs["kivi4"]), diffs  # 4-bit latents: quantized, coarser


class _Expansions:
    """Counts what the model's MLA modules expand through kv_b_proj (expand_kv) and what the absorbed kernel runs."""

    def __init__(self, monkeypatch, model):
        self.lengths: list[int] = []
        self.kernel_calls = 0
        cls = type(model.model.layers[0].self_attn)
        expand, absorbed = cls.expand_kv, kvcache.hf_mla.mla_attention

        def counting_expand(module, kv_nope, k_rot):
            self.lengths.append(kv_nope.shape[2])
            return expand(module, kv_nope, k_rot)

        def counting_absorbed(*args, **kwargs):
            self.kernel_calls += 1
            return absorbed(*args, **kwargs)

        monkeypatch.setattr(cls, "expand_kv", counting_expand)
        monkeypatch.setattr(kvcache.hf_mla, "mla_attention", counting_absorbed)


@pytest.mark.parametrize("mode", list(MODES))
def test_absorbed_kvcache_attention_gives_dynamic_cache_tokens(model, mode, monkeypatch):
    """The "kvcache" attention on latent pages: greedy tokens of DynamicCache, logits within fp32 rounding, and
    the history is never expanded: after the prompt, the module expands only each forward's new tokens."""
    kwargs = MODES[mode](*_inputs())
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", **kwargs)
    seen = _Expansions(monkeypatch, model)
    cache = kvcache.PagedCache(config=model.config, page_size=4)
    try:
        got = _generate(model, cache, "kvcache", **kwargs)
    finally:
        model.set_attn_implementation("sdpa")
    if mode != "sampling":  # (sampling draws from logits that differ by rounding: tokens may part ways)
        assert torch.equal(ref.sequences, got.sequences)
    scale = max(x.abs().max().item() for x in ref.logits)
    assert _max_diff(ref, got) <= 1e-5 * max(1.0, scale)
    layers = model.config.num_hidden_layers
    prompt = kwargs["input_ids"].shape[1]
    assert seen.kernel_calls >= layers * 6  # every decode step of every layer went through the absorbed kernel
    first = seen.lengths[0]  # the prompt's forward (prompt lookup: + its 3 candidates): SDPA on its own expansion
    assert seen.lengths[:layers] == [first] * layers and prompt <= first <= prompt + 3
    assert max(seen.lengths[layers:]) <= 4  # later forwards expand their own (1 or few, speculative) tokens only


@pytest.mark.parametrize("fmt, residual", [("int8", None), ("int8", 0), ("k=int8,v=fp8_e4m3", 0)])
def test_absorbed_attention_on_quantized_latents_matches_the_dense_path(model, fmt, residual):
    """int8 latents (with the default full-precision window and without): the absorbed kernel dequantizes as it
    reads, the sdpa path gathers dequantized latents and expands them: same tokens, logits within rounding."""
    ids, mask = _inputs()
    kw = dict(config=model.config, kv_format=fmt, page_size=4, residual_length=residual)
    dense = _generate(model, kvcache.PagedCache(**kw), "sdpa", input_ids=ids, attention_mask=mask, do_sample=False)
    try:
        fused = _generate(model, kvcache.PagedCache(**kw), "kvcache", input_ids=ids, attention_mask=mask,
                          do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(dense.sequences, fused.sequences)
    scale = max(x.abs().max().item() for x in dense.logits)
    assert _max_diff(dense, fused) <= 1e-5 * max(1.0, scale)


def test_output_attentions_with_kvcache_attention_are_eagers(model):
    """output_attentions=True with the "kvcache" attention on latent pages returns eager attention's weights over the
    expanded history, as for other models (it returned none, with a warning), prefill and decode, left-padded."""
    ids, mask = _inputs()
    runs = []
    for impl, cache in (("eager", DynamicCache(config=model.config)), ("kvcache", kvcache.PagedCache(config=model.config))):
        model.set_attn_implementation(impl)
        try:
            with torch.no_grad():
                first = model(ids, attention_mask=mask, past_key_values=cache, output_attentions=True)
                step = model(first.logits[:, -1:].argmax(-1), past_key_values=cache, output_attentions=True,
                             attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1))
        finally:
            model.set_attn_implementation("sdpa")
        runs.append((first, step))
    for eager, ours in zip(*runs):
        assert len(ours.attentions) == len(eager.attentions) == model.config.num_hidden_layers
        for a, b in zip(eager.attentions, ours.attentions):
            assert a is not None and b is not None and a.shape == b.shape
            real = mask.bool()[:, -a.shape[2]:] if a.shape[2] > 1 else torch.ones(a.shape[0], 1, dtype=torch.bool)
            assert (a - b).abs()[real.unsqueeze(1).expand(-1, a.shape[1], -1)].max() <= 1e-6  # (pad queries differ)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_latents_as_wide_as_the_rotary_part_are_mla_too(name):
    """kv_lora_rank == qk_rope_head_dim: the latents were recognized by their two widths, so equal widths went
    untagged and the "kvcache" attention (PagedCache and Engine) attended to each forward's own tokens only:
    different tokens, logits off by ~0.8, silently. The config says MLA, whatever the widths."""
    model = _model(name, kv_lora_rank=16, rope=16)
    ids, mask = _inputs()
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", **kwargs)
    try:
        got = _generate(model, kvcache.PagedCache(config=model.config, page_size=4), "kvcache", **kwargs)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref, got) <= 1e-5 * max(1.0, max(x.abs().max().item() for x in ref.logits))
    prompts = [ids[0].tolist(), ids[1, 5:].tolist()]
    results = kvcache.Engine(model, page_size=4, max_batch=2).generate(prompts, max_new_tokens=6, progress=False)
    for prompt, res in zip(prompts, results):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), past_key_values=DynamicCache(config=model.config),
                                  max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert want[0, len(prompt):].tolist() == res.tokens


@pytest.mark.parametrize("fmt", [None, "int8"])
@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_gradients_through_latent_pages_equal_dynamic_cache(impl, fmt):
    """Two recorded forwards (a prompt, then its continuation) on latent pages: every parameter gets
    DynamicCache's gradient, bit for bit. With the "kvcache" attention the continuation used to go through the
    absorbed kernel, which has no backward, and the attention's inputs (q / kv projections) got no gradient,
    silently; while autograd records, the module's expansion of the gathered latents runs instead."""
    first, second = (torch.randint(0, 128, (2, n), generator=torch.Generator().manual_seed(n)) for n in (7, 3))
    for name in ("deepseek_v3", "deepseek_v2"):
        grads = []
        for make in (lambda m: DynamicCache(config=m.config),
                     lambda m: kvcache.PagedCache(config=m.config, kv_format=fmt, page_size=4)):
            model = _model(name)
            cache = make(model)
            model.set_attn_implementation(impl if isinstance(cache, kvcache.PagedCache) else "sdpa")
            model(first, past_key_values=cache)
            model(second, past_key_values=cache).logits.logsumexp(-1).sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        missing = [n for n in grads[0] if (grads[0][n] is None) != (grads[1][n] is None)]
        assert not missing, missing
        worst = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0] if grads[0][n] is not None)
        assert worst == 0.0, (name, worst)


def test_hadamard_latents_fall_back_to_the_expanded_history(model, monkeypatch):
    ids, mask = _inputs()
    kw = dict(config=model.config, kv_format="int8(hadamard)", page_size=4, residual_length=0)
    dense = _generate(model, kvcache.PagedCache(**kw), "sdpa", input_ids=ids, attention_mask=mask, do_sample=False)
    seen = _Expansions(monkeypatch, model)
    try:
        fused = _generate(model, kvcache.PagedCache(**kw), "kvcache", input_ids=ids, attention_mask=mask,
                          do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    assert seen.kernel_calls == 0  # mla_attention refuses rotated pools: the module's own expansion instead
    assert torch.equal(dense.sequences, fused.sequences) and _max_diff(dense, fused) <= 1e-4


def test_prefix_cache_reuses_latent_pages(model):
    ids, _ = _inputs()
    prompt = ids[:1]
    first = kvcache.PagedCache(config=model.config, page_size=4, prefix_cache=True)
    _generate(model, first, "sdpa", input_ids=prompt[:, :9], do_sample=False)
    first.save_prefix(prompt[:, :9])
    second = kvcache.PagedCache(config=model.config, store=first.store)
    assert second.load_prefix(prompt) == 9
    got = _generate(model, second, "sdpa", input_ids=prompt, do_sample=False)
    ref = _generate(model, DynamicCache(config=model.config), "sdpa", input_ids=prompt, do_sample=False)
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref, got) <= 1e-5  # the prompt's last 3 tokens in their own forward: same math, other sums


@pytest.mark.parametrize("kv_format", [None, "int8"])
def test_engine_with_prefix_sharing_gives_dynamic_cache_tokens(model, kv_format):
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, 128, (11,), generator=g).tolist()
    prompts = [system + torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 6, 1, 9)]
    engine = kvcache.Engine(model, kv_format=kv_format, page_size=4, max_batch=2, prefix_cache=True)
    before = model.config._attn_implementation
    results = engine.generate(prompts, max_new_tokens=6, progress=False)
    assert model.config._attn_implementation == before  # the engine's attention choice is undone
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] >= 8  # later prompts reuse the system prompt's latent pages
    assert stats["dynamic_cache_bytes"] > 0
    model.set_attn_implementation("sdpa")
    for prompt, res in zip(prompts, results):
        # full precision: DynamicCache's tokens; int8: those of a PagedCache of the same format under HF generate
        cache = DynamicCache(config=model.config) if kv_format is None else kvcache.PagedCache(
            config=model.config, kv_format=kv_format, page_size=4)
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        assert ref[0, len(prompt):].tolist() == res.tokens
    alloc = engine.store.allocator
    assert alloc.num_blocks - alloc.num_free == len(set(engine.store.prefix_cache.block_references()))


@pytest.mark.parametrize("kv_format", [None, "int8"])
def test_bounded_engine_preempts_over_latent_pages(model, kv_format):
    """Short prompts that grow past a pool of 8 pages: preempted requests compute their latents again and end
    with the tokens of an engine with an unbounded pool."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 12, 7, 9, 4, 10)]
    want = [r.tokens for r in kvcache.Engine(model, kv_format=kv_format, page_size=8, prefix_cache=False)
            .generate(prompts, max_new_tokens=20, progress=False)]
    engine = kvcache.Engine(model, kv_format=kv_format, page_size=8, max_tokens=64, max_batch=6)
    assert [r.tokens for r in engine.generate(prompts, max_new_tokens=20, progress=False)] == want
    assert engine.stats()["preemptions"] >= 1
    alloc = engine.store.allocator
    assert alloc.num_blocks - alloc.num_free == len(set(engine.store.prefix_cache.block_references()))


@pytest.mark.parametrize("kv_format, residual", [(None, None), ("int8", 0), ("int8", None)])
def test_disk_tier_stores_and_loads_latent_pages(model, tmp_path, kv_format, residual):
    # int8 with residual_length=0: sealed pages (codes and scales); with the default window: open pages
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (16,), generator=g).tolist() + [5, 6, 7]]
    kw = dict(kv_format=kv_format, residual_length=residual, page_size=4, chunk_tokens=8,
              namespace=kvcache.Namespace(model=type(model).__name__ + "-tiny"))  # made in code: the tiers need a name
    expected = [r.tokens for r in kvcache.Engine(model, **kw).generate(prompts, max_new_tokens=4, progress=False)]
    a = kvcache.Engine(model, disk=tmp_path, **kw)
    a.generate(prompts, max_new_tokens=4, progress=False)
    a.close()
    b = kvcache.Engine(model, disk=tmp_path, **kw)
    assert [r.tokens for r in b.generate(prompts, max_new_tokens=4, progress=False)] == expected
    s = b.stats()
    assert s["disk_hit_tokens"] == 16 and s["bad_blobs"] == 0
    b.close()
    import json
    description = json.loads(next(tmp_path.glob("*/namespace.json")).read_text())
    assert (description["num_kv_heads"], description["head_dim"], description["v_head_dim"]) == (1, 16, 8)


def _dsa_model(model_type: str = "deepseek_v32"):
    """A tiny DeepSeek-V3.2 (or GLM-MoE-DSA): MLA latents plus the indexer of DeepSeek sparse attention, whose top 4
    tokens (of 12-20) are all each query attends to, so a wrong indexer key changes the logits."""
    try:
        config = transformers.AutoConfig.for_model(
            model_type, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            index_topk=4, index_head_dim=16, index_n_heads=2, **_MLA)
    except (KeyError, ValueError) as e:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}: {e}")
    assert "indexed_attention" in config.layer_types
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_deepseek_sparse_attention_matches_dynamic_cache(model_type, impl, mode):
    """DeepSeek-V3.2 caches its indexer's keys through update_indexer beside the latents (PagedLayer had no such
    method: transformers raised at the first forward). The layers keep them as DynamicCache's indexed layers do,
    through beam reorders, crops and padding: the same tokens, bit-identical logits, the same indexer keys."""
    model = _dsa_model(model_type)
    kwargs = MODES[mode](*_inputs())
    ref_cache = DynamicCache(config=model.config)
    ref = _generate(model, ref_cache, impl, **kwargs)
    cache = kvcache.PagedCache(config=model.config, page_size=4)
    got = _generate(model, cache, impl, **kwargs)
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref, got) == 0.0
    for mine, theirs in zip(cache.layers, ref_cache.layers):
        assert torch.equal(mine.indexer_keys, theirs.indexer_keys)
    assert cache.stats()["indexer_bytes"] == sum(layer.indexer_keys.nbytes for layer in ref_cache.layers) > 0
    copied = copy.deepcopy(cache)  # a copy shares the (never written in place) indexer keys; reset drops its own
    copied.reset()
    assert copied.layers[0].indexer_keys is None and torch.equal(cache.layers[0].indexer_keys,
                                                                 ref_cache.layers[0].indexer_keys)


def test_deepseek_sparse_attention_is_refused_where_the_kvcache_attention_would_run_it():
    """The "kvcache" kernel reads every token of the pages: it has no place for the indexer's choice (eager and sdpa
    get it as a mask). A cache made for that attention, an Engine, a model switched to it, and prefix reuse (the
    indexer keys are not paged) are refused by name, a given prefix cache left unbound."""
    model = _dsa_model()
    fused = copy.deepcopy(model.config)
    fused._attn_implementation = "kvcache"
    with pytest.raises(ValueError, match=r"PagedCache: layer 0 of DeepseekV32Config is of type 'indexed_attention'"):
        kvcache.PagedCache(config=fused)
    prefix = kvcache.PrefixCache(kvcache.BlockAllocator(16, 4))
    with pytest.raises(ValueError, match=r"Engine .*'indexed_attention'"):
        kvcache.Engine(model, page_size=4, prefix_cache=prefix)
    assert prefix.store is None
    ids = _inputs()[0][:1]
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"prefix_cache: \w+Config cannot share prefixes .*indexer keys"):
        kvcache.PagedCache(config=model.config, page_size=4, prefix_cache=True)
    cache = kvcache.PagedCache(config=model.config, store=kvcache.PagedCache(page_size=4, prefix_cache=True).store)
    with pytest.raises(ValueError, match=r"load_prefix is not supported for DeepSeek sparse attention"):
        cache.load_prefix(ids)
    made_for_sdpa = kvcache.PagedCache(config=model.config, page_size=4)
    model.set_attn_implementation("kvcache")  # switched after the cache was made
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=r"does not run DeepSeek sparse attention"):
            model(ids, past_key_values=made_for_sdpa)
        with torch.no_grad(), pytest.raises(ValueError, match=r"does not run DeepSeek sparse attention"):
            model(ids, use_cache=False)  # (no cache: SDPA would have ignored the indexer's choice too)
    finally:
        model.set_attn_implementation("sdpa")
