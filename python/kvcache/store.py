"""The pages of every layer of a model and the allocator of their block ids: :class:`PagedStore`, shared by
:class:`kvcache.PagedCache` objects and :class:`kvcache.Engine`."""

from __future__ import annotations

import weakref

import torch

from ._args import integer_arg
from .formats import CacheFormat
from .pool import KVPool
from .prefix import BlockAllocator, Namespace, PrefixCache
from .residual import ResidualPages, move_pages

__all__ = ["PagedStore", "DEFAULT_RESIDUAL_LENGTH", "KIVI_RESIDUAL_LENGTH"]

# Newest tokens a quantized cache keeps in the model's dtype unless told otherwise: HF QuantizedCache's
# default and KIVI's window. Quantizing them too costs int4 +10.0% perplexity against +0.37% with the
# window on SmolLM2 (2,048 tokens of pydoc; benchmarks/results/perplexity_residual.md); residual_length=0
# still quantizes every token as it is written.
DEFAULT_RESIDUAL_LENGTH = 128
KIVI_RESIDUAL_LENGTH = DEFAULT_RESIDUAL_LENGTH  # the name before every quantized format had the window

# Block ids the allocator may hand out when no max_tokens is given: the pools themselves grow on demand,
# so this is a budget, not memory (4M tokens at page 16).
_UNBOUNDED_BLOCKS = 1 << 18


class PagedStore:
    """The pages of every layer plus the allocator of their block ids (and an optional prefix cache).

    One store may back several :class:`PagedCache` objects (copies, an :class:`kvcache.Engine`'s
    requests): each holds references on the blocks it uses. A :class:`PrefixCache` given as ``prefix_cache``
    is bound to the store for good (``prefix_cache.store``): a second store over it is refused, since the
    tree's block ids hold K/V in the first store's pools. Pools are allocated per layer on first use,
    with that layer's kv heads, head_dim and device, and grow (doubling) as block ids are handed out,
    unless ``max_tokens`` fixes their size up front.

    With a quantized format, ``residual_length`` (the newest tokens of every sequence; default
    ``None``: 128, HF QuantizedCache's default and KIVI's window; 0 quantizes every token as written) and ``residual_sink_tokens`` (its first
    tokens, in whole pages) stay in the model's dtype, in residual pools beside the quantized ones
    (:mod:`kvcache.residual`); KIVI formats always use them, since a KIVI page is quantized only once it
    is complete.
    """

    def __init__(self, *, page_size: int = 16, kv_format=None, max_tokens: int | None = None,
                 prefix_cache: bool | PrefixCache = False, namespace: Namespace | None = None,
                 allocator: BlockAllocator | None = None, residual_length: int | None = None,
                 residual_sink_tokens: int = 0):
        # (a float or a bool was taken as a size: max_tokens=True made a one-page pool, page_size=True pages of 1)
        page_size = integer_arg("page_size", page_size, "tokens per page")
        if max_tokens is not None:
            max_tokens = integer_arg("max_tokens", max_tokens, "the tokens the pool holds; None: it grows")
            if max_tokens <= 0:
                raise ValueError(f"max_tokens={max_tokens} must be positive")
        if not isinstance(prefix_cache, (bool, PrefixCache)):
            raise TypeError(f"prefix_cache={prefix_cache!r} must be a bool or a kvcache.PrefixCache, not "
                            f"{type(prefix_cache).__name__}")
        for name, value in (("residual_length", residual_length), ("residual_sink_tokens", residual_sink_tokens)):
            if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__")):
                raise TypeError(f"{name}={value!r} must be an int (tokens)")
        if (residual_length or 0) < 0 or residual_sink_tokens < 0:
            raise ValueError(f"residual_length={residual_length} and residual_sink_tokens={residual_sink_tokens} "
                             f"must be >= 0")
        self.page_size = int(page_size)
        try:
            self.kv_format = None if kv_format is None else CacheFormat.parse(kv_format)
        except TypeError as e:
            raise TypeError(f"kv_format: {e}") from None
        if self.kv_format is not None and self.kv_format.family is None:
            raise ValueError(f"kv_format={str(kv_format)!r}: K and V must both be full precision, both quantized "
                             f"(int8, fp8, int4: e.g. 'k=int8,v=int4') or both KIVI (e.g. 'k=kivi2,v=kivi4'); the "
                             f"attention step reads no other mix (KVPool.allocate stores any)")
        self.max_tokens = max_tokens
        budget = _UNBOUNDED_BLOCKS if max_tokens is None else -(-max_tokens // self.page_size)
        if isinstance(prefix_cache, PrefixCache):
            if prefix_cache.store is not None:
                raise ValueError(
                    "prefix_cache: this PrefixCache already caches the pages of another PagedStore (its block ids "
                    "hold K/V in that store's pools, not in a new one's); share that store instead: "
                    "PagedCache(config, store=prefix_cache.store), or for an Engine kvcache.Engine(model, "
                    "prefix_cache=prefix_cache), which shares it")
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
        # (text config, name_or_path) of the model whose namespace an Engine set above: a PagedCache sharing the store
        # takes that namespace only for the same model (hf_cache.PagedCache._namespace)
        self.namespace_owner: tuple | None = None
        # set by the kvcache.Engine that made the store: the model geometry its pools hold, and per namespace key a
        # weak reference to the model caching under it (for Engines that share the store through its prefix cache)
        self.engine_geometry: dict | None = None
        self.engine_models: dict = {}  # namespace key -> weak reference to the model (or config) caching under it
        self.pools: dict[int, KVPool] = {}
        self.fixed_size = self.max_tokens is not None
        family = None if self.kv_format is None else self.kv_format.family  # one family: checked above
        quantized, kivi = family in ("quantized", "kivi"), family == "kivi"
        if residual_length is None:
            residual_length = DEFAULT_RESIDUAL_LENGTH
        self.residual: ResidualPages | None = None
        self.residual_pools: dict[int, KVPool] = {}
        if quantized and (residual_length or residual_sink_tokens or kivi):
            self.residual = ResidualPages(self.page_size, residual_length, -(-residual_sink_tokens // self.page_size))
            self.residual.is_live = lambda block: self.allocator.refcount(block) > 0
        if self.prefix_cache is not None:  # its blocks' K/V are this store's (checked above: not another's)
            self.prefix_cache.store = self

    def claim_namespace(self, namespace: Namespace, owner, check: bool) -> None:
        """Records ``owner`` (a model, or a PagedCache's config) as caching under ``namespace``. With ``check`` (a
        model without a ``name_or_path``, whose default namespace is only its class), another live owner under the
        same key is a ValueError naming ``namespace``: other weights there would be each other's hits. Owners are
        compared by identity (configs compare equal by value)."""
        holder = self.engine_models.get(namespace.key)
        other = holder() if holder is not None else None
        if check and other is not None and other is not owner:
            raise ValueError(f"namespace: this model has no name_or_path, so its prefixes would be cached under "
                             f"{namespace.model!r}, as another model's in the shared prefix cache (other weights: "
                             f"their K/V would be hits here); give it namespace=kvcache.Namespace(model=..., salt=...)")
        self.engine_models.setdefault(namespace.key, weakref.ref(owner))

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
            if value.shape[1] != heads:
                raise ValueError(f"layer {layer}: value has {value.shape[1]} heads but the key has {heads}; kvcache "
                                 f"pages hold K and V of the same kv heads")
            # V rows may be narrower or wider than K rows: an MLA model (DeepSeek-V2/V3) hands the cache its
            # latent kv_nope as the key and the rotary k_rot as the value
            fmt = self.kv_format or CacheFormat.parse(key.dtype)
            blocks = self.capacity_blocks if self.fixed_size else _grown(0, min_blocks)
            try:
                pool = KVPool.allocate(blocks, self.page_size, heads, dim, fmt, device=key.device,
                                       v_head_dim=value.shape[3])
            except ValueError as err:
                # (KVPool names its own arguments, head_dim and v_head_dim: here they are what the model hands the
                # cache, which for MLA are the latents, not the config's head_dim / v_head_dim)
                v_dim = value.shape[3]
                what = (f"K rows of {dim} and V rows of {v_dim} values (MLA: kv_lora_rank and qk_rope_head_dim)"
                        if v_dim != dim else f"K and V rows of {dim} values")
                raise ValueError(f"layer {layer}: the model hands the cache {what}; {err}") from None
            self.pools[layer] = pool
        elif pool.num_blocks < min_blocks:
            pool = self.pools[layer] = _grow_pool(pool, _grown(pool.num_blocks, min_blocks))
        return pool

    def residual_pool(self, layer: int, key: torch.Tensor, min_blocks: int) -> KVPool:
        """Layer ``layer``'s full-precision residual pool (the model's dtype), grown to ``min_blocks``; its rows
        are as wide as the layer's quantized pool's (K and V may differ)."""
        pool = self.residual_pools.get(layer)
        if pool is None:
            _, heads, _, dim = key.shape
            sealed = self.pools.get(layer)
            v_dim = sealed.v_head_dim if sealed is not None else dim
            pool = KVPool.allocate(_grown(0, min_blocks), self.page_size, heads, dim, key.dtype, device=key.device,
                                   v_head_dim=v_dim)
            self.residual_pools[layer] = pool
        elif pool.num_blocks < min_blocks:
            pool = self.residual_pools[layer] = _grow_pool(pool, _grown(pool.num_blocks, min_blocks))
        return pool

    def move_residual_pages(self, plan) -> None:
        """Seals and reopens the pages of a forward's residual plan (:class:`kvcache.residual.ResidualPlan`) in
        every layer's pools at once, at the first layer that writes, each layer once. The plan's bookkeeping
        changed for all layers when it was made: done layer by layer, a forward stopped after layer i (an
        exception, a KeyboardInterrupt, an update refused) left the later layers' aged pages unquantized, their
        slots given away, and those pages read as zeros from then on, in this cache, the prefix cache and the
        tiers."""
        if not plan.moves_pages:
            return
        for layer, sealed in list(self.pools.items()):
            residual = self.residual_pools.get(layer)
            if residual is None or layer in plan._moved_layers:
                continue  # (a layer without residual pages has nothing to seal: it never held a token)
            residual = self.residual_pool(layer, residual.k, plan.num_slots)
            move_pages(plan.on(residual.k.device), sealed, residual)
            plan._moved_layers.add(layer)

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
            for pool in self.pools.values():  # codes, and the per-row / per-group scales that travel with them
                pool.copy_blocks(copies)
            if self.residual is not None:  # open pages are copied in the residual pools
                moves = self.residual.copy_on_write([tuple(p) for p in copies.tolist()])
                for layer, pool in list(self.residual_pools.items()):
                    if moves:
                        pool = self.residual_pool(layer, pool.k, self.residual.num_slots)
                        ops.copy_blocks(pool.k, pool.v, torch.tensor(moves, dtype=torch.int64, device=pool.k.device))

    def forget_scales(self) -> None:
        """fp8 pools without a given scale take their per-head scales again from the next tokens written, when no
        page needs the old ones (no prefix cache, every block free): a cache emptied by ``reset``, or an Engine
        call, should not store its next prompt with the last one's scales."""
        if self.prefix_cache is not None or self.allocator.num_free != self.allocator.num_blocks:
            return
        for pool in self.pools.values():
            for role, f in (("k", pool.format.k), ("v", pool.format.v)):
                if f.kind.startswith("fp8") and f.scale is None:
                    pool._scales_set[role] = False

    def compact_residual(self) -> None:
        """Shrinks the residual pools once most of their pages were sealed (a long prompt's, after the forward
        that follows its prefill): the open pages move to the lowest slots and the pools keep twice as many
        as are in use. Called before a step is planned, so no plan refers to the old slots."""
        if self.residual is None:
            return
        moves = self.residual.compact()
        if moves is None:
            return
        from . import ops
        blocks = _grown(0, 2 * self.residual.num_slots)
        for layer, pool in list(self.residual_pools.items()):
            if moves:
                ops.copy_blocks(pool.k, pool.v, torch.tensor(moves, dtype=torch.int64, device=pool.k.device))
            if blocks < pool.num_blocks:
                self.residual_pools[layer] = _grow_pool(pool, blocks)

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
    """A copy of ``pool`` with ``blocks`` blocks (the first ``min(blocks, num_blocks)`` copied, fp8 per-head
    scales kept): grown, or shrunk (:meth:`PagedStore.compact_residual`)."""
    new = KVPool.allocate(blocks, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.format, device=pool.k.device,
                          v_head_dim=pool.v_head_dim)
    n = min(blocks, pool.num_blocks)
    new.k[:n].copy_(pool.k[:n])
    new.v[:n].copy_(pool.v[:n])
    for role in ("k", "v"):
        old, grown = getattr(pool, f"{role}_scale"), getattr(new, f"{role}_scale")
        if old is None:
            continue
        if old.dim() == 1:  # per kv head (fp8): the whole tensor
            grown.copy_(old)
        else:
            grown[:n].copy_(old[:n])
    new._scales_set = dict(pool._scales_set)
    return new

