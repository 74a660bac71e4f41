"""kvcache.PagedCache on hybrid models (linear-attention / Mamba layers beside attention layers): transformers'
own state layers for the layers that are not attention, pages for those that are. Exact against DynamicCache in
every generate mode transformers allows for them; what cannot work refuses with a clear error."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import kvcache  # noqa: E402
from generate_support import MODES, generate as _generate, inputs as _inputs, max_diff as _max_diff  # noqa: E402

if not hasattr(transformers.cache_utils, "LinearAttentionCacheLayerMixin"):
    pytest.skip(f"hybrid cache layers (LinearAttentionLayer) need transformers >= 5.5; installed "
                f"{transformers.__version__}", allow_module_level=True)

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*generation flags.*")


def _model(name: str):
    torch.manual_seed(0)
    if name == "qwen3_next":  # gated delta-net (linear attention) layers + full attention layers
        config = transformers.Qwen3NextConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            max_position_embeddings=256,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
        return transformers.Qwen3NextForCausalLM(config).eval()
    if name == "jamba":  # Mamba layers + attention layers
        config = transformers.JambaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False, max_position_embeddings=256)
        return transformers.JambaForCausalLM(config).eval()
    raise ValueError(name)


@pytest.fixture(scope="module", params=["qwen3_next", "jamba"])
def model(request):
    return _model(request.param)


# transformers refuses assisted generation (prompt lookup, assistant models) for stateful models; contrastive
# search lives on the Hub in 5.x
HYBRID_MODES = {name: mode for name, mode in MODES.items() if name != "prompt_lookup"}


@pytest.mark.parametrize("mode", list(HYBRID_MODES))
@pytest.mark.parametrize("impl", ["eager", "sdpa", "kvcache"])
def test_generate_matches_dynamic_cache(model, impl, mode):
    kwargs = HYBRID_MODES[mode](*_inputs())
    ref = _generate(model, DynamicCache(config=model.config), "eager" if impl == "eager" else "sdpa", **kwargs)
    cache = kvcache.PagedCache(config=model.config)
    got = _generate(model, cache, impl, **kwargs)
    assert torch.equal(ref.sequences, got.sequences)
    if impl == "kvcache":  # our kernel: same math, other sums
        assert _max_diff(ref, got) <= 1e-5
    else:
        assert _max_diff(ref, got) == 0.0
    types = model.config.layer_types
    assert [isinstance(layer, kvcache.PagedLayer) for layer in cache.layers] == [t == "full_attention" for t in types]
    assert sorted(cache.store.pools) == [i for i, t in enumerate(types) if t == "full_attention"]
    assert cache.get_seq_length() == got.sequences.shape[1] - 1
    assert cache.stats()["state_bytes"] > 0


def test_assisted_generation_is_refused_as_transformers_does(model):
    ids = _inputs()[0][:1]
    with pytest.raises(ValueError, match="stateful"):
        _generate(model, kvcache.PagedCache(config=model.config), "sdpa", input_ids=ids, prompt_lookup_num_tokens=3,
                  do_sample=False)


def _prefill(model, cache, ids):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits


def test_crop_refuses_a_recurrent_state_and_leaves_the_cache_untouched(model):
    ids = _inputs()[0][:1]
    cache = kvcache.PagedCache(config=model.config)
    _prefill(model, cache, ids)
    blocks = [s.blocks.tolist() for s in cache.rows]
    with pytest.raises(ValueError, match=r"crop\(-3\): layer 0 .*recurrent"):
        cache.crop(-3)
    assert cache.get_seq_length() == 12 and [s.blocks.tolist() for s in cache.rows] == blocks
    cache.crop(0)  # nothing to remove: allowed


@pytest.mark.parametrize("impl", ["eager", "sdpa", "kvcache"])
def test_a_full_pool_refuses_before_any_state_moves(model, impl):
    """max_tokens too small for the next forward: OutOfBlocksError, and the states keep the tokens they had (the
    state layers run before the first attention layer; eager/sdpa allocated the pages there, so the states took
    the refused tokens and every later forward was off DynamicCache's)."""
    model.set_attn_implementation(impl)
    try:
        torch.manual_seed(1)
        a, b, c = (torch.randint(2, 128, (1, n)) for n in (20, 20, 4))
        cache, ref = kvcache.PagedCache(config=model.config, max_tokens=32), DynamicCache(config=model.config)
        with torch.no_grad():
            model(a, past_key_values=cache), model(a, past_key_values=ref)
            held = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, kvcache.PagedLayer)]
            states = lambda: [t.clone() for i in held for t in (cache.get_conv_state(i), cache.get_recurrent_state(i))]
            before = states()
            assert held and len(before) == 2 * len(held)
            with pytest.raises(kvcache.OutOfBlocksError):
                model(b, past_key_values=cache)
            assert cache.get_seq_length() == 20
            assert all(torch.equal(x, y) for x, y in zip(states(), before))
            got, want = model(c, past_key_values=cache).logits, model(c, past_key_values=ref).logits
        assert (got - want).abs().max() <= (1e-5 if impl == "kvcache" else 0.0)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("impl", ["eager", "sdpa", "kvcache"])
@pytest.mark.parametrize("why", ["full pool", "head_dim the format refuses"])
def test_a_refused_first_forward_leaves_the_states_empty(model, impl, why):
    """Regression: on a fresh cache the pages come with the first attention layer's K/V, after the state layers
    ran; a refused first forward (OutOfBlocksError, or a quantized format the layer's width refuses) kept the
    refused prompt's states, and the retry's logits were 3e-2 (Qwen3-Next) off a fresh cache's."""
    model.set_attn_implementation(impl)
    try:
        torch.manual_seed(2)
        long, short = torch.randint(2, 128, (1, 40)), torch.randint(2, 128, (1, 6))
        kw = dict(max_tokens=16) if why == "full pool" else dict(kv_format="int4", residual_length=0)
        cache = kvcache.PagedCache(config=model.config, **kw)
        with torch.no_grad():
            with pytest.raises(kvcache.OutOfBlocksError if why == "full pool" else ValueError):
                model(long, past_key_values=cache)
            assert cache.get_seq_length() == 0 and cache.stats()["state_bytes"] == 0
            if why == "full pool":
                got = model(short, past_key_values=cache).logits
                want = model(short, past_key_values=kvcache.PagedCache(config=model.config, **kw)).logits
                assert torch.equal(got, want)
    finally:
        model.set_attn_implementation("sdpa")


class _Stop(Exception):
    pass


def _stop_in(model, layer: int):
    """Raises _Stop at the next forward of decoder layer ``layer`` (Ctrl-C or an exception part-way)."""
    def stop(module, args, kwargs):
        handle.remove()
        raise _Stop

    handle = model.model.layers[layer].register_forward_pre_hook(stop, with_kwargs=True)


def _trailing_state_model():
    """Qwen3-Next whose last layer is a linear-attention one (as Jamba's last layers are Mamba): a forward can stop
    after its last paged layer, with the pages holding its tokens and a state not."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=256,
        layer_types=["linear_attention", "full_attention", "linear_attention"])
    return transformers.Qwen3NextForCausalLM(config).eval()


def _stops(model):
    """Where a forward can stop: before the first paged layer (after a state layer), before the last paged layer,
    after the last paged layer (before a trailing state layer, where the model has one)."""
    kinds = [isinstance(layer, kvcache.PagedLayer) for layer in kvcache.PagedCache(config=model.config).layers]
    paged = [i for i, k in enumerate(kinds) if k]
    stops = {"before the first attention layer": paged[0]}
    if len(paged) > 1:
        stops["before the last attention layer"] = paged[-1]
    if paged[-1] + 1 < len(kinds):
        stops["after the last attention layer"] = paged[-1] + 1
    return stops


def _each_stop(model, impl, ids):
    """(model, where, layer, a fresh cache's logits of ids) for every place a forward can stop (_stops), on the
    fixture's model and, for Qwen3-Next, also one whose last layer is a state layer, attending with ``impl``.
    The caller runs under torch.no_grad()."""
    models = [model] + ([_trailing_state_model()] if isinstance(model, transformers.Qwen3NextForCausalLM) else [])
    for m in models:
        m.set_attn_implementation(impl)
        try:
            want = m(ids, past_key_values=kvcache.PagedCache(config=m.config)).logits
            for where, layer in _stops(m).items():
                yield m, where, layer, want
        finally:
            m.set_attn_implementation("sdpa")


@pytest.mark.parametrize("impl", ["eager", "sdpa", "kvcache"])
def test_a_first_forward_stopped_part_way_starts_the_cache_anew(model, impl):
    """A prompt's forward stopped in any layer (Ctrl-C, an exception): the states and pages of the layers it
    reached are undone (it was the first forward, so nothing before it is lost), and running the prompt again
    gives a fresh cache's logits bit for bit. Stopped before the first attention layer, the states had moved and
    no page had: the retry ran on states that had taken the prompt already (2e-2 off on Qwen3-Next, silently)."""
    ids = torch.randint(2, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for m, where, layer, want in _each_stop(model, impl, ids):
            cache = kvcache.PagedCache(config=m.config)
            _stop_in(m, layer)
            with pytest.raises(_Stop):
                m(ids, past_key_values=cache)
            assert cache.get_seq_length() == 0, where
            assert torch.equal(m(ids, past_key_values=cache).logits, want), where


@pytest.mark.parametrize("impl", ["sdpa", "kvcache"])
def test_a_later_forward_stopped_part_way_is_refused_until_reset(model, impl):
    """A decode step stopped in any layer: the states it reached took its token and cannot give it back, so the
    next forward is refused (a RuntimeError asking for reset()) wherever the stop was. Stopped before the first
    attention layer or after the last, the pages all agreed and the next step ran on the wrong states, silently.
    After reset() the cache runs a prompt as a fresh one does."""
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    step = torch.randint(2, 128, (1, 1), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for m, where, layer, want in _each_stop(model, impl, ids):
            cache = kvcache.PagedCache(config=m.config)
            m(ids, past_key_values=cache)
            _stop_in(m, layer)
            with pytest.raises(_Stop):
                m(step, past_key_values=cache)
            with pytest.raises(RuntimeError, match=r"stopped part-way .* cannot be rolled back; cache.reset\(\)"):
                m(step, past_key_values=cache)
            cache.reset()
            assert torch.equal(m(ids, past_key_values=cache).logits, want), where


def test_deepcopy_continues_independently(model):
    ids = _inputs()[0][:1]
    cache = kvcache.PagedCache(config=model.config)
    _prefill(model, cache, ids[:, :8])
    other = copy.deepcopy(cache)
    a = _prefill(model, cache, ids[:, 8:])
    b = _prefill(model, other, ids[:, 8:])
    ref_cache = DynamicCache(config=model.config)
    _prefill(model, ref_cache, ids[:, :8])
    ref = _prefill(model, ref_cache, ids[:, 8:])
    assert torch.equal(a, ref) and torch.equal(b, ref)
    assert cache.get_seq_length() == other.get_seq_length() == 12


def test_reset_empties_pages_and_states(model):
    ids = _inputs()[0][:1]
    cache = kvcache.PagedCache(config=model.config)
    first = _prefill(model, cache, ids)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.rows == []
    assert torch.equal(_prefill(model, cache, ids), first)


@pytest.mark.parametrize("empty", ["reset", "free"])
def test_after_reset_or_free_a_prompt_may_have_another_batch_size(model, empty):
    """The states kept the last batch's size (zeroed in place): a 1-row prompt after a 2-row one failed in
    transformers' state update ("Sizes of tensors must match")."""
    ids = _inputs()[0]
    cache = kvcache.PagedCache(config=model.config)
    _prefill(model, cache, ids[:2])
    getattr(cache, empty)()
    assert cache.stats()["state_bytes"] == 0
    assert torch.equal(_prefill(model, cache, ids[:1]), _prefill(model, kvcache.PagedCache(config=model.config), ids[:1]))


def test_prefix_reuse_and_the_engine_refuse_clearly(model):
    ids = _inputs()[0][:1]
    prefix = kvcache.PrefixCache(kvcache.BlockAllocator(64, 16))
    with pytest.raises(ValueError, match=r"prefix_cache: \w+Config cannot share prefixes .*hybrid model's"):
        kvcache.PagedCache(config=model.config, prefix_cache=True)
    with pytest.raises(ValueError, match=r"prefix_cache: "):
        kvcache.PagedCache(config=model.config, prefix_cache=prefix)
    assert prefix.store is None  # (refused before it was bound to a store)
    # a store with a prefix cache, shared (made for another model): save_prefix / load_prefix refuse
    cache = kvcache.PagedCache(config=model.config, store=kvcache.PagedCache(prefix_cache=True).store)
    _prefill(model, cache, ids)
    with pytest.raises(ValueError, match="save_prefix is not supported for a hybrid model: layer 0"):
        cache.save_prefix(ids)
    with pytest.raises(ValueError, match="load_prefix is not supported for a hybrid model"):
        kvcache.PagedCache(config=model.config, store=cache.store).load_prefix(ids)
    impl = model.config._attn_implementation
    layer = "LinearAttentionLayer" if model.config.model_type == "qwen3_next" else "Layer"  # (the class's name)
    with pytest.raises(ValueError, match=rf"kvcache.Engine does not run hybrid models: layer 0 of .* is a \w*{layer}"):
        kvcache.Engine(model, page_size=4)  # at construction, not at the first generate
    assert model.config._attn_implementation == impl


@pytest.mark.parametrize("kwargs, has", [({}, "no layer"), ({"num_layers": 4}, "a paged attention layer")])
def test_a_cache_made_without_the_config_names_what_is_missing(model, kwargs, has):
    """Without config= the cache has no state layers: the model's first state lookup failed inside transformers
    (an IndexError, or "Cannot get conv state for non linear attention layer 0 of type PagedLayer")."""
    cache = kvcache.PagedCache(**kwargs)
    with pytest.raises(ValueError, match=rf"layer 0 of the model asked the cache for its conv state .* this PagedCache "
                                         rf"has {has} there: .* PagedCache\(config=model.config\)"):
        with torch.no_grad():
            model(_inputs()[0][:1], past_key_values=cache)
    assert cache.get_seq_length() == 0 and not cache.store.pools


def test_a_layer_with_state_and_attention_is_refused():
    config = transformers.Qwen3NextConfig(num_hidden_layers=2, layer_types=["hybrid", "full_attention"])
    with pytest.raises(ValueError, match="layer 0 of Qwen3NextConfig is of type 'hybrid'"):
        kvcache.PagedCache(config=config)
