"""KIVIPool: one layer of a KIVI-style cache (2- or 4-bit; keys per channel, values per token).

KIVI keeps the most recent tokens in the model's dtype and quantizes a page only once it is complete
(keys need the statistics of all the page's tokens). A KIVIPool therefore holds two pools:

- ``sealed``: a :class:`kvcache.KVPool` of format ``kivi4`` / ``kivi2`` (block ids are the caller's, as for
  any KVPool), holding the quantized pages;
- ``residual``: a small full-precision KVPool holding the pages that are not sealed yet (the open page, the
  ``window`` most recent tokens, and the first ``sink_pages`` pages, which are never sealed). Which residual
  block holds the page of a caller's block id is kept by a :class:`kvcache.residual.ResidualPages`
  (``pages``), so callers use one block table per sequence, exactly as with a KVPool.

This is :mod:`kvcache.residual` (which also serves the quantized PagedCache) for one layer: ``append``
first seals the pages that are complete and older than the window *as of before this call* (K statistics
per channel over the page's tokens, V per token in groups of 32), then writes the new tokens into the
residual pool, so the tokens of the call that :meth:`attention` is about to read are always in full
precision and every sealed token precedes every query. ``attention`` runs ``paged_attention`` over the
sealed pages (each query as its own row, seeing all of them) and over the residual pages (causal,
bottom-right) and merges the two by log-sum-exp: exact attention over what is stored.

>>> import torch, kvcache
>>> pool = kvcache.KIVIPool.allocate(num_blocks=8, page_size=16, num_kv_heads=2, head_dim=64, format="kivi4",
...                                  dtype=torch.float32, residual_blocks=4)
>>> table = torch.arange(4, dtype=torch.int32).view(1, 4)
>>> key = value = torch.randn(1, 2, 40, 64)
>>> pool.append(key, value, table, torch.tensor([40], dtype=torch.int32))        # prefill: all in full precision
>>> pool.append(key[:, :, :1], value[:, :, :1], table, torch.tensor([41], dtype=torch.int32))  # seals pages 0, 1
>>> pool.sealed_pages(table, torch.tensor([41], dtype=torch.int32))
[2]
"""

from __future__ import annotations

import torch

from . import _html, residual as res
from ._args import integer_arg
from .formats import CacheFormat
from .pool import KVPool
from .residual import ResidualPages


class KIVIPool:
    """One layer's KIVI cache: quantized sealed pages plus a full-precision residual (see the module doc).

    API (the same kind as :class:`kvcache.KVPool`, with block tables instead of a slot mapping, because
    sealing needs each sequence's page order):

    - ``KIVIPool.allocate(num_blocks, page_size, num_kv_heads, head_dim, format="kivi4", *, dtype,
      residual_blocks, window=0, sink_pages=0, device="cpu")``: ``num_blocks`` quantized blocks (the
      caller's block ids), ``residual_blocks`` full-precision blocks shared by all sequences' unsealed
      pages (each sequence needs ``sink_pages + ceil((window + its largest append) / page_size) + 1``).
    - ``append(key, value, block_tables, seq_lens)``: key/value ``[batch, kv_heads, q_len, head_dim]`` are
      the last ``q_len`` tokens of every sequence (any float dtypes, each stored in the pool's ``dtype``); ``seq_lens`` ``[batch]`` int32 are the lengths *after*
      the append; ``block_tables`` ``[batch, max_blocks]`` int32 must hold a block for every page.
    - ``attention(query, block_tables, seq_lens, cu_q_lens, scale=None, softcap=0.0, return_lse=False)``:
      as :func:`kvcache.paged_attention` (no sliding window or attention-sink masking).
    - ``gather(block_tables, seq_lens, max_len=None, dtype=None)``: dense K/V ``[batch, kv_heads, max_len,
      head_dim]`` (sealed pages dequantized, the rest as stored), zero past each length.
    - ``release(block_ids)``: call when the caller frees blocks (or a sequence ends): their residual
      blocks, if any, go back to the free list. ``block_ids``: an int, a list, or a 1-D or 2-D tensor (a
      sequence's block table) of ids in ``[0, num_blocks)``; any other id is refused before anything is freed.
    - ``nbytes``: bytes of both pools.

    The residual bookkeeping lives on the host; every method validates its arguments before it writes.
    The pool keeps no sequence lengths, so it cannot check that an append's ``seq_lens`` continue what a
    sequence holds: one that skips ahead leaves the skipped slots unwritten (read back as whatever they
    held), one that goes back overwrites, as a crop would.
    """

    def __init__(self, sealed: KVPool, residual: KVPool, window: int, sink_pages: int):
        self.sealed, self.residual = sealed, residual
        self.window, self.sink_pages = window, sink_pages
        self.page_size = sealed.page_size
        self.pages = ResidualPages(self.page_size, window, sink_pages, max_slots=residual.num_blocks)

    @classmethod
    def allocate(cls, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 format: "str | CacheFormat" = "kivi4", *, dtype: torch.dtype = torch.bfloat16,
                 residual_blocks: int, window: int = 0, sink_pages: int = 0,
                 device: torch.device | str = "cpu") -> "KIVIPool":
        fmt = CacheFormat.parse(format)
        if not (fmt.k.kind.startswith("kivi") and fmt.v.kind.startswith("kivi")):
            raise ValueError(f"KIVIPool needs kivi formats for K and V, got {fmt}")
        window = integer_arg("window", window, "full-precision tokens")
        sink_pages = integer_arg("sink_pages", sink_pages, "pages never sealed")
        residual_blocks = integer_arg("residual_blocks", residual_blocks, "full-precision blocks")
        if window < 0 or sink_pages < 0 or residual_blocks <= 0:
            raise ValueError(f"window={window} and sink_pages={sink_pages} must be >= 0 and "
                             f"residual_blocks={residual_blocks} positive")
        sealed = KVPool.allocate(num_blocks, page_size, num_kv_heads, head_dim, fmt, device)
        residual = KVPool.allocate(residual_blocks, page_size, num_kv_heads, head_dim, dtype, device)
        return cls(sealed, residual, window, sink_pages)

    @property
    def format(self) -> CacheFormat:
        return self.sealed.format

    @property
    def nbytes(self) -> int:
        return self.sealed.nbytes + self.residual.nbytes

    def __repr__(self) -> str:
        return (f"KIVIPool(format={self.format}, num_blocks={self.sealed.num_blocks}, "
                f"residual_blocks={self.residual.num_blocks}, page_size={self.page_size}, "
                f"num_kv_heads={self.sealed.num_kv_heads}, head_dim={self.sealed.head_dim}, window={self.window}, "
                f"sink_pages={self.sink_pages}, residual dtype={self.residual.k.dtype}, "
                f"device={self.sealed.k.device}, {_html.human_bytes(self.nbytes)})")

    def _repr_html_(self) -> str:
        return _html.table("kvcache.KIVIPool", {
            "format": str(self.format),
            "sealed blocks x page_size": f"{self.sealed.num_blocks} x {self.page_size}",
            "full-precision blocks": f"{self.residual.num_blocks} ({self.residual.k.dtype})",
            "kv heads x head_dim": f"{self.sealed.num_kv_heads} x {self.sealed.head_dim}",
            "full-precision window": f"{self.window} tokens + {self.sink_pages} sink pages",
            "bytes": f"{_html.human_bytes(self.nbytes)} (sealed {_html.human_bytes(self.sealed.nbytes)})",
        }, "one layer")

    def sealed_pages(self, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> list[int]:
        """Number of sealed (quantized) pages of each sequence."""
        tables, lens = self._check_tables(block_tables, seq_lens)
        return [self.pages.sealed_pages(row, n) for row, n in zip(tables, lens)]

    def release(self, block_ids) -> None:
        ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids
        if isinstance(ids, int) or not isinstance(ids, (list, tuple)):
            ids = [ids]
        flat = [x for item in ids for x in (item if isinstance(item, (list, tuple)) else [item])]
        n = self.sealed.num_blocks
        for i, b in enumerate(flat):  # (all checked before any is freed)
            b = integer_arg(f"block_ids[{i}]", b, "a block id")
            if not 0 <= b < n:
                raise IndexError(f"block_ids[{i}] = {b} is not a block of this pool (0 .. {n - 1})")
        for b in flat:
            self.pages.close(int(b))

    def _check_tables(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, min_len: int = 0):
        """The host lists of ``block_tables`` and ``seq_lens``, checked: ``[batch, max_blocks]`` and ``[batch]``
        integers, every length >= ``min_len`` (and >= 0), a valid block id for every page of it."""
        for name, t, dims in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1)):
            if not isinstance(t, torch.Tensor) or t.dim() != dims or t.is_floating_point() or t.dtype == torch.bool:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name} must be a {dims}-D integer tensor, got {shape}"
                                + (f" {t.dtype}" if isinstance(t, torch.Tensor) else ""))
        tables, lens = block_tables.tolist(), seq_lens.tolist()
        if len(tables) != len(lens):
            raise ValueError(f"block_tables has {len(tables)} rows but seq_lens has {len(lens)} entries")
        P, nb = self.page_size, self.sealed.num_blocks
        for b, (row, n) in enumerate(zip(tables, lens)):
            if n < max(min_len, 0):
                raise ValueError(f"seq_lens[{b}] = {n} must be >= {max(min_len, 0)}"
                                 + (f" (the {min_len} tokens appended)" if min_len else ""))
            pages = -(-n // P)
            if len(row) < pages:
                raise IndexError(f"seq_lens[{b}] = {n} needs {pages} blocks but block_tables has {len(row)} columns "
                                 f"(page_size {P})")
            for j, blk in enumerate(row[:pages]):
                if not 0 <= blk < nb:
                    raise IndexError(f"block_tables[{b}][{j}] = {blk} is not a block of this pool (0 .. {nb - 1}); "
                                     f"seq_lens[{b}] = {n} needs its first {pages} entries")
        return tables, lens

    # ---- ops ---------------------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor) -> None:
        if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
            raise TypeError(f"key and value must be tensors, got {type(key).__name__} and {type(value).__name__}")
        if key.dim() != 4 or key.shape != value.shape:
            raise ValueError(f"key and value must both be [batch, kv_heads, q_len, head_dim], got {tuple(key.shape)} "
                             f"and {tuple(value.shape)}")
        batch, heads, q_len, dim = key.shape
        if heads != self.sealed.num_kv_heads or dim != self.sealed.head_dim:
            raise ValueError(f"key and value {tuple(key.shape)}: kv_heads = {heads} and head_dim = {dim} must be the "
                             f"pool's {self.sealed.num_kv_heads} and {self.sealed.head_dim}")
        if not (key.is_floating_point() and value.is_floating_point()):
            raise TypeError(f"key and value must be floating point, got {key.dtype} and {value.dtype}")
        device = self.residual.k.device
        if key.device != device or value.device != device:
            raise ValueError(f"key and value are on {key.device} and {value.device}, the pool on {device}")
        # (every check before the residual bookkeeping moves: a refused call seals nothing)
        tables, lens = self._check_tables(block_tables, seq_lens, min_len=q_len)
        key, value = key.to(self.residual.k.dtype), value.to(self.residual.v.dtype)  # (any float dtype, each)
        if len(lens) != batch:
            raise ValueError(f"block_tables has {len(tables)} rows and seq_lens {len(lens)} entries, but key has "
                             f"batch {batch}")
        before = [n - q_len for n in lens]
        positions = torch.tensor(before, dtype=torch.int64).view(-1, 1) + torch.arange(q_len)
        plan = self.pages.plan(tables, before, lens, positions, torch.ones(batch, q_len, dtype=torch.bool))
        res.apply(plan.on(self.residual.k.device), self.sealed, self.residual, key, value)

    def _view(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_q_lens: torch.Tensor | None, device):
        tables, lens = self._check_tables(block_tables, seq_lens)
        cu = [0] * (len(lens) + 1) if cu_q_lens is None else cu_q_lens.tolist()
        if cu_q_lens is not None:
            if not isinstance(cu, list) or len(cu) != len(lens) + 1:
                raise ValueError(f"cu_q_lens must have batch + 1 = {len(lens) + 1} entries, got "
                                 f"{tuple(cu_q_lens.shape)}")
            for b, n in enumerate(lens):
                if not 0 <= cu[b + 1] - cu[b] <= n:
                    raise ValueError(f"cu_q_lens gives sequence {b} {cu[b + 1] - cu[b]} queries, but it must have "
                                     f"0 .. seq_lens[{b}] = {n}")
        view = self.pages.view(tables, lens, [b - a for a, b in zip(cu, cu[1:])])
        return view.on(torch.device(device))

    def attention(self, query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  cu_q_lens: torch.Tensor, scale: float | None = None, softcap: float = 0.0,
                  return_lse: bool = False):
        view = self._view(block_tables, seq_lens, cu_q_lens, query.device)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return res.attention(view, self.sealed, self.residual, query, cu_q_lens, scale, softcap, return_lse)

    def gather(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int | None = None,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        view = self._view(block_tables, seq_lens, None, self.residual.k.device)
        max_len = int(seq_lens.max()) if max_len is None and seq_lens.numel() else (max_len or 0)
        return res.gather(view, self.sealed, self.residual, block_tables.to(self.residual.k.device),
                          seq_lens.to(self.residual.k.device), max_len, dtype or torch.float32)
