"""Every class of bad input raises an error that names the argument and the numbers, and leaves the
pools and outputs exactly as they were (nothing written outside the pool, nothing half-applied)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import kvcache

F16 = torch.float16


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()]).clone()


def expect_rejected(tensors, exc, match, fn):
    """fn() raises exc matching `match`, and none of `tensors` changed by a single bit."""
    before = [bits(t) for t in tensors]
    with pytest.raises(exc, match=match):
        fn()
    for t, b in zip(tensors, before):
        assert torch.equal(bits(t), b), "a rejected call modified its output"


@pytest.fixture
def pools():
    layout = kvcache.PageLayout(4, 4, 2, 8, F16)       # 16 slots
    k, v = layout.allocate(fill=0.0)
    return k, v


def kv(batch=1, heads=2, q_len=3, dim=8, dtype=F16):
    return torch.randn(batch, heads, q_len, dim).to(dtype), torch.randn(batch, heads, q_len, dim).to(dtype)


# ---- append -----------------------------------------------------------------------------------
def test_append_slot_out_of_range_writes_nothing(backend, pools):
    key, value = kv()
    # slots 0 and 1 are valid: a half-applying kernel would write them before reaching 16.
    # (slot_mapping is [batch, q_len]: the message names the bad slot by row and column, as the user indexes it)
    for bad, match in [(16, r"slot_mapping\[0, 2\] = 16 .*\[0, 16\)"),
                       (-2, r"slot_mapping\[0, 2\] = -2")]:
        slots = torch.tensor([[0, 1, bad]])
        expect_rejected(pools, IndexError, match, lambda: kvcache.append(key, value, *pools, slots))


def test_append_duplicate_slot(backend, pools):
    key, value = kv()
    slots = torch.tensor([[3, 5, 3]])
    expect_rejected(pools, IndexError, r"writes slot 3 twice \(slot_mapping\[0, 0\] and slot_mapping\[0, 2\]\)",
                    lambda: kvcache.append(key, value, *pools, slots))


@pytest.mark.parametrize("case, exc, match", [
    ("slots_int32", TypeError, r"slot_mapping must have dtype Long but has Int"),
    ("slots_shape", ValueError, r"slot_mapping has shape \[1, 2\] but must be \[batch, q_len\] = \[1, 3\]"),
    ("slots_1d", ValueError, r"slot_mapping must be a 2-D tensor but has shape \[3\]"),
    ("key_dtype", TypeError, r"key must have dtype Half but has Float"),
    ("value_shape", ValueError, r"value has shape \[1, 2, 2, 8\] but key has shape \[1, 2, 3, 8\]"),
    ("heads", ValueError, r"key.shape\[1\] = 3 must equal num_kv_heads of the cache = 2"),
    ("head_dim", ValueError, r"key.shape\[3\] = 16 must equal head_dim of the cache = 8"),
    ("key_3d", ValueError, r"key must be a 4-D tensor but has shape \[2, 3, 8\]"),
])
def test_append_bad_arguments(backend, pools, case, exc, match):
    key, value = kv()
    slots = torch.tensor([[0, 1, 2]])
    if case == "slots_int32":
        slots = slots.int()
    elif case == "slots_shape":
        slots = slots[:, :2]
    elif case == "slots_1d":
        slots = slots[0]
    elif case == "key_dtype":
        key = key.float()
    elif case == "value_shape":
        value = value[:, :, :2]
    elif case == "heads":
        key, value = kv(heads=3)
    elif case == "head_dim":
        key, value = kv(dim=16)
    elif case == "key_3d":
        key, value = key[0], value[0]
    expect_rejected(pools, exc, match, lambda: kvcache.append(key, value, *pools, slots))


@pytest.mark.parametrize("case, exc, match", [
    ("page_size", ValueError, r"page_size \(k_cache.shape\[2\]\) = 3 must be a power of two from 1 to 256"),
    ("page_too_big", ValueError, r"page_size \(k_cache.shape\[2\]\) = 512"),
    ("pool_dtype", TypeError, r"k_cache has dtype Double; supported: float32, float16, bfloat16"),
    ("kv_mismatch", ValueError, r"k_cache has shape \[4, 2, 4, 8\] but v_cache has shape \[5, 2, 4, 8\]"),
    ("kv_dtype", TypeError, r"v_cache has dtype Float but k_cache has Half"),
    ("strided_pool", ValueError, r"k_cache must be contiguous"),
    ("pool_3d", ValueError, r"k_cache must be a 4-D tensor"),
])
def test_bad_pools(case, exc, match):
    shape, v_shape, dtype, v_dtype = (4, 2, 4, 8), None, F16, None
    if case == "page_size":
        shape = (4, 2, 3, 8)
    elif case == "page_too_big":
        shape = (1, 2, 512, 8)
    elif case == "pool_dtype":
        dtype = torch.float64
    elif case == "kv_mismatch":
        v_shape = (5, 2, 4, 8)
    elif case == "kv_dtype":
        v_dtype = torch.float32
    k = torch.zeros(shape, dtype=dtype)
    v = torch.zeros(v_shape or shape, dtype=v_dtype or dtype)
    if case == "strided_pool":
        k, v = torch.zeros(4, 2, 8, 8, dtype=F16)[:, :, ::2], torch.zeros(4, 2, 4, 8, dtype=F16)
    elif case == "pool_3d":
        k, v = k[0], v[0]
    key, value = kv(dtype=k.dtype if case != "kv_dtype" else F16)
    tensors = [k, v] if k.dtype != torch.float64 else []
    expect_rejected(tensors, exc, match,
                    lambda: kvcache.append(key, value, k, v, torch.tensor([[0, 1, 2]])))
    # the gather and block-copy ops validate pools the same way
    with pytest.raises(exc, match=match):
        kvcache.copy_blocks(k, v, torch.tensor([[0, 1]]))


# ---- paged_gather / paged_gather_ragged ------------------------------------------------------------
def gather_call(pools, table, lens, max_len=8):
    k_out = torch.full((len(lens), 2, max_len, 8), 5.0, dtype=F16)
    v_out = torch.full_like(k_out, 5.0)
    return (k_out, v_out), lambda: kvcache.paged_gather(*pools, torch.tensor(table, dtype=torch.int32),
                                                      torch.tensor(lens, dtype=torch.int32), out=(k_out, v_out))


@pytest.mark.parametrize("table, lens, max_len, match", [
    ([[0, 4]], [5], 8, r"block_tables\[0, 1\] = 4 is not a block id in \[0, 4\) \(needed for seq_lens\[0\] = 5\)"),
    ([[0, -1]], [5], 8, r"block_tables\[0, 1\] = -1 is not a block id"),
    ([[0, 1]], [-1], 8, r"seq_lens\[0\] = -1 is negative"),
    ([[0, 1]], [9], 12, r"seq_lens\[0\] = 9 needs 3 blocks but block_tables has 2 columns \(page_size 4\)"),
    ([[0, 1], [2, 3]], [4, 8], 6, r"seq_lens\[1\] = 8 exceeds k_out.shape\[2\] \(max_len\) = 6"),
])
def test_gather_bad_indices_write_nothing(backend, pools, table, lens, max_len, match):
    outs, call = gather_call(pools, table, lens, max_len)
    expect_rejected(list(outs), IndexError, match, call)


def test_gather_bad_arguments(backend, pools):
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    ok = torch.zeros(1, 2, 8, 8, dtype=F16)
    with pytest.raises(TypeError, match=r"block_tables must have dtype Int but has Long"):
        kvcache.paged_gather(*pools, table.long(), lens, 8)
    with pytest.raises(TypeError, match=r"seq_lens must have dtype Int but has Long"):
        kvcache.paged_gather(*pools, table, lens.long(), 8)
    with pytest.raises(ValueError, match=r"block_tables.shape\[0\] = 1 must equal the batch size = 2"):
        kvcache.paged_gather(*pools, table, torch.tensor([1, 1], dtype=torch.int32), 8)
    with pytest.raises(TypeError, match=r"k_out/v_out have dtypes Float/Float but the cache holds Half"):
        kvcache.paged_gather(*pools, table, lens, out=(ok.float(), ok.float()))
    with pytest.raises(ValueError, match=r"k_out.shape\[1\] = 3 must equal num_kv_heads of the cache = 2"):
        kvcache.paged_gather(*pools, table, lens, out=(torch.zeros(1, 3, 8, 8, dtype=F16),) * 2)
    with pytest.raises(ValueError, match=r"k_out must be contiguous"):
        strided = torch.zeros(1, 2, 16, 8, dtype=F16)[:, :, ::2]
        kvcache.paged_gather(*pools, table, lens, out=(strided, ok))
    with pytest.raises(ValueError, match=r"k_out has shape \[1, 2, 8, 8\] but v_out has shape \[1, 2, 7, 8\]"):
        kvcache.paged_gather(*pools, table, lens, out=(ok, ok[:, :, :7].contiguous()))
    # a bad format id is named before the wrapper sizes its outputs from it
    for op, extra in ((kvcache.paged_gather, (lens,)), (kvcache.paged_gather_ragged, ())):
        args = (torch.tensor([0, 5], dtype=torch.int32),) if not extra else extra
        with pytest.raises(ValueError, match=r"k_format: 7 is not a kernel format id"):
            op(*pools, table, *args, k_format=7)


@pytest.mark.parametrize("cu, total, match", [
    ([1, 5], 4, r"cu_seq_lens\[0\] = 1 must be 0"),
    ([0, 5, 3], 3, r"cu_seq_lens must be non-decreasing but cu_seq_lens\[2\] = 3 < cu_seq_lens\[1\] = 5"),
    ([0, 5], 6, r"cu_seq_lens\[1\] = 5 must equal k_out.shape\[0\] \(total tokens\) = 6"),
    ([0, 9], 9, r"sequence lengths\[0\] = 9 needs 3 blocks but block_tables has 2 columns"),
])
def test_gather_ragged_bad_offsets_write_nothing(backend, pools, cu, total, match):
    k_out = torch.full((total, 2, 8), 5.0, dtype=F16)
    v_out = torch.full_like(k_out, 5.0)
    table = torch.tensor([[0, 1]] * (len(cu) - 1), dtype=torch.int32)
    expect_rejected([k_out, v_out], IndexError, match, lambda: kvcache.paged_gather_ragged(
        *pools, table, torch.tensor(cu, dtype=torch.int32), out=(k_out, v_out)))


def test_negative_lengths_that_would_size_the_outputs_are_named(backend, pools):
    # Regression: without `out`, the wrappers size the outputs from max(seq_lens), cu_seq_lens[-1] or max_len; a
    # negative one failed in torch's allocation ("Trying to create tensor with negative dimension -1").
    T = lambda x: torch.tensor(x, dtype=torch.int32)
    before = [bits(t) for t in pools]
    with pytest.raises(IndexError, match=r"^seq_lens\[0\] = -1 is negative"):
        kvcache.paged_gather(*pools, T([[0]]), T([-1]))
    with pytest.raises(IndexError, match=r"^seq_lens\[0\] = -2 is negative"):
        kvcache.paged_gather(*pools, T([[0], [1]]), T([-2, -3]))
    with pytest.raises(ValueError, match=r"^max_len = -1 must be >= 0"):
        kvcache.paged_gather(*pools, T([[0]]), T([2]), max_len=-1)
    with pytest.raises(IndexError, match=r"^cu_seq_lens must be non-decreasing but cu_seq_lens\[1\] = -1 < "
                                         r"cu_seq_lens\[0\] = 0"):
        kvcache.paged_gather_ragged(*pools, T([[0]]), T([0, -1]))
    with pytest.raises(IndexError, match=r"^cu_seq_lens must be non-decreasing but cu_seq_lens\[1\] = -5"):
        kvcache.paged_gather_ragged(*pools, T([[0], [1]]), T([0, -5, -2]))
    assert all(torch.equal(bits(t), b) for t, b in zip(pools, before))


def test_ints_out_of_int64_are_named_briefly(backend, pools):
    # Regression: an int past int64 reached pybind11 (the direct path), whose TypeError printed every argument
    # (the whole pools: ~21,600 characters for 8 MiB ones) without naming it, or torch.ops ("Expected a value of
    # type 'int' ... but instead found type 'int'").
    T = lambda x: torch.tensor(x, dtype=torch.int32)
    table, lens, cu = T([[0, 1]]), T([5]), T([0, 1])
    q = torch.randn(1, 2, 8, dtype=F16)
    key, value = kv(q_len=1)
    slots = torch.tensor([[5]])
    plan = kvcache.plan_step(*pools, table, lens, cu, slots, q_heads=2)
    big, small = 2**64, -2**70
    calls = {
        "window_left": lambda x: kvcache.paged_attention(q, *pools, table, lens, cu, window_left=x),
        "sink_tokens": lambda x: kvcache.paged_attention(q, *pools, table, lens, cu, sink_tokens=x),
        "k_format": lambda x: kvcache.append(key, value, *pools, slots, k_format=x),
        "v_format": lambda x: kvcache.paged_gather(*pools, table, lens, out=(torch.zeros(1, 2, 8, 8, dtype=F16),) * 2,
                                                   v_format=x),
        "max_len": lambda x: kvcache.paged_gather(*pools, table, lens, max_len=x),
        "q_heads": lambda x: kvcache.plan_step(*pools, table, lens, cu, q_heads=x),
        "planned window_left": lambda x: kvcache.paged_attention_planned(plan, q, *pools, window_left=x),
        "planned sink_tokens": lambda x: kvcache.paged_attention_planned(plan, q, *pools, sink_tokens=x),
        "planned v_format": lambda x: kvcache.append_planned(plan, key, value, *pools, v_format=x),
        "ragged k_format": lambda x: kvcache.paged_gather_ragged(*pools, table, T([0, 5]),
                                                                 out=(torch.zeros(5, 2, 8, dtype=F16),) * 2, k_format=x),
    }
    for name, call in calls.items():
        arg = name.split()[-1]
        for x in (big, small):
            before = [bits(t) for t in pools]
            with pytest.raises(ValueError) as err:
                call(x)
            assert str(err.value) == f"{arg} = {x} is out of range: it must fit in int64 [-2**63, 2**63)", name
            assert all(torch.equal(bits(t), b) for t, b in zip(pools, before)), name
    with pytest.raises(ValueError, match=r"^sink_tokens = an integer of 1001 bits is out of range"):
        calls["sink_tokens"](2**1000)


def test_window_and_sinks_must_be_ints(backend, pools):
    # Regression: window_left=2.5 ran as window_left=2 (int() truncated it) and sink_tokens=True as 1; numpy
    # and 0-dim torch integers are ints.
    T = lambda x: torch.tensor(x, dtype=torch.int32)
    table, lens, cu = T([[0, 1]]), T([5]), T([0, 1])
    plan = kvcache.plan_step(*pools, table, lens, cu, q_heads=2)
    q = torch.randn(1, 2, 8, dtype=F16)
    out = torch.full_like(q, 5.0)
    calls = {"paged_attention": lambda **kw: kvcache.paged_attention(q, *pools, table, lens, cu, out=out, **kw),
             "paged_attention_planned": lambda **kw: kvcache.paged_attention_planned(plan, q, *pools, out=out, **kw)}
    for name, call in calls.items():
        for kw, shown in ((dict(window_left=2.5), "window_left=2.5"), (dict(sink_tokens=True), "sink_tokens=True"),
                          (dict(window_left=2.0), "window_left=2.0"), (dict(sink_tokens="1"), "sink_tokens='1'")):
            expect_rejected([out, *pools], TypeError, "^" + re.escape(shown) + " must be an int", lambda: call(**kw))
        want = call(window_left=2, sink_tokens=1).clone()
        assert torch.equal(call(window_left=np.int64(2), sink_tokens=torch.tensor(1)), want), name


def test_planned_attention_refuses_floats_that_overflow_float32(backend, pools):
    # scale and softcap are Python floats (doubles) that the kernels use as float32: 1e39 is inf there
    T = lambda x: torch.tensor(x, dtype=torch.int32)
    plan = kvcache.plan_step(*pools, T([[0, 1]]), T([5]), T([0, 1]), q_heads=2)
    q = torch.randn(1, 2, 8, dtype=F16)
    out = torch.full_like(q, 5.0)
    for kw, match in ((dict(scale=3e38 * 2), r"^scale = 6e\+38 must be finite, and finite as float32"),
                      (dict(softcap=1e39), r"^softcap = 1e\+39 must be 0 \(off\) or positive, in \[")):
        expect_rejected([out, *pools], ValueError, match,
                        lambda: kvcache.paged_attention_planned(plan, q, *pools, out=out, **kw))
    # a Python int too large for a double (float() raised an OverflowError naming nothing), or no number at all
    for kw, err, match in ((dict(scale=10**400), ValueError, r"^scale = an integer of 1329 bits is out of range"),
                           (dict(softcap=-10**400), ValueError, r"^softcap = an integer of 1329 bits is out of range"),
                           (dict(scale="0.5"), TypeError, r"^scale must be a float, got str")):
        expect_rejected([out, *pools], err, match,
                        lambda: kvcache.paged_attention_planned(plan, q, *pools, out=out, **kw))
        bt, sl, cu = T([[0, 1]]), T([5]), T([0, 1])
        expect_rejected([out, *pools], err, match,
                        lambda: kvcache.paged_attention(q, *pools, bt, sl, cu, out=out, **kw))
    # the largest finite float32s are still taken
    kvcache.paged_attention_planned(plan, q, *pools, softcap=3.4e38, out=out)
    assert torch.isfinite(out).all()


def test_strided_lengths_are_refused_not_misread(backend, pools):
    # Regression (issue #21's fuzzer): the kernels read seq_lens / cu_seq_lens / cu_q_lens through their data
    # pointers as if contiguous, after validating the values in their logical order: every other element of
    # [3, 100000, 5, 7] was checked as [3, 5] and read as [3, 100000] (a write far past k_out: a segfault).
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([3, 100000, 5, 7], dtype=torch.int32)[::2]
    outs, call = gather_call(pools, table.tolist(), [3, 5])
    expect_rejected(list(pools) + list(outs), ValueError, r"seq_lens must be contiguous",
                    lambda: kvcache.paged_gather(*pools, table, lens, out=outs))
    cu = torch.tensor([0, 100000, 3, 7, 8], dtype=torch.int32)[::2]
    k_out = torch.full((8, 2, 8), 5.0, dtype=F16)
    v_out = torch.full_like(k_out, 5.0)
    expect_rejected([*pools, k_out, v_out], ValueError, r"cu_seq_lens must be contiguous",
                    lambda: kvcache.paged_gather_ragged(*pools, table, cu, out=(k_out, v_out)))
    q = torch.randn(2, 2, 8, dtype=F16)
    out = torch.full_like(q, 5.0)
    contiguous_cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    expect_rejected([*pools, out], ValueError, r"seq_lens must be contiguous",
                    lambda: kvcache.paged_attention(q, *pools, table, lens, contiguous_cu, out=out))
    expect_rejected([*pools, out], ValueError, r"cu_q_lens must be contiguous",
                    lambda: kvcache.paged_attention(q, *pools, table, lens.contiguous(),
                                                    torch.tensor([0, 9, 1, 9, 2], dtype=torch.int32)[::2], out=out))
    # plan_step copies the indices once, so it takes them with any strides, and plans what they say
    strided_plan = kvcache.plan_step(*pools, table, lens, contiguous_cu, q_heads=2)
    plan = kvcache.plan_step(*pools, table, lens.contiguous(), contiguous_cu, q_heads=2)
    assert torch.equal(strided_plan.host, plan.host)


def test_lse_and_plan_slots_are_named(backend, pools):
    # Regression (issue #21's fuzzer): the check macros write the checked expression into the message, and
    # these two were checked through local references: "l must be contiguous", "s must have dtype Long".
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens, cu = torch.tensor([5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(1, 2, 8, dtype=F16)
    out = torch.full_like(q, 5.0)
    for lse, exc, match in ((torch.zeros(1, 4)[:, ::2], ValueError, r"^lse must be contiguous"),
                            (torch.zeros(1, 2, dtype=torch.float64), TypeError, r"^lse must have dtype Float"),
                            (torch.zeros(2), ValueError, r"^lse must be a 2-D tensor")):
        expect_rejected([*pools, out], exc, match, lambda: kvcache.paged_attention(
            q, *pools, table, lens, cu, out=out, lse=lse, return_lse=True))
    with pytest.raises(TypeError, match=r"^slot_mapping must have dtype Long but has Int"):
        kvcache.plan_step(*pools, table, lens, cu, torch.tensor([[4]], dtype=torch.int32), q_heads=2)
    with pytest.raises(ValueError, match=r"^slot_mapping must be a 2-D tensor"):
        kvcache.plan_step(*pools, table, lens, cu, torch.tensor([4]), q_heads=2)


# ---- copy_blocks / swap_blocks ------------------------------------------------------------------
@pytest.mark.parametrize("mapping, match", [
    ([[0, 1], [4, 2]], r"block_mapping\[1, 0\] = 4 is not a source block id in \[0, 4\)"),
    ([[0, 1], [2, -1]], r"block_mapping\[1, 1\] = -1 is not a destination block id"),
    ([[0, 3], [1, 3]], r"writes destination block 3 twice \(rows 0 and 1\)"),
    ([[0, 1], [1, 2]], r"reads block 1 \(row 1\) that it also writes \(row 0\)"),
])
def test_copy_blocks_bad_mapping_writes_nothing(backend, pools, mapping, match):
    pools[0].normal_(), pools[1].normal_()
    expect_rejected(pools, IndexError, match, lambda: kvcache.copy_blocks(*pools, torch.tensor(mapping)))


def test_copy_blocks_bad_mapping_tensor(backend, pools):
    with pytest.raises(TypeError, match=r"block_mapping must have dtype Long but has Int"):
        kvcache.copy_blocks(*pools, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_mapping.shape\[1\] = 3 must equal 2 \(\(src, dst\) pairs\)"):
        kvcache.copy_blocks(*pools, torch.tensor([[0, 1, 2]]))


def test_swap_blocks_bad_input(backend, pools):
    host = kvcache.PageLayout(6, 4, 2, 8, F16).allocate(fill=1.0)
    expect_rejected(list(host), IndexError, r"block_mapping\[0, 1\] = 6 is not a destination block id in \[0, 6\)",
                    lambda: kvcache.swap_blocks(*pools, *host, torch.tensor([[0, 6]])))
    expect_rejected(list(host), IndexError, r"block_mapping\[0, 0\] = 4 is not a source block id in \[0, 4\)",
                    lambda: kvcache.swap_blocks(*pools, *host, torch.tensor([[4, 0]])))
    with pytest.raises(ValueError, match=r"needs distinct source and destination pools"):
        kvcache.swap_blocks(*pools, *pools, torch.tensor([[0, 1]]))
    other_shape = kvcache.PageLayout(6, 8, 2, 8, F16).allocate()
    with pytest.raises(ValueError, match=r"src pools have K blocks of shape \[2, 4, 8\] but dst pools have K blocks of shape \[2, 8, 8\]"):
        kvcache.swap_blocks(*pools, *other_shape, torch.tensor([[0, 1]]))
    other_dtype = kvcache.PageLayout(6, 4, 2, 8, torch.bfloat16).allocate()
    with pytest.raises(TypeError, match=r"src pools hold Half but dst pools hold BFloat16"):
        kvcache.swap_blocks(*pools, *other_dtype, torch.tensor([[0, 1]]))
    # each pool is named as swap_blocks names it (they were all called k_cache / v_cache; issue #21's fuzzer)
    strided = torch.zeros(6, 2, 8, 8, dtype=F16)[:, :, ::2]
    expect_rejected([strided, host[1]], ValueError, r"^k_dst must be contiguous",
                    lambda: kvcache.swap_blocks(*pools, strided, host[1], torch.tensor([[0, 1]])))
    expect_rejected(list(host), ValueError, r"^k_src has shape \[4, 2, 4, 8\] but v_src has shape \[6, 2, 4, 8\]",
                    lambda: kvcache.swap_blocks(pools[0], host[1].clone(), *host, torch.tensor([[0, 1]])))
    expect_rejected(list(host), TypeError, r"^v_src has dtype Float but k_src has Half",
                    lambda: kvcache.swap_blocks(pools[0], pools[1].float(), *host, torch.tensor([[0, 1]])))


# ---- devices (only where a second device exists) ----------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_mismatch_is_named():
    k, v = kvcache.PageLayout(4, 4, 2, 8, F16).allocate("cuda", fill=0.0)
    key, value = kv()
    with pytest.raises(ValueError, match=r"key is on cpu but k_cache is on cuda:0"):
        kvcache.append(key, value, k, v, torch.tensor([[0, 1, 2]], device="cuda"))
    with pytest.raises(ValueError, match=r"block_mapping must be a CPU tensor for swap_blocks"):
        host = kvcache.PageLayout(4, 4, 2, 8, F16).allocate()
        kvcache.swap_blocks(k, v, *host, torch.tensor([[0, 1]], device="cuda"))


# ---- the Python layout class -------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(page_size=12), ValueError, r"page_size=12 must be a power of two from 1 to 256"),
    (dict(num_kv_heads=0), ValueError, r"num_kv_heads=0 must be a positive int"),
    (dict(head_dim=-4), ValueError, r"head_dim=-4 must be a positive int"),
    (dict(num_blocks=-1), ValueError, r"num_blocks=-1 must be a non-negative int"),
    (dict(dtype=torch.int8), TypeError, r"dtype=torch.int8 is not supported"),
    # bools and floats equal to a valid int were taken (True == 1, 16.0 == 16)
    (dict(page_size=True), ValueError, r"page_size=True must be a power of two from 1 to 256, an int"),
    (dict(page_size=16.0), ValueError, r"page_size=16.0 must be a power of two"),
    (dict(num_kv_heads=True), ValueError, r"num_kv_heads=True must be a positive int"),
])
def test_page_layout_rejects(kwargs, exc, match):
    args = dict(num_blocks=4, page_size=16, num_kv_heads=2, head_dim=64, dtype=F16) | kwargs
    with pytest.raises(exc, match=match):
        kvcache.PageLayout(**args)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_kv_pool_methods_name_bad_arguments(fmt):
    """Outside-in probes of KVPool: a pool too large for memory, negative lengths and an integer gather dtype
    failed with torch's words or were taken; copy_blocks took int32 ids for quantized pools only."""
    with pytest.raises(MemoryError, match=r"num_blocks=4611686018427387904 pages of 16 tokens x 2 kv heads in "
                                          r".* need .* GiB"):
        kvcache.KVPool.allocate(2**62, 16, 2, 64, format=fmt)
    with pytest.raises(ValueError, match=r"page_size=True must be a power of two"):
        kvcache.KVPool.allocate(4, True, 2, 64, format=fmt)
    pool = kvcache.KVPool.allocate(4, 4, 2, 64, format=fmt)
    x = torch.randn(1, 2, 6, 64, dtype=torch.bfloat16)
    pool.append(x, x, torch.arange(6)[None])
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_len must be a non-negative int, got -1"):
        pool.gather(table, torch.tensor([6], dtype=torch.int32), max_len=-1)
    with pytest.raises(ValueError, match=r"seq_lens holds a negative length \(-3\)"):
        pool.gather(table, torch.tensor([-3], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype, got torch.int32"):
        pool.gather(table, torch.tensor([6], dtype=torch.int32), dtype=torch.int32)
    before = [t.clone() for t in (pool.k, pool.v)]
    pool.copy_blocks(torch.tensor([[0, 2]], dtype=torch.int32))  # int32 ids for every format
    assert torch.equal(pool.k[2], before[0][0]) and torch.equal(pool.v[2], before[1][0])
    k, v = pool.gather(torch.tensor([[2]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
    k0, v0 = pool.gather(torch.tensor([[0]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
    assert torch.equal(k, k0) and torch.equal(v, v0)


# ---- the Python layer: formats, the engine's sampling arguments, a hand-built prefix ------------------------
@pytest.mark.parametrize("text", ["k=int8,v=int4,k=fp16", "k=int8,k=int4", "v=int8", "k=int8,v=int4,w=int8"])
def test_cache_format_keys_each_once(text):
    with pytest.raises(ValueError, match=r"expected 'k=<format>,v=<format>', each once"):
        kvcache.CacheFormat.parse(text)


@pytest.mark.parametrize("fmt", ["k=bf16,v=int8", "k=int8,v=fp32", "k=kivi2,v=int8", "k=fp16,v=kivi4"])
def test_mixed_families_are_refused_when_the_cache_is_made(fmt):
    """The attention step reads K and V of one family; PagedCache and the Engine used to accept other mixes and
    fail at the first quantized page, maybe hundreds of tokens later, with enum numbers. KVPool stores any."""
    assert kvcache.CacheFormat.parse(fmt).family is None
    with pytest.raises(ValueError, match=rf"kv_format='{fmt}': K and V must both be full precision, both quantized"):
        kvcache.PagedCache(kv_format=fmt, num_layers=1)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match=rf"kv_format='{fmt}'"):
        kvcache.Engine(transformers.LlamaForCausalLM(config).eval(), kv_format=fmt)
    pool = kvcache.KVPool.allocate(4, 16, 1, 32, fmt)  # the pool level keeps every mix
    assert str(pool.format) == fmt
    for ok in ("k=int8,v=int4", "k=kivi2,v=kivi4", "int8"):  # (two full-precision dtypes: refused at parse now,
        # as the storage ops take K and V of one dtype: test_formats)
        assert kvcache.CacheFormat.parse(ok).family is not None
        kvcache.PagedCache(kv_format=ok, num_layers=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be >= 1"),
    (dict(max_new_tokens=-1), r"max_new_tokens=-1 must be >= 1"),
    (dict(do_sample=True, temperature=0.0), r"temperature=0.0 must be > 0 when sampling"),
    (dict(do_sample=True, temperature=-1.0), r"temperature=-1.0 must be > 0 when sampling"),
    (dict(top_k=-2), r"top_k=-2 must be >= 0"),
])
def test_engine_refuses_bad_sampling_arguments(kwargs, match):
    """Before: max_new_tokens <= 0 still produced a token, a non-positive temperature silently sampled greedily."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    engine = kvcache.Engine(transformers.LlamaForCausalLM(config).eval())
    with pytest.raises(ValueError, match=match):
        engine.generate([[1, 2, 3]], **kwargs)
    assert engine.generate([[1, 2, 3]], max_new_tokens=2)[0].tokens.__len__() == 2  # still usable


@pytest.mark.parametrize("length, count", [(10, 1), (3, 3), (-1, 0), (16, 2), (17, 1)])
def test_sequence_from_a_match_with_the_wrong_block_count(length, count):
    """A Match's blocks are ceil(length / page_size) ids; sequence() used to take any count and fail far
    later (slots(), append). Refused before any block is shared: the allocator is unchanged."""
    alloc = kvcache.BlockAllocator(8, 4)
    seq = alloc.sequence()
    alloc.append(seq, 12)
    before = alloc.stats()
    with pytest.raises(ValueError, match=rf"a Match of length={length} needs ceil\({length} / page_size=4\)"):
        alloc.sequence(kvcache.Match(length, seq.blocks[:count], 0))
    assert alloc.stats() == before
    alloc.release(seq)
    assert alloc.num_free == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
def test_a_pool_on_a_missing_cuda_device_is_not_reported_as_out_of_memory():
    # (an outside-in probe: "which cuda could not allocate: Found no NVIDIA driver" as a MemoryError)
    with pytest.raises(RuntimeError, match=r"device='cuda', but this torch sees no CUDA device"):
        kvcache.KVPool.allocate(4, 16, 2, 64, "int8", device="cuda")


def test_mla_attention_names_its_missing_scale():
    pool = kvcache.KVPool.allocate(4, 4, 1, 8, torch.float32, v_head_dim=2)
    with pytest.raises(TypeError, match=r"mla_attention: scale must be a float .* it has no default"):
        kvcache.mla_attention(torch.randn(1, 2, 8), torch.randn(1, 2, 2), pool.k, pool.v,
                              torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                              torch.tensor([0, 1], dtype=torch.int32), None)
