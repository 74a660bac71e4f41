"""kvcache.BlockAllocator: reference counts, copy-on-write sequences, exact accounting, and bad input
that raises a clear error and changes nothing."""

from __future__ import annotations

import threading

import pytest
import torch

import kvcache


def snapshot(alloc: kvcache.BlockAllocator) -> tuple:
    return tuple(alloc.refcount(b) for b in range(alloc.num_blocks)), alloc.stats()["waste_tokens"]


def expect_rejected(alloc, exc, match, fn):
    before = snapshot(alloc)
    with pytest.raises(exc, match=match):
        fn()
    assert snapshot(alloc) == before, "a rejected call changed the allocator"


def test_allocate_share_free_round_trip():
    alloc = kvcache.BlockAllocator(8, 16)
    blocks = alloc.allocate(3)
    assert blocks.dtype == torch.int32 and blocks.tolist() == [0, 1, 2]
    alloc.share(blocks[:2])
    assert [alloc.refcount(b) for b in range(4)] == [2, 2, 1, 0]
    s = alloc.stats()
    assert (s["free"], s["used"], s["shared"], s["references"]) == (5, 3, 2, 5)
    assert alloc.free(blocks) == 1          # block 2 had one reference
    assert alloc.free([0, 1]) == 2
    assert alloc.num_free == 8


def test_sequence_append_and_slots():
    alloc = kvcache.BlockAllocator(8, 4)
    seq = alloc.sequence()
    assert alloc.append(seq, 6).shape == (0, 2)
    assert seq.num_tokens == 6 and seq.blocks.tolist() == [0, 1]
    assert seq.slots().tolist() == [0, 1, 2, 3, 4, 5]
    alloc.append(seq, 3)
    assert seq.blocks.tolist() == [0, 1, 2]
    assert seq.slots(6).tolist() == [6, 7, 8]
    with pytest.raises(IndexError, match=r"positions \[0, 10\) are outside the sequence's 9 tokens"):
        seq.slots(0, 10)
    alloc.release(seq)
    assert seq.num_tokens == 0 and alloc.num_free == 8


def test_fork_copies_the_partial_page_on_first_write():
    layout = kvcache.PageLayout(8, 4, 1, 2, torch.float32)
    k, v = layout.allocate(fill=0.0)
    alloc = kvcache.BlockAllocator(8, 4)
    parent = alloc.sequence()
    alloc.append(parent, 6)
    values = torch.arange(1.0, 7.0).view(1, 1, 6, 1).expand(1, 1, 6, 2)
    kvcache.append(values, -values, k, v, parent.slots().view(1, -1))
    child = alloc.fork(parent)
    copies = alloc.append(child, 1, pools=(k, v))
    assert copies.tolist() == [[1, 2]]
    assert child.blocks.tolist() == [0, 2] and parent.blocks.tolist() == [0, 1]
    # The copy carries the parent's tokens 4 and 5 into the child's own page.
    assert k[2, 0, :2, 0].tolist() == [5.0, 6.0] and v[2, 0, :2, 0].tolist() == [-5.0, -6.0]
    assert alloc.append(parent, 1).shape == (0, 2)     # sole owner of page 1 now: no copy
    assert alloc.refcount(0) == 2                     # the full page stays shared


def test_pools_for_several_layers_all_get_the_copy():
    pools = [kvcache.PageLayout(4, 2, 1, 1, torch.float16).allocate(fill=float(i)) for i in range(3)]
    alloc = kvcache.BlockAllocator(4, 2)
    seq = alloc.sequence()
    alloc.append(seq, 1)
    fork = alloc.fork(seq)
    alloc.append(fork, 1, pools=pools)
    for i, (k, v) in enumerate(pools):
        k[0].fill_(100 + i)
    alloc.append(alloc.fork(seq), 1, pools=pools)   # copies block 0 into a new block in every layer
    assert all(float(k[2, 0, 0, 0]) == 100 + i for i, (k, _) in enumerate(pools))


def test_waste_accounting_is_exact():
    alloc = kvcache.BlockAllocator(64, 16, bytes_per_block=1024)
    seqs = [alloc.sequence() for _ in range(3)]
    for seq, n in zip(seqs, (1, 16, 33)):
        alloc.append(seq, n)
    s = alloc.stats()
    assert s["used"] == 1 + 1 + 3
    assert s["filled_tokens"] == 50
    assert s["waste_tokens"] == 5 * 16 - 50
    assert s["waste_fraction"] == pytest.approx(30 / 80)
    assert s["used_bytes"] == 5 * 1024 and s["waste_bytes"] == 30 * 64


def test_exhaustion_raises_out_of_blocks_and_changes_nothing():
    alloc = kvcache.BlockAllocator(4, 4)
    seq = alloc.sequence()
    alloc.append(seq, 10)
    expect_rejected(alloc, kvcache.OutOfBlocksError, r"out of blocks: need 2, 1 free of 4", lambda: alloc.allocate(2))
    fork = alloc.fork(seq)
    expect_rejected(alloc, kvcache.OutOfBlocksError, r"appending 3 tokens to a sequence of 10 needs 2 blocks",
                    lambda: alloc.append(fork, 3))
    assert fork.num_tokens == 10 and fork.blocks.tolist() == seq.blocks.tolist()
    assert issubclass(kvcache.OutOfBlocksError, RuntimeError)


@pytest.mark.parametrize("case, exc, match", [
    ("double_free", ValueError, r"block 3 is free; cannot free it again"),
    ("free_twice_in_one_call", ValueError, r"block 0 is freed 2 times but has only 1 reference\(s\)"),
    ("unknown_block", IndexError, r"blocks\[1\] = 9 is not a block id: ids are in \[0, 8\)"),
    ("negative_block", IndexError, r"blocks\[0\] = -1 is not a block id"),
    ("share_free_block", ValueError, r"blocks\[1\] = block 5 is free; only blocks in use"),
    ("block_dtype", TypeError, r"blocks must have dtype int32 or int64 \(block ids\) but has Float"),
    ("block_dim", ValueError, r"blocks must be a 1-D tensor but has shape \[1, 2\]"),
    ("table_mismatch", ValueError, r"the block table has 1 blocks but 5 tokens occupy ceil\(5 / 4\) = 2"),
    ("table_freed", ValueError, r"block_table\[0\] = block 6 is free"),
    ("negative_append", ValueError, r"num_tokens = -1 must be >= 0 \(tokens to make room for\)"),
    ("negative_allocate", ValueError, r"num_blocks = -1 must be >= 0"),
    ("refcount_range", IndexError, r"block = 8 is not a block id"),
    # a float id in a list was truncated (free([1.5]) freed block 1), where a float tensor is refused
    ("float_id_free", TypeError, r"blocks must be .* sequence of ints, got an element 1.5 \(float\)"),
    ("float_id_share", TypeError, r"blocks must be .* sequence of ints, got an element 0.9 \(float\)"),
    ("float_refcount", TypeError, r"'float' object cannot be interpreted as an integer"),
    # counts of the wrong type were truncated (allocate(2.7) gave 2 blocks, append(seq, 2.9) room for 2)
    ("float_allocate", TypeError, r"num_blocks=2.7 must be an int \(blocks to allocate\), not float"),
    ("str_allocate", TypeError, r"num_blocks='3' must be an int"),
    ("float_append", TypeError, r"num_tokens=2.9 must be an int \(tokens to make room for\), not float"),
])
def test_bad_input_is_rejected_with_state_unchanged(case, exc, match):
    alloc = kvcache.BlockAllocator(8, 4)
    held = alloc.allocate(3)  # blocks 0, 1, 2 in use; 3 .. 7 free
    calls = {
        "double_free": lambda: alloc.free([0, 3]),
        "free_twice_in_one_call": lambda: alloc.free(torch.tensor([0, 0], dtype=torch.int32)),
        "unknown_block": lambda: alloc.free([0, 9]),
        "negative_block": lambda: alloc.share([-1]),
        "share_free_block": lambda: alloc.share([0, 5]),
        "block_dtype": lambda: alloc.free(torch.tensor([0.0])),
        "block_dim": lambda: alloc.free(torch.tensor([[0, 1]])),
        "table_mismatch": lambda: alloc.append(kvcache.Sequence(held[:1], 5, 4), 1),
        "table_freed": lambda: alloc.append(kvcache.Sequence(torch.tensor([6], dtype=torch.int32), 2, 4), 1),
        "negative_append": lambda: alloc.append(alloc.sequence(), -1),
        "negative_allocate": lambda: alloc.allocate(-1),
        "refcount_range": lambda: alloc.refcount(8),
        "float_id_free": lambda: alloc.free([0, 1.5]),
        "float_id_share": lambda: alloc.share([0.9]),
        "float_refcount": lambda: alloc.refcount(1.5),
        "float_allocate": lambda: alloc.allocate(2.7),
        "str_allocate": lambda: alloc.allocate("3"),
        "float_append": lambda: alloc.append(alloc.sequence(), 2.9),
    }
    expect_rejected(alloc, exc, match, calls[case])


def test_bad_construction():
    with pytest.raises(ValueError, match="page_size = 3 must be a power of two from 1 to 256"):
        kvcache.BlockAllocator(8, 3)
    with pytest.raises(ValueError, match="num_blocks = -2"):
        kvcache.BlockAllocator(-2, 16)
    for args, kwargs, match in (((8.9, 4), {}, r"num_blocks=8.9 must be an int"),
                                ((True, 4), {}, r"num_blocks=True must be an int"),  # (was a one-block pool)
                                ((8, 4.0), {}, r"page_size=4.0 must be an int"),
                                ((8, 4), {"bytes_per_block": 1.5}, r"bytes_per_block=1.5 must be an int")):
        with pytest.raises(TypeError, match=match):
            kvcache.BlockAllocator(*args, **kwargs)
    with pytest.raises(ValueError, match=r"bytes_per_block=-1024 must be >= 0"):
        kvcache.BlockAllocator(8, 4, bytes_per_block=-1024)


@pytest.mark.parametrize("case", ["none_in_list", "too_few_blocks", "other_page_size", "int_pair", "bare_tensor"])
def test_append_checks_pools_before_the_allocator_moves_a_shared_page(case):
    """A fork's shared partial page is moved to a new block before the copy: a bad ``pools`` found only when
    copying left the sequence on the new block, which never got the page's tokens (token 5 read 0.0)."""
    layout = kvcache.PageLayout(8, 4, 1, 2, torch.float32)
    k, v = layout.allocate(fill=0.0)
    alloc = kvcache.BlockAllocator(8, 4)
    parent = alloc.sequence()
    alloc.append(parent, 5)
    fork = alloc.fork(parent)
    bad = {"none_in_list": [(k, v), None], "too_few_blocks": (k[:4], v[:4]),
           "other_page_size": (k.view(8, 1, 2, 4), v.view(8, 1, 2, 4)),
           "int_pair": (k.to(torch.int32), v.to(torch.int32)), "bare_tensor": k}[case]
    table, tokens = fork.blocks.clone(), fork.num_tokens
    expect_rejected(alloc, (TypeError, ValueError), r"pools", lambda: alloc.append(fork, 1, pools=bad))
    assert torch.equal(fork.blocks, table) and fork.num_tokens == tokens


def test_append_applies_the_copy_to_a_quantized_kvpool():
    pool = kvcache.KVPool.allocate(8, 4, 1, 32, "int8")
    alloc = kvcache.BlockAllocator(8, 4)
    parent = alloc.sequence()
    alloc.append(parent, 3)
    x = torch.randn(1, 1, 3, 32)
    pool.append(x, -x, parent.slots().view(1, -1))
    fork = alloc.fork(parent)
    copies = alloc.append(fork, 1, pools=pool)
    src, dst = copies.tolist()[0]
    assert torch.equal(pool.k[dst, :, :3], pool.k[src, :, :3]) and torch.equal(pool.k_scale[dst, :, :3], pool.k_scale[src, :, :3])


def test_int64_ids_must_fit_in_int32():
    alloc = kvcache.BlockAllocator(4, 4)
    with pytest.raises(IndexError, match=r"blocks\[0\] = 4294967296 does not fit in int32"):
        alloc.free(torch.tensor([2**32]))


def test_threads_share_one_allocator():
    alloc = kvcache.BlockAllocator(512, 16)
    errors = []

    def worker(seed: int) -> None:
        try:
            for i in range(300):
                seq = alloc.sequence()
                alloc.append(seq, 1 + (i * 13 + seed) % 90)
                fork = alloc.fork(seq)
                alloc.append(fork, 7)
                alloc.release(seq)
                alloc.release(fork)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert alloc.num_free == 512 and alloc.stats()["references"] == 0


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_native_class_is_a_torch_custom_class():
    alloc = torch.classes.kvcache.BlockAllocator(4, 16)

    @torch.jit.script
    def take_two(a: torch.classes.kvcache.BlockAllocator) -> torch.Tensor:  # type: ignore[name-defined]
        return a.allocate(2)

    assert take_two(alloc).tolist() == [0, 1]
    assert alloc.num_free() == 2
    assert "BlockAllocator(num_blocks=4" in repr(kvcache.BlockAllocator(4, 16))
