"""Pure-PyTorch references: the specification of every kvcache op.

Tests compare each kernel against these functions, benchmarks use them as the "plain PyTorch" baseline,
and they double as a slow fallback. They use :class:`kvcache.layout.PageLayout` for every page offset and
mirror the ops' destination-passing signatures: writers mutate their cache/output arguments in place.
"""

from __future__ import annotations

import torch

from .layout import PageLayout


def append(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    """Writes K/V of new tokens into the pools at their slots (-1 skips a token).

    key, value: [batch, num_kv_heads, q_len, head_dim]; slot_mapping: [batch, q_len] int64.
    """
    layout = PageLayout.of(k_cache)
    keep = slot_mapping >= 0                                     # [batch, q_len]
    block, offset = layout.split_slot(slot_mapping[keep])        # [n], [n]
    k_cache[block, :, offset, :] = key.transpose(1, 2)[keep]     # [n, num_kv_heads, head_dim]
    v_cache[block, :, offset, :] = value.transpose(1, 2)[keep]


def _gather_one(k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor,
                length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence, [length, num_kv_heads, head_dim]."""
    layout = PageLayout.of(k_cache)
    positions = torch.arange(length, device=k_cache.device)
    block, offset = layout.split_slot(layout.token_slots(table_row, positions))
    return k_cache[block, :, offset, :], v_cache[block, :, offset, :]


def paged_gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Pages -> padded [batch, num_kv_heads, max_len, head_dim]; rows past each length are zero."""
    k_out.zero_()
    v_out.zero_()
    for b, length in enumerate(seq_lens.tolist()):
        k, v = _gather_one(k_cache, v_cache, block_tables[b], length)
        k_out[b, :, :length] = k.transpose(0, 1)
        v_out[b, :, :length] = v.transpose(0, 1)


def paged_gather_ragged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        cu_seq_lens: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Pages -> packed [total_tokens, num_kv_heads, head_dim], sequence b at rows cu[b]:cu[b+1]."""
    cu = cu_seq_lens.tolist()
    for b in range(len(cu) - 1):
        k, v = _gather_one(k_cache, v_cache, block_tables[b], cu[b + 1] - cu[b])
        k_out[cu[b]:cu[b + 1]] = k
        v_out[cu[b]:cu[b + 1]] = v


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """k_cache[dst] = k_cache[src] (and V) for each (src, dst) row of block_mapping [n, 2]."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def swap_blocks(k_src: torch.Tensor, v_src: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """k_dst[dst] = k_src[src] (and V) across pools, possibly on different devices."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    k_dst[dst.to(k_dst.device)] = k_src[src.to(k_src.device)].to(k_dst.device)
    v_dst[dst.to(v_dst.device)] = v_src[src.to(v_src.device)].to(v_dst.device)
