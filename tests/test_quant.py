"""The quantizers of csrc/core/quant.h against their PyTorch mirror (kvcache.quant): codes bit for bit."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache import quant


def interesting_floats(n: int = 200_000, seed: int = 0) -> torch.Tensor:
    """Random values over many binades, plus exact ties, subnormal-range and saturating values."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.empty(n).uniform_(-24, 20, generator=g))
    x = mags * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    ties = torch.arange(-64, 64, dtype=torch.float32) / 16 + 1 / 32  # halfway between fp8 grid points
    bad = [float("nan"), -float("nan"), float("inf"), -float("inf"), 3e38, -3.4e38]
    return torch.cat([x, ties, torch.tensor([0.0, -0.0, 448.0, 464.0, 57344.0, 61440.0, 1e30, -1e30] + bad)])


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.5])
def test_fp8_codes_bit_identical_to_torch(kind, scale):
    x = interesting_floats()
    ref = quant.fp8_quantize(x, scale, kind)
    got = torch.empty_like(ref)
    kvcache._C._quant_fp8(x.data_ptr(), got.data_ptr(), x.numel(), scale, kind == "e4m3")
    mismatch = (got != ref).nonzero().flatten()
    assert mismatch.numel() == 0, f"{mismatch.numel()} codes differ, e.g. x={x[mismatch[:5]].tolist()}"


def test_int8_rows_bit_identical():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 128, generator=g) * torch.exp2(torch.empty(4096, 1).uniform_(-10, 10, generator=g))
    x[7] = 0.0                      # an all-zero row
    x[9, :5] = torch.tensor([0.5, -1.0, 0.25, 1 / 254, -3 / 254])  # exact ties at 127/amax
    codes_ref, scale_ref = quant.int8_quantize(x)
    codes, scale = torch.empty_like(codes_ref), torch.empty_like(scale_ref)
    kvcache._C._quant_int8_rows(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), 4096, 128)
    assert torch.equal(codes, codes_ref)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(quant.int8_dequantize(codes, scale)[7], torch.zeros(128))


def test_int8_ties_from_bfloat16_inputs():
    # bf16 values have 8 significant bits: x * (127 / amax) lands on exact .5 ties often, where a
    # reciprocal-then-multiply division (PyTorch's float / tensor) rounds the other way.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20000, 64, generator=g).to(torch.bfloat16).float()
    codes_ref, scale_ref = quant.int8_quantize(x)
    codes, scale = torch.empty_like(codes_ref), torch.empty_like(scale_ref)
    kvcache._C._quant_int8_rows(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), 20000, 64)
    assert torch.equal(codes, codes_ref)


@pytest.mark.parametrize("bits", [2, 4])
def test_uint_groups_bit_identical(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2048, 32, generator=g) * 3 + 1
    x[1000:] = x[1000:].to(torch.bfloat16).float()  # bf16 inputs: frequent exact ties
    x[3] = 0.7                      # a constant group
    codes_ref, scale_ref, zero_ref = quant.uint_quantize(x, bits)
    codes, scale, zero = torch.empty_like(codes_ref), torch.empty_like(scale_ref), torch.empty_like(zero_ref)
    kvcache._C._quant_uint_groups(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), 2048, 32, bits)
    assert torch.equal(codes, codes_ref) and torch.equal(scale, scale_ref) and torch.equal(zero, zero_ref)
    back = quant.uint_dequantize(codes, scale, zero)
    assert torch.equal(back[3], x[3])                       # a constant group comes back exactly
    err = (back - x).abs().max(dim=-1).values
    assert bool((err <= scale / 2 * (1 + 1e-5) + 1e-6).all())  # within half a step


def bad_rows(rows: int, d: int, seed: int) -> torch.Tensor:
    """Random rows, most with a NaN, +-Inf or a huge finite value somewhere; some all bad, one all NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g)
    bad = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 6e4, 1e5])
    pick = torch.randint(0, len(bad), (rows, 3), generator=g)
    where = torch.randint(0, d, (rows, 3), generator=g)
    x.scatter_(1, where, bad[pick])
    x[0] = float("nan")
    x[1] = float("inf")
    x[2, ::2], x[2, 1::2] = float("inf"), -float("inf")
    x[3] = 0.0
    x[3, 5] = float("nan")
    return x


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_int8_rows_with_bad_values_bit_identical():
    x = bad_rows(4096, 64, seed=5)
    codes_ref, scale_ref = quant.int8_quantize(x)
    codes, scale = torch.empty_like(codes_ref), torch.empty_like(scale_ref)
    kvcache._C._quant_int8_rows(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), 4096, 64)
    assert torch.equal(codes, codes_ref) and torch.equal(bits_of(scale), bits_of(scale_ref))
    has_nan = x.isnan().any(-1)
    assert torch.equal(scale.isnan(), has_nan) and torch.isfinite(scale[~has_nan]).all()
    finite_amax = torch.where(x.isfinite(), x.abs(), 0).amax(-1)
    inf_in_scaled_row = (x == float("inf")) & (finite_amax > 0).unsqueeze(-1)   # (no finite magnitude: code 0)
    assert torch.equal(codes[inf_in_scaled_row].unique(), torch.tensor([127], dtype=torch.int8))
    assert torch.equal(scale[~has_nan], finite_amax[~has_nan] / 127)   # only finite values set a scale


@pytest.mark.parametrize("bits", [2, 4])
def test_uint_groups_with_bad_values_bit_identical(bits):
    x = bad_rows(4096, 32, seed=bits)
    codes_ref, scale_ref, zero_ref = quant.uint_quantize(x, bits)
    codes, scale, zero = torch.empty_like(codes_ref), torch.empty_like(scale_ref), torch.empty_like(zero_ref)
    kvcache._C._quant_uint_groups(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), 4096, 32, bits)
    assert torch.equal(codes, codes_ref) and torch.equal(scale, scale_ref) and torch.equal(zero, zero_ref)
    # fp16 metadata: never infinite, whatever the values
    assert torch.isfinite(scale.half()).all() and torch.isfinite(zero.half()).all()
    spread = (scale > 0).unsqueeze(-1)   # (a group with no finite range reads the same for every code: 0)
    assert bool((codes[(x == float("inf")) & spread] == 2**bits - 1).all())
    assert bool((codes[(x == -float("inf")) & spread] == 0).all())
    assert torch.isnan(quant.group_quantize(x, bits)[1][0, 0])     # per-token groups: a NaN scale for a NaN


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (3, 64), dtype=torch.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape == (3, 64 * bits // 8)
    assert torch.equal(quant.unpack(packed, bits), codes)
    if bits == 4:  # lowest dim in the low nibble
        assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)


def test_group_quantize_shapes_and_error():
    x = torch.randn(5, 8, 128)
    codes, scale, zero = quant.group_quantize(x, 4, 32)
    assert codes.shape == (5, 8, 128) and scale.shape == zero.shape == (5, 8, 4)
    rel = (quant.group_dequantize(codes, scale, zero) - x).norm() / x.norm()
    assert rel < 0.1
    with pytest.raises(ValueError, match="head_dim=100 must be a multiple of group=32"):
        quant.group_quantize(torch.randn(2, 100), 4)


# ---- Hadamard rotation -------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [2, 16, 64, 128, 256])
def test_fwht_is_the_hadamard_matrix(dim):
    i = torch.arange(dim)
    bits = i.view(-1, 1) & i.view(1, -1)
    parity = torch.zeros_like(bits)
    for b in range(dim.bit_length()):
        parity ^= (bits >> b) & 1
    h = 1.0 - 2.0 * parity.double()
    x = torch.randint(-8, 8, (5, dim)).float()   # small integers: every sum is exact
    assert torch.equal(quant.fwht(x).double(), x.double() @ h.T)


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_rotation_keeps_dot_products_and_inverts(dim):
    g = torch.Generator().manual_seed(dim)
    q, k = torch.randn(7, dim, generator=g), torch.randn(7, dim, generator=g) * 5
    dots = (quant.rotate_query(q).double() * quant.rotate(k).double()).sum(-1)
    assert torch.allclose(dots, (q.double() * k.double()).sum(-1), atol=1e-4)
    assert torch.allclose(quant.unrotate(quant.rotate(k)), k, atol=1e-5)
    signs = quant.rot_signs(dim)
    assert 0.25 < (signs < 0).float().mean() < 0.75   # a real mix of signs, not all +1


def test_rotation_spreads_an_outlier_channel():
    x = torch.randn(64, 64) * 0.1
    x[:, 5] += 20.0                               # one outlier channel, like SmolLM2's keys
    crest = lambda t: float((t.abs().amax(-1) / t.pow(2).mean(-1).sqrt()).mean())  # noqa: E731
    assert crest(x) > 7.5 and crest(quant.rotate(x)) < 1.5


def test_rotation_needs_a_power_of_two():
    with pytest.raises(ValueError, match=r"head_dim=96 must be a power of two"):
        quant.rotate(torch.zeros(2, 96))


# ---- KIVI planar packing -------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_planar_packing_layout_and_round_trip(bits):
    codes = torch.randint(0, 2**bits, (3, 64), dtype=torch.uint8)
    packed = quant.pack_planar(codes, bits)
    assert packed.shape == (3, 64 * bits // 8)
    assert torch.equal(quant.unpack_planar(packed, bits), codes)
    span = 4 * bits
    for d in (0, 5, 17, 31, 32, 63):   # core/quant.h: planar_byte / planar_shift
        byte = (d // 32) * span + (d % 32) % span
        shift = bits * ((d % 32) // span)
        assert torch.equal((packed[:, byte].to(torch.int32) >> shift) & (2**bits - 1), codes[:, d].to(torch.int32))
