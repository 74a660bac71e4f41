"""Hugging Face transformers drop-in: :class:`PagedCache` as ``past_key_values``, and the ``"kvcache"``
attention implementation that reads the pages in place.

>>> import torch, kvcache, transformers
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                                   num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.LlamaForCausalLM(config).eval()
>>> cache = kvcache.PagedCache(config=model.config, kv_format="int8")
>>> out = model.generate(torch.tensor([[1, 2, 3]]), past_key_values=cache, max_new_tokens=4, do_sample=False)
>>> cache.get_seq_length(), cache.stats()["format"]
(6, 'int8')

Two ways to attend:

- *dense* (any ``attn_implementation``: ``eager``, ``sdpa``...): ``update`` writes the new K/V into the
  pages with :func:`kvcache.append` and returns the layer's whole K/V through :func:`kvcache.paged_gather`,
  so every model works unchanged (and, in full precision, bit-identically to ``DynamicCache``).
- *fused* (``model.set_attn_implementation("kvcache")``): ``update`` only writes, and the registered
  attention function runs :func:`kvcache.paged_attention` over the pages (dequantizing in registers):
  no per-step copy of the history. Leading (left) padding is never stored; other masks fall back to
  the dense path, so results stay correct.

The pages of all layers share one :class:`kvcache.BlockAllocator` (a :class:`PagedStore`). Copies of a
cache (``copy.deepcopy``, beam-search reordering, ``batch_select_indices``...) share pages copy-on-write:
full pages are shared, a shared partial page is copied on its first write.
"""

from __future__ import annotations

import contextvars
import copy
import importlib.abc
import importlib.machinery
import inspect
import math
import sys
from dataclasses import dataclass, field

import torch

from .formats import CacheFormat
from . import residual as res
from .pool import KVPool
from .prefix import BlockAllocator, Namespace, PrefixCache, Sequence
from .residual import ResidualPages, ResidualPlan

__all__ = ["PagedCache", "PagedStore", "ATTENTION_NAME", "register_attention"]

ATTENTION_NAME = "kvcache"

try:  # transformers is optional for the rest of kvcache
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError:  # pragma: no cover - exercised only without transformers
    Cache, CacheLayerMixin = object, object

# KIVI's default full-precision window (the paper's residual length R)
KIVI_RESIDUAL_LENGTH = 128

# Block ids the allocator may hand out when no max_tokens is given: the pools themselves grow on demand,
# so this is a budget, not memory (4M tokens at page 16).
_UNBOUNDED_BLOCKS = 1 << 18


# ---- storage shared by caches -------------------------------------------------------------------
class PagedStore:
    """The pages of every layer plus the allocator of their block ids (and an optional prefix cache).

    One store may back several :class:`PagedCache` objects (copies, an :class:`kvcache.Engine`'s
    requests): each holds references on the blocks it uses. Pools are allocated per layer on first use,
    with that layer's kv heads, head_dim and device, and grow (doubling) as block ids are handed out,
    unless ``max_tokens`` fixes their size up front.

    With a quantized format, ``residual_length`` (the newest tokens of every sequence; default
    ``None``: 128 for KIVI formats, as in the KIVI paper, else 0) and ``residual_sink_tokens`` (its first
    tokens, in whole pages) stay in the model's dtype, in residual pools beside the quantized ones
    (:mod:`kvcache.residual`); KIVI formats always use them, since a KIVI page is quantized only once it
    is complete.
    """

    def __init__(self, *, page_size: int = 16, kv_format=None, max_tokens: int | None = None,
                 prefix_cache: bool | PrefixCache = False, namespace: Namespace | None = None,
                 allocator: BlockAllocator | None = None, residual_length: int | None = None,
                 residual_sink_tokens: int = 0):
        if max_tokens is not None and max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens} must be positive")
        if (residual_length or 0) < 0 or residual_sink_tokens < 0:
            raise ValueError(f"residual_length={residual_length} and residual_sink_tokens={residual_sink_tokens} "
                             f"must be >= 0")
        self.page_size = int(page_size)
        self.kv_format = None if kv_format is None else CacheFormat.parse(kv_format)
        self.max_tokens = max_tokens
        budget = _UNBOUNDED_BLOCKS if max_tokens is None else -(-max_tokens // self.page_size)
        if isinstance(prefix_cache, PrefixCache):
            self.prefix_cache = prefix_cache
            self.allocator = prefix_cache.allocator
            if self.allocator.page_size != self.page_size:
                raise ValueError(f"the prefix cache's page_size={self.allocator.page_size} differs from "
                                 f"page_size={self.page_size}")
        else:
            self.allocator = allocator or BlockAllocator(budget, self.page_size)
            if self.allocator.page_size != self.page_size:
                raise ValueError(f"the allocator's page_size={self.allocator.page_size} differs from "
                                 f"page_size={self.page_size}")
            self.prefix_cache = PrefixCache(self.allocator) if prefix_cache else None
        if allocator is not None or isinstance(prefix_cache, PrefixCache):
            self.max_tokens = self.allocator.num_blocks * self.page_size  # someone else's budget: fixed
        self.namespace = namespace
        self.pools: dict[int, KVPool] = {}
        self.fixed_size = self.max_tokens is not None
        fmt = self.kv_format
        quantized = fmt is not None and (fmt.k.quantized or fmt.v.quantized)
        kivi = fmt is not None and (fmt.k.kind.startswith("kivi") or fmt.v.kind.startswith("kivi"))
        if residual_length is None:
            residual_length = KIVI_RESIDUAL_LENGTH if kivi else 0
        self.residual: ResidualPages | None = None
        self.residual_pools: dict[int, KVPool] = {}
        if quantized and (residual_length or residual_sink_tokens or kivi):
            self.residual = ResidualPages(self.page_size, residual_length, -(-residual_sink_tokens // self.page_size))
            self.residual.is_live = lambda block: self.allocator.refcount(block) > 0

    @property
    def residual_label(self) -> str:
        """The residual settings as text (part of the prefix cache's namespace): "" when there are none."""
        r = self.residual
        if r is None:
            return ""
        return f"residual={r.window}" + (f",sinks={r.sink_pages * self.page_size}" if r.sink_pages else "")

    @property
    def capacity_blocks(self) -> int:
        return self.allocator.num_blocks

    def pool(self, layer: int, key: torch.Tensor, value: torch.Tensor, min_blocks: int) -> KVPool:
        """Layer ``layer``'s pool, created from the first K/V it sees and grown to ``min_blocks``."""
        pool = self.pools.get(layer)
        if pool is None:
            _, heads, _, dim = key.shape
            if value.shape[1] != heads or value.shape[3] != dim:
                raise ValueError(f"layer {layer}: value heads/head_dim {tuple(value.shape[1::2])} differ from the "
                                 f"key's ({heads}, {dim}); kvcache pages need equal K and V shapes")
            fmt = self.kv_format or CacheFormat.parse(key.dtype)
            blocks = self.capacity_blocks if self.fixed_size else _grown(0, min_blocks)
            pool = KVPool.allocate(blocks, self.page_size, heads, dim, fmt, device=key.device)
            self.pools[layer] = pool
        elif pool.num_blocks < min_blocks:
            pool = self.pools[layer] = _grow_pool(pool, _grown(pool.num_blocks, min_blocks))
        return pool

    def residual_pool(self, layer: int, key: torch.Tensor, min_blocks: int) -> KVPool:
        """Layer ``layer``'s full-precision residual pool (the model's dtype), grown to ``min_blocks``."""
        pool = self.residual_pools.get(layer)
        if pool is None:
            _, heads, _, dim = key.shape
            pool = KVPool.allocate(_grown(0, min_blocks), self.page_size, heads, dim, key.dtype, device=key.device)
            self.residual_pools[layer] = pool
        elif pool.num_blocks < min_blocks:
            pool = self.residual_pools[layer] = _grow_pool(pool, _grown(pool.num_blocks, min_blocks))
        return pool

    def ensure_blocks(self, min_blocks: int) -> None:
        """Grows every pool so that block ids below ``min_blocks`` are valid."""
        for layer, pool in list(self.pools.items()):
            if pool.num_blocks < min_blocks:
                self.pools[layer] = _grow_pool(pool, _grown(pool.num_blocks, min_blocks))

    def copy_blocks(self, copies: torch.Tensor) -> None:
        """Applies the allocator's copy-on-write (src, dst) pairs to every layer's pool."""
        if len(copies):
            self.ensure_blocks(int(copies.max()) + 1)
            from . import ops
            for pool in self.pools.values():
                if not (pool.format.k.quantized or pool.format.v.quantized):
                    ops.copy_blocks(pool.k, pool.v, copies)
                    continue
                src, dst = copies[:, 0].to(pool.k.device), copies[:, 1].to(pool.k.device)
                for role in ("k", "v"):  # codes, and the per-row / per-group scales that travel with them
                    for t in (getattr(pool, role), getattr(pool, f"{role}_scale")):
                        if t is not None and t.dim() >= 3:
                            t.index_copy_(0, dst, t.index_select(0, src))
            if self.residual is not None:  # open pages are copied in the residual pools
                moves = self.residual.copy_on_write([tuple(p) for p in copies.tolist()])
                for layer, pool in list(self.residual_pools.items()):
                    if moves:
                        pool = self.residual_pool(layer, pool.k, self.residual.num_slots)
                        ops.copy_blocks(pool.k, pool.v, torch.tensor(moves, dtype=torch.int64, device=pool.k.device))

    def clear(self) -> None:
        """Drops every pool's memory (the allocator must hold no blocks)."""
        self.pools.clear()
        self.residual_pools.clear()
        if self.residual is not None:
            self.residual.reset()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values()) + sum(p.nbytes for p in self.residual_pools.values())

    def residual_bytes_per_block(self) -> int:
        return sum(p.nbytes // p.num_blocks for p in self.residual_pools.values())

    def bytes_per_block(self) -> int:
        return sum(p.nbytes // p.num_blocks for p in self.pools.values())


def _grown(current: int, needed: int) -> int:
    return max(needed, 2 * current, 16)


def _grow_pool(pool: KVPool, blocks: int) -> KVPool:
    """A copy of ``pool`` with ``blocks`` blocks (the old ones copied, fp8 per-head scales kept)."""
    new = KVPool.allocate(blocks, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.format, device=pool.k.device)
    n = pool.num_blocks
    new.k[:n].copy_(pool.k)
    new.v[:n].copy_(pool.v)
    for role in ("k", "v"):
        old, grown = getattr(pool, f"{role}_scale"), getattr(new, f"{role}_scale")
        if old is None:
            continue
        if old.dim() == 1:  # per kv head (fp8): the whole tensor
            grown.copy_(old)
        else:
            grown[:n].copy_(old)
    new._scales_set = dict(pool._scales_set)
    return new


# ---- padding hand-over from the mask function to update() ---------------------------------------
# The mask function runs at the start of each forward, before the first layer's update(); it leaves
# the left padding of a fresh prompt here so that the cache never stores pad tokens in fused mode.
@dataclass
class _Padding:
    mask: torch.Tensor  # [batch, kv_length] bool
    q_length: int


_PENDING_PADDING: contextvars.ContextVar[_Padding | None] = contextvars.ContextVar("kvcache_padding", default=None)


def _leading_pads(mask: torch.Tensor) -> list[int] | None:
    """Per-row count of leading False entries, or None if some row has a False after a True."""
    m = mask.to(torch.bool)
    pads = (~m).to(torch.int32).cumprod(dim=1).sum(dim=1)
    expected = torch.arange(m.shape[1], device=m.device).unsqueeze(0) >= pads.unsqueeze(1)
    if not torch.equal(expected, m):
        return None
    return pads.tolist()


# ---- the cache ----------------------------------------------------------------------------------
class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a :class:`PagedCache`: its length; the pages live in the store."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: "PagedCache", index: int):
        super().__init__()
        self.cache, self.index, self.length = cache, index, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.index)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # an int query length (5.4+) or the cache_position tensor (4.57 - 5.3)
        q = int(query_length.shape[0]) if torch.is_tensor(query_length) else int(query_length)
        return self.length + q, 0

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


@dataclass
class _StepPlan:
    """Index tensors of one forward (shared by its layers): where the new tokens go, and the tables."""

    length: int            # slots per row before the step (pads included)
    q_len: int
    version: int
    slot_mapping: torch.Tensor   # [batch, q_len] int64, -1 for pads that are not stored
    block_tables: torch.Tensor   # [batch, max_blocks] int32
    seq_lens: torch.Tensor       # [batch] int32: stored tokens after the step
    cu_q_lens: torch.Tensor      # [batch + 1] int32: stored queries
    query_rows: torch.Tensor | None  # rows of [batch * q_len] that are stored, None = all
    num_blocks: int              # 1 + the largest block id in the tables
    residual: ResidualPlan | None = None  # with residual pools: their part of the step
    _copies: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> "_StepPlan":
        """The plan with its tensors on ``device`` (layers may live on different devices)."""
        if self.slot_mapping.device == device:
            return self
        if device not in self._copies:
            move = {name: getattr(self, name) for name in ("slot_mapping", "block_tables", "seq_lens", "cu_q_lens",
                                                           "query_rows")}
            move = {k: None if v is None else v.to(device) for k, v in move.items()}
            self._copies[device] = _StepPlan(self.length, self.q_len, self.version, num_blocks=self.num_blocks,
                                             residual=None if self.residual is None else self.residual.on(device),
                                             **move)
        return self._copies[device]


class PagedCache(Cache):
    """A paged, optionally quantized KV cache usable as ``past_key_values`` of transformers models.

    Args:
        config: the model config (``model.config``): gives the number of layers and lets the cache see
            which attention implementation the model uses. Without it, layers are created as they come.
        page_size: tokens per page (a power of two).
        kv_format: storage format of K and V, e.g. ``"int8"``, ``"k=int8,v=int4"``,
            :class:`kvcache.CacheFormat`; default: the model's dtype (full precision).
        max_tokens: size the pool for this many tokens (all rows together) up front; by default it grows.
        device, dtype: only checked against the tensors the model passes (pages follow the model).
        sink_tokens: with a sliding-window model and ``"kvcache"`` attention, the first tokens stay
            visible (StreamingLLM attention sinks).
        residual_length: with a quantized ``kv_format``, the newest ``residual_length`` tokens of every row
            stay in the model's dtype (as HF QuantizedCache's ``residual_length``; KIVI's window): their
            pages are quantized once they are older (:mod:`kvcache.residual`). Default: 128 for KIVI
            formats (which also keep the page being written in full precision), 0 for the others.
        residual_sink_tokens: the first tokens of every row (in whole pages) are never quantized.
        store: share the pages (and allocator, prefix cache) of another cache or an Engine.
        prefix_cache: keep a :class:`kvcache.PrefixCache` over the pages (``True``), or use the given one
            (its allocator then numbers the pages); see :meth:`load_prefix` / :meth:`save_prefix`.
        allocator: number the pages with this :class:`kvcache.BlockAllocator` (its size bounds the pool).
    """

    def __init__(self, config=None, *, page_size: int = 16, kv_format=None, max_tokens: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, sink_tokens: int = 0,
                 store: PagedStore | None = None, prefix_cache: bool | PrefixCache = False,
                 allocator: BlockAllocator | None = None, num_layers: int | None = None,
                 residual_length: int | None = None, residual_sink_tokens: int = 0):
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if num_layers is None and text_config is not None:
            num_layers = getattr(text_config, "num_hidden_layers", None)
        if store is None:
            store = PagedStore(page_size=page_size, kv_format=kv_format, max_tokens=max_tokens,
                               prefix_cache=prefix_cache, allocator=allocator, residual_length=residual_length,
                               residual_sink_tokens=residual_sink_tokens)
        self.store = store
        self.config = text_config
        self.device = None if device is None else torch.device(device)
        self.dtype = dtype
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens={sink_tokens} must be >= 0")
        self.sink_tokens = int(sink_tokens)
        if self.sink_tokens and store.residual is not None:
            raise ValueError(f"sink_tokens={sink_tokens} (attention sinks of a sliding window) cannot be combined with "
                             f"residual pages ({store.residual_label}, format {store.kv_format}): the kernel's window "
                             f"needs every token at its position in one pool")
        self.rows: list[Sequence] = []   # per batch row: its stored tokens (pads not stored)
        self.pads: list[int] = []        # per batch row: leading pad slots that were not stored
        self._version = 0
        self._plan: _StepPlan | None = None
        self._dense_row_mode = False
        layers = [PagedLayer(self, i) for i in range(num_layers)] if num_layers else []
        super().__init__(layers=layers)

    # ---- what transformers calls -----------------------------------------------------------------
    @property
    def fused(self) -> bool:
        """Whether the model attends with the ``"kvcache"`` implementation (update then only writes)."""
        return getattr(self.config, "_attn_implementation", None) == ATTENTION_NAME

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Writes the new K/V ``[batch, kv_heads, q_len, head_dim]`` of layer ``layer_idx`` into the pages.

        Returns the layer's whole K/V (dense mode) or the new K/V tagged for the ``"kvcache"``
        attention function (fused mode)."""
        while len(self.layers) <= layer_idx:
            self.layers.append(PagedLayer(self, len(self.layers)))
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            self._check_placement(key_states)
            layer.lazy_initialization(key_states, value_states)
        batch, _, q_len, _ = key_states.shape
        pending = _PENDING_PADDING.get()
        if layer_idx == 0 and pending is not None:
            _PENDING_PADDING.set(None)  # one forward's padding: consumed (or dropped) by its first layer
        if not self.rows:
            self._start_rows(batch, q_len, layer.length, pending)
        elif batch != len(self.rows):
            raise ValueError(f"key_states has batch {batch} but the cache holds {len(self.rows)} rows; beam search "
                             f"and num_return_sequences need an empty cache (or cache.batch_repeat_interleave)")
        if self.sink_tokens and not self.fused:
            raise ValueError(f"sink_tokens={self.sink_tokens} needs the kernel's attention: "
                             f"model.set_attn_implementation('kvcache') (transformers' masks have no sinks)")
        plan = self._step_plan(layer.length, q_len).on(key_states.device)
        pool = self.store.pool(layer_idx, key_states, value_states, plan.num_blocks)
        if plan.residual is not None:  # seal what aged, write the new tokens in full precision
            residual = self.store.residual_pool(layer_idx, key_states, plan.residual.num_slots)
            res.apply(plan.residual, pool, residual, key_states, value_states)
        elif pool.k.is_floating_point() and pool.k.dtype != key_states.dtype:  # e.g. bf16 pages, fp32 model
            pool.append(key_states.to(pool.k.dtype), value_states.to(pool.v.dtype), plan.slot_mapping)
        else:
            pool.append(key_states, value_states, plan.slot_mapping)
        layer.length += q_len
        if self.fused:
            k = key_states.view(key_states.shape)  # a fresh tensor object to carry the tag
            k._kvcache = (self, layer_idx, plan)
            return k, value_states
        return self._dense(layer_idx, key_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].length

    def reset(self) -> None:
        """Empties the cache (its pages go back to the allocator); the pools stay allocated."""
        self._release_rows()
        for layer in self.layers:
            layer.length = 0

    def free(self) -> None:
        """Empties the cache and, unless the store is shared with a prefix cache, drops the pools' memory."""
        self.reset()
        if self.store.prefix_cache is None and self.store.allocator.num_free == self.store.allocator.num_blocks:
            self.store.clear()

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]``: block tables are rewired, pages shared copy-on-write."""
        self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([i for i in range(len(self.rows)) for _ in range(int(repeats))])

    def crop(self, tokens_to_remove: int | None = None, **kwargs) -> None:
        """``crop(-n)`` drops the newest ``n`` tokens; ``crop(0)`` does nothing; ``crop(n > 0)`` (the
        transformers < 5.14 convention) keeps the first ``n``. Exact for every format: the dropped slots
        are simply rewritten later."""
        if tokens_to_remove is None:  # older keyword names
            tokens_to_remove = next(kwargs[k] for k in ("max_length", "maximum_length", "tokens_to_remove") if k in kwargs)
        n = int(tokens_to_remove)
        length = self.get_seq_length()
        new_len = max(0, length + n) if n < 0 else (length if n == 0 else min(n, length))
        if new_len == length:
            return
        if any(layer.length != length for layer in self.layers):
            raise RuntimeError("crop in the middle of a forward (layers hold different lengths)")
        alloc, page = self.store.allocator, self.store.page_size
        for b, seq in enumerate(self.rows):
            self.pads[b] = min(self.pads[b], new_len)
            stored = new_len - self.pads[b]
            keep = -(-stored // page)
            if keep < len(seq.blocks):
                alloc.free(seq.blocks[keep:])
                seq.blocks = seq.blocks[:keep].clone()
            seq.num_tokens = stored
        for layer in self.layers:
            layer.length = new_len
        self._version += 1

    def activate_past_recording(self) -> None:  # nothing is ever evicted from the pages
        pass

    def __deepcopy__(self, memo) -> "PagedCache":
        """An independent copy that shares the pages copy-on-write (no data is copied until a write)."""
        other = copy.copy(self)
        other.layers = []
        for layer in self.layers:
            new_layer = copy.copy(layer)
            new_layer.cache = other
            other.layers.append(new_layer)
        other.rows = [self.store.allocator.fork(seq) for seq in self.rows]
        other.pads = list(self.pads)
        other._plan = None
        return other

    def __del__(self):
        try:
            self._release_rows()
        except Exception:  # interpreter shutdown
            pass

    # ---- prefix reuse ------------------------------------------------------------------------------
    def _namespace(self):
        ns = self.store.namespace
        if ns is None:
            fmt = self.store.kv_format
            label = "" if fmt is None else "+".join(filter(None, (str(fmt), self.store.residual_label)))
            ns = Namespace(model=str(getattr(self.config, "_name_or_path", "") or type(self.config).__name__),
                           kv_format=label)
        return ns

    def load_prefix(self, input_ids: torch.Tensor) -> int:
        """Starts an empty batch-1 cache with the longest cached prefix of ``input_ids`` (from the store's
        prefix cache) and returns its length; ``generate`` then prefills only the rest. At least one token
        is left to compute."""
        if self.store.prefix_cache is None:
            raise ValueError("this cache has no prefix cache (PagedCache(prefix_cache=True))")
        tokens = torch.as_tensor(input_ids).reshape(-1).cpu()
        if self.rows or self.get_seq_length():
            raise ValueError("load_prefix needs an empty cache")
        m = self.store.prefix_cache.match(tokens[:-1], self._namespace())
        if m.length == 0:
            return 0
        # a partial last page is shared too: it is copied on the first write (copy-on-write)
        seq = self.store.allocator.sequence(m)
        self.rows, self.pads = [seq], [0]
        if not self.layers:
            raise ValueError("load_prefix needs the number of layers (PagedCache(config=...))")
        for layer in self.layers:
            layer.length = m.length
        self._version += 1
        return m.length

    def save_prefix(self, input_ids: torch.Tensor, row: int = 0) -> int:
        """Caches row ``row``'s first ``len(input_ids)`` tokens (which must be what it holds) in the prefix
        cache; returns how many were cached already."""
        if self.store.prefix_cache is None:
            raise ValueError("this cache has no prefix cache (PagedCache(prefix_cache=True))")
        tokens = torch.as_tensor(input_ids).reshape(-1).cpu()
        if self.pads[row]:
            tokens = tokens[self.pads[row]:]
        seq = self.rows[row]
        n = min(len(tokens), seq.num_tokens, self.get_seq_length() - self.pads[row])
        return self.store.prefix_cache.insert(tokens[:n], seq.blocks[: -(-n // self.store.page_size)],
                                              self._namespace()).prefix_length

    # ---- accounting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Tokens, blocks, bytes (stored, reserved by the pools), internal waste, and the bytes an
        equivalent ``DynamicCache`` would hold in the model's dtype. With residual pages, ``residual_blocks``
        of the blocks are also held in full precision, and ``bytes`` counts both copies."""
        page = self.store.page_size
        length = self.get_seq_length()
        tokens = sum(length - p for p in self.pads)
        blocks = sum(len(s.blocks) for s in self.rows)
        per_block = self.store.bytes_per_block()
        residual_blocks = 0
        if self.store.residual is not None:
            open_blocks = self.store.residual.slot_of
            residual_blocks = sum(int(b) in open_blocks for s in self.rows for b in s.blocks.tolist())
        dense = 0
        for pool in self.store.pools.values():
            elem = torch.finfo(self.layers[0].dtype).bits // 8 if self.layers and self.layers[0].is_initialized else 2
            dense += 2 * len(self.rows) * length * pool.num_kv_heads * pool.head_dim * elem
        fmt = self.store.kv_format
        if fmt is None and self.layers and self.layers[0].is_initialized:
            fmt = CacheFormat.parse(self.layers[0].dtype)
        label = "+".join(filter(None, (str(fmt), self.store.residual_label))) if fmt is not None else "model dtype"
        return {
            "format": label,
            "rows": len(self.rows),
            "seq_length": length,
            "tokens": tokens,
            "blocks": blocks,
            "page_size": page,
            "residual_blocks": residual_blocks,
            "bytes": blocks * per_block + residual_blocks * self.store.residual_bytes_per_block(),
            "pool_bytes": self.store.nbytes,
            "waste_tokens": blocks * page - tokens,
            "waste_fraction": (blocks * page - tokens) / (blocks * page) if blocks else 0.0,
            "dynamic_cache_bytes": dense,
        }

    def __repr__(self) -> str:
        s = self.stats()
        mode = "kvcache attention" if self.fused else "dense"
        return (f"PagedCache(layers={len(self.layers)}, rows={s['rows']}, seq_length={s['seq_length']}, "
                f"format={s['format']}, page_size={s['page_size']}, blocks={s['blocks']}, "
                f"bytes={_human(s['bytes'])} vs DynamicCache {_human(s['dynamic_cache_bytes'])}, mode={mode})")

    def _repr_html_(self) -> str:
        s = self.stats()
        rows = "".join(f"<tr><td>{k}</td><td>{_human(v) if 'bytes' in k else v}</td></tr>" for k, v in s.items())
        return f"<b>kvcache.PagedCache</b> ({'kvcache attention' if self.fused else 'dense'})<table>{rows}</table>"

    # ---- internals -------------------------------------------------------------------------------
    def _check_placement(self, key: torch.Tensor) -> None:
        if self.device is not None and key.device != self.device:
            raise ValueError(f"PagedCache(device={self.device}) got key_states on {key.device}")
        if self.dtype is not None and key.dtype != self.dtype:
            raise ValueError(f"PagedCache(dtype={self.dtype}) got key_states of dtype {key.dtype}")

    @property
    def _max_block(self) -> int:
        return max((int(s.blocks.max()) for s in self.rows if len(s.blocks)), default=-1)

    def _start_rows(self, batch: int, q_len: int, length: int, pending: _Padding | None) -> None:
        pads = [0] * batch
        if (self.fused and length == 0 and pending is not None and pending.mask.shape[0] == batch
                and pending.mask.shape[1] == q_len):
            pads = _leading_pads(pending.mask) or pads
        self.rows = [self.store.allocator.sequence() for _ in range(batch)]
        self.pads = pads
        self._version += 1

    def _release_rows(self) -> None:
        for seq in self.rows:
            self.store.allocator.release(seq)
        self.rows, self.pads = [], []
        self._plan = None
        self._version += 1

    def _select_rows(self, sources: list[int]) -> None:
        if not self.rows:
            return
        n = len(self.rows)
        bad = [s for s in sources if not 0 <= s < n]
        if bad:
            raise IndexError(f"row index {bad[0]} is out of range for a cache of {n} rows")
        alloc = self.store.allocator
        new_rows = [alloc.fork(self.rows[s]) for s in sources]
        new_pads = [self.pads[s] for s in sources]
        self._release_rows()
        self.rows, self.pads = new_rows, new_pads

    def _step_plan(self, length: int, q_len: int) -> _StepPlan:
        plan = self._plan
        if plan is not None and plan.length == length and plan.q_len == q_len and plan.version == self._version:
            return plan
        page, alloc = self.store.page_size, self.store.allocator
        end = length + q_len
        for b, seq in enumerate(self.rows):  # room for the new tokens (copy-on-write of shared pages)
            need = end - self.pads[b] - seq.num_tokens
            if need > 0:
                copies = alloc.append(seq, need)
                self.store.copy_blocks(copies)
        num_blocks = self._max_block + 1
        self.store.ensure_blocks(num_blocks)
        self._version += 1
        batch = len(self.rows)
        max_blocks = max(1, max(len(s.blocks) for s in self.rows))
        tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
        for b, seq in enumerate(self.rows):
            tables[b, : len(seq.blocks)] = seq.blocks
        pads = torch.tensor(self.pads, dtype=torch.int64)
        stored_pos = torch.arange(length, end).unsqueeze(0) - pads.unsqueeze(1)      # [batch, q_len]
        valid = stored_pos >= 0
        pos = stored_pos.clamp(min=0)
        slots = tables.to(torch.int64).gather(1, pos // page) * page + pos % page
        slot_mapping = torch.where(valid, slots, torch.full_like(slots, -1))
        seq_lens = (end - pads).clamp(min=0).to(torch.int32)
        q_counts = valid.sum(dim=1)
        cu_q = torch.zeros(batch + 1, dtype=torch.int32)
        torch.cumsum(q_counts, 0, out=cu_q[1:])
        query_rows = None if bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1)
        residual = None
        if self.store.residual is not None:
            residual = self.store.residual.plan([s.blocks.tolist() for s in self.rows],
                                                [max(0, length - p) for p in self.pads], seq_lens.tolist(),
                                                stored_pos, valid)
        device = next((p.k.device for p in self.store.pools.values()), None) or self.layers[0].device
        self._plan = plan = _StepPlan(length, q_len, self._version, slot_mapping.to(device), tables.to(device),
                                      seq_lens.to(device), cu_q.to(device),
                                      None if query_rows is None else query_rows.to(device), num_blocks,
                                      None if residual is None else residual.on(device))
        return plan

    def _dense(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V as ``[batch, kv_heads, length, head_dim]`` (pad slots that were not stored are zero)."""
        layer, pool = self.layers[layer_idx], self.store.pools[layer_idx]
        plan = self._plan.on(pool.k.device)
        length = layer.length
        if plan.residual is not None:
            k, v = res.gather(plan.residual, pool, self.store.residual_pools[layer_idx], plan.block_tables,
                              plan.seq_lens, length, dtype)
        elif pool.k.is_floating_point():  # full precision: gather as stored, then cast if the model differs
            k, v = pool.gather(plan.block_tables, plan.seq_lens, max_len=length)
            k, v = (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))
        else:
            k, v = pool.gather(plan.block_tables, plan.seq_lens, max_len=length, dtype=dtype)
        if not any(self.pads):
            return k, v
        k_out, v_out = torch.zeros_like(k), torch.zeros_like(v)
        for b, pad in enumerate(self.pads):  # right-align the stored tokens behind the padding
            k_out[b, :, pad:] = k[b, :, : length - pad]
            v_out[b, :, pad:] = v[b, :, : length - pad]
        return k_out, v_out


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---- the "kvcache" attention implementation ------------------------------------------------------
def kvcache_mask(batch_size, *args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask function of the ``"kvcache"`` implementation: the 2-D padding mask (or None when nothing is
    padded); causality, windows and sinks are the kernel's. Leaves the padding for the cache's update."""
    from transformers import masking_utils

    mask = masking_utils.flash_attention_mask(batch_size, *args, attention_mask=attention_mask, **kwargs)
    q_length = args[0] if args else kwargs.get("q_length", kwargs.get("cache_position"))
    q_length = int(q_length.shape[0]) if torch.is_tensor(q_length) else int(q_length)
    _PENDING_PADDING.set(None if mask is None else _Padding(mask, q_length))
    return mask


def kvcache_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """Attention over the pages of a :class:`PagedCache` (the tag ``update`` left on ``key``); anything
    else (no cache, another cache, masks the kernel cannot express) goes through PyTorch's SDPA."""
    tag = getattr(key, "_kvcache", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    if tag is not None:
        cache, layer_idx, plan = tag
        if _fused_ok(cache, plan, attention_mask, query) and not (sliding_window and plan.residual is not None):
            return _paged(cache, layer_idx, plan, query, scaling, sliding_window, softcap), None
        key, value = cache._dense(layer_idx, query.dtype)
    return _dense_attention(query, key, value, attention_mask, dropout if module.training else 0.0, scaling,
                            sliding_window, softcap), None


def _fused_ok(cache: PagedCache, plan: _StepPlan, mask, query) -> bool:
    """Whether the kernel's view (stored tokens, bottom-right causal) is exactly what the mask asks for."""
    if mask is None:
        return not any(cache.pads)
    if mask.dim() != 2 or mask.shape[0] != len(cache.pads):
        return False
    key = (id(mask), plan.version, plan.length)
    if getattr(cache, "_mask_checked", None) == key:
        return cache._mask_ok
    pads = _leading_pads(mask)
    total = plan.length + plan.q_len
    ok = pads is not None and [p + total - mask.shape[1] for p in pads] == cache.pads
    cache._mask_checked, cache._mask_ok = key, ok
    cache._mask_ref = mask  # keeps id(mask) from being reused while the key is live
    return ok


def _paged(cache: PagedCache, layer_idx: int, plan: _StepPlan, query: torch.Tensor, scaling: float,
           sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    from . import ops

    batch, heads, q_len, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
    if plan.query_rows is not None:
        q = q.index_select(0, plan.query_rows)
    pool = cache.store.pools[layer_idx]
    if plan.residual is not None:  # (sliding windows went to the dense path: positions span two pools)
        out = res.attention(plan.residual, pool, cache.store.residual_pools[layer_idx], q, plan.cu_q_lens,
                            float(scaling), softcap=float(softcap or 0.0))
    else:
        out = ops.paged_attention(q, pool.k, pool.v, plan.block_tables, plan.seq_lens, plan.cu_q_lens,
                                  float(scaling), window_left=-1 if not sliding_window else int(sliding_window) - 1,
                                  sink_tokens=cache.sink_tokens if sliding_window else 0,
                                  softcap=float(softcap or 0.0), **pool.op_kwargs())
    if plan.query_rows is not None:
        full = out.new_zeros(batch * q_len, heads, dim)
        full.index_copy_(0, plan.query_rows, out)
        out = full
    return out.view(batch, q_len, heads, dim)


def _dense_attention(query, key, value, mask2d, dropout, scaling, sliding_window, softcap):
    """Bottom-right causal attention with a 2-D padding mask (or a ready 4-D mask) in PyTorch."""
    batch, heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if mask2d is not None and mask2d.dim() == 4:
        allowed = mask2d if mask2d.dtype == torch.bool else None
        additive = None if allowed is not None else mask2d
    else:
        i = torch.arange(q_len, device=query.device).unsqueeze(1) + (kv_len - q_len)
        j = torch.arange(kv_len, device=query.device).unsqueeze(0)
        allowed = j <= i
        if sliding_window:
            allowed = allowed & (j > i - int(sliding_window))
        allowed = allowed.view(1, 1, q_len, kv_len)
        if mask2d is not None:
            allowed = allowed & mask2d[:, -kv_len:].to(torch.bool).view(batch, 1, 1, kv_len)
        additive = None
    if heads != kv_heads:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    if softcap:
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
        scores = torch.tanh(scores / softcap) * softcap
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        if additive is not None:
            scores = scores + additive
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        out = torch.matmul(probs, value)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed if allowed is not None else additive, dropout_p=dropout,
            scale=scaling)
    return out.transpose(1, 2).contiguous()


# ---- registration -------------------------------------------------------------------------------
_registered = False


def register_attention() -> None:
    """Registers ``"kvcache"`` with transformers' attention and mask interfaces (done on import of
    kvcache once transformers is imported)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvcache_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvcache_mask)
    _registered = True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the attention implementation right after ``transformers.modeling_utils`` is imported,
    so ``import kvcache`` does not pay for importing transformers."""

    target = "transformers.modeling_utils"

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            try:
                register_attention()
            finally:
                if self in sys.meta_path:
                    sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec


def install_registration() -> None:
    if "transformers.modeling_utils" in sys.modules:
        register_attention()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
