"""Block allocator and radix-tree prefix cache: the C++ core (``csrc/prefix``) with a Pythonic face.

A :class:`BlockAllocator` hands out the block ids of one KV pool (shared by all layers) with reference
counts; a :class:`Sequence` is one request's block table. :class:`PrefixCache` is a radix tree of
cached token sequences over the same blocks: ``match`` finds the longest cached prefix (it may end
inside a page), ``insert`` caches a finished prefix, ``lock`` pins a path, ``evict`` frees unlocked
leaves (LRU or LFU). Pages are copy-on-write: a request that continues a prefix ending inside a page,
or a forked sequence, gets its own copy of that page the first time it writes into it.

>>> import torch, kvcache
>>> alloc = kvcache.BlockAllocator(num_blocks=64, page_size=4)
>>> cache = kvcache.PrefixCache(alloc)
>>> ns = kvcache.Namespace(model="llama-3-8b", kv_format="bf16")
>>> prompt = torch.tensor([1, 2, 3, 4, 5, 6])
>>> seq = alloc.sequence()
>>> alloc.append(seq, len(prompt)).shape    # prefill: room for 6 tokens; no page to copy
torch.Size([0, 2])
>>> seq
Sequence(num_tokens=6, blocks=[0, 1])
>>> cache.insert(prompt, seq, ns).prefix_length
0
>>> m = cache.match(torch.tensor([1, 2, 3, 4, 5, 9]), ns)   # shares tokens 0..4, diverges inside page 1
>>> m.length, m.blocks.tolist()
(5, [0, 1])
>>> other = alloc.sequence(m)                # takes references on the matched blocks
>>> alloc.append(other, 1).tolist()          # page 1 is shared: copied to a new block before the write
[[1, 2]]
>>> other.blocks.tolist(), alloc.refcount(0)
([0, 2], 3)

Namespaces keep caches that differ in anything affecting K/V apart: model and revision, adapter,
KV format, positional encoding, and a user salt. A namespace takes memory only while it holds cached
prefixes: a lookup never registers one (a miss in a namespace the cache never saw leaves no trace),
and one whose last prefix is evicted is forgotten. The C++ objects are ``torch.classes.kvcache.
BlockAllocator`` and ``torch.classes.kvcache.PrefixCache`` (``.native`` on the wrappers); their
methods run without the GIL and lock internally, so both are safe to share between Python threads.
:class:`PrefixCache` calls its tree's hot methods (match, insert, their ragged forms, lock, unlock,
evict) through ``kvcache._C._PrefixTree``, CPython vectorcall methods over the same C++ object that skip
torch's custom-class call overhead (a few microseconds per call, more than a match itself).
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import torch

from . import _C, _html, ops
from ._args import integer_arg

__all__ = [
    "BlockAllocator", "Insert", "Match", "MatchInto", "Namespace", "OutOfBlocksError", "PrefixCache", "RaggedMatch",
    "RaggedMatchInto", "Sequence",
]


class OutOfBlocksError(RuntimeError):
    """The pool has too few free blocks, even after evicting every unlocked cached prefix."""


def _raise_out_of_blocks(err: RuntimeError) -> None:
    if str(err).startswith("out of blocks"):
        raise OutOfBlocksError(str(err).splitlines()[0]) from None


def _ids(values, name: str) -> torch.Tensor:
    """A 1-D CPU int tensor of ids (tensors pass through: the C++ side checks dtype, device and shape)."""
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, Sequence):
        return values.blocks
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a 1-D tensor or a sequence of ints, got {type(values).__name__}")
    ids = []
    for v in values:
        try:
            ids.append(operator.index(v))  # (a float is refused: torch.tensor(..., dtype=int64) truncates 1.5 to 1)
        except TypeError:
            raise TypeError(f"{name} must be a 1-D tensor or a sequence of ints, got an element {v!r} "
                            f"({type(v).__name__})") from None
    try:
        return torch.tensor(ids, dtype=torch.int64)
    except (RuntimeError, OverflowError) as err:  # (an int past int64)
        raise TypeError(f"{name} must be a 1-D tensor or a sequence of ints that fit int64") from err


def _pool_list(pools) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(pools, tuple) and len(pools) == 2 and isinstance(pools[0], torch.Tensor):
        return [pools]
    return [tuple(p) for p in pools]


def _append_targets(pools, num_blocks: int, page_size: int) -> list:
    """``pools`` of :meth:`BlockAllocator.append` as a list of ``(k_cache, v_cache)`` pairs or KVPools, each checked
    to hold every block id of an allocator of ``num_blocks`` pages of ``page_size`` tokens: checked before the
    allocator changes, since a copy that fails after it moved a shared page would leave the sequence on a block
    that never got the page's tokens."""
    if (isinstance(pools, tuple) and len(pools) == 2 and isinstance(pools[0], torch.Tensor)) or hasattr(pools, "copy_blocks"):
        pools = [pools]
    if isinstance(pools, torch.Tensor) or not isinstance(pools, Iterable):
        raise TypeError(f"pools: a (k_cache, v_cache) pair, a KVPool or a list of them, got {type(pools).__name__}")
    out = []
    for i, entry in enumerate(pools):
        if hasattr(entry, "copy_blocks") and hasattr(entry, "k"):  # a KVPool (any format)
            k, v = entry.k, entry.v
        elif isinstance(entry, (tuple, list)) and len(entry) == 2 and all(isinstance(t, torch.Tensor) for t in entry):
            k, v = entry
            if any(t.dtype not in (torch.float32, torch.float16, torch.bfloat16) for t in entry):
                raise TypeError(f"pools[{i}]: full-precision caches are float32, float16 or bfloat16, got "
                                f"{entry[0].dtype} / {entry[1].dtype}; a quantized pool goes in as its KVPool")
        else:
            raise TypeError(f"pools[{i}]: a (k_cache, v_cache) pair of tensors or a KVPool, got {type(entry).__name__}")
        for name, t in (("k_cache", k), ("v_cache", v)):
            if t.dim() < 3 or t.shape[0] < num_blocks or t.shape[2] != page_size:
                raise ValueError(f"pools[{i}] {name} has shape {tuple(t.shape)}, but the allocator's blocks need "
                                 f"[>= num_blocks = {num_blocks}, kv_heads, page_size = {page_size}, ...]")
        out.append(entry)
    return out


# ---- results ------------------------------------------------------------------------------------
class Match(NamedTuple):
    """A cached prefix: ``length`` tokens whose KV is in ``blocks`` (int32, ``ceil(length / page_size)``
    ids; the last page is partial when ``length`` is not a multiple of the page size). ``node`` is the
    handle of the tree node holding the last matched token, for :meth:`PrefixCache.lock`; 0 (the empty
    prefix, whose lock and unlock do nothing) when nothing matched.

    :meth:`BlockAllocator.sequence` takes one; a user of :meth:`PrefixCache.match_into` builds it from
    what that wrote: ``Match(length, row[:ceil(length / page_size)], node)``."""

    length: int
    blocks: torch.Tensor
    node: int


class MatchInto(NamedTuple):
    """A cached prefix written into the caller's tensor by :meth:`PrefixCache.match_into`: ``length`` tokens,
    whose blocks are the first ``ceil(length / page_size)`` entries of ``out``; ``node`` as in :class:`Match`."""

    length: int
    node: int


class Insert(NamedTuple):
    """``prefix_length`` tokens were cached already (the caller's blocks for them stay the caller's);
    ``node`` holds the last inserted token."""

    prefix_length: int
    node: int


class RaggedMatch(NamedTuple):
    """Matches of a batch, varlen style: sequence ``i`` matched ``lengths[i]`` tokens, its blocks are
    ``blocks[cu_blocks[i]:cu_blocks[i + 1]]`` and its node is ``nodes[i]``."""

    lengths: torch.Tensor
    blocks: torch.Tensor
    cu_blocks: torch.Tensor
    nodes: torch.Tensor

    def match(self, i: int) -> Match:
        """The :class:`Match` of sequence ``i``."""
        if not 0 <= i < len(self.lengths):
            raise IndexError(f"sequence {i} is out of range for a batch of {len(self.lengths)}")
        lo, hi = int(self.cu_blocks[i]), int(self.cu_blocks[i + 1])
        return Match(int(self.lengths[i]), self.blocks[lo:hi], int(self.nodes[i]))


class RaggedMatchInto(NamedTuple):
    """Matches of a batch written into the caller's block table by :meth:`PrefixCache.match_ragged_into`:
    sequence ``i`` matched ``lengths[i]`` tokens, whose blocks are the first ``ceil(lengths[i] / page_size)``
    entries of row ``i`` of the table; its node is ``nodes[i]``. Both ``[batch]`` int64 tensors (the
    caller's own when it passed them)."""

    lengths: torch.Tensor
    nodes: torch.Tensor


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that changes K/V. Prefixes match only within one namespace.

    >>> Namespace(model="m", kv_format="int8") == Namespace(model="m", kv_format="int8")
    True
    >>> Namespace(model="m").key != Namespace(model="m", salt="user-42").key
    True
    """

    model: str = ""
    revision: str = ""
    adapter: str = ""
    kv_format: str = ""   # e.g. "bf16" or str(kvcache.CacheFormat.parse("k=int8,v=int4"))
    rope: str = ""        # positional-encoding settings, e.g. "theta=500000,scaling=llama3x8"
    salt: str = ""        # user-chosen: isolates tenants, or anything else not listed here
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # (a non-str field was keyed as itself: model=5 and model=None made keys no str can name, model=["x"] an
        # unhashable one); kv_format may be a CacheFormat, keyed by its str
        for name in ("model", "revision", "adapter", "rope", "salt"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Namespace {name}={value!r} must be a str, not {type(value).__name__}")
        values = (self.model, self.revision, self.adapter, str(self.kv_format), self.rope, self.salt)
        object.__setattr__(self, "key", json.dumps(values))


DEFAULT_NAMESPACE = Namespace()


# ---- allocator ----------------------------------------------------------------------------------
@dataclass(eq=False)
class Sequence:
    """One request's block table: ``blocks`` (int32, one reference each held by this sequence) holding
    ``num_tokens`` tokens. Made by :meth:`BlockAllocator.sequence`; grown by :meth:`BlockAllocator.append`."""

    blocks: torch.Tensor
    num_tokens: int = 0
    page_size: int = field(default=16, repr=False)

    def slots(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Slots (``block * page_size + offset``, int64) of token positions ``[start, end)``."""
        end = self.num_tokens if end is None else end
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"positions [{start}, {end}) are outside the sequence's {self.num_tokens} tokens")
        pos = torch.arange(start, end)
        return self.blocks.to(torch.int64)[pos // self.page_size] * self.page_size + pos % self.page_size

    def __repr__(self) -> str:
        return f"Sequence(num_tokens={self.num_tokens}, blocks={self.blocks.tolist()})"


class BlockAllocator:
    """Reference-counted block ids of one KV pool (all layers), with copy-on-write sequences.

    Args:
        num_blocks: blocks in the pool (``PageLayout.num_blocks``).
        page_size: tokens per block, a power of two from 1 to 256.
        bytes_per_block: bytes of one block over all layers, K and V (``layout.bytes_per_block *
            num_layers``); only for the byte figures of :meth:`stats`.

    When a request needs blocks and too few are free, the allocator asks its :class:`PrefixCache` (if
    one was made over it) to evict unlocked prefixes, then raises :class:`OutOfBlocksError`; it never
    hands out a block that is in use.
    """

    def __init__(self, num_blocks: int, page_size: int, *, bytes_per_block: int = 0):
        # (a float was truncated and a bool read as 1: BlockAllocator(True, 4) made a one-block pool)
        num_blocks = integer_arg("num_blocks", num_blocks, "blocks in the pool")
        page_size = integer_arg("page_size", page_size, "tokens per block")
        bytes_per_block = integer_arg("bytes_per_block", bytes_per_block, "bytes of one block over all layers")
        if bytes_per_block < 0:
            raise ValueError(f"bytes_per_block={bytes_per_block} must be >= 0 (0: no byte figures in stats())")
        try:
            self.native = torch.classes.kvcache.BlockAllocator(num_blocks, page_size)
        except RuntimeError as err:
            raise ValueError(str(err).splitlines()[0]) from None
        self.page_size = page_size
        self.bytes_per_block = bytes_per_block
        # Bound once: every attribute lookup on a torch ScriptObject builds a new method object (~1 us).
        self._append, self._share, self._free = self.native.append, self.native.share, self.native.free

    @property
    def num_blocks(self) -> int:
        return self.native.num_blocks()

    @property
    def num_free(self) -> int:
        return self.native.num_free()

    # ---- blocks ---------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> torch.Tensor:
        """``num_blocks`` blocks (int32 ids) with one reference each."""
        num_blocks = integer_arg("num_blocks", num_blocks, "blocks to allocate")
        try:
            return self.native.allocate(num_blocks)
        except RuntimeError as err:
            _raise_out_of_blocks(err)
            raise

    def share(self, blocks) -> None:
        """One more reference on each block (which must be in use)."""
        self._share(_ids(blocks, "blocks"))

    def free(self, blocks) -> int:
        """Drops one reference per entry; returns how many blocks became free."""
        return self._free(_ids(blocks, "blocks"))

    def refcount(self, block: int) -> int:
        return self.native.refcount(operator.index(block))

    # ---- sequences ------------------------------------------------------------------------------
    def sequence(self, prefix: Match | None = None) -> Sequence:
        """A new sequence, empty or starting with a matched prefix (whose blocks it then shares)."""
        if prefix is None:
            return Sequence(torch.empty(0, dtype=torch.int32), 0, self.page_size)
        length, count = int(prefix.length), prefix.blocks.numel()
        if length < 0 or count != -(-length // self.page_size) or prefix.blocks.dim() != 1:
            raise ValueError(f"prefix: a Match of length={length} needs ceil({length} / page_size={self.page_size}) = "
                             f"{-(-length // self.page_size)} block ids in a 1-D tensor, got shape "
                             f"{tuple(prefix.blocks.shape)}")
        blocks = prefix.blocks.to(torch.int32, copy=True)  # the sequence's own table, whatever the caller does with m
        if count > 1 and torch.unique(blocks).numel() != count:  # (one page's K/V would be read as another's)
            raise ValueError(f"prefix: a Match's blocks are a sequence's pages, distinct blocks; got {blocks.tolist()}")
        self.native.share(blocks)
        return Sequence(blocks, int(prefix.length), self.page_size)

    def append(self, seq: Sequence, num_tokens: int, pools=None) -> torch.Tensor:
        """Makes room for ``num_tokens`` more tokens in ``seq`` (all or nothing).

        If the sequence's partial last page is shared (a fork, or a prefix match that ended inside a
        page), it is first moved to a new block. Returns those copies as ``[n, 2]`` int64 (src, dst)
        pairs, which must be applied before writing: pass ``pools`` (a ``(k_cache, v_cache)`` pair, a
        :class:`kvcache.KVPool`, or a list of them, one per layer) to have them applied with
        :func:`kvcache.copy_blocks` (``KVPool.copy_blocks`` for a KVPool). ``pools`` is checked before anything
        changes (each must hold every block id of this allocator, pages of its page_size).
        Write the new tokens at ``seq.slots(seq.num_tokens - num_tokens)``.
        """
        num_tokens = integer_arg("num_tokens", num_tokens, "tokens to make room for")
        targets = None if pools is None else _append_targets(pools, self.num_blocks, self.page_size)
        try:
            table, copies = self._append(seq.blocks, seq.num_tokens, num_tokens)
        except RuntimeError as err:
            _raise_out_of_blocks(err)
            raise
        seq.blocks, seq.num_tokens = table, seq.num_tokens + num_tokens
        if targets and len(copies):
            for entry in targets:
                if hasattr(entry, "copy_blocks") and hasattr(entry, "k"):
                    entry.copy_blocks(copies)
                else:
                    ops.copy_blocks(entry[0], entry[1], copies)
        return copies

    def fork(self, seq: Sequence) -> Sequence:
        """A copy of ``seq`` sharing all its blocks (beam search, parallel sampling)."""
        self.native.share(seq.blocks)
        return Sequence(seq.blocks.clone(), seq.num_tokens, self.page_size)

    def release(self, seq: Sequence) -> None:
        """Drops the sequence's references; it is empty afterwards."""
        self.native.free(seq.blocks)
        seq.blocks, seq.num_tokens = torch.empty(0, dtype=torch.int32), 0

    # ---- accounting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Blocks ``free`` / ``used`` / ``shared``, ``references``, tokens ``filled_tokens`` and ``waste_tokens``
        (internal fragmentation of sequences: reserved but unwritten slots), ``waste_fraction`` of the
        used slots, and the byte figures when ``bytes_per_block`` was given."""
        s = dict(self.native.stats())
        used_slots = s["used"] * self.page_size
        s["waste_fraction"] = s["waste_tokens"] / used_slots if used_slots else 0.0
        if self.bytes_per_block:
            s["used_bytes"] = s["used"] * self.bytes_per_block
            s["waste_bytes"] = s["waste_tokens"] * self.bytes_per_block // self.page_size
        return s

    def __repr__(self) -> str:
        s = self.native.stats()
        return (f"BlockAllocator(num_blocks={s['num_blocks']}, page_size={self.page_size}, free={s['free']}, "
                f"used={s['used']}, shared={s['shared']})")

    def _repr_html_(self) -> str:
        s = self.stats()
        rows = {"blocks": f"{s['num_blocks']} of {self.page_size} tokens",
                "free / used / shared": f"{s['free']} / {s['used']} / {s['shared']}",
                "tokens held": s["filled_tokens"],
                "unwritten slots in used blocks": f"{s['waste_tokens']} ({_html.percent(s['waste_fraction'])})"}
        if self.bytes_per_block:
            rows["bytes used"] = _html.human_bytes(s["used_bytes"])
        return _html.table("kvcache.BlockAllocator", rows)


# ---- prefix cache -------------------------------------------------------------------------------
class PrefixCache:
    """Radix tree of cached prefixes over a :class:`BlockAllocator`'s blocks.

    Args:
        allocator: the device pool's allocator. The cache holds a reference on each block it caches and
            evicts for the allocator when it runs short.
        policy: ``"lru"`` (least recently used leaf first) or ``"lfu"`` (least hit first, then LRU).
        host_pools: optional host tier, a ``(k, v)`` pair or a list of them (one per layer, CPU tensors
            of the device pools' block shape; pinned memory helps). Evicted prefixes are copied there
            with :func:`kvcache.swap_blocks` and copied back on a later match. Needs ``device_pools``.
        device_pools: the device pools, same form, in the same layer order.
        disk, remote, chunk_tokens: prefix tiers beyond this process (:mod:`kvcache.tiers`): a directory and/or
            a ``redis://host:port/db`` URL (or :class:`kvcache.DiskTier` / :class:`kvcache.RedisTier` objects).
            The tree alone has no pages to fill: a :class:`kvcache.Engine` made over this cache
            (``Engine(model, prefix_cache=cache)``) fetches into it and writes from it, and :meth:`stats`
            then carries the tiers' counters under ``"tiers"``.

    The tree holds block ids; their K/V live in the pools of one :class:`kvcache.PagedStore`, the first made over
    it (an Engine's or PagedCache's), ``cache.store`` from then on. Further Engines given this cache share that
    store's pools (same model geometry and format, else a ValueError); a second ``PagedStore`` or
    ``PagedCache(prefix_cache=cache)`` is refused: share the pages with ``PagedCache(config, store=cache.store)``.

    A match returns blocks without taking references: either take them (``allocator.sequence(m)``),
    which keeps the data alive, and/or lock the node (``lock=True`` or :meth:`lock`), which keeps the
    prefix in the cache until :meth:`unlock`.

    Lookups (the ``match*`` methods) change no state but the counters, the recency of what they hit and
    the locks they were asked for: a lookup in a namespace the cache holds nothing in costs no memory.
    """

    def __init__(self, allocator: BlockAllocator, *, policy: str = "lru", host_pools=None, device_pools=None,
                 disk=None, remote=None, chunk_tokens: int | None = None):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a kvcache.BlockAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.policy = policy
        try:
            self.native = torch.classes.kvcache.PrefixCache(allocator.native, policy)
        except RuntimeError as err:
            raise ValueError(str(err).splitlines()[0]) from None
        self.host_allocator: BlockAllocator | None = None
        self.tiers = None  # the kvcache.tiers.PrefixTiers an Engine binds to this tree
        # the kvcache.PagedStore whose pools hold the K/V of the blocks this tree caches: bound by the first store
        # made over it, for good (its block ids mean nothing in another store's pools)
        self.store = None
        self.tier_options = {}
        if chunk_tokens is not None:
            from .tiers import check_chunk_tokens
            chunk_tokens = check_chunk_tokens(chunk_tokens, allocator.page_size)
        if disk is not None or remote is not None:
            from .tiers import _as_tier  # made now: a bad URL or path fails here, not at the first lookup
            self.tier_options = {"disk": _as_tier(disk, "disk"), "remote": _as_tier(remote, "remote"),
                                 "chunk_tokens": chunk_tokens}
        if (host_pools is None) != (device_pools is None):
            raise ValueError("a host tier needs both host_pools and device_pools")
        if host_pools is not None:
            host, device = _pool_list(host_pools), _pool_list(device_pools)
            if not host or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for p in host for t in p):
                raise ValueError("host_pools must be (k, v) tensor pairs [num_blocks, num_kv_heads, page_size, head_dim]")
            self.host_allocator = BlockAllocator(host[0][0].shape[0], allocator.page_size)
            self.native.set_host_tier(self.host_allocator.native, [k for k, _ in device], [v for _, v in device],
                                      [k for k, _ in host], [v for _, v in host])
        # The same tree through pybind11 (csrc/prefix/prefix_pybind.cpp), bound once: a call through
        # the torch class costs ~3.5 us of argument boxing and schema matching, more than a match.
        fast = _C._PrefixTree(self.native.core_id(), Match, Insert, RaggedMatch,  # results made as these
                              Namespace, DEFAULT_NAMESPACE,                       # namespaces resolved there
                              match_into_type=MatchInto, ragged_match_into_type=RaggedMatchInto)
        self._match, self._insert, self._evict = fast.match, fast.insert, fast.evict
        self._lock, self._unlock = fast.lock, fast.unlock
        self._match_ragged, self._insert_ragged = fast.match_ragged, fast.insert_ragged
        # The lookups are the hot path: this instance's match / match_into / match_ragged are the C++
        # methods themselves (same signatures and results as the methods below, which document them),
        # which saves a Python frame per call (~0.2 us, a third of a match_into).
        self._match_into, self._match_ragged_into = fast.match_into, fast.match_ragged_into
        self._cached_length = fast.cached_length
        self.match, self.match_into, self.match_ragged = fast.match, fast.match_into, fast.match_ragged
        self.match_ragged_into = fast.match_ragged_into

    def match(self, tokens, namespace: Namespace | str = DEFAULT_NAMESPACE, *, lock: bool = False) -> Match:
        """The longest cached prefix of ``tokens`` (a 1-D int32/int64 CPU tensor or numpy array, or a
        sequence of ints). ``namespace`` may also be the key string of a Namespace, or None for the default.

        With a host tier, a prefix found there is copied back first. ``lock=True`` locks the returned
        node in the same step (no other thread can evict it in between)."""
        return self._match(tokens, namespace, lock)

    def cached_length(self, tokens, namespace: Namespace | str = DEFAULT_NAMESPACE) -> int:
        """How many leading tokens of ``tokens`` the cache holds (on the device or the host tier), changing
        nothing: no recency, no hit counters, no load from the host tier. (A look through :meth:`match` counted as a
        hit and made the prefix the most recently used: a diagnostic changed what was evicted next.)

        >>> alloc = BlockAllocator(8, 4); cache = PrefixCache(alloc)
        >>> _ = cache.insert([1, 2, 3, 4, 5, 6], alloc.allocate(2))
        >>> cache.cached_length([1, 2, 3, 9]), cache.stats()["lookups"]
        (3, 0)
        """
        return self._cached_length(tokens, namespace)

    def match_into(self, tokens, out: torch.Tensor, namespace: Namespace | str = DEFAULT_NAMESPACE, *,
                   lock: bool = False) -> MatchInto:
        """:meth:`match`, writing the blocks into ``out`` instead of a new tensor: its first
        ``ceil(length / page_size)`` entries; the rest of ``out`` is left as it was. ``out`` is a 1-D int32
        CPU tensor of any stride with at least ``ceil(len(tokens) / page_size)`` entries (checked before
        anything is matched), typically the request's row of a ``[batch, max_blocks]`` block table.

        The same match without making a tensor, which is most of the cost of a :meth:`match` call
        (~0.5 us of ~1.2 us for a 2k-token prompt here); a server that keeps block tables uses this.

        >>> alloc = BlockAllocator(8, 4); cache = PrefixCache(alloc)
        >>> cache.insert([1, 2, 3, 4, 5], alloc.allocate(2)).prefix_length
        0
        >>> table = torch.full((2, 3), -1, dtype=torch.int32)
        >>> cache.match_into([1, 2, 3, 4, 5, 6], table[1]).length, table.tolist()
        (5, [[-1, -1, -1], [0, 1, -1]])
        """
        return self._match_into(tokens, out, namespace, lock)

    def insert(self, tokens, blocks, namespace: Namespace | str = DEFAULT_NAMESPACE, *,
               lock: bool = False) -> Insert:
        """Caches ``tokens``, whose KV is in ``blocks`` (``ceil(len(tokens) / page_size)`` block ids the
        caller holds, or a :class:`Sequence` holding at least those tokens). The cache takes its own
        reference on the blocks of the part it did not have; the caller keeps its references."""
        if isinstance(blocks, Sequence):
            n = len(tokens)
            if n > blocks.num_tokens:
                raise ValueError(f"tokens has {n} entries but the sequence holds {blocks.num_tokens}")
            blocks = blocks.blocks[:-(-n // self.allocator.page_size)]
        return self._insert(tokens, blocks, namespace, lock)

    def match_ragged(self, tokens: torch.Tensor, cu_lens: torch.Tensor, namespace: Namespace | str = DEFAULT_NAMESPACE,
                     *, lock: bool = False) -> RaggedMatch:
        """:meth:`match` of a batch in one call: sequence ``i`` is ``tokens[cu_lens[i]:cu_lens[i + 1]]``
        (``cu_lens``: ``[batch + 1]`` int32/int64 offsets; either may also be a numpy array or a list).
        Every result holds when the call returns: with a host tier, loading a later sequence's prefix
        never evicts the blocks returned for an earlier one (it loads less instead)."""
        return self._match_ragged(tokens, cu_lens, namespace, lock)

    def match_ragged_into(self, tokens: torch.Tensor, cu_lens: torch.Tensor, out: torch.Tensor,
                          namespace: Namespace | str = DEFAULT_NAMESPACE, *, lock: bool = False,
                          lengths: torch.Tensor | None = None, nodes: torch.Tensor | None = None) -> RaggedMatchInto:
        """:meth:`match_ragged`, writing into the caller's tensors instead of new ones: sequence ``i``'s blocks
        go to the first ``ceil(lengths[i] / page_size)`` entries of row ``i`` of ``out`` (a 2-D int32 CPU
        block table of any strides, ``batch`` rows and at least ``ceil(len(sequence) / page_size)`` columns
        for every sequence); the rest of the row is left as it was. ``lengths`` and ``nodes``, if given, are
        ``[batch]`` int64 CPU tensors to write the matched lengths and node handles into (else new ones are
        made). Everything is checked before anything is matched: a bad argument changes nothing.

        A server admitting a batch keeps these tables anyway; filling them in one call spares the four
        result tensors of :meth:`match_ragged` (~3.7 us a call here, more than the matches of a few requests).

        >>> alloc = BlockAllocator(8, 4); cache = PrefixCache(alloc)
        >>> cache.insert([1, 2, 3, 4, 5], alloc.allocate(2)).prefix_length
        0
        >>> table, lengths = torch.full((2, 3), -1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
        >>> r = cache.match_ragged_into(torch.tensor([1, 2, 3, 4, 5, 6, 1, 2]), [0, 6, 8], table, lengths=lengths)
        >>> r.lengths is lengths, lengths.tolist(), table.tolist()
        (True, [5, 2], [[0, 1, -1], [0, -1, -1]])
        """
        return self._match_ragged_into(tokens, cu_lens, out, namespace, lock, lengths, nodes)

    def insert_ragged(self, tokens: torch.Tensor, cu_lens: torch.Tensor, blocks: torch.Tensor, cu_blocks: torch.Tensor,
                      namespace: Namespace | str = DEFAULT_NAMESPACE, *, lock: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`insert` of a batch in one call (in order); returns (prefix lengths, nodes). Every sequence
        is checked before the first is inserted."""
        return self._insert_ragged(tokens, cu_lens, blocks, cu_blocks, namespace, lock)

    def match_many(self, sequences: Iterable, namespace: Namespace | str = DEFAULT_NAMESPACE, *,
                   lock: bool = False) -> list[Match]:
        """:meth:`match` of each token sequence, in one native call."""
        seqs = [_ids(s, "tokens").to(torch.int32) for s in sequences]
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        if seqs:
            torch.cumsum(torch.tensor([len(s) for s in seqs]), 0, out=cu[1:])
        flat = torch.cat(seqs) if seqs else torch.empty(0, dtype=torch.int32)
        r = self.match_ragged(flat, cu, namespace, lock=lock)
        return [r.match(i) for i in range(len(seqs))]

    def lock(self, node: int) -> None:
        """Pins ``node`` and its ancestors (counted; each lock needs one :meth:`unlock`). The empty
        prefix's handle 0, what a match of nothing returns, pins nothing: its lock and unlock do nothing."""
        self._lock(integer_arg("node", node, "a handle from a match"))

    def unlock(self, node: int) -> None:
        """Undoes one :meth:`lock` of ``node`` (or a lock taken by ``lock=True``)."""
        self._unlock(integer_arg("node", node, "a handle from a match"))

    def evict(self, num_blocks: int) -> int:
        """Evicts unlocked leaves in the policy's order (``"lru"``: least recently used first; ``"lfu"``: least
        often hit first) (to the host tier if any), until ``num_blocks``
        device blocks went back to the allocator or nothing evictable is left; returns how many did (a
        leaf's blocks go together, so it can be more than asked). Blocks already free do not count:
        ``evict(n)`` frees n more, and ``clear()`` is ``evict(allocator.num_blocks)``."""
        return self._evict(integer_arg("num_blocks", num_blocks, "device blocks to free"))

    def clear(self) -> int:
        """Evicts every unlocked prefix from the device; returns the device blocks freed. With a host tier, an
        eviction demotes to host memory, so the prefixes stay there (and still match) while it has room."""
        return self.evict(self.allocator.num_blocks)

    def stats(self) -> dict:
        """Counters (``lookups``, ``lookup_tokens``, ``hit_tokens``, ``inserts``, ``inserted_tokens``,
        ``evicted_nodes``, ``evicted_blocks``, host ``demoted_*`` / ``loaded_*``), ``hit_rate`` = hit
        tokens / looked-up tokens, and the current tree:

        - ``namespaces``: namespaces holding at least one node; ``nodes``, ``locked_nodes``,
          ``evictable_leaves``, ``host_nodes``; ``device_tokens`` / ``host_tokens`` on their edges.
        - ``device_blocks`` / ``host_blocks``: distinct blocks the cache holds a reference on; with no
          sequence sharing them, what :meth:`clear` frees and what the allocator counts as used.
        - ``device_block_refs`` / ``host_block_refs``: the references themselves (``len(block_references())``),
          more than the blocks when several nodes hold one page: a page split between a prefix and its
          continuation, or the same blocks cached in two namespaces.

        >>> alloc = BlockAllocator(8, 4); cache = PrefixCache(alloc)
        >>> cache.insert([1, 2, 3, 4, 5, 6], alloc.allocate(2)).prefix_length   # blocks 0, 1
        0
        >>> cache.insert([1, 2, 3, 9], alloc.allocate(1)).prefix_length   # splits [1..6] inside block 0
        3
        >>> s = cache.stats(); s["device_blocks"], s["device_block_refs"]   # block 0 is in both halves
        (3, 4)
        """
        s = dict(self.native.stats())
        s["hit_rate"] = s["hit_tokens"] / s["lookup_tokens"] if s["lookup_tokens"] else 0.0
        if self.tiers is not None:
            s["tiers"] = self.tiers.stats()
        return s

    def block_references(self, host: bool = False) -> list[int]:
        """Every block reference the cache holds (one entry per reference), on the device or the host."""
        return self.native.block_references(host).tolist()

    def check(self) -> None:
        """Raises AssertionError if an internal invariant of the tree is broken (for tests)."""
        problem = self.native.check_invariants()
        if problem:
            raise AssertionError(problem)

    def __repr__(self) -> str:
        s = self.native.stats()
        host = f", host_nodes={s['host_nodes']}" if self.host_allocator is not None else ""
        return (f"PrefixCache(policy={self.policy!r}, nodes={s['nodes']}, device_tokens={s['device_tokens']}, "
                f"locked_nodes={s['locked_nodes']}{host}, lookups={s['lookups']}, hit_tokens={s['hit_tokens']})")

    def _repr_html_(self) -> str:
        s = self.stats()
        rows = {"policy": self.policy, "nodes (locked)": f"{s['nodes']} ({s['locked_nodes']})",
                "cached tokens": s["device_tokens"], "cached blocks": s["device_blocks"],
                "lookups": s["lookups"],
                "hit rate": f"{_html.percent(s['hit_rate'])} ({s['hit_tokens']} of {s['lookup_tokens']} tokens)",
                "evicted blocks": s["evicted_blocks"]}
        if self.host_allocator is not None:
            rows["host tier: nodes / tokens"] = f"{s['host_nodes']} / {s['host_tokens']}"
        return _html.table("kvcache.PrefixCache", rows)
