"""Shared fixtures: devices, dtypes, page sizes, and a random paged batch builder."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kvcache

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PAGE_SIZES = tuple(2**i for i in range(9))  # 1 .. 256

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ("cpu", pytest.param("cuda", marks=[_cuda, pytest.mark.cuda]))


def asset_missing(message: str):
    """Skips a test whose real model or text is not cached; fails it under CI, where the test command has
    fetched them (make's fetch-assets), so that a real-model test never passes by skipping there."""
    from kvcache.assets import offline

    if os.environ.get("CI") and not offline():
        pytest.fail(f"CI: {message}", pytrace=False)
    pytest.skip(message)


ISA_ORDER = ("generic", "avx2", "avx512", "avx512bf16")
SUPPORTED_ISAS = ISA_ORDER[: ISA_ORDER.index(kvcache._C.best_cpu_isa()) + 1]

# The CUDA kernels built as C++ against a CPU emulator of the CUDA execution model
# (csrc/cuda_emulation; built when KVCACHE_CUDA_EMULATION=ON, as `make test` does): the same schemas
# as torch.ops.kvcache, under torch.ops.kvcache_cuda_emulation. KVCACHE_CUDA_EMULATION_LIBRARY names
# another build of it (`make test-cuda-asan`: with AddressSanitizer).
CUDA_EMULATION_LIBRARY = Path(os.environ.get("KVCACHE_CUDA_EMULATION_LIBRARY",
                                             Path(kvcache.__file__).parent / "_cuda_emulation.so"))
if CUDA_EMULATION_LIBRARY.exists():
    torch.ops.load_library(str(CUDA_EMULATION_LIBRARY))
HAS_CUDA_EMULATION = CUDA_EMULATION_LIBRARY.exists()
CUDA_EMULATED = "cuda-emulated"


@contextmanager
def ops_backend(name: str):
    """Routes kvcache's op wrappers to the CUDA kernels under the emulator (CUDA_EMULATED) or leaves them
    on torch.ops.kvcache."""
    before = kvcache.ops._ops
    if name == CUDA_EMULATED:
        kvcache.ops._ops = torch.ops.kvcache_cuda_emulation
    try:
        yield
    finally:
        kvcache.ops._ops = before


@pytest.fixture(params=("ops",) + ((CUDA_EMULATED,) if HAS_CUDA_EMULATION else ()))
def backend(request):
    """Runs a test of the storage ops on the registered kernels (torch.ops.kvcache, CPU here) and on the
    CUDA kernels under the emulator."""
    with ops_backend(request.param):
        yield request.param


# The avx512bf16 build's chunked prefill over bf16 pages with a bf16 query goes through MKL's bf16 GEMM by
# default on CPUs with AMX-BF16 and through the register kernel elsewhere: both run wherever torch's MKL
# has the routine ("+bf16gemm" forces the GEMM, the plain build name turns it off). Its bf16 and fp8 pages with
# a bf16 query take vdpbf16ps by default except on Intel cores, the fp32 FMAs of the avx512 build there: both
# run on any CPU with AVX-512 BF16 (the plain build name forces the dot products, "+fma" turns them off).
BF16_GEMM = "avx512bf16+bf16gemm"
BF16_FMA = "avx512bf16+fma"
KERNEL_BUILDS = SUPPORTED_ISAS + ((BF16_FMA,) if "avx512bf16" in SUPPORTED_ISAS else ()) + (
    (BF16_GEMM,) if "avx512bf16" in SUPPORTED_ISAS and kvcache._C.cpu_bf16_gemm_available() else ())
# KVCACHE_TEST_KERNEL_BUILDS=default runs the kernel-build tests once, on the build a user gets (the best ISA, its
# automatic GEMM and dot-product choices) instead of once per build: `make test-cpu-build` compiles the same
# torch-free kernels again, against another torch, so their per-build math is `make test`'s to check (issue #21).
DEFAULT_BUILD = "default"
_BUILDS = os.environ.get("KVCACHE_TEST_KERNEL_BUILDS", "all")
if _BUILDS not in ("all", DEFAULT_BUILD):
    raise ValueError(f"KVCACHE_TEST_KERNEL_BUILDS={_BUILDS!r} must be 'all' or '{DEFAULT_BUILD}'")
if _BUILDS == DEFAULT_BUILD:
    KERNEL_BUILDS = (DEFAULT_BUILD,)


@pytest.fixture(params=KERNEL_BUILDS + ((CUDA_EMULATED,) if HAS_CUDA_EMULATION else ()))
def isa(request):
    """Runs a test once per CPU attention-kernel build this machine supports (and the avx512bf16 build's
    GEMM prefill and its FMA path), and once on the CUDA kernels under the emulator (every op of the test then
    runs there)."""
    before = kvcache._C.cpu_isa()
    if request.param not in (CUDA_EMULATED, DEFAULT_BUILD):
        kvcache._C.set_cpu_isa(request.param.split("+")[0])
        kvcache._C.set_cpu_bf16_gemm("on" if request.param == BF16_GEMM else "off")
        kvcache._C.set_cpu_bf16_dot("off" if request.param == BF16_FMA else "on")
    try:
        with ops_backend(request.param):
            yield request.param
    finally:
        kvcache._C.set_cpu_isa(before)
        kvcache._C.set_cpu_bf16_gemm("auto")
        kvcache._C.set_cpu_bf16_dot("auto")


# The builds whose kernels round a bf16 query to integers: AVX-512 BF16 + VNNI (int8 and int4 keys: two 8-bit
# levels; KIVI keys: 16 bits) and AVX2 (int8, int4 and KIVI keys: 16 bits); the others take exact fp32 products.
INTEGER_QUERY_BUILDS = [b for b in ("avx2", "avx512bf16") if b in SUPPORTED_ISAS]
if KERNEL_BUILDS == (DEFAULT_BUILD,):
    INTEGER_QUERY_BUILDS = [b for b in INTEGER_QUERY_BUILDS if b == SUPPORTED_ISAS[-1]]


@pytest.fixture(params=INTEGER_QUERY_BUILDS)
def integer_build(request):
    """Runs a test once per CPU build this machine supports whose kernels quantize a bf16 query."""
    before = kvcache._C.cpu_isa()
    kvcache._C.set_cpu_isa(request.param)
    yield request.param
    kvcache._C.set_cpu_isa(before)


def attention_vs_reference(pool, deq, table, lens, cu, q, window=-1, scale=None):
    """Runs pool.attention(q, ...) and checks its output against float64 attention on the dequantized
    pages `deq` = (K, V) by the FlashAttention rule: at most twice the error of PyTorch's attention in the
    query's dtype, plus the rounding of the output. Returns (lse, lse64, lse_pt): ours, float64's and
    PyTorch's, for the caller's check of the log-sum-exp."""
    from kvcache import reference as ref
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = pool.attention(q, table, lens, cu, scale, window_left=window, return_lse=True)
    out64, lse64 = torch.zeros(q.shape, dtype=torch.float64), torch.zeros(q.shape[:2])
    ref.paged_attention(q.double(), deq[0].double(), deq[1].double(), table, lens, cu, scale, window, 0, 0.0,
                        out64, lse64, compute_dtype=torch.float64)
    out_pt, lse_pt = torch.zeros_like(q), torch.zeros(q.shape[:2])
    ref.paged_attention(q, deq[0].to(q.dtype), deq[1].to(q.dtype), table, lens, cu, scale, window, 0, 0.0,
                        out_pt, lse_pt, compute_dtype=q.dtype)
    pt_err = (out_pt.double() - out64).abs().max().item()
    noise = 2 * (out64.to(q.dtype).double() - out64).abs().max().item()
    err = (out.double() - out64).abs().max().item()
    assert err <= 2 * pt_err + noise + 1e-6, f"error {err:.3g} > 2 x {pt_err:.3g} + {noise:.3g}"
    return lse, lse64, lse_pt


def assert_lse_rule(lse, lse64, lse_pt):
    """The log-sum-exp by the FlashAttention rule too: at most twice PyTorch's error in the query's dtype
    (bf16 queries of int8 and int4 keys are quantized per row, in two int8 levels for byte dot products on
    AVX-512 and to 16 bits on AVX2; the CUDA prefill stages dequantized pages in the query's dtype for the
    tensor cores)."""
    lse_err, lse_pt_err = (lse - lse64).abs().max().item(), (lse_pt - lse64).abs().max().item()
    assert lse_err <= 2 * lse_pt_err + 2e-3, f"lse error {lse_err:.3g} > 2 x {lse_pt_err:.3g} + 2e-3"


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


def pytest_addoption(parser):
    parser.addoption("--soak-long", action="store_true", default=False,
                     help="run the soak tests (tests/test_soak.py) with ten times as many requests")


def pytest_terminal_summary(terminalreporter):
    """The fuzz tests' distinct-case counts per op (tests/fuzz_support.py), when they ran."""
    import sys
    fuzz = sys.modules.get("fuzz_support")
    if fuzz is not None:
        fuzz.report(terminalreporter)


def pytest_sessionfinish(session):
    """Under pytest-xdist (the test command runs two workers), a worker hands its fuzz cases to the
    controller, which reports them."""
    import sys
    workeroutput = getattr(session.config, "workeroutput", None)
    fuzz = sys.modules.get("fuzz_support")
    if workeroutput is not None and fuzz is not None:
        workeroutput["kvcache_fuzz_cases"] = fuzz.export()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    cases = getattr(node, "workeroutput", {}).get("kvcache_fuzz_cases")
    if cases:
        import fuzz_support
        fuzz_support.absorb(cases)
