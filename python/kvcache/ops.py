"""Typed wrappers of the ``torch.ops.kvcache`` ops.

The ops are defined in C++ (``csrc/ops.cpp``) and called here through their ``.default`` overloads:
no Python ``torch.library.custom_op`` sits on the hot path. Every op that writes its arguments returns
nothing, so torch.compile generates its fake (meta) kernel itself; none needs a Python one.
"""

from __future__ import annotations

import torch

_ops = torch.ops.kvcache


def append(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    """Writes the K/V of new tokens into the page pools.

    Args:
        key, value: ``[batch, num_kv_heads, q_len, head_dim]``, any strides (as Hugging Face models hand
            them over), same dtype as the pools.
        k_cache, v_cache: pools ``[num_blocks, num_kv_heads, page_size, head_dim]``, written in place.
        slot_mapping: ``[batch, q_len]`` int64; ``slot = block_id * page_size + offset``, -1 skips a token.

    >>> import torch, kvcache
    >>> k_cache, v_cache = kvcache.PageLayout(2, 4, 1, 8, torch.float32).allocate(fill=0.0)
    >>> key = torch.ones(1, 1, 2, 8); value = 2 * key
    >>> kvcache.append(key, value, k_cache, v_cache, torch.tensor([[5, -1]]))
    >>> k_cache[1, 0, 1].tolist() == [1.0] * 8, float(v_cache.sum())
    (True, 16.0)
    """
    _ops.append.default(key, value, k_cache, v_cache, slot_mapping)


def paged_gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int | None = None, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers each sequence's pages into padded ``[batch, num_kv_heads, max_len, head_dim]`` K and V.

    Rows past a sequence's length are zero. ``block_tables`` is ``[batch, max_blocks]`` int32 and
    ``seq_lens`` ``[batch]`` int32. Without ``out``, ``max_len`` defaults to ``max(seq_lens)``.

    >>> import torch, kvcache
    >>> layout = kvcache.PageLayout(4, 2, 1, 3, torch.float32)
    >>> k_cache = torch.arange(24.).view(layout.shape); v_cache = -k_cache
    >>> k, v = kvcache.paged_gather(k_cache, v_cache, torch.tensor([[3, 1]], dtype=torch.int32),
    ...                             torch.tensor([3], dtype=torch.int32))
    >>> k[0, 0].tolist()
    [[18.0, 19.0, 20.0], [21.0, 22.0, 23.0], [6.0, 7.0, 8.0]]
    """
    if out is None:
        if max_len is None:
            max_len = int(seq_lens.max()) if seq_lens.numel() else 0
        _, heads, _, dim = k_cache.shape
        shape = (seq_lens.shape[0], heads, max_len, dim)
        out = (k_cache.new_empty(shape), v_cache.new_empty(shape))
    _ops.paged_gather.default(k_cache, v_cache, block_tables, seq_lens, out[0], out[1])
    return out


def paged_gather_ragged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        cu_seq_lens: torch.Tensor, *,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers the pages into packed ``[total_tokens, num_kv_heads, head_dim]`` K and V.

    Sequence ``b`` occupies rows ``cu_seq_lens[b]:cu_seq_lens[b + 1]`` (``cu_seq_lens`` is
    ``[batch + 1]`` int32, starting at 0), the varlen convention of FlashAttention.
    """
    if out is None:
        total = int(cu_seq_lens[-1]) if cu_seq_lens.numel() else 0
        _, heads, _, dim = k_cache.shape
        out = (k_cache.new_empty((total, heads, dim)), v_cache.new_empty((total, heads, dim)))
    _ops.paged_gather_ragged.default(k_cache, v_cache, block_tables, cu_seq_lens, out[0], out[1])
    return out


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies whole blocks within one pool (copy-on-write): ``block_mapping`` is ``[n, 2]`` int64 of
    (src, dst) pairs; destinations are distinct and never also sources in the same call."""
    _ops.copy_blocks.default(k_cache, v_cache, block_mapping)


def swap_blocks(k_src: torch.Tensor, v_src: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """Copies blocks between two pools of the same block shape, e.g. device <-> host.

    ``block_mapping`` is a CPU ``[n, 2]`` int64 tensor of (block in src pools, block in dst pools).
    """
    _ops.swap_blocks.default(k_src, v_src, k_dst, v_dst, block_mapping)
