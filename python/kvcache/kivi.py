"""KIVIPool: one layer of a KIVI-style cache (2- or 4-bit; keys per channel, values per token).

KIVI keeps the most recent tokens in the model's dtype and quantizes a page only once it is complete
(keys need the statistics of all the page's tokens). A KIVIPool therefore holds two pools:

- ``sealed``: a :class:`kvcache.KVPool` of format ``kivi4`` / ``kivi2`` (block ids are the caller's, as for
  any KVPool), holding the quantized pages;
- ``residual``: a small full-precision KVPool holding the pages that are not sealed yet (the open page, the
  ``window`` most recent tokens, and the first ``sink_pages`` pages, which are never sealed). Which residual
  block holds the page of a caller's block id is kept here (``residual_of``), so callers use one block
  table per sequence, exactly as with a KVPool.

``append`` first seals the pages that are complete and older than the window *as of before this call*
(one ``kvcache.append`` of whole pages into the sealed pool: K statistics per channel over the page's
tokens, V per token in groups of 32), then writes the new tokens into the residual pool. So the tokens of
the call that :meth:`attention` is about to read are always in full precision, and every sealed token
precedes every query. ``attention`` runs ``paged_attention`` twice: over the sealed pages (each query as its
own row, seeing all of them) and over the residual pages (causal, bottom-right), and merges the two states
with ``merge_states``; both carry the log-sum-exp, so the result is exact attention over what is stored.

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

from . import ops
from .formats import CacheFormat
from .pool import KVPool


class KIVIPool:
    """One layer's KIVI cache: quantized sealed pages plus a full-precision residual (see the module doc).

    API (the same kind as :class:`kvcache.KVPool`, with block tables instead of a slot mapping, because
    sealing needs each sequence's page order):

    - ``KIVIPool.allocate(num_blocks, page_size, num_kv_heads, head_dim, format="kivi4", *, dtype,
      residual_blocks, window=0, sink_pages=0, device="cpu")``: ``num_blocks`` quantized blocks (the
      caller's block ids), ``residual_blocks`` full-precision blocks shared by all sequences' unsealed
      pages (each sequence needs ``sink_pages + ceil((window + its largest append) / page_size) + 1``).
    - ``append(key, value, block_tables, seq_lens)``: key/value ``[batch, kv_heads, q_len, head_dim]`` are
      the last ``q_len`` tokens of every sequence; ``seq_lens`` ``[batch]`` int32 are the lengths *after*
      the append; ``block_tables`` ``[batch, max_blocks]`` int32 must hold a block for every page.
    - ``attention(query, block_tables, seq_lens, cu_q_lens, scale=None, softcap=0.0, return_lse=False)``:
      as :func:`kvcache.paged_attention` (no sliding window or attention-sink masking).
    - ``gather(block_tables, seq_lens, max_len=None, dtype=None)``: dense K/V ``[batch, kv_heads, max_len,
      head_dim]`` (sealed pages dequantized, the rest as stored), zero past each length.
    - ``release(block_ids)``: call when the caller frees blocks (or a sequence ends): their residual
      blocks, if any, go back to the free list.
    - ``nbytes``: bytes of both pools.

    The residual bookkeeping lives on the host; every method validates its arguments before it writes.
    """

    def __init__(self, sealed: KVPool, residual: KVPool, window: int, sink_pages: int):
        self.sealed, self.residual = sealed, residual
        self.window, self.sink_pages = window, sink_pages
        self.page_size = sealed.page_size
        self.residual_of = [-1] * sealed.num_blocks     # caller's block id -> residual block (-1: sealed/none)
        self._free = list(range(residual.num_blocks - 1, -1, -1))

    @classmethod
    def allocate(cls, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 format: "str | CacheFormat" = "kivi4", *, dtype: torch.dtype = torch.bfloat16,
                 residual_blocks: int, window: int = 0, sink_pages: int = 0,
                 device: torch.device | str = "cpu") -> "KIVIPool":
        fmt = CacheFormat.parse(format)
        if not (fmt.k.kind.startswith("kivi") and fmt.v.kind.startswith("kivi")):
            raise ValueError(f"KIVIPool needs kivi formats for K and V, got {fmt}")
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

    # ---- bookkeeping -----------------------------------------------------------------------------------
    def _sealed_end(self, row: list[int], num_pages: int) -> int:
        """First page past the sealed run [sink_pages, end) of a sequence."""
        end = self.sink_pages
        while end < num_pages and self.residual_of[row[end]] < 0:
            end += 1
        return max(end, self.sink_pages)

    def sealed_pages(self, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> list[int]:
        """Number of sealed (quantized) pages of each sequence."""
        tables, lens = block_tables.tolist(), seq_lens.tolist()
        out = []
        for row, n in zip(tables, lens):
            pages = -(-n // self.page_size)
            out.append(max(0, min(self._sealed_end(row, pages), pages) - self.sink_pages))
        return out

    def release(self, block_ids) -> None:
        for b in (block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids):
            if self.residual_of[b] >= 0:
                self._free.append(self.residual_of[b])
                self.residual_of[b] = -1

    # ---- ops ---------------------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor) -> None:
        P = self.page_size
        if key.dim() != 4 or key.shape != value.shape:
            raise ValueError(f"key and value must both be [batch, kv_heads, q_len, head_dim], got {tuple(key.shape)} "
                             f"and {tuple(value.shape)}")
        batch, _, q_len, _ = key.shape
        tables, lens = block_tables.tolist(), seq_lens.tolist()
        if len(lens) != batch or len(tables) != batch:
            raise ValueError(f"block_tables has {len(tables)} rows and seq_lens {len(lens)} entries, but key has "
                             f"batch {batch}")
        seal, new_pages = [], []                          # (block, residual block); blocks needing a residual
        for b, (row, n) in enumerate(zip(tables, lens)):
            before = n - q_len
            if before < 0:
                raise ValueError(f"seq_lens[{b}] = {n} is shorter than the {q_len} tokens appended")
            pages = -(-n // P)
            if len(row) < pages or min(row[:pages], default=0) < 0 or max(row[:pages], default=0) >= len(self.residual_of):
                raise IndexError(f"block_tables[{b}] must hold {pages} valid block ids for seq_lens[{b}] = {n}, "
                                 f"got {row[:pages]}")
            end = self._sealed_end(row, -(-before // P))
            for p in range(end, max(end, (before - self.window) // P)):
                seal.append((row[p], self.residual_of[row[p]]))
            first_new = before // P
            if before % P and self.residual_of[row[first_new]] < 0 and first_new >= self.sink_pages:
                raise ValueError(f"sequence {b}: page {first_new} (block {row[first_new]}) is sealed; tokens can only "
                                 f"be appended after the sealed pages")
            new_pages += [row[p] for p in range(first_new, pages) if self.residual_of[row[p]] < 0]
        if len(new_pages) > len(self._free) + len(seal):
            raise RuntimeError(f"KIVIPool is out of residual blocks: this append needs {len(new_pages)}, "
                               f"{len(self._free) + len(seal)} are free (allocate more residual_blocks)")
        if seal:  # whole pages out of the residual, quantized into their sealed blocks
            res = torch.tensor([r for _, r in seal], dtype=torch.long, device=self.residual.k.device)
            blocks = torch.tensor([blk for blk, _ in seal], dtype=torch.long)
            slots = (blocks.view(-1, 1) * P + torch.arange(P)).to(self.residual.k.device)
            self.sealed.append(self.residual.k[res], self.residual.v[res], slots)
            for blk, r in seal:
                self.residual_of[blk] = -1
                self._free.append(r)
        for blk in new_pages:
            self.residual_of[blk] = self._free.pop()
        slots = torch.empty((batch, q_len), dtype=torch.long)
        for b, (row, n) in enumerate(zip(tables, lens)):
            for i, pos in enumerate(range(n - q_len, n)):
                slots[b, i] = self.residual_of[row[pos // P]] * P + pos % P
        self.residual.append(key, value, slots.to(self.residual.k.device))

    def _split(self, block_tables: torch.Tensor, seq_lens: torch.Tensor):
        """Per sequence: (sealed table row, sealed tokens, residual table row, residual tokens, sink tokens)."""
        P = self.page_size
        parts = []
        for row, n in zip(block_tables.tolist(), seq_lens.tolist()):
            pages = -(-n // P)
            end = min(self._sealed_end(row, pages), max(pages, self.sink_pages))
            sink = min(self.sink_pages * P, n)
            sealed_row = row[self.sink_pages:end] if end > self.sink_pages else []
            res_row = [self.residual_of[row[p]] for p in list(range(min(self.sink_pages, pages))) + list(range(end, pages))]
            parts.append((sealed_row, len(sealed_row) * P, res_row, n - len(sealed_row) * P, sink))
        return parts

    @staticmethod
    def _table(rows: list[list[int]], device) -> torch.Tensor:
        width = max([len(r) for r in rows] + [1])
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)

    def attention(self, query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  cu_q_lens: torch.Tensor, scale: float | None = None, softcap: float = 0.0,
                  return_lse: bool = False):
        dev = query.device
        parts = self._split(block_tables, seq_lens)
        cu = cu_q_lens.tolist()
        res_out, res_lse = ops.paged_attention(
            query, self.residual.k, self.residual.v, self._table([p[2] for p in parts], dev),
            torch.tensor([p[3] for p in parts], dtype=torch.int32, device=dev), cu_q_lens, scale, softcap=softcap,
            return_lse=True)
        rows = [(r, b) for b in range(len(parts)) for r in range(cu[b], cu[b + 1]) if parts[b][1] > 0]
        if not rows:
            return (res_out, res_lse) if return_lse else res_out
        # Every sealed token precedes every query: each query is its own row and sees all of them.
        idx = torch.tensor([r for r, _ in rows], dtype=torch.long, device=dev)
        s_out, s_lse = self.sealed.attention(
            query[idx], self._table([parts[b][0] for _, b in rows], dev),
            torch.tensor([parts[b][1] for _, b in rows], dtype=torch.int32, device=dev),
            torch.arange(len(rows) + 1, dtype=torch.int32, device=dev), scale, softcap=softcap, return_lse=True)
        sealed_out = torch.zeros_like(res_out).index_copy_(0, idx, s_out)
        sealed_lse = torch.full_like(res_lse, float("-inf")).index_copy_(0, idx, s_lse)
        out, lse = ops.merge_states(res_out, res_lse, sealed_out, sealed_lse)
        return (out, lse) if return_lse else out

    def gather(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int | None = None,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.residual.k.device
        dtype = dtype or torch.float32
        parts = self._split(block_tables, seq_lens)
        lens = seq_lens.tolist()
        max_len = max(lens, default=0) if max_len is None else max_len
        shape = (len(lens), self.sealed.num_kv_heads, max_len, self.sealed.head_dim)
        k_out, v_out = torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev)
        rk, rv = self.residual.gather(self._table([p[2] for p in parts], dev),
                                      torch.tensor([p[3] for p in parts], dtype=torch.int32, device=dev))
        sk, sv = self.sealed.gather(self._table([p[0] for p in parts], dev),
                                    torch.tensor([p[1] for p in parts], dtype=torch.int32, device=dev), dtype=dtype)
        rk, rv = rk.to(dtype), rv.to(dtype)  # (a full-precision pool gathers into its own dtype)
        for b, (_, n_sealed, _, n_res, sink) in enumerate(parts):
            k_out[b, :, :sink], v_out[b, :, :sink] = rk[b, :, :sink], rv[b, :, :sink]
            k_out[b, :, sink:sink + n_sealed], v_out[b, :, sink:sink + n_sealed] = sk[b, :, :n_sealed], sv[b, :, :n_sealed]
            rest = lens[b] - sink - n_sealed
            k_out[b, :, sink + n_sealed:lens[b]] = rk[b, :, sink:sink + rest]
            v_out[b, :, sink + n_sealed:lens[b]] = rv[b, :, sink:sink + rest]
        return k_out, v_out
