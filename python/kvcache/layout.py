"""The page layout of a KV pool, on the Python side.

One layer's K (or V) pool is a contiguous tensor ``[num_blocks, num_kv_heads, page_size, head_dim]``
("head-major"): decode attention streams one KV head of a sequence at a time, and in this layout the
``page_size x head_dim`` tile of a (block, head) pair is one contiguous run. The C++ twin of this class
is ``csrc/core/paged_layout.h``; between them they are the only code that computes page offsets.

K and V rows may differ in width (``v_head_dim``; by default equal to ``head_dim``): MLA models (DeepSeek-V2/V3)
hand the cache a latent of ``kv_lora_rank`` dims as the key and the rotary part of ``qk_rope_head_dim`` dims as
the value. The V pool is then ``[num_blocks, num_kv_heads, page_size, v_head_dim]``: the same blocks, heads and
pages, rows of their own width.

A *slot* names one token position in the pool: ``slot = block_id * page_size + offset_in_page``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_PAGE_SIZES = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PageLayout:
    """Geometry of one layer's K/V pools.

    >>> import torch
    >>> layout = PageLayout(num_blocks=8, page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    >>> layout.shape
    (8, 8, 16, 128)
    >>> layout.slot(block=3, offset=5)
    53
    >>> layout.bytes_per_block  # K and V together
    65536
    >>> mla = PageLayout(num_blocks=8, page_size=16, num_kv_heads=1, head_dim=512, v_head_dim=64)  # MLA latents
    >>> mla.shape, mla.v_shape, mla.bytes_per_block
    ((8, 1, 16, 512), (8, 1, 16, 64), 18432)
    """

    num_blocks: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    v_head_dim: int | None = None  # width of the V rows; None: head_dim

    def __post_init__(self) -> None:
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if (isinstance(self.page_size, bool) or not isinstance(self.page_size, int)
                or self.page_size not in SUPPORTED_PAGE_SIZES):  # (True == 1 and 16.0 == 16 would pass "in")
            raise ValueError(f"page_size={self.page_size!r} must be a power of two from 1 to 256, an int")
        for name in ("num_blocks", "num_kv_heads", "head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_blocks" else 1):
                raise ValueError(f"{name}={value!r} must be a {'non-negative' if name == 'num_blocks' else 'positive'} int")
        if self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype={self.dtype} is not supported; use one of {SUPPORTED_DTYPES}")

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of the K pool (and of the V pool when the widths are equal):
        ``(num_blocks, num_kv_heads, page_size, head_dim)``."""
        return (self.num_blocks, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        """Shape of the V pool: ``(num_blocks, num_kv_heads, page_size, v_head_dim)``."""
        return (self.num_blocks, self.num_kv_heads, self.page_size, self.v_head_dim)

    @property
    def equal_widths(self) -> bool:
        """Whether K and V rows have one width (what :func:`kvcache.paged_attention` reads)."""
        return self.v_head_dim == self.head_dim

    def dim(self, role: str) -> int:
        """Width of the rows of one side: ``role`` "k" or "v"."""
        if role not in ("k", "v"):
            raise ValueError(f"role={role!r} must be 'k' or 'v'")
        return self.head_dim if role == "k" else self.v_head_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of K plus one block of V."""
        return self.num_kv_heads * self.page_size * (self.head_dim + self.v_head_dim) * self.dtype.itemsize

    def allocate(self, device: torch.device | str = "cpu", *, fill: float | None = None,
                 pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocates the K and V pools (uninitialized unless ``fill`` is given).

        Large CPU pools ask for transparent huge pages before they are touched: attention jumps from
        page to page, and 4 KiB pages would make most of those jumps TLB misses.
        """
        return (pool_tensor(self.shape, self.dtype, device, fill=fill, pin_memory=pin_memory),
                pool_tensor(self.v_shape, self.dtype, device, fill=fill, pin_memory=pin_memory))

    @classmethod
    def of(cls, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None) -> "PageLayout":
        """The layout of existing pool tensors (the K pool, and the V pool when its rows may differ in width)."""
        if k_cache.dim() != 4:
            raise ValueError(f"k_cache must be [num_blocks, num_kv_heads, page_size, head_dim], got {tuple(k_cache.shape)}")
        n, h, p, d = k_cache.shape
        v_dim = d
        if v_cache is not None:
            if v_cache.dim() != 4 or tuple(v_cache.shape[:3]) != (n, h, p):
                raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}; the "
                                 f"pools must match in [num_blocks, num_kv_heads, page_size] (only head_dim may differ)")
            v_dim = v_cache.shape[3]
        # Codes of quantized pools (and float64 pools in tests) have other dtypes; the geometry is what counts.
        dtype = k_cache.dtype if k_cache.dtype in SUPPORTED_DTYPES else torch.float32
        return cls(num_blocks=n, page_size=p, num_kv_heads=h, head_dim=d, dtype=dtype, v_head_dim=v_dim)

    # ---- slots --------------------------------------------------------------------------------
    def slot(self, block: int | torch.Tensor, offset: int | torch.Tensor) -> int | torch.Tensor:
        """Slot of position ``offset`` in block ``block``."""
        return block * self.page_size + offset

    def split_slot(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in page) of each slot."""
        return torch.div(slot, self.page_size, rounding_mode="floor"), slot % self.page_size

    def token_slots(self, block_table_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots of token positions of one sequence whose pages are ``block_table_row``."""
        blocks = block_table_row.to(torch.int64)[torch.div(positions, self.page_size, rounding_mode="floor")]
        return blocks * self.page_size + positions % self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)


def pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu", *,
                fill: float | None = None, pin_memory: bool = False) -> torch.Tensor:
    """A pool tensor, uninitialized unless ``fill`` is given. A CPU tensor of >= 8 MiB lives on a fresh mapping
    advised to transparent huge pages before its pages are first touched (the fill, or the first append):
    attention jumps from page to page, and with 4 KiB pages most of those jumps are TLB misses. (Advising
    torch.empty's memory was not enough: it may be heap memory a freed tensor already touched.)"""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if torch.device(device).type == "cpu" and not pin_memory and nbytes >= (8 << 20):
        from . import _C  # the extension is loaded by the package __init__

        if nbytes >= 1 << 62:  # (no machine maps this much; mmap's failure is a MemoryError too)
            raise MemoryError(f"a pool tensor of {nbytes} bytes {tuple(shape)} ({dtype}) is larger than any address space")
        t = _C.huge_page_tensor(nbytes).view(dtype).view(shape)
    else:
        t = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    if fill is not None:
        t.fill_(fill)
    return t
