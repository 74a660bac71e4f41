"""Check 4 of issue #23 on the emulated CUDA kernels: the global loads of KV pages in a decode step, as the
emulator logs them (emu::log_global_load; a warp-wide load is one call site's n-th execution by the lanes of a
warp, whatever the order the emulator runs them in). The decode kernel copies its K / V tiles with cp.async;
every copy is logged. On whole 16-key tiles (lengths a multiple of 16):

- each warp-wide load moves >= 512 bytes (32 lanes x 16);
- >= 95% of every 32-byte sector it touches is bytes it asked for;
- each KV byte of the step's pages is read once: the bytes read are exactly the sequences' K and V rows,
  and no address is read twice (a GQA group of up to 16 query heads is one pass over the keys).

The MLA kernels copy their latent and rope rows the same way (a CTA per tile of 8 query heads on the CUDA cores,
of 16 on tensor cores).

The log also counts the tensor-core instructions (mma, ldmatrix) and the shared-memory wavefronts an ldmatrix takes
beyond one per matrix: the bank conflicts of the tiles, which must be none."""

from __future__ import annotations

import pytest
import torch

import kvcache
from conftest import CUDA_EMULATED, HAS_CUDA_EMULATION, ops_backend
from test_quantized import filled_pool

pytestmark = pytest.mark.skipif(not HAS_CUDA_EMULATION, reason="the CUDA emulation library is not built")


def logged(run) -> list[int]:
    """run() on the emulated CUDA kernels under the access log: its summary (access_log_stop)."""
    ops = torch.ops.kvcache_cuda_emulation
    with ops_backend(CUDA_EMULATED):
        ops.access_log_start()
        try:
            run()
        finally:
            summary = ops.access_log_stop()
    return summary


def whole_page_pool(fmt: str, lens: list[int], page: int, heads: int, dim: int):
    """A pool holding `lens` tokens (multiples of `page`) per sequence on shuffled pages, each sequence appended
    at once."""
    g = torch.Generator().manual_seed(7)
    pages = [n // page for n in lens]
    pool = kvcache.KVPool.allocate(sum(pages) + 1, page, heads, dim, fmt)
    perm = torch.randperm(pool.num_blocks, generator=g).to(torch.int32)
    table = torch.full((len(lens), max(pages)), -1, dtype=torch.int32)
    start = 0
    for b, (n, p) in enumerate(zip(lens, pages)):
        table[b, :p] = perm[start:start + p]
        start += p
        k, v = (torch.randn(1, heads, n, dim, generator=g).to(torch.bfloat16) for _ in range(2))
        pool.append(k, v, pool.layout.token_slots(table[b], torch.arange(n)).view(1, n))
    return pool, table, torch.tensor(lens, dtype=torch.int32)


def row_bytes(codes: torch.Tensor, page: int) -> int:
    """Bytes of one (block, head, position) row of a code pool [blocks, heads, page, ...]."""
    return codes[0, 0].numel() * codes.element_size() // page


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "int8", "fp8_e4m3", "int4", "k=int8,v=int4", "kivi2",
                                 "kivi4"])
@pytest.mark.parametrize("head_dim, group", [(128, 4), (64, 8), (128, 16)])
def test_decode_reads_each_kv_byte_once_in_full_sectors(fmt, head_dim, group):
    heads, page, lens = 2, 16, [256, 512, 48]
    in_dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(fmt, torch.bfloat16)
    if fmt.startswith("kivi"):  # KIVI keys are written whole pages at a time: one append per sequence
        pool, table, seq_lens = whole_page_pool(fmt, lens, page, heads, head_dim)
    else:
        pool, table, seq_lens, _, _ = filled_pool(fmt, lens, page, heads, head_dim, in_dtype, seed=5)
    q = torch.randn(len(lens), heads * group, head_dim).to(in_dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    summary = logged(lambda: pool.attention(q, table, seq_lens, cu, head_dim ** -0.5))
    warp_loads, loaded, sector_bytes, min_warp_bytes, read_again = summary[:5]
    shared_loads, shared_extra = summary[8:]
    assert shared_loads > 0 and shared_extra == 0  # the ring's (or decoded tile's) reads: no bank conflicts
    kv_row = row_bytes(pool.k, page) + row_bytes(pool.v, page)
    assert warp_loads > 0
    assert loaded == sum(lens) * heads * kv_row  # every K and V row of the step, codes only
    assert read_again == 0
    assert min_warp_bytes >= 512, (min_warp_bytes, kv_row)
    assert loaded / sector_bytes >= 0.95


def test_the_log_sees_a_read_twice_and_a_partial_warp():
    """The summary is not vacuous: a GQA group wider than a CTA's pass (32 query heads per KV head) reads the
    keys twice, and a sequence that ends inside a tile leaves lanes idle in its last copies (int8 at head_dim
    128: a warp copies two keys' rows at once; the 41st key is alone)."""
    pool, table, seq_lens, _, _ = filled_pool("int8", [41], 16, 1, 128, torch.bfloat16, seed=6)
    q = torch.randn(1, 32, 128).to(torch.bfloat16)
    cu = torch.arange(2, dtype=torch.int32)
    _, loaded, _, min_warp_bytes, read_again = logged(lambda: pool.attention(q, table, seq_lens, cu, 128 ** -0.5))[:5]
    kv_row = row_bytes(pool.k, 16) + row_bytes(pool.v, 16)
    assert loaded == 2 * 41 * kv_row and read_again == 41 * kv_row
    assert min_warp_bytes < 512


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float16, torch.float32, "int8", "fp8_e4m3", "int4", "kivi4"])
@pytest.mark.parametrize("q_heads", [8, 1])
def test_mla_decode_reads_each_latent_byte_once_in_full_sectors(fmt, q_heads):
    """The MLA kernels at DeepSeek-V3's widths (latent 512, rope 64): a CTA takes up to 8 query heads of a kv head
    (16 on tensor cores: bf16 and fp16), so a decode step of 8 heads reads every latent and rope row once. A stage
    copies 8 keys' rows (16): every warp-wide copy moves 512 bytes when a stage's 16-byte units are a multiple of 32
    (bf16, fp16, fp32, int8, fp8); int4 and KIVI rows (18 and 9 units per key at these widths) leave half a warp in
    a stage's last copy."""
    from test_mla_attention import cu_from, mla_pool

    lens = [64, 128, 16]
    g = torch.Generator().manual_seed(11)
    pool, table, seq_lens, _, _ = mla_pool(lens, fmt, 512, 64, page=16, generator=g)
    dtype = fmt if isinstance(fmt, torch.dtype) else torch.bfloat16
    q_latent = torch.randn(len(lens), q_heads, 512, generator=g).to(dtype)
    q_rope = torch.randn(len(lens), q_heads, 64, generator=g).to(dtype)
    summary = logged(lambda: pool.mla_attention(q_latent, q_rope, table, seq_lens, cu_from([1] * len(lens)), 0.1))
    warp_loads, loaded, sector_bytes, min_warp_bytes, read_again = summary[:5]
    shared_loads, shared_extra = summary[8:]
    assert shared_loads > 0 and shared_extra == 0  # stage / decoded-tile / S-block reads: no bank conflicts
    units = (row_bytes(pool.k, 16) + row_bytes(pool.v, 16)) // 16
    assert warp_loads > 0
    assert loaded == sum(lens) * 16 * units  # every latent and rope row of the step, codes only
    assert read_again == 0
    assert loaded / sector_bytes >= 0.95
    if 8 * units % 32 == 0:
        assert min_warp_bytes >= 512, (min_warp_bytes, units)
    else:
        assert min_warp_bytes >= 256, (min_warp_bytes, units)


def mla_step(dtype, latent: int, rope: int, q_heads: int, lens: list[int], q_lens: list[int]):
    """One mla_attention call on the emulated kernels under the access log: (its summary, the pool)."""
    from test_mla_attention import cu_from, mla_pool

    g = torch.Generator().manual_seed(12)
    pool, table, seq_lens, _, _ = mla_pool(lens, dtype, latent, rope, page=16, generator=g)
    q_dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    q_latent = torch.randn(sum(q_lens), q_heads, latent, generator=g).to(q_dtype)
    q_rope = torch.randn(sum(q_lens), q_heads, rope, generator=g).to(q_dtype)
    summary = logged(lambda: pool.mla_attention(q_latent, q_rope, table, seq_lens, cu_from(q_lens), 0.1))
    return summary, pool


@pytest.mark.parametrize("dtype,latent,rope,q_heads", [(torch.bfloat16, 512, 64, 16), (torch.float16, 256, 32, 16),
                                                       (torch.bfloat16, 192, 48, 12), (torch.float16, 64, 16, 3)])
def test_mla_runs_on_tensor_cores_without_bank_conflicts(dtype, latent, rope, q_heads):
    """bf16 / fp16 pools of the query's dtype run in mla_mma_kernel: 16 query heads as mma's M dimension, stages
    of 16 keys. Per CTA and stage: S = Q [C | K_rope]^T takes (latent + rope) / 16 k-steps x 2 n-tiles of mma and
    one ldmatrix.x4 per k-step; P C takes latent / 8 n-tiles of mma and one ldmatrix.x4.trans per 16 dims. The
    stage's rows are padded by 16 bytes, so no ldmatrix conflicts. A decode step still reads every latent and
    rope byte once, in 512-byte warp copies of full sectors."""
    lens = [64, 112, 16]  # whole stages: a partial one leaves lanes idle in its copies
    summary, pool = mla_step(dtype, latent, rope, q_heads, lens, [1, 1, 1])
    warp_loads, loaded, sector_bytes, min_warp_bytes, read_again, mma, ldmatrix, extra = summary[:8]
    assert summary[8] > 0 and summary[9] == 0  # the warps' S blocks, read back: no bank conflicts
    stages = sum(-(-n // 16) for n in lens)
    assert mma == stages * (2 * (latent + rope) // 16 + latent // 8)
    assert ldmatrix == stages * ((latent + rope) // 16 + latent // 16)
    assert extra == 0
    units = (row_bytes(pool.k, 16) + row_bytes(pool.v, 16)) // 16
    assert loaded == sum(lens) * 16 * units and read_again == 0
    assert min_warp_bytes >= 512 and loaded / sector_bytes >= 0.95


@pytest.mark.parametrize("dtype,latent,rope", [(torch.float32, 512, 64), ("int8", 512, 64), (torch.bfloat16, 576, 72),
                                               (torch.bfloat16, 96, 16), (torch.float16, 64, 8)])
def test_mla_off_the_tensor_core_grid_runs_on_cuda_cores(dtype, latent, rope):
    """fp32 and quantized pools, and widths off mla_mma_kernel's grid (latent a multiple of 64 up to 512, rope of
    16 up to 64), run on the CUDA cores: no mma."""
    summary, _ = mla_step(dtype, latent, rope, 8, [40, 9], [1, 3])
    assert summary[0] > 0 and summary[5] == 0 and summary[6] == 0


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64), ("int8", 128)])
def test_prefill_tiles_have_no_bank_conflicts(dtype, head_dim):
    """prefill_mma_kernel's K / V tiles (rows padded by 16 bytes) take one wavefront per ldmatrix matrix."""
    fmt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, dtype)
    in_dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    pool, table, seq_lens, _, _ = filled_pool(fmt, [96, 130], 16, 2, head_dim, in_dtype, seed=8)
    q = torch.randn(96 + 130, 2 * 4, head_dim).to(in_dtype)
    cu = torch.tensor([0, 96, 96 + 130], dtype=torch.int32)
    summary = logged(lambda: pool.attention(q, table, seq_lens, cu, head_dim ** -0.5))
    mma, ldmatrix, extra = summary[5:8]
    assert mma > 0 and ldmatrix > 0
    assert extra == 0


@pytest.mark.parametrize("fmt,head_dim", [("bf16", 256), ("int4", 256), ("int8", 40), ("fp32", 96)])
def test_staged_tiles_are_read_without_bank_conflicts(fmt, head_dim):
    """The decode tiles staged without the ring (head_dim 256: 8 dims per lane; rows that are not whole 16-byte
    units: value by value) are fp32 tiles whose lanes read consecutive words: no bank conflicts. (A tile read down
    its columns would conflict: csrc/tests/test_cuda_emulator.cpp checks that the log counts such reads.)"""
    in_dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    pool, table, seq_lens, _, _ = filled_pool(fmt, [40, 17], 16, 1, head_dim, in_dtype, seed=9)
    q = torch.randn(2, 4, head_dim).to(in_dtype)
    cu = torch.arange(3, dtype=torch.int32)
    summary = logged(lambda: pool.attention(q, table, seq_lens, cu, head_dim ** -0.5))
    assert summary[8] > 0 and summary[9] == 0
