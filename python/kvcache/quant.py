"""Reference quantizers of the KV formats: the PyTorch mirror of ``csrc/core/quant.h``.

Every function computes in float32 with the same steps as the C++ header (a reciprocal per group,
round-half-to-even, clamps), so the codes a kernel stores are bit-identical to these. Shapes: the last
dimension is ``head_dim``; everything before it is batch-like.

Bad values (NaN, +-Inf) never enter a scale or zero point: those come from a group's finite values only.
NaN is fp8's NaN code, else the code nearest 0 (and, where asked, a NaN scale for its group); +-Inf is the
largest code of its sign. Asymmetric groups (fp16 metadata) saturate their values at +-65504 first.

>>> import torch
>>> x = torch.tensor([[0.5, -1.0, 0.25, 0.0]])
>>> codes, scale = int8_quantize(x)
>>> codes.tolist(), round(scale.item(), 6)
([[64, -127, 32, 0]], 0.007874)
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP16_MAX = 65504.0  # asymmetric groups keep fp16 (scale, zero): their values saturate here


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _div(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """numerator / t, correctly rounded like C++'s fp32 division. (``float / tensor`` in PyTorch is
    ``t.reciprocal() * float``: two roundings, which moves codes at exact ties.)"""
    return torch.full_like(t, numerator) / t


# ---- int8: symmetric, one scale per row (token, kv head) -----------------------------------------
def _nan_to_zero(y: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(y), torch.zeros_like(y), y)


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes int8 [..., d] and scales float32 [...] with ``x ~= codes * scale``.

    The scale comes from the row's finite values; a row holding a NaN gets a NaN scale (it reads back NaN,
    the NaN itself code 0), +-Inf is +-127."""
    x = _f32(x)
    amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=-1)
    inv = torch.where(amax > 0, _div(127.0, amax), torch.zeros_like(amax))
    codes = torch.round(_nan_to_zero(x * inv.unsqueeze(-1))).clamp(-127, 127).to(torch.int8)
    scale = torch.where(torch.isnan(x).any(dim=-1), torch.full_like(amax, float("nan")), amax / 127.0)
    return codes, scale


def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scale.unsqueeze(-1)


# ---- fp8: one scale per kv head ------------------------------------------------------------------
def fp8_quantize(x: torch.Tensor, scale: torch.Tensor | float, kind: str = "e4m3") -> torch.Tensor:
    """fp8 codes (as uint8 bit patterns) of ``x / scale``, rounded to nearest even, saturated (+-Inf too);
    NaN of either sign is the code 0x7f."""
    inv = _div(1.0, torch.as_tensor(scale, dtype=torch.float32))
    y = (_f32(x) * inv).clamp(-FP8_MAX[kind], FP8_MAX[kind])
    codes = y.to(FP8_DTYPES[kind]).view(torch.uint8)
    return torch.where(torch.isnan(y), torch.full_like(codes, 0x7F), codes)


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor | float, kind: str = "e4m3") -> torch.Tensor:
    return codes.view(FP8_DTYPES[kind]).to(torch.float32) * torch.as_tensor(scale, dtype=torch.float32)


def fp8_scale_for(x: torch.Tensor, kind: str = "e4m3", dim: int | tuple[int, ...] = -1) -> torch.Tensor:
    """A scale that maps the absolute maximum of ``x``'s finite values (over ``dim``) onto the format's largest
    value (1 where there is none)."""
    x = _f32(x)
    amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=dim)
    return torch.where(amax > 0, amax / FP8_MAX[kind], torch.ones_like(amax))


# ---- asymmetric unsigned N-bit groups --------------------------------------------------------------
def uint_quantize(x: torch.Tensor, bits: int, dim: int = -1,
                  nan_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes uint8 in [0, 2^bits - 1] (unpacked), scale and zero (float32) reduced over ``dim``.

    min and max are those of the finite values, saturated at +-65504 (a group with none: 0 and 0); NaN takes
    the code nearest 0, +-Inf the highest / lowest code. ``nan_scale``: a group holding a NaN gets a NaN
    scale (for groups of one token, which then read back NaN)."""
    x = _f32(x)
    levels = float((1 << bits) - 1)
    finite = torch.isfinite(x)
    inf = torch.full_like(x, float("inf"))
    clamped = x.clamp(-FP16_MAX, FP16_MAX)
    mn = torch.where(finite, clamped, inf).amin(dim=dim, keepdim=True)
    mx = torch.where(finite, clamped, -inf).amax(dim=dim, keepdim=True)
    empty = ~(mn <= mx)
    mn, mx = mn.masked_fill(empty, 0.0), mx.masked_fill(empty, 0.0)
    inv = torch.where(mx > mn, _div(levels, mx - mn), torch.zeros_like(mx))
    codes = torch.round(_nan_to_zero((_nan_to_zero(x) - mn) * inv)).clamp(0, levels).to(torch.uint8)
    scale = (mx - mn) / levels
    if nan_scale:
        scale = torch.where(torch.isnan(x).any(dim=dim, keepdim=True), torch.full_like(scale, float("nan")), scale)
    return codes, scale.squeeze(dim), mn.squeeze(dim)


def uint_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return codes.to(torch.float32) * scale.unsqueeze(dim) + zero.unsqueeze(dim)


def group_quantize(x: torch.Tensor, bits: int, group: int = 32):
    """Asymmetric groups of ``group`` along the last dim: codes [..., d], scale/zero [..., d / group]. A
    group holding a NaN gets a NaN scale (each group belongs to one token)."""
    *lead, d = x.shape
    if d % group:
        raise ValueError(f"head_dim={d} must be a multiple of group={group}")
    codes, scale, zero = uint_quantize(x.reshape(*lead, d // group, group), bits, nan_scale=True)
    return codes.reshape(*lead, d), scale, zero


def group_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = 32) -> torch.Tensor:
    *lead, d = codes.shape
    out = uint_dequantize(codes.reshape(*lead, d // group, group), scale, zero)
    return out.reshape(*lead, d)


# ---- Hadamard rotation (the ``hadamard`` option of a format) --------------------------------------
def rot_signs(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed signs s_d flipped onto each dim before the transform (Knuth's multiplicative hash)."""
    d = torch.arange(dim, dtype=torch.int64, device=device)
    return torch.where(((d * 2654435761) % 2**32) >> 31 == 1, -1.0, 1.0)


def rot_scales(dim: int) -> tuple[float, float, float]:
    """(c, 1 / (c D), 1 / (c^2 D)) with c = 2^-ceil(log2(D) / 2): forward, inverse and query scales."""
    if dim < 2 or dim > 1024 or dim & (dim - 1):
        raise ValueError(f"head_dim={dim} must be a power of two (2 to 1024) for Hadamard-rotated formats")
    c = 2.0 ** -((dim.bit_length() - 1 + 1) // 2)
    return c, 1.0 / (c * dim), 1.0 / (c * c * dim)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform along the last dim, butterflies in the order of
    ``quant::fwht``: for h = 1, 2, 4, ..., (x[i], x[i + h]) -> (x[i] + x[i + h], x[i] - x[i + h])."""
    *lead, d = x.shape
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, d)
        h *= 2
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """c * H (s . x) along the last dim, in float32 (what a ``hadamard`` format quantizes)."""
    c, _, _ = rot_scales(x.shape[-1])
    return fwht(_f32(x) * rot_signs(x.shape[-1], x.device)) * c


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate`: s . (H y) / (c D)."""
    _, inv, _ = rot_scales(y.shape[-1])
    return fwht(_f32(y)) * (inv * rot_signs(y.shape[-1], y.device))


def rotate_query(q: torch.Tensor) -> torch.Tensor:
    """A query rotated so that ``rotate_query(q) . rotate(k) == q . k``."""
    _, _, qs = rot_scales(q.shape[-1])
    return rotate(q) * qs


# ---- packing: 8 / bits codes per byte, lowest dim in the lowest bits ---------------------------------
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., d] -> bytes [..., d * bits / 8]."""
    per = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


# ---- KIVI packing: planes per 32-dim chunk (csrc/core/quant.h: planar_byte) ----------------------------
def pack_planar(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., d] (d a multiple of 32) -> bytes [..., d * bits / 8]: in each 32-dim chunk, dim j
    sits in byte j % (4 bits) at bit bits * (j // (4 bits))."""
    *lead, d = codes.shape
    planes = 8 // bits
    c = codes.to(torch.int32).reshape(*lead, d // 32, planes, 4 * bits)
    shifts = (torch.arange(planes, dtype=torch.int32, device=codes.device) * bits).view(planes, 1)
    return (c << shifts).sum(-2).to(torch.uint8).reshape(*lead, d * bits // 8)


def unpack_planar(packed: torch.Tensor, bits: int) -> torch.Tensor:
    *lead, nbytes = packed.shape
    planes = 8 // bits
    p = packed.to(torch.int32).reshape(*lead, nbytes // (4 * bits), 1, 4 * bits)
    shifts = (torch.arange(planes, dtype=torch.int32, device=packed.device) * bits).view(planes, 1)
    return ((p >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(*lead, nbytes * planes)
