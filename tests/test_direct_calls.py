"""The per-layer ops' direct entry points (csrc/direct_calls.cpp): in eager mode with plain tensors the wrappers call
kvcache._C instead of torch.ops. Same op, same results, same errors; dispatch modes still see the call, and
anything the direct path cannot honour (__torch_function__ subclasses and modes) goes through torch.ops."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcache
from kvcache import ops


def _step(fmt: str = "bf16", dim: int = 64):
    pool = _zeroed(kvcache.KVPool.allocate(4, 16, 2, dim, fmt))
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    lens, cu = torch.tensor([20], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 20, dim, generator=g).to(torch.bfloat16)
    pool.append(x[:, :, :19], x[:, :, :19], pool.layout.token_slots(table[0], torch.arange(19)).view(1, -1))
    slots = pool.layout.token_slots(table[0], torch.tensor([19])).view(1, 1)
    q = torch.randn(1, 8, dim, generator=g).to(torch.bfloat16)
    return pool, table, lens, cu, slots, x[:, :, 19:], q


def _zeroed(pool):
    for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if t is not None:
            t.zero_()
    return pool


class _Logged(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


class _Tagged(torch.Tensor):
    """A __torch_function__ subclass: the direct path would not call its override."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_direct_path_is_taken_only_when_it_can_be():
    t = torch.ones(2)
    assert ops._direct(t, t)
    assert not ops._direct(t.as_subclass(_Tagged), t)
    with torch.device("cpu"):  # a torch-function mode
        assert not ops._direct(t, t)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_direct_and_torch_ops_agree_bit_for_bit(fmt):
    pool, table, lens, cu, slots, new, q = _step(fmt)
    kw = pool.op_kwargs()
    twin = _zeroed(kvcache.KVPool.allocate(4, 16, 2, 64, fmt))
    for a, b in ((pool.k, twin.k), (pool.v, twin.v), (pool.k_scale, twin.k_scale), (pool.v_scale, twin.v_scale)):
        if a is not None:
            b.copy_(a)
    plan = pool.plan(table, lens, cu, slots, q_heads=8)
    pool.append(new, new, plan)                                    # direct
    out = pool.attention_planned(q, plan)
    out_u = ops.paged_attention(q, pool.k, pool.v, table, lens, cu, **kw)
    tkw = twin.op_kwargs()
    torch.ops.kvcache.append_planned.default(new, new, twin.k, twin.v, plan.host, plan.device, tkw["k_scale"],
                                             tkw["v_scale"], tkw["k_format"], tkw["v_format"])
    ref = torch.empty_like(q)
    torch.ops.kvcache.paged_attention_planned.default(q, twin.k, twin.v, plan.host, plan.device, 64 ** -0.5, -1, 0,
                                                      0.0, ref, None, tkw["k_scale"], tkw["v_scale"],
                                                      tkw["k_format"], tkw["v_format"])
    assert torch.equal(pool.k, twin.k) and torch.equal(pool.v, twin.v)
    assert torch.equal(out, ref) and torch.equal(out_u, ref)


def test_dispatch_modes_see_the_direct_calls():
    pool, table, lens, cu, slots, new, q = _step()
    plan = pool.plan(table, lens, cu, slots, q_heads=8)
    with _Logged() as mode:
        pool.append(new, new, plan)
        pool.attention_planned(q, plan)
        pool.attention(q, table, lens, cu)
    assert {"kvcache.append_planned.default", "kvcache.paged_attention_planned.default",
            "kvcache.paged_attention.default"} <= set(mode.calls)


def test_torch_function_subclasses_take_torch_ops():
    pool, table, lens, cu, slots, new, q = _step()
    _Tagged.seen.clear()
    out = ops.paged_attention(q.as_subclass(_Tagged), pool.k, pool.v, table, lens, cu)
    assert any("paged_attention" in name for name in _Tagged.seen)
    assert torch.equal(out.as_subclass(torch.Tensor), ops.paged_attention(q, pool.k, pool.v, table, lens, cu))


def test_direct_calls_raise_the_ops_errors():
    pool, table, lens, cu, slots, new, q = _step()
    plan = pool.plan(table, lens, cu, slots, q_heads=8)
    with pytest.raises(ValueError, match="query has shape \\[1, 6, 64\\] but the plan was made for 1 query tokens of 8 heads"):
        pool.attention_planned(q[:, :6], plan)
    with pytest.raises(TypeError, match="key must have dtype BFloat16 but has Float"):
        pool.append(new.float(), new, plan)
    with pytest.raises(ValueError, match="k_format = 99"):
        ops.paged_attention_planned(plan, q, pool.k, pool.v, k_format=99)


def test_direct_planned_attention_fills_the_defaults_as_torch_ops_callers_do():
    """The direct planned attention makes its scale (head_dim ** -0.5) and output itself; given out and lse, it
    writes them and returns them. head_dim 80: its scale is not a power of two, so another formula would show."""
    pool, table, lens, cu, slots, new, q = _step(dim=80)
    kw = pool.op_kwargs()
    plan = pool.plan(table, lens, cu, q_heads=8)
    ref, ref_lse = torch.empty_like(q), torch.empty(1, 8)
    torch.ops.kvcache.paged_attention_planned.default(q, pool.k, pool.v, plan.host, plan.device, 80 ** -0.5, -1, 0,
                                                      0.0, ref, ref_lse, kw["k_scale"], kw["v_scale"],
                                                      kw["k_format"], kw["v_format"])
    assert torch.equal(ops.paged_attention_planned(plan, q, pool.k, pool.v, **kw), ref)
    out = torch.full_like(q, float("nan"))
    got, lse = ops.paged_attention_planned(plan, q, pool.k, pool.v, out=out, return_lse=True, **kw)
    assert got is out and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    halved = pool.attention_planned(q, plan, 0.5 * 80 ** -0.5)
    assert not torch.equal(halved, ref)
