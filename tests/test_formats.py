"""KV formats: typed objects, canonical text that round-trips, exact byte accounting."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache import CacheFormat, KVFormat, memory


@pytest.mark.parametrize("text", ["fp16", "bf16", "fp32", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi2", "kivi4",
                                  "int4(group=64)", "fp8_e4m3(scale=0.05)", "kivi2(group=128)",
                                  "int8(hadamard)", "int4(group=64,hadamard)", "fp8_e4m3(scale=0.05,hadamard)"])
def test_text_round_trips(text):
    fmt = KVFormat.parse(text)
    assert str(fmt) == text
    assert KVFormat.parse(str(fmt)) == fmt


@pytest.mark.parametrize("scale", [0.1234567, 0.1234568, 1 / 3, 2.5e-5, 3e38, 1.0])
def test_fp8_scale_text_is_the_stored_float32(scale):
    # The text names the float32 the pools store: scales that store differently print differently (":g"
    # printed 0.1234567 and 0.1234568 alike, one prefix-cache namespace for two formats), scales that store
    # alike print alike, and the text reads back as the same float32.
    fmt = KVFormat("fp8_e4m3", scale=scale)
    back = KVFormat.parse(str(fmt))
    assert str(back) == str(fmt)
    f32 = torch.tensor(scale, dtype=torch.float32)
    assert torch.equal(torch.tensor(back.scale, dtype=torch.float32), f32)
    nudged = torch.nextafter(f32, torch.tensor(float("inf"))).item()
    assert str(KVFormat("fp8_e4m3", scale=nudged)) != str(fmt)
    assert str(KVFormat("fp8_e4m3", scale=f32.item())) == str(fmt)


def test_cache_format_text():
    assert str(CacheFormat.parse("int8")) == "int8"
    both = CacheFormat.parse("k=int4(group=64),v=int8")
    assert both.k == KVFormat("int4", group=64) and both.v == KVFormat("int8")
    assert str(both) == "k=int4(group=64),v=int8"
    assert CacheFormat.parse(str(both)) == both
    assert CacheFormat.parse(torch.bfloat16) == CacheFormat(KVFormat("bf16"), KVFormat("bf16"))
    # torch's dtype names are the formats of those dtypes ("bfloat16" was refused as an unknown format)
    for alias, kind in (("bfloat16", "bf16"), ("float16", "fp16"), ("half", "fp16"), ("float32", "fp32"),
                        ("float", "fp32"), ("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2(scale=0.5)", "fp8_e5m2")):
        assert CacheFormat.parse(alias).k.kind == kind, alias
    assert str(CacheFormat.parse("k=int8,v=bfloat16")) == "k=int8,v=bf16"
    assert hash(CacheFormat.parse("k=int8,v=int8")) == hash(CacheFormat.parse("int8"))  # same identity
    rot = CacheFormat.parse("k=int8(hadamard),v=int4")
    assert rot.k == KVFormat("int8", hadamard=True) and str(rot) == "k=int8(hadamard),v=int4"
    assert rot != CacheFormat.parse("k=int8,v=int4")   # a different cache identity: different codes


@pytest.mark.parametrize("bad, match", [
    ("int3", r"unknown KV format 'int3'"),
    ("int4(group=48)", r"group=48 must be 16, 32, 64 or 128"),
    ("int8(scale=0.1)", r"scale=0.1 is only for fp8 formats"),
    ("int4(bits=3)", r"unknown option 'bits'"),
    ("bf16(hadamard)", r"hadamard is only for int8, fp8 and int4 formats, not bf16 \(it spreads outliers"),
    # the storage ops take K and V pages of one dtype: such a pool was made, and its first append failed
    ("k=fp16,v=bf16", r"k=fp16,v=bf16: K and V in full precision must share one dtype"),
    ("k=bfloat16,v=float32", r"k=bf16,v=fp32: K and V in full precision must share one dtype"),
    # int8 and fp8 have no groups: the group was dropped from the text, which then parsed to another format
    ("int8(group=64)", r"group=64 is only for int4 and KIVI formats, not int8"),
    ("fp8_e4m3(group=16)", r"group=16 is only for int4 and KIVI formats, not fp8_e4m3"),
    ("kivi2(hadamard)", r"hadamard is only for .* not kivi2"),
    ("int8(hadamard=1)", r"unknown option 'hadamard'"),
    ("k=int8,x=int4", r"expected 'k=<format>,v=<format>'"),
    ("k=int8", r"expected 'k=<format>,v=<format>'"),
])
def test_bad_formats(bad, match):
    with pytest.raises(ValueError, match=match):
        CacheFormat.parse(bad)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 1e-50, 1e39, -0.5, 0.0, 10**400, "inf"],
                         ids=["inf", "nan", "1e-50", "1e39", "-0.5", "0", "10**400", "str"])
def test_fp8_scale_must_be_a_positive_float32_normal(scale):
    """An outside-in probe: scale=inf was taken (every value then read back NaN), 1e-50 became 0 in the float32
    pool, 1e39 failed inside the kernel with an error naming nothing."""
    err = TypeError if isinstance(scale, str) else ValueError
    with pytest.raises(err, match=r"scale"):
        KVFormat("fp8_e4m3", scale=scale)
    if not isinstance(scale, str):
        with pytest.raises(ValueError, match=r"scale=.* must be a positive float32 normal number"):
            CacheFormat.parse(f"fp8_e5m2(scale={scale})")
    # the extremes that are still float32 normals store and read back finite values
    for ok in (torch.finfo(torch.float32).tiny, 1e38):
        pool = kvcache.KVPool.allocate(2, 4, 1, 16, format=f"fp8_e4m3(scale={ok!r})")
        x = torch.full((1, 1, 1, 16), ok, dtype=torch.bfloat16)
        pool.append(x, x, torch.tensor([[0]]))
        k, v = pool.gather(torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
        assert torch.isfinite(k).all() and torch.isfinite(v).all()


def test_scale_shape_counts_the_formats_groups():
    # (it assumed groups of 32 where bytes_per_token_head counted the format's own: 4 groups against 8 at 128 dims)
    fmt = KVFormat("int4", group=16)
    assert fmt.scale_shape(2, 4, 16, 128, "k") == (2, 4, 16, 8, 2)
    assert fmt.metadata_bytes_per_token_head(128, 16, "k") == 8 * 4.0
    assert KVFormat("int4").scale_shape(2, 4, 16, 128, "k") == (2, 4, 16, 4, 2)


def test_bytes_per_token_head_by_hand():
    d, page = 128, 16
    assert KVFormat("bf16").bytes_per_token_head(d, page, "k") == 256
    assert KVFormat("int8").bytes_per_token_head(d, page, "k") == 128 + 4          # + fp32 scale
    assert KVFormat("fp8_e4m3").bytes_per_token_head(d, page, "k") == 128          # per-head scale only
    assert KVFormat("int4").bytes_per_token_head(d, page, "v") == 64 + 4 * 4       # 4 groups x (2 + 2)
    assert KVFormat("int4", hadamard=True).bytes_per_token_head(d, page, "v") == 64 + 4 * 4  # rotation: no bytes
    assert KVFormat("kivi2").bytes_per_token_head(d, page, "k") == 32 + 128 * 4 / 16  # per channel per page
    assert KVFormat("kivi2").bytes_per_token_head(d, page, "v") == 32 + 4 * 4


def test_memory_calculator_with_formats():
    # Llama-3-8B geometry, int8 K + int4 V: bits for the codes plus metadata per (token, head)
    shape = memory.KVShape(32, 8, 128)
    fmt = CacheFormat.parse("k=int8,v=int4")
    per_token = memory.bytes_per_token(shape, k_bits=8, v_bits=4,
                                       k_meta_bytes_per_token_head=fmt.k.metadata_bytes_per_token_head(128, 16, "k"),
                                       v_meta_bytes_per_token_head=fmt.v.metadata_bytes_per_token_head(128, 16, "v"))
    assert per_token == 32 * 8 * fmt.bytes_per_token_head(128, 16) == 32 * 8 * (132 + 80)
