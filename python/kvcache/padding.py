"""The padding hand-over from the ``"kvcache"`` mask function to :meth:`kvcache.PagedCache.update` (and the
cache hand-over from ``get_mask_sizes`` to the mask function).

The mask function runs at the start of each forward, before the first layer's ``update``; it leaves the
left padding of a fresh prompt here so that the cache never stores pad tokens when the kernel attends."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch


@dataclass
class Padding:
    """A forward's 2-D padding mask, left by the mask function for the first layer's update."""

    mask: torch.Tensor  # [batch, kv_length] bool
    q_length: int


PENDING_PADDING: contextvars.ContextVar[Padding | None] = contextvars.ContextVar("kvcache_padding", default=None)

# The cache whose ``get_mask_sizes`` transformers' mask code just asked (before the mask function, before the
# layers): the ``"kvcache"`` mask function plans that cache's step there (PagedCache._plan_ahead), outside the
# model's layer loop.
PENDING_CACHE: contextvars.ContextVar[object | None] = contextvars.ContextVar("kvcache_mask_cache", default=None)


def leading_pads(mask: torch.Tensor) -> list[int] | None:
    """Per-row count of leading False entries, or None if some row has a False after a True."""
    m = mask.to(torch.bool)
    pads = (~m).to(torch.int32).cumprod(dim=1).sum(dim=1)
    expected = torch.arange(m.shape[1], device=m.device).unsqueeze(0) >= pads.unsqueeze(1)
    if not torch.equal(expected, m):
        return None
    return pads.tolist()

