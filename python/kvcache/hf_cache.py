"""The transformers ``Cache``: :class:`PagedCache` (and its per-layer view :class:`PagedLayer`), usable as
``past_key_values`` of Hugging Face models; the pages live in a :class:`kvcache.PagedStore`."""

from __future__ import annotations

import copy
import numbers
import operator
import warnings
import weakref

import torch

from .formats import CacheFormat
from . import _html, hf_mla, residual as res
from .padding import PENDING_CACHE, PENDING_PADDING, Padding, leading_pads
from .prefix import BlockAllocator, Namespace, OutOfBlocksError, PrefixCache, Sequence
from .step import StepPlan, plan_step
from ._args import integer_arg
from .store import PagedStore

__all__ = ["PagedCache", "PagedLayer", "ATTENTION_NAME", "cache_geometry"]

ATTENTION_NAME = "kvcache"  # the attention (and mask) implementation registered with transformers

try:  # transformers is optional for the rest of kvcache
    from transformers import PretrainedConfig
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError:  # pragma: no cover - exercised only without transformers
    Cache, CacheLayerMixin, PretrainedConfig = object, object, object
try:  # the state layers of hybrid models (linear attention, conv, Mamba): transformers 5.5+
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin
except ImportError:
    DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin = None, None

# layer types of a hybrid config whose cache is HF's own state layer (no per-token K/V to page)
STATE_LAYER_TYPES = ("linear_attention", "conv", "dummy", "moe", "mlp")
# layer types (config.layer_types) of layers that write no K/V of their own: states, or an MLP / MoE only
_LAYER_TYPES_WITHOUT_KV = STATE_LAYER_TYPES + ("mamba", "dense", "sparse")


def is_mla_config(config) -> bool:
    """Whether ``config`` is an MLA model's (``kv_lora_rank`` and ``qk_rope_head_dim``): in transformers >= 5 its
    layers hand the cache latents. (Not decided by the widths: a latent as wide as the rotary part is MLA too.)"""
    return bool(getattr(config, "kv_lora_rank", None) and getattr(config, "qk_rope_head_dim", None))


def _check_store_geometry(store: PagedStore, config) -> None:
    """A shared store's pools hold rows of one model geometry: a model of another is refused here, naming the
    store (its first forward failed inside the append op: "key.shape[1] = 4 must equal num_kv_heads = 2")."""
    if is_mla_config(config):  # (transformers 4.x expands the latents: the pools' rows depend on the version)
        return
    if getattr(config, "new_decoder_architecture", False) or getattr(config, "multi_query", False):
        return  # (Falcon: K/V broadcast to other head counts before the cache sees them)
    try:
        heads, k_dim, v_dim = cache_geometry(config)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return
    mine = dict(kv_heads=heads, k_dim=k_dim, v_dim=v_dim)
    # (every pool's: a model whose layers differ in width, Gemma 4's global layers say, matches one of them)
    held = [dict(kv_heads=p.num_kv_heads, k_dim=p.head_dim, v_dim=p.v_head_dim or p.head_dim)
            for p in store.pools.values()]
    if store.engine_geometry:
        held.append({key: store.engine_geometry.get(key) for key in mine})
    if held and mine not in held:
        bound = held[0]
        diff = [f"{k}={mine[k]} (its pages: {v})" for k, v in bound.items() if v is not None and mine[k] != v]
        raise ValueError(f"store: its pools hold pages of another model geometry: this model has {', '.join(diff)}; "
                         f"give this cache a store of its own")


def cache_geometry(config) -> tuple[int, int, int]:
    """(kv heads, K row width, V row width) of what a model hands its cache per layer and token.

    MLA models (DeepSeek-V2/V3: ``kv_lora_rank`` and ``qk_rope_head_dim`` in the config) hand it their latents,
    one head of ``kv_lora_rank`` dims as the key and one of ``qk_rope_head_dim`` dims as the value; other models
    their K/V heads of ``head_dim`` dims."""
    if is_mla_config(config):
        return 1, int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(heads), int(dim), int(dim)


def indexed_layer(config) -> int | None:
    """The first layer of DeepSeek sparse attention (layer type ``"indexed_attention"``: DeepSeek-V3.2, GLM-5 and
    kin), whose indexer keys the model caches through ``update_indexer`` beside its K/V; None without one."""
    types = getattr(config, "layer_types", None) if config is not None else None
    return next((i for i, t in enumerate(types or ()) if t == "indexed_attention"), None)


def sparse_attention_refusal(where: str) -> ValueError:
    """The one error of DeepSeek sparse attention meeting the ``"kvcache"`` attention (cache, mask function, attention
    function, Engine): the kernel reads every token of the pages and has no place for the indexer's choice of
    tokens, which eager / sdpa apply as a mask."""
    return ValueError(f"{where}: the \"kvcache\" attention does not run DeepSeek sparse attention (the model's indexer "
                      f"picks the tokens each query attends to, where its kernel reads every token); use PagedCache "
                      f"with attn_implementation=\"eager\" or \"sdpa\" (the indexer's choice applied as a mask), or "
                      f"DynamicCache")


def check_pageable(config, what: str) -> None:
    """Refuses DeepSeek sparse attention where the ``"kvcache"`` attention would run it, naming ``what`` and the
    layer (:func:`sparse_attention_refusal`)."""
    layer = indexed_layer(config)
    if layer is not None:
        raise sparse_attention_refusal(f"{what}: layer {layer} of {type(config).__name__} is of type "
                                       f"'indexed_attention'")


def _state_layers(config) -> list | None:
    """For a hybrid model (``config.layer_types`` naming linear-attention / conv / Mamba layers): one entry per
    layer, HF's own state layer or None where the layer pages its K/V; None for a model of attention only."""
    if getattr(config, "_attn_implementation", None) == ATTENTION_NAME:
        check_pageable(config, "PagedCache")
    types = getattr(config, "layer_types", None) if config is not None else None
    # (transformers 4.x's Jamba names its Mamba layers in layers_block_type only: its first forward then failed
    # inside PagedCache with an AttributeError instead of the version refusal below)
    older = getattr(config, "layers_block_type", None) if config is not None and not types else None
    if older and "mamba" in older and DYNAMIC_LAYER_TYPE_MAPPING is None:
        types = older
    if not types or not any(t in ("linear_attention", "conv", "mamba") or t.startswith("hybrid") for t in types):
        return None  # attention only (layers without attention never call update: PagedLayers are fine)
    bad = next(((i, t) for i, t in enumerate(types) if t.startswith("hybrid")), None)
    if bad is not None:  # one layer holding both a Mamba state and attention K/V (Falcon-H1, Zamba)
        raise ValueError(f"layer {bad[0]} of {type(config).__name__} is of type {bad[1]!r} (a state and attention "
                         f"K/V in one layer): PagedCache does not page such layers; use DynamicCache")
    if DYNAMIC_LAYER_TYPE_MAPPING is None:
        import transformers
        raise ValueError(f"{type(config).__name__} has linear-attention/Mamba layers, whose cache layers need "
                         f"transformers >= 5.5 (installed: {transformers.__version__})")
    states = getattr(config, "number_of_conv_states", 1)
    layers = []
    for t in types:
        if t in ("dummy", "moe", "mlp"):
            layers.append(DYNAMIC_LAYER_TYPE_MAPPING["dummy"]())
        elif t in STATE_LAYER_TYPES:
            layers.append(DYNAMIC_LAYER_TYPE_MAPPING[t](number_of_states=states))
        else:
            layers.append(None)
    return layers


class _StoredWithGradient(torch.autograd.Function):
    """The stored K or V of this forward's tokens as they are, with the gradient passed to the K or V the model
    handed the cache (straight through): what DynamicCache's concatenation gives them, while the values are
    the pages' (exactly the same in full precision; a quantized format's rounding is not differentiated)."""

    @staticmethod
    def forward(ctx, stored: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        ctx.new_dtype = new.dtype
        return stored.view_as(stored)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad.to(ctx.new_dtype)


def wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records this forward (grad mode on and an input that requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def with_gradient(dense: torch.Tensor, new: torch.Tensor, start: int) -> torch.Tensor:
    """``dense`` ``[batch, heads, length, dim]`` whose positions ``[start, start + q_len)`` hold the tokens of a
    forward's ``new`` ``[batch, heads, q_len, dim]``, made differentiable with respect to ``new`` there."""
    end = start + new.shape[2]
    return torch.cat([dense[:, :, :start], _StoredWithGradient.apply(dense[:, :, start:end], new),
                      dense[:, :, end:]], dim=2)


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a :class:`PagedCache`: its length; the pages live in the store."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: "PagedCache", index: int):
        super().__init__()
        self.cache, self.index, self.length = cache, index, 0
        # whether it holds K/V of its own (written by update, or loaded by load_prefix): layers that never call
        # update (Gemma 3n's shared-KV layers read an earlier layer's) do not, and their length says nothing
        self.takes_kv = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.index)

    # ``keys`` / ``values``: DynamicLayer's attributes, read from the pages (transformers' Cache API, e.g.
    # ``cache.layers[i].keys``; 4.x's ``cache[i]``). The base class's ``__init__`` sets them to None.
    @property
    def keys(self) -> torch.Tensor | None:
        """This layer's keys ``[batch, kv_heads, length, head_dim]`` in the model's dtype, as DynamicCache holds
        them (MLA: the latents ``kv_nope``), read from the pages: a new tensor on every read (quantized formats
        dequantized; under the ``"kvcache"`` attention, which stores no left padding, padded positions are
        zero), or None while the layer holds no tokens. Writing to it does not change the cache."""
        return self.cache._read_layer(self.index)[0]

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_set("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """This layer's values (MLA: ``k_rot``), as :attr:`keys`."""
        return self.cache._read_layer(self.index)[1]

    @values.setter
    def values(self, value) -> None:
        self._refuse_set("values", value)

    def _refuse_set(self, name: str, value) -> None:
        if value is not None:
            raise AttributeError(f"PagedLayer.{name} is read from the pages; write tokens through "
                                 f"cache.update(key_states, value_states, layer_idx)")

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # an int query length (5.4+) or the cache_position tensor (4.57 - 5.3)
        q = int(query_length.shape[0]) if torch.is_tensor(query_length) else int(query_length)
        hybrid = self.cache._has_state_layers()
        if hybrid:  # a forward's start: its states must hold what the pages hold
            self.cache._check_states()
        if self.cache.fused and PLAN_AHEAD:  # the mask function comes next: it plans the step there (_plan_ahead)
            _leave_for_mask(self.cache)
        elif hybrid:  # eager/sdpa on a hybrid model: the pages before any state moves
            self.cache._reserve_ahead(q)
        # after a forward that stopped part-way, the length the next forward continues from (get_seq_length),
        # not this layer's own: its mask spanned the stopped forward's tokens too (a 3-token retry: a 46-wide
        # mask over 43 keys, a RuntimeError in the attention)
        length = self.cache._continues_from() if self.takes_kv else self.length
        return length + q, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.cache.store.max_tokens is None else self.cache.store.max_tokens

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()

    # Cache-level methods act on all layers at once (the block tables are shared); these keep the
    # layer API complete for code that walks ``cache.layers``.
    def reset(self) -> None:
        self.length = 0
        self.takes_kv = False
        self._reset_indexer()

    # DeepSeek sparse attention (layer type "indexed_attention": DeepSeek-V3.2, GLM-5 and kin): the indexer's keys
    # ``[batch, tokens, index_head_dim]``, kept as transformers' DynamicIndexedLayer keeps them (one tensor, grown
    # by concatenation, never written in place: copies of the cache may share it). The model scores them itself
    # to pick the tokens its attention reads; they are not paged. ``indexer_position_ids`` is set by the models
    # that keep their positions (``[position_dims, batch, tokens]``).
    indexer_keys: torch.Tensor | None = None
    indexer_position_ids: torch.Tensor | None = None
    is_indexer_initialized: bool = False

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Appends this forward's indexer keys ``[batch, q_len, index_head_dim]``; returns all of them."""
        if not self.is_indexer_initialized:
            self.indexer_keys = indexer_key_states[:, :0]
            self.is_indexer_initialized = True
        self.indexer_keys = torch.cat([self.indexer_keys, indexer_key_states], dim=1)
        return self.indexer_keys

    def _reset_indexer(self) -> None:
        self.indexer_keys = self.indexer_position_ids = None
        self.is_indexer_initialized = False

    def _crop_indexer(self, length: int) -> None:
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :length]
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = self.indexer_position_ids[..., :length]

    def _select_indexer(self, index: torch.Tensor) -> None:
        if self.indexer_keys is not None and self.indexer_keys.numel():
            self.indexer_keys = self.indexer_keys.index_select(0, index.to(self.indexer_keys.device))
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = self.indexer_position_ids.index_select(
                1, index.to(self.indexer_position_ids.device))

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("reorder a PagedCache as a whole: cache.reorder_cache(beam_idx)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop a PagedCache as a whole: cache.crop(n)")

    def offload(self) -> None:  # pages stay where they are
        pass

    def prefetch(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"PagedLayer(index={self.index}, length={self.length})"



# Whether the "kvcache" mask function plans a step before the layer loop (so torch.compile compiles the loop).
# Not with torch < 2.14: its inductor loses the symbol of a layer's new length in the loop's compiled graph
# (NameError in the generated code); there the step is planned at the first layer, as before.
PLAN_AHEAD = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


@torch.compiler.disable
def _leave_for_mask(cache: "PagedCache") -> None:
    PENDING_CACHE.set(cache)  # (ContextVar.set: a graph break, before the model's layer loop)


class PagedCache(Cache):
    """A paged, optionally quantized KV cache usable as ``past_key_values`` of transformers models.

    MLA models (DeepSeek-V2/V3) hand the cache latents of two widths (``kv_nope`` as the key, ``k_rot`` as the
    value): their pages hold rows of those two widths, paged, quantized and prefix-shared like any other, and
    eager/sdpa attention reads them back through ``paged_gather``; the ``"kvcache"`` attention reads them in
    place through the absorbed kernel (:mod:`kvcache.hf_mla`).

    The cache reads like DynamicCache: ``cache.layers[i].keys`` / ``.values`` are a layer's K/V (a copy read
    from the pages), ``get_seq_length``, ``crop``, ``reorder_cache``, ``batch_select_indices`` and
    ``copy.deepcopy`` / ``copy.copy`` (both an independent cache, copy-on-write pages) act on every layer at
    once (with a quantized format, the copy takes its own copy of the full-precision window's pages: shared,
    the first copy to let such a page age out of its window would quantize it for both). It does not pickle
    (a ``TypeError`` that says what to use instead).

    Args:
        config: the model config (``model.config``): gives the number of layers and lets the cache see
            which attention implementation the model uses. Without it, layers are created as they come and
            the cache hands the model dense K/V (so ``"kvcache"`` attention falls back to SDPA over them:
            correct, but not reading the pages in place, and ``sink_tokens`` is refused).
        page_size: tokens per page (a power of two).
        kv_format: storage format of K and V, e.g. ``"int8"``, ``"k=int8,v=int4"``,
            :class:`kvcache.CacheFormat`; default: the model's dtype (full precision).
        max_tokens: size the pool for this many tokens (all rows together) up front; by default it grows.
        device, dtype: only checked against the tensors the model passes (pages follow the model).
        sink_tokens: with a sliding-window model and ``"kvcache"`` attention, the first tokens stay
            visible (StreamingLLM attention sinks). Not with residual pages: a quantized format needs
            ``residual_length=0``, and KIVI formats (always residual) are refused (a ``ValueError``).
        residual_length: with a quantized ``kv_format``, the newest ``residual_length`` tokens of every row
            stay in the model's dtype (as HF QuantizedCache's ``residual_length``; KIVI's window): their
            pages are quantized once they are older (:mod:`kvcache.residual`). Default: 128 (HF's default,
            KIVI's window), the accurate configuration; ``0`` quantizes every token as it is written (KIVI
            formats, and any format with ``residual_sink_tokens``, still keep the page being written in full
            precision until it is complete). In full precision (``kv_format=None`` or a float dtype) both
            are accepted and change nothing: every token is kept in the model's dtype already.
        residual_sink_tokens: the first tokens of every row (in whole pages) are never quantized.
        store: share the pages (and allocator, prefix cache) of another cache or an Engine.
        prefix_cache: keep a :class:`kvcache.PrefixCache` over the pages (``True``), or use the given one
            (its allocator then numbers the pages); see :meth:`load_prefix` / :meth:`save_prefix`. A PrefixCache
            already used by another cache or Engine holds pages in that one's store: it is refused here (a
            ValueError naming ``prefix_cache``); share the store instead, ``store=prefix_cache.store``.
        allocator: number the pages with this :class:`kvcache.BlockAllocator` (its size bounds the pool).
        num_layers: the number of layers when there is no ``config`` (with one, it must agree with the
            config's ``num_hidden_layers``); without either, layers are created as the model reaches them.
        namespace: the :class:`kvcache.Namespace` its prefixes are cached under (``save_prefix`` /
            ``load_prefix``). Default: the model's (its ``name_or_path``, else its config's class, and the format);
            sharing an Engine's store, the Engine's namespace when the cache is for the Engine's model. A model
            without a ``name_or_path`` sharing a prefix cache with another such model of the same class is
            refused (a ValueError naming ``namespace``): their prefixes would be each other's hits.
    """

    def __init__(self, config=None, *, page_size: int = 16, kv_format=None, max_tokens: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, sink_tokens: int = 0,
                 store: PagedStore | None = None, prefix_cache: bool | PrefixCache = False,
                 allocator: BlockAllocator | None = None, num_layers: int | None = None,
                 residual_length: int | None = None, residual_sink_tokens: int = 0,
                 namespace: Namespace | None = None):
        if namespace is not None and not isinstance(namespace, Namespace):
            raise TypeError(f"namespace={namespace!r} must be a kvcache.Namespace, not {type(namespace).__name__}")
        self._given_namespace = namespace
        if config is not None and not isinstance(config, PretrainedConfig):
            # (config=model slipped through before: the cache ran dense, and its warnings blamed the model)
            given = getattr(config, "config", None)
            hint = " (pass model.config, not the model)" if isinstance(given, PretrainedConfig) else ""
            raise TypeError(f"config must be the model's transformers config (model.config), got "
                            f"{type(config).__name__}{hint}")
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        states = _state_layers(text_config)  # (first: a refused config leaves a given store or prefix cache unbound)
        if prefix_cache is not False and prefix_cache is not None:  # (before a given PrefixCache is bound to a store)
            indexed = indexed_layer(text_config) if text_config is not None else None
            if states is not None or indexed is not None:
                why = ("a hybrid model's linear-attention/Mamba states are not paged per token" if states is not None
                       else f"DeepSeek sparse attention's indexer keys (layer {indexed}) are not paged")
                raise ValueError(f"prefix_cache: {type(text_config).__name__} cannot share prefixes through the pages "
                                 f"({why}, so save_prefix / load_prefix refuse it); leave prefix_cache off")
        configured = getattr(text_config, "num_hidden_layers", None) if text_config is not None else None
        if num_layers is not None:
            if isinstance(num_layers, bool) or not hasattr(num_layers, "__index__") or num_layers < 0:
                raise ValueError(f"num_layers={num_layers!r} must be a non-negative int")
            if configured is not None and num_layers != configured:
                raise ValueError(f"num_layers={num_layers} disagrees with the config's num_hidden_layers={configured}; "
                                 f"pass one of them")
        else:
            num_layers = configured
        if store is None:
            store = PagedStore(page_size=page_size, kv_format=kv_format, max_tokens=max_tokens,
                               prefix_cache=prefix_cache, allocator=allocator, residual_length=residual_length,
                               residual_sink_tokens=residual_sink_tokens)
        elif text_config is not None:
            _check_store_geometry(store, text_config)
        self.store = store
        self.config = text_config
        self.device = None if device is None else torch.device(device)
        self.dtype = dtype
        sink_tokens = integer_arg("sink_tokens", sink_tokens, "attention sinks of a sliding window")
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens={sink_tokens} must be >= 0")
        self.sink_tokens = sink_tokens
        if sink_tokens and text_config is not None and not getattr(text_config, "sliding_window", None) and not any(
                "sliding" in str(t) for t in getattr(text_config, "layer_types", None) or ()):
            warnings.warn(f"sink_tokens={sink_tokens}: {type(text_config).__name__} has no sliding window, so every "
                          f"token is visible and attention sinks change nothing", stacklevel=2)
        if self.sink_tokens and store.residual is not None:
            fix = ("a KIVI format always has them (its open page); use full precision or int8 / fp8 / int4 with "
                   "residual_length=0" if store.kv_format.family == "kivi"
                   else "pass residual_length=0 (and no residual_sink_tokens) to quantize every token as it is written")
            raise ValueError(f"sink_tokens={sink_tokens} (attention sinks of a sliding window) cannot be combined with "
                             f"residual pages ({store.residual_label}, format {store.kv_format}): the kernel's window "
                             f"needs every token at its position in one pool; {fix}")
        self.rows: list[Sequence] = []   # per batch row: its stored tokens (pads not stored)
        self.pads: list[int] = []        # per batch row: leading pad slots that were not stored
        self._version = 0
        # the rows were started by a forward that has not been followed by another use yet: if it stopped part-way
        # (an exception or Ctrl-C in a layer), the layers after the stop were never written (_first_forward_stopped)
        self._first_forward_open = False
        # a hybrid model's state tensors as the last forward's start found them, so that a forward stopped before its
        # first paged layer (the states moved, the pages did not) or after its last one shows (_check_states)
        self._state_notes: list | None = None
        self._reached_pages = True  # whether the forward since the last start wrote its first paged layer
        self._rows_planned = False  # the rows count a step the running forward planned before its layers (_settle)
        self._plan: StepPlan | None = None
        self._planned_ahead = False  # the coming forward's step was planned by the mask function
        self._external_plan: StepPlan | None = None
        self._dense_row_mode = False
        # (step version, layer) of K/V tagged for the "kvcache" attention and not yet attended to by it: a model
        # attending with another implementation (sdpa, eager) would see only the forward's own tokens
        self._unattended: tuple[int, int] | None = None
        # while autograd records: per layer, (start, K, V) of each recorded forward's tokens, so that a later
        # forward's gradient reaches them as DynamicCache's concatenation would; dropped by crop / reorder / reset
        self._graph: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self._graph_dropped = False
        if states is not None:  # a hybrid model: HF's state layers where the model keeps states, pages elsewhere
            layers = [PagedLayer(self, i) if st is None else st for i, st in enumerate(states)]
        else:
            layers = [PagedLayer(self, i) for i in range(num_layers)] if num_layers else []
        # (num_layers= alone does not say which layers write K/V: Gemma 3n's shared-KV layers never do)
        self._layers_known = text_config is not None and bool(layers)
        super().__init__(layers=layers)

    @property
    def paged_layers(self) -> list[PagedLayer]:
        """The layers whose K/V live in the pages (all of them, except a hybrid model's state layers)."""
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    @property
    def state_layers(self) -> list:
        """A hybrid model's own (transformers) cache layers of its linear-attention / conv / Mamba layers."""
        return [layer for layer in self.layers if not isinstance(layer, PagedLayer)]

    # what transformers 4.x's hybrid models read off their own cache classes (HybridMambaAttentionDynamicCache,
    # Qwen3NextDynamicCache, ...): handed a PagedCache, they failed on a bare AttributeError
    _HYBRID_CACHE_ATTRIBUTES = frozenset({"has_previous_state", "conv_states", "ssm_states", "recurrent_states",
                                          "update_conv_state", "update_ssm_state", "rnn_state", "seqlen_offset"})

    def __getattr__(self, name: str):
        # (only for attributes the object does not have: everything it has is found before this is called)
        if name in PagedCache._HYBRID_CACHE_ATTRIBUTES:
            import transformers
            raise AttributeError(
                f"kvcache.PagedCache has no {name!r}: the model is a hybrid (linear-attention / Mamba) model asking "
                f"its cache for a recurrent state, which transformers {transformers.__version__} keeps in the "
                f"model's own cache class. PagedCache holds such states with transformers >= 5.5 and "
                f"PagedCache(config=model.config); here use the model's own cache")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _first_paged(self) -> int:
        return next((i for i, layer in enumerate(self.layers) if isinstance(layer, PagedLayer)), 0)

    # ---- what transformers calls -----------------------------------------------------------------
    @property
    def fused(self) -> bool:
        """Whether the model attends with the ``"kvcache"`` implementation (update then only writes)."""
        return getattr(self.config, "_attn_implementation", None) == ATTENTION_NAME

    def set_step_plan(self, plan: StepPlan | None) -> None:
        """For an owner that schedules its own (packed) steps, such as :class:`kvcache.Engine`: the next
        forwards write their K/V at ``plan``'s slots and attend with the ``"kvcache"`` kernel over its
        tables, without this cache's rows; ``None`` returns to the cache's own bookkeeping."""
        if plan is not None:
            self._refuse_states("packed steps (kvcache.Engine)")
        self._external_plan = plan

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Writes the new K/V ``[batch, kv_heads, q_len, head_dim]`` of layer ``layer_idx`` into the pages.

        Returns the layer's whole K/V (dense mode) or the new K/V tagged for the ``"kvcache"``
        attention function (fused mode)."""
        while len(self.layers) <= layer_idx:
            self.layers.append(PagedLayer(self, len(self.layers)))
        layer = self.layers[layer_idx]
        if not isinstance(layer, PagedLayer):
            raise ValueError(f"layer {layer_idx} is a {type(layer).__name__} (the model's own state layer), not an "
                             f"attention layer: it has no K/V to update")
        is_first = layer_idx == self._first_paged()  # (the forward's first paged layer)
        if (not layer.takes_kv and self.rows and self._external_plan is None and not self._first_forward_open
                and not is_first and any(other.takes_kv for other in self.paged_layers)):
            self._refuse_unwritten_layer(layer_idx)
        if not layer.is_initialized:
            try:
                self._check_placement(key_states)
                layer.lazy_initialization(key_states, value_states)
            except BaseException:
                self._undo_failed_first_forward()
                raise
        if is_first and self.rows:
            self._settle(in_forward=True)
        if self._external_plan is not None:  # a step scheduled by its owner (kvcache.Engine): write and tag
            plan = self._external_plan.on(key_states.device)
            self.write(layer_idx, key_states, value_states, plan)
            if self.fused:
                return self._tagged(key_states, value_states, layer_idx, plan)
            return self._packed(layer_idx, plan, key_states.dtype)  # PyTorch attention under the owner's mask
        batch, _, q_len, _ = key_states.shape
        pending = self._take_padding(layer_idx)
        if self.sink_tokens and not self.fused:
            why = ("this cache was built without config=, so it cannot see the model's attention: "
                   "PagedCache(config=model.config, ...)" if self.config is None else
                   "model.set_attn_implementation('kvcache') before the cache's first forward")
            self._undo_failed_first_forward()
            raise ValueError(f"sink_tokens={self.sink_tokens} needs the kernel's attention (transformers' masks "
                             f"have no sinks): {why}")
        if not self.rows:
            self._start_rows(batch, q_len, layer.length, pending)
            try:  # a first forward that fails here (a full pool, a format the layer's width refuses) leaves
                # the cache empty, not holding rows of nothing that a retry with another batch would trip on
                plan = self._step_plan(layer.length, q_len).on(key_states.device)
                self.write(layer_idx, key_states, value_states, plan)
            except BaseException:
                if all(other.length == 0 for other in self.paged_layers):
                    self._release_rows()
                    self._undo_failed_first_forward()
                raise
        elif batch != len(self.rows):
            # (a cache without config= cannot tell a first forward that stopped part-way from a whole one)
            stopped = ("; if the forward that started it stopped part-way (an exception or KeyboardInterrupt), "
                       "cache.reset() empties it" if self._first_forward_open and not self._layers_known else "")
            raise ValueError(f"key_states has batch {batch} but the cache holds {len(self.rows)} rows; beam search "
                             f"and num_return_sequences need an empty cache (or cache.batch_repeat_interleave){stopped}")
        else:
            plan = self._step_plan(layer.length, q_len).on(key_states.device)
            self.write(layer_idx, key_states, value_states, plan)
        layer.length = plan.length + plan.q_len  # (not += q_len: inductor 2.13 lost that symbol in its output)
        layer.takes_kv = True
        if is_first:
            self._reached_pages = True  # (_check_states)
        if wants_grad(key_states, value_states):
            if plan.length and self._graph_dropped:
                warnings.warn("kvcache.PagedCache: gradients reach the K/V of this forward's tokens but not those "
                              "cached before a crop, reorder or batch selection (the pages keep values, not their "
                              "autograd graph)", stacklevel=2)
            self._graph.setdefault(layer_idx, []).append((plan.length, key_states, value_states))
        elif self._graph:  # as DynamicCache, whose concatenation outside autograd leaves its history no graph
            self._graph.pop(layer_idx, None)
        if self.fused:
            return self._tagged(key_states, value_states, layer_idx, plan)
        return self._dense(layer_idx, key_states.dtype, key_states, value_states)

    def write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan) -> None:
        """Writes a layer's new K/V at the slots of ``plan`` (the step's :class:`kvcache.StepPlan`): through
        the kernels' plan of the step, so no index values are read on the host per layer."""
        pool = self.store.pool(layer_idx, key_states, value_states, plan.num_blocks)
        # the attention's query heads, so that append and attention share one kernel plan per step
        q_heads = getattr(self.config, "num_attention_heads", None) or pool.num_kv_heads
        if plan.residual is not None:  # seal what aged (every layer at once), write the new tokens in full precision
            residual = self.store.residual_pool(layer_idx, key_states, plan.residual.num_slots)
            self.store.move_residual_pages(plan.residual)  # (this layer's pools included: both exist by now)
            res.write_tokens(plan.residual, pool, residual, key_states, value_states, q_heads)
            return
        if pool.k.is_floating_point() and pool.k.dtype != key_states.dtype:  # e.g. bf16 pages, fp32 model
            key_states, value_states = key_states.to(pool.k.dtype), value_states.to(pool.v.dtype)
        pool.append(key_states, value_states, plan.kernel_plan(pool, q_heads))

    def _tagged(self, key_states, value_states, layer_idx: int, plan: StepPlan):
        """The new K/V, the key tagged for the ``"kvcache"`` attention function: (cache, layer, plan)."""
        if not torch.compiler.is_compiling():  # (eager only: a value guard would recompile every step)
            self._check_attended(plan)
            self._unattended = (plan.version, layer_idx)
        k = key_states.view(key_states.shape)  # a fresh tensor object to carry the tag
        k._kvcache = (self, layer_idx, plan)
        k._kvcache_value = value_states  # what the attention must be handed as V (kvcache_attention checks it)
        # MLA latents: the module expands them (the tag is lost). Known by the config, not by the widths: latents
        # as wide as the rotary part (kv_lora_rank == qk_rope_head_dim) went untagged and attended only to the
        # forward's own tokens
        if key_states.shape[-1] != value_states.shape[-1] or is_mla_config(self.config):
            hf_mla.leave_pending(self, layer_idx, plan)
        return k, value_states

    def _check_attended(self, plan: StepPlan) -> None:
        """Refuses a forward whose previous layer took its K/V tagged for the ``"kvcache"`` attention but attended
        with another implementation: that attention saw only the forward's own tokens, not the cache's."""
        if self._unattended is None or self._unattended[0] != plan.version:
            return  # (a step that raised before its attention leaves a stale mark: not this step's)
        layer = self._unattended[1]
        self._unattended = None
        owned = self._external_plan is not None
        if plan.length == 0 and not owned:
            return  # a prompt: its own tokens are all there is to see, so the other attention was right
        if not owned:  # its layers now hold this forward's tokens up to that layer only
            self.reset()
        if owned:  # (the Engine sets both already: its advice would not help)
            raise RuntimeError(
                f"kvcache.Engine: layer {layer} stored its K/V for the \"kvcache\" attention but its attention never "
                f"called it: the model computes attention itself, not through transformers' attention interface, so "
                f"the Engine cannot run it; use model.generate with a kvcache.PagedCache and eager/sdpa attention")
        raise RuntimeError(
            f"kvcache.PagedCache: layer {layer} stored its K/V for the \"kvcache\" attention (the cache's config has "
            f"_attn_implementation={ATTENTION_NAME!r}) but the model attended with another implementation, which saw "
            f"only this forward's {plan.q_len} token(s), not the cache: build the cache from the model's own config "
            f"(PagedCache(config=model.config)) or run the model with model.set_attn_implementation("
            f"{ATTENTION_NAME!r})" + ("" if owned else "; the cache was emptied"))

    # A hybrid model's linear-attention / Mamba layers ask the cache for their states by layer index; transformers'
    # Cache answers from self.layers, where a PagedCache made without the model's config has no state layers (an
    # IndexError or "Cannot get conv state for non linear attention layer 0 of type PagedLayer" from inside
    # transformers). These name what is missing instead.
    def _state_layer_of(self, layer_idx: int, what: str) -> None:
        if 0 <= layer_idx < len(self.layers) and not isinstance(self.layers[layer_idx], PagedLayer):
            return
        has = "no layer" if layer_idx >= len(self.layers) else "a paged attention layer"
        raise ValueError(f"layer {layer_idx} of the model asked the cache for its {what} (a linear-attention / Mamba "
                         f"layer of a hybrid model), but this PagedCache has {has} there: its state layers are made "
                         f"from the model's config, so create it as PagedCache(config=model.config)")

    def get_conv_state(self, layer_idx: int, *args, **kwargs):
        self._state_layer_of(layer_idx, "conv state")
        return super().get_conv_state(layer_idx, *args, **kwargs)

    def get_recurrent_state(self, layer_idx: int, *args, **kwargs):
        self._state_layer_of(layer_idx, "recurrent state")
        return super().get_recurrent_state(layer_idx, *args, **kwargs)

    def update_conv_state(self, conv_states, layer_idx: int, *args, **kwargs):
        self._state_layer_of(layer_idx, "conv state")
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, *args, **kwargs):
        self._state_layer_of(layer_idx, "recurrent state")
        return super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)

    # A hybrid model's forward moves every state layer's tensors (replaced, or updated in place: a decode step's
    # causal_conv1d_update and selective_state_update write the tensors they got, with no update_* call), and its
    # pages. At each forward's start the cache notes its state tensors (weak references and autograd versions):
    # at the next start, a forward that wrote no paged layer must have left them all as they were, and one that
    # did must have moved them all. Otherwise it stopped before its first paged layer (the states took tokens
    # the pages did not) or after its last one (later states lack them).
    def _linear_states(self) -> list[list]:
        return [[*layer.conv_states.values(), *layer.recurrent_states.values()] for layer in self.state_layers
                if LinearAttentionCacheLayerMixin is not None and isinstance(layer, LinearAttentionCacheLayerMixin)]

    def _note_states(self) -> list[list]:
        return [[None if t is None else (weakref.ref(t), t._version) for t in layer] for layer in self._linear_states()]

    def _states_disagree(self) -> bool:
        """Whether the forward since the last start moved the states and not the pages, or the reverse."""
        if self._state_notes is None:
            return False
        moved = [any(n is not None if t is None else (n is None or n[0]() is not t or n[1] != t._version)
                     for t, n in zip(layer, notes)) or len(layer) != len(notes)
                 for layer, notes in zip(self._linear_states(), self._state_notes)]
        return not all(moved) if self._reached_pages else any(moved)

    @torch.compiler.disable
    def _check_states(self) -> None:
        """At a forward's start: after a stopped forward that moved a hybrid model's states but not its pages (or
        the reverse), the cache is undone whole if that forward was the first (nothing before it is lost), and
        refused otherwise (recurrent states cannot be rolled back): the next forward ran on states that had taken
        the stopped forward's tokens, or lacked them (logits 2e-2 off, silently, on Qwen3-Next)."""
        if self._states_disagree():
            if self.rows and not self._first_forward_open:
                self._raise_states_stopped()
            self._undo_stopped_first_forward()
        self._state_notes = self._note_states()
        self._reached_pages = False

    def _raise_states_stopped(self, lengths: list[int] | None = None) -> None:
        held = f"its paged layers hold {lengths} tokens" if lengths else "its recurrent states and pages hold different forwards"
        raise RuntimeError(f"kvcache.PagedCache: a forward stopped part-way ({held}) and this hybrid model's "
                           f"recurrent states, updated by the layers it reached, cannot be rolled back; cache.reset() "
                           f"empties the cache")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        layer = self.layers[layer_idx]
        first = self._first_paged()
        if layer_idx == first or (layer_idx == 0 and not isinstance(layer, PagedLayer)):
            # "how long" (a hybrid model: its first attention layer, as transformers does): what every paged layer
            # holds; after a forward that stopped part-way, the tokens the next forward keeps (_settle)
            return self._continues_from()
        if isinstance(layer, PagedLayer):
            return layer.length
        raise ValueError(f"layer {layer_idx} is a {type(layer).__name__}, which holds no sequence length")

    def reset(self) -> None:
        """Empties the cache (its pages go back to the allocator; a hybrid model's states are dropped, so the next
        prompt may have any batch size); the pools stay allocated. fp8 scales taken from
        the first tokens are taken again from the next ones, unless the pages are shared (a prefix cache, a
        ``deepcopy`` still holding pages), whose stored tokens keep needing them."""
        self._release_rows()
        self.store.forget_scales()
        # A hybrid model's state layers are made anew: reset in place they keep their tensors, zeroed, of the last
        # batch's size, so a prompt of another batch size failed in transformers' state update (as it does after
        # DynamicCache.reset(); every PagedCache starts any batch size after reset() or free()).
        for layer in self.paged_layers:
            layer.reset()  # (its length and indexer keys)
        self._fresh_state_layers()

    def _fresh_state_layers(self) -> None:
        """A hybrid model's state layers made anew (empty, any batch size)."""
        fresh = _state_layers(self.config) if self._has_state_layers() else None
        self._state_notes, self._reached_pages = None, True  # (fresh states; the pages are empty then too)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, PagedLayer):
                continue
            if fresh is not None and fresh[i] is not None:
                self.layers[i] = fresh[i]
            else:
                layer.reset()

    def _undo_failed_first_forward(self) -> None:
        """A first forward refused at its first attention layer (a full pool, a width the format refuses, a
        device) had already run a hybrid model's state layers before it: their states go back to empty, so that
        the cache is unchanged, as the error says (a retry read the refused prompt's states: logits 3e-2 off)."""
        if not self.rows and all(layer.length == 0 for layer in self.paged_layers):
            self._fresh_state_layers()
            for layer in self.paged_layers:  # the next first forward takes its device and dtype anew
                layer.is_initialized = False

    def free(self) -> None:
        """Empties the cache and, unless the store is shared with a prefix cache, drops the pools' memory."""
        self.reset()
        if self.store.prefix_cache is None and self.store.allocator.num_free == self.store.allocator.num_blocks:
            self.store.clear()

    if not hasattr(Cache, "__iter__"):  # transformers 5 took __iter__ from Cache and kept it on DynamicCache (4.x's
        # Cache iterates through layers[i].keys / .values, which PagedLayer reads from the pages)
        def __iter__(self):
            """Each layer's ``(keys, values, None)``, as transformers 5's ``DynamicCache`` yields them (its third item,
            a sliding layer's window, is None: the pages keep every token), read from the pages as
            :attr:`PagedLayer.keys`. A hybrid model's state layers yield ``(None, None, None)``."""
            for layer in self.layers:
                if isinstance(layer, PagedLayer):
                    yield layer.keys, layer.values, None
                else:
                    yield None, None, None

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]``: block tables are rewired, pages shared copy-on-write
        (a hybrid model's state layers are reordered as transformers does). ``beam_idx`` is a 1-D tensor (or
        sequence) of integer row indices, at least one."""
        index = torch.as_tensor(beam_idx)
        if index.dim() != 1 or index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
            raise TypeError(f"reorder_cache: beam_idx must be a 1-D tensor of integer row indices, got shape "
                            f"{tuple(index.shape)} and dtype {index.dtype}")
        self._select_rows(index.tolist(), "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the rows ``indices`` selects, as tensor indexing does (``DynamicCache`` indexes its tensors
        with it): row indices, negative ones counted from the end, or a boolean mask of one entry per row."""
        n = len(self.rows) or self._state_batch()
        index = torch.as_tensor(indices).cpu()
        if index.dtype == torch.bool and index.shape != (n,):
            raise IndexError(f"indices is a boolean mask of shape {tuple(index.shape)}, but the cache holds {n} rows")
        if index.dtype != torch.bool and (index.is_floating_point() or index.is_complex()):
            raise IndexError(f"indices must be integer row indices or a boolean mask, got dtype {index.dtype}")
        rows = torch.arange(n)
        try:
            picked = rows[index]
        except IndexError as e:
            raise IndexError(f"indices {index.tolist()} out of range for a cache of {n} rows") from e
        self._select_rows(picked.reshape(-1).tolist(), "indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Row ``i`` becomes rows ``i * repeats .. i * repeats + repeats - 1`` (copy-on-write), as
        ``DynamicCache`` repeats its tensors; ``repeats`` is an integer >= 1."""
        if isinstance(repeats, bool) or not hasattr(repeats, "__index__"):
            raise TypeError(f"batch_repeat_interleave: repeats must be an integer, got {repeats!r}")
        r = operator.index(repeats)
        if r < 1:  # (0 would leave a cache of no rows, which still claims its tokens)
            raise ValueError(f"batch_repeat_interleave: repeats must be >= 1, got {r}")
        n = len(self.rows) or self._state_batch()
        self._select_rows([i for i in range(n) for _ in range(r)], "repeats")

    def crop(self, tokens_to_remove: int | None = None, **kwargs) -> None:
        """``crop(-n)`` drops the newest ``n`` tokens; ``crop(0)`` does nothing; ``crop(n > 0)`` (the
        transformers < 5.14 convention) keeps the first ``n``. The kept tokens read as before, and the dropped
        slots are simply rewritten later: in full precision or with ``residual_length=0`` (int8, int4, and fp8 with
        a given scale) the cache is then bit for bit one that never held the dropped tokens. fp8 without a given
        scale keeps the scale its first forward took, dropped tokens included (only ``reset()`` / ``free()`` take
        it anew), so the kept tokens match such a cache within fp8's rounding, not bit for bit. KIVI formats keep the page being written
        in full precision even with ``residual_length=0``: a crop into a sealed page reopens it with its dequantized
        values, where a cache that never held the dropped tokens would hold that page's keys in full precision
        (the next logits differ within KIVI's rounding). With a full-precision window, kept tokens that had
        aged out of it before the crop stay quantized (their page is reopened with its dequantized values), where
        a cache that never held the dropped tokens would still hold them in full precision. A hybrid model's conv
        states are cropped by transformers' own layers (after :meth:`activate_past_recording`); a recurrent (linear-attention/Mamba) state cannot be rolled
        back, so cropping tokens then raises a ValueError."""
        if tokens_to_remove is None:  # older keyword names
            tokens_to_remove = next((kwargs[k] for k in ("max_length", "maximum_length") if k in kwargs), None)
            if tokens_to_remove is None:
                raise TypeError(f"crop() needs tokens_to_remove (an integer), got "
                                f"{'no argument' if not kwargs else 'only ' + ', '.join(map(repr, kwargs))}")
        if isinstance(tokens_to_remove, bool) or not hasattr(tokens_to_remove, "__index__"):
            raise TypeError(f"crop: tokens_to_remove must be an integer, got {tokens_to_remove!r}")
        n = operator.index(tokens_to_remove)
        self._settle()  # (a forward that stopped part-way: back to the tokens every layer holds, then crop)
        length = self.get_seq_length()
        new_len = max(0, length + n) if n < 0 else (length if n == 0 else min(n, length))
        for i, layer in enumerate(self.layers):  # first, so that a state layer's refusal leaves the pages as they were
            if (LinearAttentionCacheLayerMixin is not None and isinstance(layer, LinearAttentionCacheLayerMixin)
                    and new_len != length and not layer.is_croppable):
                raise ValueError(f"crop({n}): layer {i} is a {type(layer).__name__} holding a recurrent "
                                 f"(linear-attention/Mamba) state, which cannot be rolled back; PagedCache crops "
                                 f"attention pages and conv states only")
        for layer in self.state_layers:  # transformers' state layers take the tokens to remove (<= 0); crop(0)
            if new_len != length or getattr(layer, "record_past", True):  # trims the conv states a recording kept
                layer.crop(new_len - length)
        if new_len == length:
            return
        self._truncate(new_len)

    def _truncate(self, new_len: int) -> None:
        """Keeps the first ``new_len`` tokens of every row and paged layer (pages past them go back)."""
        self._drop_graph()
        alloc, page = self.store.allocator, self.store.page_size
        for b, seq in enumerate(self.rows):
            self.pads[b] = min(self.pads[b], new_len)
            stored = new_len - self.pads[b]
            keep = -(-stored // page)
            if keep < len(seq.blocks):
                alloc.free(seq.blocks[keep:])
                seq.blocks = seq.blocks[:keep].clone()
            seq.num_tokens = stored
        for layer in self.paged_layers:
            layer.length = new_len
            layer._crop_indexer(new_len)
        self._version += 1

    def _written_lengths(self) -> list[int]:
        """The lengths of the paged layers that take K/V: layers that never call update (Gemma 3n's shared-KV layers,
        which read an earlier layer's; layers without attention) stay uninitialized at 0 and are not counted."""
        return [layer.length for layer in self.paged_layers if layer.takes_kv]

    def _settle_quietly(self) -> None:
        """_settle for what only reads the cache (stats, repr): a hybrid model's stopped forward, which _settle
        refuses, is left for the next forward to refuse."""
        try:
            self._settle()
        except RuntimeError:
            if not self.state_layers:
                raise

    def _continues_from(self) -> int:
        """The tokens the next forward continues from: what every paged layer holds (after a forward that stopped
        part-way, what the next use rolls it back to, _settle); 0 after a first forward that stopped part-way."""
        if self._first_forward_stopped():
            return 0
        first = self._first_paged()
        return min(self._written_lengths(), default=self.layers[first].length if first < len(self.layers) else 0)

    def _kv_layers_known(self) -> list[PagedLayer] | None:
        """The paged layers a complete forward writes K/V to, in order, when the cache knows its layers (config=):
        not Gemma 3n's / Gemma 4's shared-KV layers (the last ``num_kv_shared_layers``), nor layers
        whose ``layer_types`` entry has no attention (MLP / MoE only). None when layers come as the model reaches
        them."""
        if not self._layers_known:
            return None
        shared = getattr(self.config, "num_kv_shared_layers", 0) or 0
        types = getattr(self.config, "layer_types", None) or ()
        return [layer for layer in self.paged_layers
                if layer.index < len(self.layers) - shared
                and not (layer.index < len(types) and str(types[layer.index]) in _LAYER_TYPES_WITHOUT_KV)]

    def _first_forward_stopped(self) -> bool:
        """Whether the forward that started this cache's rows stopped part-way (an exception or KeyboardInterrupt
        in a layer): the layers it reached hold its tokens and the later ones have never been written. Told only
        while that forward is the last one (a next forward, crop or save_prefix settles it) and when the cache
        knows its layers (config=); without them, the next forward finds out at the first layer it reaches that was never
        written (update refuses it)."""
        if not self._first_forward_open or not self.rows or self._external_plan is not None:
            return False
        if self._reached_pages and self._has_state_layers() and self._states_disagree():
            return True  # (a hybrid's later states behind its pages; not asked once the next forward has started)
        expected = self._kv_layers_known()
        if not expected:
            return False
        written = [layer.takes_kv for layer in expected]
        reached = written.index(False) if False in written else len(written)
        # the layers reached are the first ones (a layer the model never calls would make the pattern other)
        return 0 < reached < len(written) and not any(written[reached:])

    def _refuse_unwritten_layer(self, layer_idx: int) -> None:
        """A layer that was never written gets K/V in a later forward: the forward that started the rows stopped
        before it (a cache that does not know its layers cannot tell sooner), and this forward took the tokens
        already held as its past. Its layers before this one wrote at the wrong positions: the cache empties and
        the forward is refused, rather than attending over positions this layer never held."""
        held = {layer.index: layer.length for layer in self.paged_layers if layer.takes_kv}
        self._undo_stopped_first_forward()
        raise RuntimeError(f"kvcache.PagedCache: layer {layer_idx} gets its first K/V while layers "
                           f"{sorted(held)} hold {sorted(set(held.values()))} tokens: the forward that started this "
                           f"cache stopped part-way (an exception or KeyboardInterrupt) before reaching layer "
                           f"{layer_idx}. The cache has been emptied (reset()); run the prompt again. A cache built "
                           f"with config=model.config rolls such a forward back by itself")

    def _undo_stopped_first_forward(self) -> None:
        """Back to an empty cache, as before the stopped first forward (its pages go back, a hybrid model's states
        are made anew, fp8 scales it took are taken again): the next forward is a first forward, of any batch."""
        self.reset()
        for layer in self.paged_layers:  # the next first forward takes its device and dtype anew
            layer.is_initialized = False

    def _settle(self, in_forward: bool = False) -> None:
        """After a forward that stopped part-way (an exception or KeyboardInterrupt in a layer, an update refused),
        the layers it reached hold its tokens and the others do not: the cache goes back to the tokens every paged
        layer holds, as if that forward had never run (its residual pages were sealed in every layer at once:
        the sealing a retry would do). Called where the next use begins: the next forward's first paged layer,
        ``save_prefix``, ``crop``. A hybrid model's recurrent states cannot be rolled back: a RuntimeError there
        (``reset()``)."""
        if self._external_plan is not None or not self.rows:
            return
        if self._first_forward_open:
            if self._first_forward_stopped():
                self._undo_stopped_first_forward()
                return
            self._first_forward_open = False  # a next use: that forward ended (where the layers are known, whole)
        lengths = self._written_lengths()
        planned, self._rows_planned = self._rows_planned, False
        if not lengths:
            return
        if min(lengths) == max(lengths):
            # A step planned (its pages taken, the rows counting its tokens) by a forward that stopped before any
            # layer wrote (the "kvcache" mask function plans it): the rows go back to what the layers hold, or a
            # fork would share the step's page without copy-on-write. Not the running forward's own plan.
            if not (in_forward and planned) and any(
                    seq.num_tokens > max(0, lengths[0] - pad) for seq, pad in zip(self.rows, self.pads)):
                self._truncate(lengths[0])
            return
        if self.state_layers:
            self._raise_states_stopped(lengths)
        self._unattended = None
        self._truncate(min(lengths))

    def activate_past_recording(self) -> None:
        """Nothing is ever evicted from the pages; a hybrid model's conv states start keeping their past."""
        for layer in self.state_layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def __copy__(self) -> "PagedCache":
        """As :meth:`__deepcopy__`: a shallow copy sharing the rows would give the pages back when either copy is
        dropped, and the other would read pages it no longer holds."""
        return self.__deepcopy__({})

    def __getstate__(self):
        raise TypeError("a kvcache.PagedCache cannot be pickled: its pages live in pools numbered by an allocator "
                        "(C++). copy.deepcopy forks it (copy-on-write); save_prefix / a PrefixCache with a disk or "
                        "Redis tier keep prompts' pages across processes")

    def __deepcopy__(self, memo) -> "PagedCache":
        """An independent copy that shares the pages copy-on-write (no data is copied until a write), but for
        a quantized format's open (full-precision) pages past the sinks, which it copies (:meth:`_own_open_pages`)."""
        self._settle()  # (a forward that stopped part-way: the copy starts from what every layer holds)
        other = object.__new__(type(self))  # (copy.copy is this method now)
        other.__dict__.update(self.__dict__)
        other.layers = []
        for layer in self.layers:
            if not isinstance(layer, PagedLayer):  # a hybrid model's state layer: small, copied
                other.layers.append(copy.deepcopy(layer, memo))
                continue
            new_layer = copy.copy(layer)
            new_layer.cache = other
            other.layers.append(new_layer)
        if other._state_notes is not None and not other._reached_pages:  # (the copy's states are other tensors)
            other._state_notes = other._note_states()
        other.rows = [self.store.allocator.fork(seq) for seq in self.rows]
        try:
            other._own_open_pages()
        except BaseException:  # (OutOfBlocksError in a bounded pool) the copy's rows go back now, not when the
            other._release_rows()  # cycle collector reaches it (its layers point back at it)
            raise
        other.pads = list(self.pads)
        other._plan, other._planned_ahead = None, False
        other._graph = {layer: list(segments) for layer, segments in self._graph.items()}
        return other

    def _own_open_pages(self) -> None:
        """For a fresh copy: its rows' open pages past the sinks, and every page after the first of them, move
        to blocks of its own (one per shared block, so rows that shared a page still do). NOTE: shared, the
        first copy to let such a page age out of its window would seal it, and the other copy would then read
        quantized the tokens its own window holds in full precision (an outside-in probe: a copy's logits
        depended on whether the original had been continued first). Sealed pages stay shared: they never
        change (a page that gets tokens again is copied before it is written)."""
        residual, alloc = self.store.residual, self.store.allocator
        if residual is None or not self.rows:
            return
        starts = []  # per row: its first page to copy
        for seq in self.rows:
            blocks = seq.blocks.tolist()
            starts.append(next((p for p in range(residual.sink_pages, len(blocks)) if blocks[p] in residual.slot_of),
                               len(blocks)))
        tails = [seq.blocks[p0:] for seq, p0 in zip(self.rows, starts)]
        old = list(dict.fromkeys(b for tail in tails for b in tail.tolist()))
        if not old:
            return
        new = alloc.allocate(len(old))  # (all or nothing: OutOfBlocksError)
        pairs = torch.stack([torch.tensor(old, dtype=torch.int64), new.to(torch.int64)], dim=1)
        try:
            self.store.copy_blocks(pairs)
        except BaseException:
            alloc.free(new)
            raise
        new_of = dict(zip(old, new.tolist()))
        mapped = [torch.tensor([new_of[b] for b in tail.tolist()], dtype=torch.int32) for tail in tails]
        alloc.share(torch.cat(mapped))  # one reference per row holding a new block; then allocate's goes
        alloc.free(new)
        alloc.free(torch.cat(tails))    # the fork's references to the shared blocks (the source still holds them)
        for seq, p0, blocks in zip(self.rows, starts, mapped):
            seq.blocks = torch.cat([seq.blocks[:p0], blocks])

    def __del__(self):
        try:
            self._release_rows()
        except Exception:  # interpreter shutdown
            pass

    # ---- prefix reuse ------------------------------------------------------------------------------
    def _namespace(self) -> Namespace:
        """The namespace of this cache's prefixes: the one given; the store's when it is this model's (an Engine's
        store holds its model's namespace, salt and all); else the model's own, so that another model sharing the
        store never reads this one's K/V (it did: an Engine for model A, a PagedCache for B on its store, and B's
        load_prefix served A's K/V)."""
        if self._given_namespace is not None:
            return self._given_namespace
        ns, owner = self.store.namespace, self.store.namespace_owner
        name = str(getattr(self.config, "_name_or_path", "") or "")
        if ns is not None and (owner is None or self.config is owner[0] or (name and name == owner[1])):
            return ns
        fmt = self.store.kv_format
        label = "" if fmt is None else "+".join(filter(None, (str(fmt), self.store.residual_label)))
        ns = Namespace(model=name or type(self.config).__name__, kv_format=label)
        if not name and self.config is not None:  # two models of one class, both unnamed: one key, other weights
            self.store.claim_namespace(ns, self.config, check=True)
        return ns

    def load_prefix(self, input_ids: torch.Tensor) -> int:
        """Starts an empty batch-1 cache with the longest cached prefix of ``input_ids`` (from the store's
        prefix cache) and returns its length; ``generate`` then prefills only the rest. At least one token
        is left to compute."""
        if self.store.prefix_cache is None:
            raise ValueError("this cache has no prefix cache (PagedCache(prefix_cache=True))")
        self._refuse_states("load_prefix")
        self._settle()  # (after a stopped first forward the cache is empty: a prefix may start it)
        tokens = torch.as_tensor(input_ids)
        if tokens.dim() > 2 or (tokens.dim() == 2 and tokens.shape[0] != 1):
            raise ValueError(f"input_ids has shape {tuple(tokens.shape)}: load_prefix starts a batch-1 cache, so it "
                             f"takes one row ([n] or [1, n]); for a batch, use kvcache.Engine or one cache per row")
        tokens = tokens.reshape(-1).cpu()
        if self.rows or self.get_seq_length():
            raise ValueError("load_prefix needs an empty cache")
        if not self.layers:  # (checked before the match takes any block: a refused call changes nothing)
            raise ValueError("load_prefix needs the number of layers: PagedCache(config=model.config) or "
                             "PagedCache(num_layers=...)")
        m = self.store.prefix_cache.match(tokens[:-1], self._namespace())
        if m.length == 0:
            return 0
        # a partial last page is shared too: it is copied on the first write (copy-on-write)
        seq = self.store.allocator.sequence(m)
        self.rows, self.pads = [seq], [0]
        shared = getattr(self.config, "num_kv_shared_layers", 0) or 0  # (Gemma 3n: its last layers read others' K/V)
        for layer in self.paged_layers:
            layer.length = m.length
            layer.takes_kv = not shared or layer.index < len(self.layers) - shared
        self._version += 1
        return m.length

    def save_prefix(self, input_ids: torch.Tensor, row: int = 0, *, attention_mask: torch.Tensor | None = None) -> int:
        """Caches row ``row``'s first ``len(input_ids)`` tokens in the prefix cache; returns how many were
        cached already. ``input_ids``: that row's ids (``[n]`` or ``[1, n]``) or the whole batch's
        (``[batch, n]``, left padding included, as the model was given them). Ids past what the row holds
        are left out (``generate``'s output: its last token has no K/V yet). The ids must be those the row's
        K/V were computed from: the cache sees K/V, not ids, so it cannot check them, and with other ids
        every later prompt that starts with those would be served this row's K/V.

        Left padding: with the ``"kvcache"`` attention the cache knows each row's pads and leaves them out. With
        eager/sdpa it never sees the mask, so a padded row's pages hold its pads as tokens, and its ids would be
        cached with the pads in front. Pass the ``attention_mask`` the model was given (shaped as ``input_ids``)
        and such a row is refused (a ValueError naming ``attention_mask``) instead of cached so; with it, right
        padding (trailing zeros) is left out too."""
        if self.store.prefix_cache is None:
            raise ValueError("this cache has no prefix cache (PagedCache(prefix_cache=True))")
        self._refuse_states("save_prefix")
        self._settle()  # (after a forward that stopped part-way: only what every layer holds is saved)
        batch = len(self.rows)
        if not batch:
            raise ValueError("save_prefix needs a cache that holds tokens (run the model with it first)")
        if isinstance(row, bool) or not isinstance(row, numbers.Integral) or not 0 <= row < batch:
            raise IndexError(f"row={row!r} is not a row of this cache's batch of {batch}")
        tokens = torch.as_tensor(input_ids)
        if tokens.dim() == 2 and tokens.shape[0] in (1, batch):  # one row's, or the batch's: take row `row`
            tokens = tokens[0 if tokens.shape[0] == 1 else row]
        elif tokens.dim() != 1:
            raise ValueError(f"input_ids has shape {tuple(tokens.shape)}: give row {row}'s ids ([n] or [1, n]) or "
                             f"the whole batch's ([{batch}, n])")
        tokens = tokens.cpu()
        if attention_mask is not None:
            tokens = self._unpadded_by_mask(tokens, attention_mask, row, batch)
        elif self.pads[row]:
            tokens = tokens[self.pads[row]:]
        seq = self.rows[row]
        n = min(len(tokens), seq.num_tokens, self.get_seq_length() - self.pads[row])
        return self.store.prefix_cache.insert(tokens[:n], seq.blocks[: -(-n // self.store.page_size)],
                                              self._namespace()).prefix_length

    def _unpadded_by_mask(self, tokens: torch.Tensor, attention_mask, row: int, batch: int) -> torch.Tensor:
        """Row ``row``'s ids without the padding ``attention_mask`` shows, refusing pads the pages hold as tokens."""
        mask = torch.as_tensor(attention_mask)
        if mask.dim() == 2 and mask.shape[0] in (1, batch):
            mask = mask[0 if mask.shape[0] == 1 else row]
        if mask.dim() != 1 or mask.shape[0] != tokens.shape[0]:
            raise ValueError(f"attention_mask has shape {tuple(torch.as_tensor(attention_mask).shape)}; it must be "
                             f"shaped as input_ids (row {row}: {tokens.shape[0]} ids)")
        keep = (mask.cpu() != 0).to(torch.int64)
        lead = int((keep.cumsum(0) == 0).sum())  # leading zeros: left padding
        real = int(keep.sum())
        if real and int(keep[lead:lead + real].sum()) != real:
            raise ValueError(f"attention_mask row {row} has zeros between its tokens ({keep.tolist()}): only left "
                             f"and right padding can be saved")
        if lead != self.pads[row]:
            known = (f"this cache saw {self.pads[row]} pads in row {row}" if self.pads[row] else
                     f"its pages hold them as tokens (with eager/sdpa attention the cache never sees the mask; "
                     f"model.set_attn_implementation(\"kvcache\") lets it leave pads out), so its K/V are not those "
                     f"of the unpadded prompt")
            raise ValueError(f"attention_mask shows {lead} left pads in row {row}, but {known}; nothing was cached")
        return tokens[lead:lead + real]

    # ---- accounting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Tokens, blocks, bytes (stored, reserved by the pools), internal waste, and the bytes an
        equivalent ``DynamicCache(config=config)`` would hold in the model's dtype (``dynamic_cache_bytes``:
        in a sliding-window layer DynamicCache keeps only the newest ``sliding_window - 1`` tokens of each
        row, where the pages hold every token, so on such models ``bytes`` can exceed it). With residual
        pages, ``residual_blocks`` of the blocks are also held in full precision, and ``bytes`` counts both
        copies. Held beside the pages, as DynamicCache holds them, and counted in neither: a hybrid model's
        states (``state_bytes``) and DeepSeek sparse attention's indexer keys (``indexer_bytes``).

        ``blocks`` (and ``bytes``, ``residual_blocks``) count distinct pages: rows that share pages
        (``batch_repeat_interleave``, beam search, ``deepcopy``, prefix hits) store them once. ``block_refs``
        counts each row's pages (a shared page once per row); ``tokens`` and ``waste_tokens`` are per row, the
        unused slots of every row's last page."""
        self._settle_quietly()
        page = self.store.page_size
        length = self.get_seq_length()
        tokens = sum(length - p for p in self.pads)
        # Rows share pages (batch_repeat_interleave, beam reorders, deepcopy, prefix hits): a page is stored once.
        held = {int(b) for s in self.rows for b in s.blocks.tolist()}
        blocks, block_refs = len(held), sum(len(s.blocks) for s in self.rows)
        per_block = self.store.bytes_per_block()
        residual_blocks = 0
        if self.store.residual is not None:
            open_blocks = self.store.residual.slot_of
            residual_blocks = sum(b in open_blocks for b in held)
        model_dtype = self._model_dtype()
        elem = torch.finfo(model_dtype).bits // 8 if model_dtype is not None else 2
        from . import _dynamic

        windows = _dynamic.layer_windows(self.config)  # per layer: None (every token) or its sliding window
        dense = 0
        for layer, pool in self.store.pools.items():
            window = windows[layer] if layer < len(windows) else None
            held = _dynamic.held_tokens(length, window)  # DynamicCache's rows are as long as the longest
            dense += len(self.rows) * held * pool.num_kv_heads * (pool.head_dim + pool.v_head_dim) * elem
        fmt = self.store.kv_format
        if fmt is None and model_dtype is not None:
            fmt = CacheFormat.parse(model_dtype)
        label = "+".join(filter(None, (str(fmt), self.store.residual_label))) if fmt is not None else "model dtype"
        return {
            "format": label,
            "rows": len(self.rows),
            "seq_length": length,
            "tokens": tokens,
            "blocks": blocks,
            "block_refs": block_refs,
            "page_size": page,
            "residual_blocks": residual_blocks,
            "bytes": blocks * per_block + residual_blocks * self.store.residual_bytes_per_block(),
            "pool_bytes": self.store.nbytes,
            "waste_tokens": block_refs * page - tokens,
            "waste_fraction": (block_refs * page - tokens) / (block_refs * page) if block_refs else 0.0,
            "dynamic_cache_bytes": dense,
            "state_bytes": self._state_bytes(),  # a hybrid model's own linear-attention/Mamba states (not paged)
            # DeepSeek sparse attention's indexer keys, held beside the pages (DynamicCache holds the same)
            "indexer_bytes": sum(layer.indexer_keys.numel() * layer.indexer_keys.element_size()
                                 for layer in self.paged_layers if layer.indexer_keys is not None),
        }

    def __repr__(self) -> str:
        s = self.stats()
        mode = "kvcache attention" if self.fused else "dense"
        return (f"PagedCache(layers={len(self.layers)}, rows={s['rows']}, seq_length={s['seq_length']}, "
                f"format={s['format']}, page_size={s['page_size']}, blocks={s['blocks']}, "
                f"bytes={_html.human_bytes(s['bytes'])} vs DynamicCache "
                f"{_html.human_bytes(s['dynamic_cache_bytes'])}, mode={mode})")

    def _repr_html_(self) -> str:
        s = self.stats()
        rows = {k: _html.human_bytes(v) if "bytes" in k else f"{v:.1%}" if k == "waste_fraction" else v for k, v in s.items()}
        prefix = self.store.prefix_cache
        if prefix is not None:
            p = prefix.stats()
            rows["prefix hit rate"] = f"{p['hit_rate']:.1%} ({p['hit_tokens']} of {p['lookup_tokens']} tokens)"
        return _html.table("kvcache.PagedCache", rows, "kvcache attention" if self.fused else "dense")

    # ---- internals -------------------------------------------------------------------------------
    def _model_dtype(self) -> torch.dtype | None:
        """The dtype of the model's K/V: as seen by a forward, else what the pages tell (a full-precision pool
        holds it, a residual pool too: e.g. right after load_prefix), else the config's; None if unknown."""
        first = self.layers[self._first_paged()] if self.layers else None
        if first is not None and first.is_initialized:
            return first.dtype
        for pool in list(self.store.pools.values()) + list(self.store.residual_pools.values()):
            if pool.k.is_floating_point() and pool.k.dtype.itemsize > 1 and not pool.format.k.quantized:
                return pool.k.dtype
        # transformers 5 names it dtype and warns when its torch_dtype property is read; a 4.x config may hold
        # only a torch_dtype attribute, read from its __dict__ (never through that property)
        dtype = getattr(self.config, "dtype", None)
        if dtype is None:
            dtype = vars(self.config).get("torch_dtype") if hasattr(self.config, "__dict__") else None
        return dtype if isinstance(dtype, torch.dtype) else None

    def _refuse_states(self, what: str) -> None:
        states = [(i, type(layer).__name__) for i, layer in enumerate(self.layers) if not isinstance(layer, PagedLayer)
                  and type(layer).__name__ != "DummyLayer"]
        if states:
            raise ValueError(f"{what} is not supported for a hybrid model: layer {states[0][0]} is a {states[0][1]} "
                             f"(a linear-attention/Mamba state of the whole history, not paged per token); use "
                             f"model.generate with a PagedCache of its own")
        indexed = indexed_layer(self.config)
        if indexed is not None:
            raise ValueError(f"{what} is not supported for DeepSeek sparse attention: layer {indexed} keeps indexer keys "
                             f"beside its pages (not paged, so not shared); use model.generate with a PagedCache of "
                             f"its own")

    def _state_tensors(self):
        for layer in self.state_layers:
            for group in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
                yield from (t for t in group.values() if t is not None)

    def _state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._state_tensors())

    def _state_batch(self) -> int:
        return next((int(t.shape[0]) for t in self._state_tensors()), 0)

    def _check_placement(self, key: torch.Tensor) -> None:
        if key.device.type == "meta":  # (it failed inside the first op, and left a pool on meta behind)
            raise ValueError("key_states is on the meta device: the pages hold real K/V (a model loaded on meta "
                             "must be materialized first)")
        if self.device is not None and key.device != self.device:
            raise ValueError(f"PagedCache(device={self.device}) got key_states on {key.device}")
        if self.dtype is not None and key.dtype != self.dtype:
            raise ValueError(f"PagedCache(dtype={self.dtype}) got key_states of dtype {key.dtype}")

    @property
    def _max_block(self) -> int:
        return max((int(s.blocks.max()) for s in self.rows if len(s.blocks)), default=-1)

    def _start_rows(self, batch: int, q_len: int, length: int, pending: Padding | None) -> None:
        pads = [0] * batch
        if (self.fused and length == 0 and pending is not None and pending.mask.shape[0] == batch
                and pending.mask.shape[1] == q_len):
            pads = leading_pads(pending.mask) or pads
        self.rows = [self.store.allocator.sequence() for _ in range(batch)]
        self.pads = pads
        self._version += 1
        self._first_forward_open = length == 0
        if length == 0:
            self._graph_dropped = False

    def _drop_graph(self) -> None:
        self._graph_dropped = self._graph_dropped or bool(self._graph)
        self._graph = {}

    def _release_rows(self) -> None:
        for seq in self.rows:
            self.store.allocator.release(seq)
        self._drop_graph()
        self.rows, self.pads = [], []
        self._first_forward_open = False
        self._plan = None
        self._planned_ahead = False
        self._unattended = None
        self._version += 1

    def _select_rows(self, sources: list[int], name: str) -> None:
        self._settle()  # (a forward that stopped part-way: what every layer holds is selected, and stays known)
        # Checked before anything moves: a refused selection leaves rows, pages and states as they were.
        n = len(self.rows) or self._state_batch()
        if n and not sources:  # a cache of no rows would still claim its tokens, and the next forward read them
            raise ValueError(f"{name} selects no row of the cache's {n}: a PagedCache keeps at least one row "
                             f"(reset() or free() empties it)")
        bad = [s for s in sources if not 0 <= s < n]
        if n and bad:
            raise IndexError(f"{name}: row index {bad[0]} is out of range for a cache of {n} rows")
        index = torch.tensor(sources, dtype=torch.long)
        for layer in self.paged_layers:  # DeepSeek sparse attention's indexer keys follow the rows
            layer._select_indexer(index)
        if self.state_layers and self._state_batch():  # a hybrid model's states follow the rows
            index = torch.tensor(sources, dtype=torch.long)
            for layer in self.state_layers:
                if hasattr(layer, "conv_states"):
                    layer.reorder_cache(index)
        if not self.rows:
            return
        alloc = self.store.allocator
        new_rows = [alloc.fork(self.rows[s]) for s in sources]
        new_pads = [self.pads[s] for s in sources]
        self._release_rows()
        self.rows, self.pads = new_rows, new_pads

    def _take_padding(self, layer_idx: int) -> Padding | None:
        # One forward's padding, left by the mask function: consumed (or dropped) by its first attention layer.
        # Only that layer reads the context variable: torch.compile before 2.14 cannot trace ContextVar.get, so
        # a read in every layer would break every layer's graph. A step planned ahead took it already.
        if layer_idx != self._first_paged():
            return None
        if self._planned_ahead:
            self._planned_ahead = False
            return None
        pending = PENDING_PADDING.get()
        if pending is not None:
            PENDING_PADDING.set(None)
        return pending

    def _has_state_layers(self) -> bool:
        return any(not isinstance(layer, PagedLayer) for layer in self.layers)

    @torch.compiler.disable
    def _reserve_ahead(self, q_len: int) -> None:
        """A hybrid model's state layers (linear attention, Mamba) may run before its first attention layer, which
        allocated the step's pages (eager/sdpa attention): a full pool then raised OutOfBlocksError after the states
        had taken the refused tokens (audit: the next forward 0.07 off DynamicCache's on Qwen3-Next). So its
        continuation steps are planned here, from get_mask_sizes, before the layer loop; the first layer's update
        finds the plan made (_step_plan). The "kvcache" attention plans here anyway (_plan_ahead)."""
        if self._external_plan is not None or not self.rows or not self.store.pools:
            return
        self._settle()  # (a forward that stopped part-way: planned from what the next forward keeps)
        first = self.layers[self._first_paged()] if self.layers else None
        if self.rows and isinstance(first, PagedLayer) and first.is_initialized:
            self._step_plan(first.length, q_len)
            self._rows_planned = True  # (this forward's: _settle at its first paged layer keeps it)

    @torch.compiler.disable
    def _plan_ahead(self, batch: int, q_len: int) -> None:
        """Plans the coming forward from the ``"kvcache"`` mask function, before the model's layer loop: the
        step's plan, the pools grown for it and every kernel plan the layers will ask for. Under torch.compile
        the planning's graph break is then outside the loop, so dynamo compiles the loop (a break inside a
        loop makes it run the loop eagerly). Only a continuation is planned (rows, pools and layers exist: a
        fresh prompt's pools come with its first K/V); anything else is left to ``update``, as before."""
        self._planned_ahead = False
        if self._external_plan is not None or not self.rows or not self.store.pools:
            return
        self._settle()  # (a forward that stopped part-way: planned from what the next forward keeps)
        if not self.rows or batch != len(self.rows):
            return
        first = self.layers[self._first_paged()] if self.layers else None
        if not isinstance(first, PagedLayer) or not first.is_initialized:
            return
        PENDING_PADDING.set(None)  # (rows exist: a continuation's padding is the rows' own)
        plan = self._step_plan(first.length, q_len)
        q_heads = getattr(self.config, "num_attention_heads", None)
        for layer, pool in list(self.store.pools.items()):
            heads = q_heads or pool.num_kv_heads
            on = plan.on(pool.k.device)
            if on.residual is None:
                on.kernel_plan(pool, heads)
                continue
            residual = self.store.residual_pools.get(layer)
            if residual is None:
                continue
            residual = self.store.residual_pool(layer, residual.k, on.residual.num_slots)
            on.residual.kernel_plans(pool, residual, heads)
            on.residual.seal_plan(pool)
        self._planned_ahead = self._rows_planned = True

    def _step_plan(self, length: int, q_len: int) -> StepPlan:
        plan = self._plan
        if plan is not None and plan.length == length and plan.q_len == q_len and plan.version == self._version:
            return plan  # every layer after the first: no graph break under torch.compile
        return self._new_step_plan(length, q_len)

    @torch.compiler.disable
    def _new_step_plan(self, length: int, q_len: int) -> StepPlan:
        # Once per forward, at its first layer: the allocator and the plan read the host's bookkeeping, which
        # torch.compile cannot trace. Disabled as a whole, it is one clean graph break per step; traced, its
        # breaks inside nested frames made dynamo run every decoder layer's frame eagerly.
        alloc = self.store.allocator
        self.store.compact_residual()
        end = length + q_len
        page = self.store.page_size
        if self.store.prefix_cache is None and alloc.num_free < len(self.rows) * (-(-q_len // page) + 1):
            self._check_room(alloc, end)  # (a nearly full pool: the whole batch's blocks, before any row takes some)
        for b, seq in enumerate(self.rows):  # room for the new tokens (copy-on-write of shared pages)
            need = end - self.pads[b] - seq.num_tokens
            if need > 0:
                copies = alloc.append(seq, need)
                self.store.copy_blocks(copies)
        self.store.ensure_blocks(self._max_block + 1)
        self._version += 1
        device = next((p.k.device for p in self.store.pools.values()), None) or self.layers[self._first_paged()].device
        self._plan = plan = plan_step(self.rows, [length - p for p in self.pads], [q_len] * len(self.rows),
                                      packed=False, page_size=self.store.page_size, device=device,
                                      residual=self.store.residual, length=length, version=self._version)
        return plan

    def _check_room(self, alloc: BlockAllocator, end: int) -> None:
        """OutOfBlocksError unless the pool's free blocks cover every row's new pages (and a copy of a shared partial
        last page): rows took blocks one after another, so the last row's refusal named its own need against a pool
        its batch-mates had just emptied ("needs 3 blocks, 0 free of 6" while the cache held none), and the rows
        before it kept theirs. Only without a prefix cache, whose evictions the allocator makes when short."""
        page, need = self.store.page_size, []
        for b, seq in enumerate(self.rows):
            tokens = end - self.pads[b] - seq.num_tokens
            if tokens <= 0:
                need.append(0)
                continue
            held = seq.blocks.numel()
            shared = seq.num_tokens % page and held and alloc.refcount(int(seq.blocks[-1])) > 1
            need.append(-(-(seq.num_tokens + tokens) // page) - held + bool(shared))
        if sum(need) > alloc.num_free:
            raise OutOfBlocksError(f"out of blocks: this forward's {len(need)} rows need {sum(need)} more blocks of {page} tokens "
                                   f"(per row: {need}), but {alloc.num_free} of the pool's {alloc.num_blocks} are free "
                                   f"(max_tokens={self.store.max_tokens}); the cache is unchanged")

    def _dense(self, layer_idx: int, dtype: torch.dtype, new_k: torch.Tensor | None = None,
               new_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V as ``[batch, kv_heads, length, head_dim]`` (pad slots that were not stored are zero).
        Given this forward's K/V (``new_k``, ``new_v``) while autograd records, its tokens carry their gradient
        (:func:`with_gradient`)."""
        pool = self.store.pools[layer_idx]
        length = self.layers[layer_idx].length
        k, v = self._right_align(*self._gather(layer_idx, self._plan.on(pool.k.device), length, dtype), length)
        if wants_grad(new_k, new_v):
            for start, seg_k, seg_v in self._graph.get(layer_idx, []):  # this forward's tokens are the last
                k, v = with_gradient(k, seg_k, start), with_gradient(v, seg_v, start)
        return k, v

    def _read_layer(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A layer's K/V as :meth:`_dense` gives them, outside a forward (no step plan): for ``PagedLayer.keys``."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        pool = self.store.pools.get(layer_idx)
        if not isinstance(layer, PagedLayer) or pool is None or not self.rows or layer.length == 0:
            return None, None
        length = layer.length
        lens = torch.tensor([max(0, length - p) for p in self.pads], dtype=torch.int32)
        width = max(1, max(len(seq.blocks) for seq in self.rows))
        tables = torch.zeros(len(self.rows), width, dtype=torch.int32)
        for b, seq in enumerate(self.rows):
            tables[b, : len(seq.blocks)] = seq.blocks
        tables, lens = tables.to(pool.k.device), lens.to(pool.k.device)
        dtype = getattr(layer, "dtype", None) or (pool.k.dtype if pool.k.is_floating_point() else torch.float32)
        if self.store.residual is not None and layer_idx in self.store.residual_pools:
            k, v = res.gather_now(self.store.residual, pool, self.store.residual_pools[layer_idx], tables, lens,
                                  length, dtype)
        else:
            k, v = _gather_pool(pool, tables, lens, length, dtype)
        return self._right_align(k, v, length)

    def _right_align(self, k: torch.Tensor, v: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' stored tokens (left-aligned by the gather) behind their left padding, which is zero."""
        if not any(self.pads):
            return k, v
        k_out, v_out = torch.zeros_like(k), torch.zeros_like(v)
        for b, pad in enumerate(self.pads):
            k_out[b, :, pad:] = k[b, :, : length - pad]
            v_out[b, :, pad:] = v[b, :, : length - pad]
        return k_out, v_out

    def _packed(self, layer_idx: int, plan: StepPlan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed step's K/V for attention in PyTorch: every row's stored tokens, row after row, as
        ``[1, kv_heads, sum(seq_lens), head_dim]``; the step's owner (:class:`kvcache.Engine`) hands the model
        the 4-D mask that keeps each query to its own row's keys (:func:`packed_attention_mask`)."""
        lens = plan._host[1] if plan._host is not None else plan.seq_lens.cpu()
        max_len = int(lens.max()) if lens.numel() else 0
        k, v = self._gather(layer_idx, plan, max_len, dtype)
        keep = (torch.arange(max_len, device=k.device).view(1, -1) < plan.seq_lens.view(-1, 1).to(torch.int64))
        return k.transpose(1, 2)[keep].transpose(0, 1).unsqueeze(0), v.transpose(1, 2)[keep].transpose(0, 1).unsqueeze(0)

    def _gather(self, layer_idx: int, plan: StepPlan, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K/V of ``plan``'s rows as padded ``[batch, kv_heads, length, head_dim]`` (V rows as wide as
        the V pool's) in ``dtype``, left-aligned."""
        pool = self.store.pools[layer_idx]
        if plan.residual is not None:
            k, v = res.gather(plan.residual, pool, self.store.residual_pools[layer_idx], plan.block_tables,
                              plan.seq_lens, length, dtype)
        else:
            k, v = _gather_pool(pool, plan.block_tables, plan.seq_lens, length, dtype)
        return k, v


def _gather_pool(pool, tables: torch.Tensor, seq_lens: torch.Tensor, length: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One pool's K/V of ``tables``' rows, ``[batch, kv_heads, length, head_dim]`` in ``dtype``."""
    if pool.k.is_floating_point():  # full precision: gather as stored, then cast if the model differs
        k, v = pool.gather(tables, seq_lens, max_len=length)
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))
    return pool.gather(tables, seq_lens, max_len=length, dtype=dtype)


def packed_attention_mask(plan: StepPlan, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The additive ``[1, 1, total_q, total_kv]`` mask of a packed step whose K/V are :meth:`PagedCache._packed`'s
    (row after row): query ``i`` of row ``b`` (at position ``seq_lens[b] - q_len_b + i``) sees the keys of row
    ``b`` at positions up to its own (and, with a sliding ``window``, after ``position - window``); 0 where it
    may attend, the dtype's lowest value elsewhere."""
    seq_lens = plan._host[1] if plan._host is not None else plan.seq_lens.cpu()
    cu_q = plan._host[2] if plan._host is not None else plan.cu_q_lens.cpu()
    lens, q_lens = seq_lens.to(torch.int64), (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    row_q = torch.repeat_interleave(torch.arange(len(lens)), q_lens)                 # [total_q]: each query's row
    row_k = torch.repeat_interleave(torch.arange(len(lens)), lens)                   # [total_kv]: each key's row
    kv_start = torch.cumsum(lens, 0) - lens
    pos_q = torch.arange(int(q_lens.sum())) - (torch.cumsum(q_lens, 0) - q_lens)[row_q] + (lens - q_lens)[row_q]
    pos_k = torch.arange(int(lens.sum())) - kv_start[row_k]
    allowed = (row_q.view(-1, 1) == row_k.view(1, -1)) & (pos_k.view(1, -1) <= pos_q.view(-1, 1))
    if window:  # a sliding window: keys at positions > p - window
        allowed &= pos_k.view(1, -1) > pos_q.view(-1, 1) - window
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, *allowed.shape).to(plan.seq_lens.device)



