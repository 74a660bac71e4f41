"""Shared fixtures: devices, dtypes, page sizes, and a random paged batch builder."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kvcache

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PAGE_SIZES = tuple(2**i for i in range(9))  # 1 .. 256

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ("cpu", pytest.param("cuda", marks=[_cuda, pytest.mark.cuda]))


ISA_ORDER = ("generic", "avx2", "avx512", "avx512bf16")
SUPPORTED_ISAS = ISA_ORDER[: ISA_ORDER.index(kvcache._C.best_cpu_isa()) + 1]


@pytest.fixture(params=SUPPORTED_ISAS)
def isa(request):
    """Runs a test once per CPU attention-kernel build this machine supports."""
    before = kvcache._C.cpu_isa()
    kvcache._C.set_cpu_isa(request.param)
    yield request.param
    kvcache._C.set_cpu_isa(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@dataclass
class PagedBatch:
    """A random batch of sequences stored in a K/V pool through shuffled block tables."""

    layout: kvcache.PageLayout
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # [batch, max_blocks] int32, unused entries -1
    seq_lens: torch.Tensor       # [batch] int32
    used_blocks: torch.Tensor    # ids of the blocks holding tokens

    @property
    def cu_seq_lens(self) -> torch.Tensor:
        return torch.nn.functional.pad(self.seq_lens.cumsum(0), (1, 0)).to(torch.int32)


def make_paged_batch(lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: str = "cpu", spare_blocks: int = 3,
                     generator: torch.Generator | None = None) -> PagedBatch:
    """Pool with the sequences' blocks at random ids; blocks no sequence uses are NaN (poison)."""
    pages = [-(-n // page_size) for n in lens]
    num_blocks = sum(pages) + spare_blocks
    layout = kvcache.PageLayout(num_blocks, page_size, num_kv_heads, head_dim, dtype)
    k_cache = torch.full(layout.shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(layout.shape, float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=generator)
    max_blocks = max(pages, default=0) + 1  # one extra column, left at -1
    table = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[start:start + p].to(torch.int32)
        start += p
    used = perm[:start]
    k_cache[used.to(device)] = torch.randn((len(used), *layout.shape[1:]), generator=generator).to(dtype).to(device)
    v_cache[used.to(device)] = torch.randn((len(used), *layout.shape[1:]), generator=generator).to(dtype).to(device)
    return PagedBatch(layout, k_cache, v_cache, table.to(device),
                      torch.tensor(lens, dtype=torch.int32, device=device), used)
