"""kvcache.PrefixCache: matching (including inside a page) with copy-on-write reuse, namespaces, locks,
eviction, the host tier, bad input, threads, its two ways into one C++ tree (the pybind11 fast path
and the torch class: same answers, same errors), and a property-based test against a pure-Python model.

Every pool in these tests stores, at each token position, a hash of the namespace and of the tokens up
to and including that position: the K/V a model would have computed there depends on exactly that.
So a match is right only if every block it returns holds that value at every matched position, and a
sequence is intact only if its own blocks still do; a block reused too early, a page written while
shared, or a copy that went wrong all show up as a wrong value.
"""

from __future__ import annotations

import array
import gc
import os
import random
import re
import sys
import threading
import time
import weakref
from collections import Counter

import numpy as np

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcache

NAMESPACES = ("a", "b")


def kv_values(ns: str, tokens: list[int]) -> list[float]:
    """The value at each position: a rolling hash of (namespace, tokens[:position + 1]), exact in fp32."""
    h, out = NAMESPACES.index(ns) + 1 if ns in NAMESPACES else 7, []
    for t in tokens:
        h = (h * 31 + int(t) + 1) % 1048573
        out.append(float(h))
    return out


class Pools:
    """One layer's K/V pool ([num_blocks, 1, page_size, 1], V = -K) and helpers to write and read it."""

    def __init__(self, num_blocks: int, page_size: int):
        self.page = page_size
        self.k, self.v = kvcache.PageLayout(num_blocks, page_size, 1, 1, torch.float32).allocate(fill=-1.0)

    def write(self, seq: kvcache.Sequence, ns: str, tokens: list[int], start: int) -> None:
        vals = torch.tensor(kv_values(ns, tokens)[start:]).view(1, 1, -1, 1)
        if vals.numel():
            kvcache.append(vals, -vals, self.k, self.v, seq.slots(start).view(1, -1))

    def read(self, blocks, n: int) -> list[float]:
        blocks = [int(b) for b in blocks]
        return [float(self.k[blocks[p // self.page], 0, p % self.page, 0]) for p in range(n)]

    def holds(self, blocks, ns: str, tokens: list[int]) -> bool:
        n = len(tokens)
        return self.read(blocks, n) == kv_values(ns, tokens) and self.read(blocks, n) == [
            -float(self.v[int(blocks[p // self.page]), 0, p % self.page, 0]) for p in range(n)]


def request(alloc, cache, pools, ns, tokens, *, lock=False):
    """What a serving loop does: match, share the hit, append and compute the rest."""
    m = cache.match(torch.tensor(tokens, dtype=torch.int64), ns, lock=lock)
    seq = alloc.sequence(m)
    alloc.append(seq, len(tokens) - m.length, pools=(pools.k, pools.v))
    pools.write(seq, ns, tokens, m.length)
    return m, seq


# ---- examples -----------------------------------------------------------------------------------
def test_match_inside_a_page_reuses_it_through_copy_on_write():
    alloc, pools = kvcache.BlockAllocator(16, 4), Pools(16, 4)
    cache = kvcache.PrefixCache(alloc)
    first = [5, 6, 7, 8, 9, 10, 11]
    _, seq = request(alloc, cache, pools, "a", first)
    cache.insert(first, seq, "a")
    alloc.release(seq)
    second = [5, 6, 7, 8, 9, 42, 43, 44]        # diverges at 5, inside page 1
    m, seq2 = request(alloc, cache, pools, "a", second)
    assert m.length == 5 and m.blocks.tolist() == [0, 1]
    assert seq2.blocks[0] == 0 and seq2.blocks[1] != 1   # page 0 shared, page 1 copied then written
    assert pools.holds(seq2.blocks, "a", second)
    assert pools.holds(cache.match(first, "a").blocks, "a", first)  # the cached page is untouched
    assert cache.stats()["hit_tokens"] == 0 + 5 + 7


def test_namespaces_keep_caches_apart():
    alloc, pools = kvcache.BlockAllocator(16, 4), Pools(16, 4)
    cache = kvcache.PrefixCache(alloc)
    bf16 = kvcache.Namespace(model="llama-3-8b", revision="r1", kv_format="bf16")
    int8 = kvcache.Namespace(model="llama-3-8b", revision="r1", kv_format="int8")
    tokens = list(range(9))
    _, seq = request(alloc, cache, pools, bf16.key, tokens)
    cache.insert(tokens, seq, bf16)
    assert cache.match(tokens, bf16).length == 9
    for other in (int8, kvcache.Namespace(model="llama-3-8b", revision="r2", kv_format="bf16"),
                  kvcache.Namespace(model="llama-3-8b", revision="r1", kv_format="bf16", salt="tenant-2"),
                  kvcache.Namespace(model="llama-3-8b", revision="r1", kv_format="bf16", adapter="lora-7"),
                  kvcache.Namespace(model="llama-3-8b", revision="r1", kv_format="bf16", rope="theta=1e6")):
        assert cache.match(tokens, other).length == 0
    assert cache.match(tokens, bf16.key).length == 9   # the key string is the namespace
    with pytest.raises(TypeError, match="namespace must be a kvcache.Namespace or a str"):
        cache.match(tokens, 3)


def test_insert_reports_the_cached_prefix_and_takes_references():
    alloc, pools = kvcache.BlockAllocator(16, 4), Pools(16, 4)
    cache = kvcache.PrefixCache(alloc)
    _, seq = request(alloc, cache, pools, "a", list(range(10)))
    assert cache.insert(list(range(6)), seq, "a").prefix_length == 0      # a prefix of the sequence
    assert cache.insert(list(range(10)), seq, "a").prefix_length == 6
    assert sorted(cache.block_references()) == [0, 1, 1, 2]  # page 1 straddles the two nodes
    assert [alloc.refcount(b) for b in range(3)] == [2, 3, 2]
    alloc.release(seq)
    assert cache.evict(100) == 3 and alloc.num_free == 16


def test_locks_pin_paths_and_count():
    alloc, pools = kvcache.BlockAllocator(16, 4), Pools(16, 4)
    cache = kvcache.PrefixCache(alloc)
    for base in (0, 100):
        _, seq = request(alloc, cache, pools, "a", list(range(base, base + 8)))
        cache.insert(list(range(base, base + 8)), seq, "a")
        alloc.release(seq)
    m = cache.match(list(range(8)), "a", lock=True)
    cache.lock(m.node)
    assert cache.stats()["locked_nodes"] == 1
    assert cache.clear() == 2                  # only the unlocked prefix
    cache.unlock(m.node)
    assert cache.clear() == 0                  # still locked once
    cache.unlock(m.node)
    assert cache.clear() == 2 and alloc.num_free == 16
    with pytest.raises(IndexError, match=rf"node handle {m.node} is unknown or stale"):
        cache.unlock(m.node)
    # a handle that is not an int was converted (lock(str(node)) locked the node): refused, nothing locked
    for bad in (str(m.node), m.node + 0.7, True):
        with pytest.raises(TypeError, match=r"node=.* must be an int \(a handle from a match\)"):
            cache.lock(bad)
    with pytest.raises(TypeError, match=r"num_blocks=1.5 must be an int"):
        cache.evict(1.5)
    assert cache.stats()["locked_nodes"] == 0


def test_full_pool_evicts_cached_prefixes():
    alloc, pools = kvcache.BlockAllocator(8, 4), Pools(8, 4)
    cache = kvcache.PrefixCache(alloc)
    for base in (0, 100):
        _, seq = request(alloc, cache, pools, "a", list(range(base, base + 16)))
        cache.insert(list(range(base, base + 16)), seq, "a")
        alloc.release(seq)
    assert alloc.num_free == 0
    _, seq = request(alloc, cache, pools, "a", list(range(200, 220)))   # 5 blocks: evicts both
    assert cache.stats()["evicted_nodes"] == 2
    assert cache.match(list(range(100, 116)), "a").length == 0
    with pytest.raises(kvcache.OutOfBlocksError, match="out of blocks"):
        alloc.append(seq, 20)
    assert seq.num_tokens == 20 and pools.holds(seq.blocks, "a", list(range(200, 220)))


def test_lfu_keeps_the_frequently_hit_prefix():
    alloc, pools = kvcache.BlockAllocator(16, 4), Pools(16, 4)
    cache = kvcache.PrefixCache(alloc, policy="lfu")
    for base in (0, 100):
        _, seq = request(alloc, cache, pools, "a", list(range(base, base + 4)))
        cache.insert(list(range(base, base + 4)), seq, "a")
        alloc.release(seq)
    for _ in range(3):
        cache.match(list(range(4)), "a")
    cache.match(list(range(100, 104)), "a")
    cache.evict(1)
    assert cache.match(list(range(4)), "a").length == 4
    assert cache.match(list(range(100, 104)), "a").length == 0
    with pytest.raises(ValueError, match="policy = 'mru' is not an eviction policy"):
        kvcache.PrefixCache(kvcache.BlockAllocator(4, 4), policy="mru")


def test_ragged_calls_equal_single_calls():
    alloc, pools = kvcache.BlockAllocator(64, 4), Pools(64, 4)
    cache = kvcache.PrefixCache(alloc)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [1, 2, 3, 4, 5, 6, 8, 8, 8], [7, 7]]
    seqs = [request(alloc, cache, pools, "a", p)[1] for p in prompts]
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.int32)
    cu = torch.tensor([0, 7, 11, 20, 22])
    pages = [s.blocks for s in seqs]
    blocks = torch.cat(pages)
    cu_blocks = torch.tensor([0, 2, 3, 6, 7])
    prefix, nodes = cache.insert_ragged(tokens, cu, blocks, cu_blocks, "a")
    assert prefix.tolist() == [0, 3, 6, 0]
    queries = [[1, 2, 3, 4, 5, 0], [1, 2, 3, 9, 9], [7, 7, 7], [2]]
    batch = cache.match_many(queries, "a")
    single = [cache.match(q, "a") for q in queries]
    assert [(m.length, m.blocks.tolist(), m.node) for m in batch] == [
        (m.length, m.blocks.tolist(), m.node) for m in single]
    assert [m.length for m in batch] == [5, 4, 2, 0]
    for q, m in zip(queries, batch):
        assert pools.holds(m.blocks, "a", q[:m.length])
    with pytest.raises(ValueError, match=r"sequence 1 has 4 tokens = 1 pages but 2 blocks"):
        cache.insert_ragged(tokens, cu, blocks, torch.tensor([0, 2, 4, 6, 7]), "a")
    with pytest.raises(IndexError, match=r"cu_lens\[-1\] = 21 must equal len\(tokens\) = 22"):
        cache.match_ragged(tokens, torch.tensor([0, 21]), "a")


@pytest.mark.parametrize("vocab", [50, 60_000, 1 << 20], ids=["small", "16-bit", "beyond-16-bit"])
def test_match_length_is_the_longest_common_prefix_with_anything_cached(vocab):
    """Long sequences of random ids (edges of hundreds of tokens, compared 16 at a time; ids above
    65535 make an edge 4-byte), and queries that leave them anywhere, including by an id that differs
    only above bit 15: every match length, single and batched, equals a brute-force longest common prefix."""
    rng = random.Random(vocab)
    page = 16
    alloc = kvcache.BlockAllocator(2048, page)
    cache = kvcache.PrefixCache(alloc)
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    base, seqs = tok(400), []
    for _ in range(30):
        s = base[:rng.randrange(len(base) + 1)] + tok(rng.randrange(200))
        blocks = alloc.allocate(-(-len(s) // page))
        cache.insert(torch.tensor(s, dtype=torch.int32), blocks)
        alloc.free(blocks)
        seqs.append(s)

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    queries = []
    for _ in range(150):
        q = list(rng.choice(seqs))[:rng.randrange(450)] + tok(rng.randrange(3))
        if q and rng.random() < 0.7:
            i = rng.randrange(len(q))
            q[i] = q[i] + rng.choice([1, 65536, -65536 if q[i] >= 65536 else 65536 * 2])
        queries.append(q)
    want = [max(lcp(s, q) for s in seqs) for q in queries]
    assert [cache.match(torch.tensor(q, dtype=torch.int32)).length for q in queries] == want
    flat = torch.tensor([t for q in queries for t in q], dtype=torch.int32)
    cu = torch.tensor([0] + [len(q) for q in queries]).cumsum(0)
    assert cache.match_ragged(flat, cu).lengths.tolist() == want
    assert sum(w >= 16 for w in want) > 50 and sum(0 < w < lcp_max for w, lcp_max in zip(want, map(len, queries))) > 50
    cache.check()


@pytest.mark.parametrize("case, exc, match", [
    ("token_dtype", TypeError, r"tokens must have dtype int32 or int64 \(token ids\) but has Float"),
    ("token_dim", ValueError, r"tokens must be a 1-D tensor but has shape \[2, 3\]"),
    ("token_range", IndexError, r"tokens\[1\] = 4294967296 does not fit in int32"),
    ("lengths", ValueError, r"blocks has 1 entries but 6 tokens occupy ceil\(6 / 4\) = 2 pages"),
    ("freed_block", ValueError, r"blocks\[1\] = block 9 is free"),
    ("unknown_block", IndexError, r"blocks\[1\] = 99 is not a block id"),
    ("unlock_unlocked", ValueError, r"is not locked; unlock without lock"),
    ("stale_handle", IndexError, r"node handle 123456789 is unknown or stale"),
    ("negative_evict", ValueError, r"num_blocks = -1; must be >= 0"),
    ("sequence_too_short", ValueError, r"tokens has 12 entries but the sequence holds 10"),
])
def test_bad_input_is_rejected_with_state_unchanged(case, exc, match):
    alloc, pools = kvcache.BlockAllocator(16, 4), Pools(16, 4)
    cache = kvcache.PrefixCache(alloc)
    _, seq = request(alloc, cache, pools, "a", list(range(10)))
    node = cache.insert(list(range(10)), seq, "a").node
    calls = {
        "token_dtype": lambda: cache.match(torch.ones(3), "a"),
        "token_dim": lambda: cache.insert(torch.ones(2, 3, dtype=torch.int64), seq.blocks, "a"),
        "token_range": lambda: cache.match(torch.tensor([1, 2**32]), "a"),
        "lengths": lambda: cache.insert(list(range(6)), seq.blocks[:1], "a"),
        "freed_block": lambda: cache.insert(list(range(20, 26)), [0, 9], "a"),
        "unknown_block": lambda: cache.insert(list(range(20, 26)), [0, 99], "a"),
        "unlock_unlocked": lambda: cache.unlock(node),
        "stale_handle": lambda: cache.unlock(123456789),
        "negative_evict": lambda: cache.evict(-1),
        "sequence_too_short": lambda: cache.insert(list(range(12)), seq, "a"),
    }
    before = (cache.stats(), sorted(cache.block_references()), [alloc.refcount(b) for b in range(16)])
    with pytest.raises(exc, match=match):
        calls[case]()
    after = (cache.stats(), sorted(cache.block_references()), [alloc.refcount(b) for b in range(16)])
    for s in (before[0], after[0]):   # a rejected lookup may still count as a lookup; nothing else moves
        s.pop("lookups"), s.pop("lookup_tokens"), s.pop("hit_rate")
    assert before == after
    cache.check()


def test_host_tier_moves_evicted_prefixes_out_and_back():
    layers, device_blocks, host_blocks, page = 2, 6, 8, 4
    device = [kvcache.PageLayout(device_blocks, page, 2, 8, torch.float16).allocate(fill=0.0) for _ in range(layers)]
    host = [kvcache.PageLayout(host_blocks, page, 2, 8, torch.float16).allocate(fill=0.0) for _ in range(layers)]
    alloc = kvcache.BlockAllocator(device_blocks, page)
    cache = kvcache.PrefixCache(alloc, host_pools=host, device_pools=device)
    assert "host_nodes=0" in repr(cache)

    def run(tokens, fill):
        m = cache.match(tokens)
        seq = alloc.sequence(m)
        alloc.append(seq, len(tokens) - m.length, pools=device)
        for layer, (k, v) in enumerate(device):        # "compute" the new tokens: a value per layer
            for s in seq.slots(m.length).tolist():
                k[s // page, :, s % page] = fill + layer
                v[s // page, :, s % page] = -(fill + layer)
        cache.insert(tokens, seq)
        alloc.release(seq)
        return m

    run(list(range(8)), 1.0)
    run(list(range(100, 112)), 2.0)          # 3 more blocks; 5 of 6 used
    assert cache.evict(2) == 2               # the older prefix goes to the host
    s = cache.stats()
    assert (s["host_nodes"], s["demoted_blocks"]) == (1, 2)
    assert cache.host_allocator.num_free == host_blocks - 2
    m = cache.match(list(range(8)))          # found on the host: copied back
    assert m.length == 8 and cache.stats()["loaded_blocks"] == 2
    for layer, (k, v) in enumerate(device):
        for b in m.blocks.tolist():
            assert torch.all(k[b] == 1.0 + layer) and torch.all(v[b] == -(1.0 + layer))
    assert cache.host_allocator.num_free == host_blocks
    cache.check()
    with pytest.raises(ValueError, match="needs both host_pools and device_pools"):
        kvcache.PrefixCache(kvcache.BlockAllocator(6, page), host_pools=host)
    with pytest.raises(ValueError, match="the device pools have 6 blocks but the allocator has 5"):
        kvcache.PrefixCache(kvcache.BlockAllocator(5, page), host_pools=host, device_pools=device)


def test_threads_share_one_cache():
    alloc, pools = kvcache.BlockAllocator(1024, 16), Pools(1024, 16)
    cache = kvcache.PrefixCache(alloc)
    system = list(range(50))
    errors = []

    def worker(t: int) -> None:
        try:
            for i in range(60):
                tokens = system + [(i * 7 + j + t) % 11 for j in range(20)]
                m, seq = request(alloc, cache, pools, "a", tokens, lock=True)
                ins = cache.insert(tokens, seq, "a", lock=True)
                assert pools.holds(seq.blocks, "a", tokens)
                cache.unlock(m.node)
                cache.unlock(ins.node)
                alloc.release(seq)
                if i % 20 == 0:
                    cache.evict(4)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cache.check()
    assert cache.stats()["locked_nodes"] == 0
    cache.clear()
    assert alloc.num_free == 1024


@pytest.mark.parametrize("front_end", ["pybind11", "torch class"])
def test_native_calls_release_the_gil(front_end):
    """Both ways in run the tree with the GIL released (the pybind11 path releases it itself, torch
    does it for custom-class methods): another Python thread keeps running in the middle of a long
    native call (20000 matches of 2176 tokens in one call, tens of milliseconds). Were the GIL held,
    that thread could run only before or after the call, never in its middle half."""
    alloc = kvcache.BlockAllocator(256, 16)
    cache = kvcache.PrefixCache(alloc)
    tokens = torch.randint(0, 32000, (2176,), dtype=torch.int32)
    cache.insert(tokens, alloc.allocate(136), "a")
    flat, cu = tokens.repeat(20000), torch.arange(20001) * 2176
    stop, stamps = threading.Event(), []

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=spin)
    thread.start()
    while not stamps:
        pass
    t0 = time.perf_counter()
    if front_end == "pybind11":
        lengths = cache.match_ragged(flat, cu, "a").lengths
    else:
        lengths = cache.native.match_ragged(flat, cu, "a", False)[0]
    t1 = time.perf_counter()
    stop.set()
    thread.join()
    assert bool((lengths == 2176).all())
    lo, hi = t0 + (t1 - t0) / 4, t1 - (t1 - t0) / 4
    assert any(lo <= t <= hi for t in stamps), f"no Python progress during the {1e3 * (t1 - t0):.0f} ms native call"


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_native_classes_work_in_torchscript():
    alloc = torch.classes.kvcache.BlockAllocator(8, 4)
    cache = torch.classes.kvcache.PrefixCache(alloc, "lru")

    @torch.jit.script
    def cache_prompt(a: torch.classes.kvcache.BlockAllocator,  # type: ignore[name-defined]
                     c: torch.classes.kvcache.PrefixCache, tokens: torch.Tensor) -> int:  # type: ignore[name-defined]
        table, _ = a.append(torch.empty(0, dtype=torch.int32), 0, tokens.size(0))
        c.insert(tokens, table, "ns", False)
        a.free(table)
        length, _, _ = c.match(tokens, "ns", False)
        return length

    assert cache_prompt(alloc, cache, torch.arange(6)) == 6


# ---- two ways in, one tree: the pybind11 fast path and the torch class ----------------------------
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [7, 7]]
QUERIES = [[1, 2, 3, 4, 5, 0], [1, 2, 3, 9, 9], [7, 7, 7], [2], []]


def cached(prompts=PROMPTS, num_blocks=64, page=4):
    """A cache holding `prompts` in namespace "a", the cache holding the only references."""
    alloc = kvcache.BlockAllocator(num_blocks, page)
    cache = kvcache.PrefixCache(alloc)
    for p in prompts:
        table = alloc.allocate(-(-len(p) // page))
        cache.insert(p, table, "a")
        alloc.free(table)
    return alloc, cache


def strided(values, dtype):
    return np.array([x for v in values for x in (v, -1)], dtype=dtype)[::2]


ID_KINDS = {
    "int32 tensor": lambda v: torch.tensor(v, dtype=torch.int32),
    "int64 tensor": lambda v: torch.tensor(v, dtype=torch.int64),
    "strided tensor": lambda v: torch.from_numpy(strided(v, np.int32)),
    "int32 numpy": lambda v: np.array(v, dtype=np.int32),
    "int64 numpy": lambda v: np.array(v, dtype=np.int64),
    "strided numpy": lambda v: strided(v, np.int64),
    "array.array": lambda v: array.array("i", v),
    "list": list,
    "tuple": tuple,
}


@pytest.mark.parametrize("kind", ID_KINDS)
def test_every_kind_of_ids_gets_the_torch_class_answer(kind):
    make = ID_KINDS[kind]
    alloc, cache = cached()
    for q in QUERIES:
        m = cache.match(make(q), "a")
        length, blocks, node = cache.native.match(torch.tensor(q, dtype=torch.int64), "a", False)
        assert type(m) is kvcache.prefix.Match
        assert (m.length, m.blocks.dtype, m.blocks.tolist(), m.node) == (length, torch.int32, blocks.tolist(), node)
    flat, cu = [t for q in QUERIES for t in q], [0, 6, 11, 14, 15, 15]
    got = cache.match_ragged(make(flat), make(cu), "a")
    want = cache.native.match_ragged(torch.tensor(flat), torch.tensor(cu), "a", False)
    assert type(got) is kvcache.prefix.RaggedMatch
    assert [(t.dtype, t.tolist()) for t in got] == [(t.dtype, t.tolist()) for t in want]

    table = alloc.allocate(2)
    ins = cache.insert(make([1, 2, 3, 4, 50]), make(table.tolist()), "a")
    assert type(ins) is kvcache.prefix.Insert and ins.prefix_length == 4
    assert ins == (4, ins.node) and hash(ins) == hash((4, ins.node)) and ins._replace(node=0) == (4, 0)
    tables = alloc.allocate(3)
    prefix, nodes = cache.insert_ragged(make([60, 61, 62, 63, 64, 70]), make([0, 5, 6]), make(tables.tolist()),
                                        make([0, 2, 3]), "a")
    assert prefix.tolist() == [0, 0] and nodes.dtype == torch.int64
    for tokens in ([1, 2, 3, 4, 50], [60, 61, 62, 63, 64], [70]):
        assert cache.native.match(torch.tensor(tokens), "a", False)[0] == len(tokens)
    cache.check()


def test_the_fast_path_and_the_torch_class_share_one_tree():
    alloc, cache = cached()
    table = alloc.allocate(1)
    cache.native.insert(torch.tensor([5, 5, 5]), table, "a", False)   # in through the torch class...
    assert cache.match([5, 5, 5], "a").length == 3                      # ...out through pybind11
    assert cache.stats()["lookups"] == 1 and cache.stats()["inserts"] == len(PROMPTS) + 1
    m = cache.match(PROMPTS[0], "a")
    m.blocks[0] = 1000                                                  # results are the caller's own
    assert cache.match(PROMPTS[0], "a").blocks[0] != 1000

    native = torch.classes.kvcache.PrefixCache(kvcache.BlockAllocator(8, 4).native, "lru")
    core_id = native.core_id()
    fast = kvcache._C._PrefixTree(core_id)
    del native    # the fast path's object keeps the tree; the id is forgotten
    with pytest.raises(ValueError, match=rf"core_id = {core_id} names no live torch.classes.kvcache.PrefixCache"):
        kvcache._C._PrefixTree(core_id)
    length, blocks, _ = fast.match([1, 2], "a", False)                  # plain tuples without result types
    assert length == 0 and blocks.tolist() == []


def test_bound_lookups_equal_the_documented_methods():
    """cache.match / cache.match_ragged are the C++ methods bound to the instance (no Python frame);
    they answer as the class's documented methods do, for every form of namespace."""
    _, cache = cached()
    flat, cu = torch.tensor([t for q in QUERIES for t in q]), torch.tensor([0, 6, 11, 14, 15, 15])
    ns = kvcache.Namespace(model="m")
    cache.insert(QUERIES[0], cache.allocator.allocate(2), ns)
    cache.insert(QUERIES[1], cache.allocator.allocate(2))            # the default namespace
    for namespace in ("a", ns, ns.key, kvcache.prefix.DEFAULT_NAMESPACE, None):
        for q in QUERIES:
            bound, documented = cache.match(q, namespace), kvcache.PrefixCache.match(cache, q, namespace)
            assert (bound.length, bound.blocks.tolist(), bound.node) == (
                documented.length, documented.blocks.tolist(), documented.node)
        bound, documented = cache.match_ragged(flat, cu, namespace), kvcache.PrefixCache.match_ragged(
            cache, flat, cu, namespace)
        assert [t.tolist() for t in bound] == [t.tolist() for t in documented]
    assert cache.match(QUERIES[1]).length == len(QUERIES[1]) == cache.match(QUERIES[1], None).length
    assert cache.match(QUERIES[0], ns).length == len(QUERIES[0]) and cache.match(QUERIES[0], "a").length == 5
    assert isinstance(cache.match(QUERIES[0], ns, lock=True), kvcache.prefix.Match)


def test_match_into_writes_what_match_returns_into_the_callers_row():
    """match_into: the same length and node as match, the blocks in the first entries of a caller's int32
    tensor (contiguous or strided: a row or a column of a table), the rest of it untouched."""
    _, cache = cached()
    table = torch.full((len(QUERIES), 4), -7, dtype=torch.int32)
    columns = torch.full((4, len(QUERIES)), -7, dtype=torch.int32)
    for i, q in enumerate(QUERIES):
        m = cache.match(q, "a")
        k = len(m.blocks)
        for out in (table[i], columns[:, i]):
            version = out._version
            got = cache.match_into(q, out, "a")
            assert isinstance(got, kvcache.prefix.MatchInto) and tuple(got) == (m.length, m.node)
            assert out[:k].tolist() == m.blocks.tolist() and out[k:].tolist() == [-7] * (4 - k)
            assert out._version > version or k == 0        # in-place writes are versioned
    assert kvcache.PrefixCache.match_into(cache, QUERIES[0], table[0], "a") == cache.match_into(QUERIES[0], table[0], "a")
    got = cache.match_into(QUERIES[0], out=table[0], namespace="a", lock=True)   # keywords, and a lock
    assert cache.stats()["locked_nodes"] > 0
    cache.unlock(got.node)
    assert cache.stats()["locked_nodes"] == 0


@pytest.mark.parametrize("case, exc, match", [
    ("list", TypeError, r"out must be a torch.Tensor, got list"),
    ("int64", TypeError, r"out must have dtype int32 \(block ids\) but has Long"),
    ("short", ValueError, r"out has 1 entries but a match of 6 tokens may need 2 \(ceil\(6 / 4\)\)"),
    ("two_d", ValueError, r"out must be a 1-D tensor but has shape \[2, 2\]"),
    ("meta", ValueError, r"out must be a plain strided CPU tensor but is on meta"),
    ("inference", ValueError, r"out is an inference tensor, which cannot be written outside torch.inference_mode"),
])
def test_match_into_rejects_a_bad_out_before_matching(case, exc, match):
    """A bad out changes nothing: no lock taken, no entry written, the tree's state as it was."""
    _, cache = cached()
    with torch.inference_mode():
        inference = torch.zeros(4, dtype=torch.int32)
    outs = {"list": [0, 0, 0], "int64": torch.zeros(4, dtype=torch.int64), "short": torch.zeros(1, dtype=torch.int32),
            "two_d": torch.zeros(2, 2, dtype=torch.int32), "meta": torch.zeros(4, dtype=torch.int32, device="meta"),
            "inference": inference}
    before = cache.stats()
    with pytest.raises(exc, match=match):
        cache.match_into(QUERIES[0], outs[case], "a", lock=True)
    after = cache.stats()
    assert (after["locked_nodes"], after["lookups"], after["hit_tokens"]) == (0, before["lookups"], before["hit_tokens"])
    if case != "list" and case != "meta":
        assert outs[case].count_nonzero() == 0
    with torch.inference_mode():       # inside inference mode an inference tensor is writable
        assert cache.match_into(QUERIES[0], inference, "a").length == 5 and inference[:2].count_nonzero() > 0


def ragged_queries():
    return torch.tensor([t for q in QUERIES for t in q]), torch.tensor([0, 6, 11, 14, 15, 15])


@pytest.mark.parametrize("given", [False, True])
def test_match_ragged_into_writes_what_match_ragged_returns_into_the_callers_table(given):
    """match_ragged_into: the lengths and nodes of match_ragged, each sequence's blocks in the first entries
    of its row of a caller's table (contiguous or transposed), the rest untouched; lengths and nodes into
    the caller's tensors when given (the same objects come back), else new ones."""
    _, cache = cached()
    flat, cu = ragged_queries()
    want = cache.match_ragged(flat, cu, "a")
    batch = len(QUERIES)
    for table in (torch.full((batch, 3), -7, dtype=torch.int32), torch.full((3, batch), -7, dtype=torch.int32).t()):
        lengths, nodes = (torch.full((batch,), -1), torch.full((2 * batch,), -1)[::2]) if given else (None, None)
        version = table._version
        got = cache.match_ragged_into(flat, cu, table, "a", lengths=lengths, nodes=nodes)
        assert isinstance(got, kvcache.prefix.RaggedMatchInto)
        assert got.lengths.tolist() == want.lengths.tolist() and got.nodes.tolist() == want.nodes.tolist()
        assert (got.lengths is lengths and got.nodes is nodes) if given else got.lengths.dtype == torch.int64
        for i in range(batch):
            lo, hi = int(want.cu_blocks[i]), int(want.cu_blocks[i + 1])
            assert table[i, :hi - lo].tolist() == want.blocks[lo:hi].tolist()
            assert table[i, hi - lo:].tolist() == [-7] * (3 - (hi - lo))
        assert table._version > version                       # in-place writes are versioned
    got = cache.match_ragged_into(tokens=flat, cu_lens=cu, out=torch.empty(batch, 2, dtype=torch.int32), namespace="a",
                                  lock=True)
    assert cache.stats()["locked_nodes"] > 0
    for node in got.nodes.tolist():
        cache.unlock(node)
    assert cache.stats()["locked_nodes"] == 0
    empty = cache.match_ragged_into(torch.empty(0, dtype=torch.int32), [0], torch.empty(0, 0, dtype=torch.int32))
    assert empty.lengths.tolist() == [] and empty.nodes.tolist() == []


def _ragged_into_case(case):
    """(out, lengths, nodes, cu_lens) for one bad argument; the rest as a good call has them."""
    batch = len(QUERIES)
    with torch.inference_mode():
        inference = torch.zeros(batch, 2, dtype=torch.int32)
    shared = torch.zeros(64, dtype=torch.int64)      # one buffer seen as two dtypes: out and lengths overlap
    out, lengths, nodes, cu = torch.zeros(batch, 2, dtype=torch.int32), None, None, ragged_queries()[1]
    if case == "list":
        out = [[0, 0]] * batch
    elif case == "int64":
        out = torch.zeros(batch, 2, dtype=torch.int64)
    elif case == "one_d":
        out = torch.zeros(batch * 2, dtype=torch.int32)
    elif case == "rows":
        out = torch.zeros(batch - 1, 2, dtype=torch.int32)
    elif case == "narrow":
        out = torch.zeros(batch, 1, dtype=torch.int32)
    elif case == "meta":
        out = torch.zeros(batch, 2, dtype=torch.int32, device="meta")
    elif case == "inference":
        out = inference
    elif case == "lengths_int32":
        lengths = torch.zeros(batch, dtype=torch.int32)
    elif case == "lengths_size":
        lengths = torch.zeros(batch + 1, dtype=torch.int64)
    elif case == "nodes_2d":
        nodes = torch.zeros(batch, 1, dtype=torch.int64)
    elif case == "same":
        lengths = nodes = torch.zeros(batch, dtype=torch.int64)
    elif case == "aliased":
        out, lengths = shared.view(torch.int32)[:2 * batch].view(batch, 2), shared[:batch]
    elif case == "cu":
        cu = torch.tensor([0, 6, 5, 14, 15, 15])
    return out, lengths, nodes, cu


@pytest.mark.parametrize("case, exc, match", [
    ("list", TypeError, r"out must be a torch.Tensor, got list"),
    ("int64", TypeError, r"out must have dtype int32 \(block ids\) but has Long"),
    ("one_d", ValueError, r"out must be a 2-D tensor but has shape \[10\]"),
    ("rows", ValueError, r"out has 4 rows but the batch has 5 sequences"),
    ("narrow", ValueError, r"out has 1 columns but sequence 0 has 6 tokens, whose match may need 2 \(ceil\(6 / 4\)\)"),
    ("meta", ValueError, r"out must be a plain strided CPU tensor but is on meta"),
    ("inference", ValueError, r"out is an inference tensor, which cannot be written outside torch.inference_mode"),
    ("lengths_int32", TypeError, r"lengths must have dtype int64 \(matched tokens\) but has Int"),
    ("lengths_size", ValueError, r"lengths has 6 entries but the batch has 5 sequences"),
    ("nodes_2d", ValueError, r"nodes must be a 1-D tensor but has shape \[5, 1\]"),
    ("same", ValueError, r"lengths and nodes overlap in memory"),
    ("aliased", ValueError, r"lengths and out overlap in memory"),
    ("cu", IndexError, r"cu_lens must be non-decreasing but cu_lens\[2\] = 5 < cu_lens\[1\] = 6"),
])
def test_match_ragged_into_rejects_bad_arguments_before_matching(case, exc, match):
    """A bad argument changes nothing: no lock taken, no lookup counted, no entry of any tensor written."""
    _, cache = cached()
    flat = ragged_queries()[0]
    out, lengths, nodes, cu = _ragged_into_case(case)
    before = cache.stats()
    with pytest.raises(exc, match=match):
        cache.match_ragged_into(flat, cu, out, "a", lock=True, lengths=lengths, nodes=nodes)
    after = cache.stats()
    assert (after["locked_nodes"], after["lookups"], after["hit_tokens"]) == (0, before["lookups"], before["hit_tokens"])
    for t in (out, lengths, nodes):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            assert t.count_nonzero() == 0


@pytest.mark.parametrize("call, message", [
    (lambda f: f.match(), r"match\(\) missing required argument 'tokens'"),
    (lambda f: f.match([1], "a", False, 4), r"match\(\) takes at most 3 arguments \(4 given\)"),
    (lambda f: f.match([1], "a", lck=True), r"match\(\) got an unexpected keyword argument 'lck'"),
    (lambda f: f.match([1], "a", namespace="a"), r"match\(\) got multiple values for argument 'namespace'"),
    (lambda f: f.match_into([1]), r"match_into\(\) missing required argument 'out'"),
    (lambda f: f.match_ragged_into([1], [0, 1]), r"match_ragged_into\(\) missing required argument 'out'"),
    (lambda f: f.match_ragged_into([1], [0, 1], None, "a", False, None, None, 1),
     r"match_ragged_into\(\) takes at most 7 arguments \(8 given\)"),
    (lambda f: f.insert_ragged([1], [0, 1], [0]), r"insert_ragged\(\) missing required argument 'cu_blocks'"),
    (lambda f: f.evict(1.5), r"evict\(\) argument 'num_blocks' must be int, not float"),
    (lambda f: f.lock(node="x"), r"lock\(\) argument 'node' must be int, not str"),
    (lambda f: f.unlock(), r"unlock\(\) missing required argument 'node'"),
])
def test_fast_path_binds_arguments_as_a_python_function_does(call, message):
    _, cache = cached()
    fast = kvcache._C._PrefixTree(cache.native.core_id())
    before = cache.stats()
    with pytest.raises(TypeError, match=message):
        call(fast)
    assert cache.stats() == before


def test_fast_path_takes_every_argument_by_name():
    alloc, cache = cached()
    fast = kvcache._C._PrefixTree(cache.native.core_id())
    m = fast.match(tokens=QUERIES[0], namespace="a", lock=True)
    fast.unlock(node=m[2])
    n = cache.native.stats()["inserts"]
    fast.insert(blocks=alloc.allocate(1), tokens=[40, 41], namespace="a")
    fast.insert_ragged(tokens=[50, 51], cu_lens=[0, 2], blocks=alloc.allocate(1), cu_blocks=[0, 1], namespace="a")
    assert cache.native.stats()["inserts"] == n + 2
    assert fast.match_ragged(cu_lens=[0, 2], tokens=[50, 51], namespace="a")[0].tolist() == [2]
    assert fast.evict(num_blocks=0) == 0
    assert [p.name for p in __import__("inspect").signature(cache.match_into).parameters.values()] == [
        "tokens", "out", "namespace", "lock"]
    assert [p.name for p in __import__("inspect").signature(cache.match_ragged_into).parameters.values()] == [
        "tokens", "cu_lens", "out", "namespace", "lock", "lengths", "nodes"]
    got = fast.match_ragged_into(nodes=None, out=torch.zeros(1, 1, dtype=torch.int32), cu_lens=[0, 2], tokens=[50, 51],
                                 namespace="a", lengths=torch.zeros(1, dtype=torch.int64), lock=False)
    assert got[0].tolist() == [2]


def test_result_tensors_are_the_callers_own():
    """Results are fresh tensors: writing into one changes no later result, they outlive the cache,
    and nothing else holds them (dropping a result frees it)."""
    _, cache = cached()
    flat, cu = torch.tensor([t for q in QUERIES for t in q]), torch.tensor([0, 6, 11, 14, 15, 15])
    single, ragged = cache.match(QUERIES[0], "a"), cache.match_ragged(flat, cu, "a")
    want = single.blocks.tolist(), [t.tolist() for t in ragged]
    assert want[0] and want[1][1]  # something to overwrite
    assert all(t.device.type == "cpu" and t.is_contiguous() and t.dim() == 1 for t in (single.blocks, *ragged))
    single.blocks[0] = 1000
    ragged.blocks[0] = 1000
    assert cache.match(QUERIES[0], "a").blocks.tolist() == want[0]
    assert [t.tolist() for t in cache.match_ragged(flat, cu, "a")] == want[1]
    refs = [weakref.ref(t) for t in (single.blocks, *ragged)]
    del cache
    gc.collect()
    assert single.blocks.tolist() == [1000] + want[0][1:]
    del single, ragged
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("case, exc, match", [
    ("float_numpy", TypeError, r"tokens must have dtype int32 or int64 \(token ids\) but has format 'd'"),
    ("unsigned_numpy", TypeError, r"tokens must have dtype int32 or int64 \(token ids\) but has format 'I'"),
    ("numpy_2d", ValueError, r"tokens must be a 1-D array but has shape \[2, 3\]"),
    ("not_ints", TypeError, r"tokens must be a 1-D tensor or a sequence of ints, got an element 'x' \(str\) at \[1\]"),
    ("float_token", TypeError, r"tokens must be a 1-D tensor or a sequence of ints, got an element 1.5 \(float\) at \[0\]"),
    ("not_a_sequence", TypeError, r"tokens must be a 1-D tensor or a sequence of ints, got int"),
    ("int_too_big", IndexError, r"tokens\[1\] = 1099511627776 does not fit in int32"),
    ("int_beyond_int64", IndexError, r"tokens\[0\] = 1180591620717411303424 does not fit in int32"),
    ("meta_tensor", ValueError, r"tokens must be a CPU tensor but is on meta"),
    ("block_too_big", IndexError, r"blocks\[0\] = 8589934592 does not fit in int32"),
    ("namespace", TypeError, r"namespace must be a kvcache.Namespace or a str, got int"),
    ("empty_cu", ValueError, r"cu_lens must have batch \+ 1 >= 1 entries"),
    ("float_cu", TypeError, r"cu_lens must have dtype int32 or int64 but has Float"),
    ("cu_start", IndexError, r"cu_lens\[0\] = 1 must be 0"),
    ("cu_order", IndexError, r"cu_lens must be non-decreasing but cu_lens\[2\] = 1 < cu_lens\[1\] = 2"),
    ("cu_mismatch", ValueError, r"cu_lens has 3 entries but cu_blocks has 2; both are \[batch \+ 1\]"),
    ("freed_block_late", ValueError, r"blocks\[2\] = block \d+ is free"),
    ("unknown_core", ValueError, r"core_id = -5 names no live torch.classes.kvcache.PrefixCache"),
    ("result_type", TypeError, r"match_type must be a NamedTuple class with 3 fields, or None"),
    # one block for two pages of a sequence: a later match would read page 0's K/V as page 1's
    ("dup_blocks", ValueError, r"blocks\[1\] = block \d+ is blocks\[0\] too: a sequence's pages are distinct"),
    ("dup_blocks_ragged", ValueError, r"blocks\[2\] = block \d+ is blocks\[1\] too: a sequence's pages are distinct"),
    ("dup_match_blocks", ValueError, r"prefix: a Match's blocks are a sequence's pages, distinct blocks"),
])
def test_fast_path_rejects_bad_input_with_state_unchanged(case, exc, match):
    alloc, cache = cached(num_blocks=16)
    late = alloc.allocate(3)
    alloc.free(late[2:])       # the last request of a batch no longer holds its block
    fast = kvcache._C._PrefixTree(cache.native.core_id())
    calls = {
        "float_numpy": lambda: cache.match(np.ones(3), "a"),
        "unsigned_numpy": lambda: cache.match(np.ones(3, dtype=np.uint32), "a"),
        "numpy_2d": lambda: cache.match(np.ones((2, 3), dtype=np.int32), "a"),
        "not_ints": lambda: cache.match([1, "x"], "a"),
        "float_token": lambda: cache.match([1.5], "a"),  # (the message named the list, not the element)
        "not_a_sequence": lambda: cache.match(5, "a"),
        "int_too_big": lambda: cache.match([1, 2**40], "a"),
        "int_beyond_int64": lambda: cache.match([2**70], "a"),
        "meta_tensor": lambda: cache.match(torch.ones(3, dtype=torch.int32, device="meta"), "a"),
        "block_too_big": lambda: cache.insert([1, 2, 3], np.array([2**33]), "a"),
        "namespace": lambda: fast.match([1], 5, False),
        "empty_cu": lambda: cache.match_ragged([1], [], "a"),
        "float_cu": lambda: cache.match_ragged([1], torch.tensor([0.0, 1.0]), "a"),
        "cu_start": lambda: cache.match_ragged([1, 2], [1, 2], "a"),
        "cu_order": lambda: cache.match_ragged([1, 2, 3], [0, 2, 1, 3], "a"),
        "cu_mismatch": lambda: cache.insert_ragged([1, 2], [0, 1, 2], late[:2], [0, 2], "a"),
        "freed_block_late": lambda: cache.insert_ragged([20, 21, 22, 23, 24, 30], [0, 5, 6], late, [0, 2, 3], "a"),
        "unknown_core": lambda: kvcache._C._PrefixTree(-5),
        "result_type": lambda: kvcache._C._PrefixTree(cache.native.core_id(), dict),
        "dup_blocks": lambda: cache.insert(list(range(40, 48)), late[[0, 0]], "a"),
        "dup_blocks_ragged": lambda: cache.insert_ragged(list(range(40, 52)), [0, 4, 12], late[[0, 1, 1]],
                                                         [0, 1, 3], "a"),
        "dup_match_blocks": lambda: alloc.sequence(kvcache.Match(8, late[[1, 1]], -1)),
    }
    before = (cache.stats(), sorted(cache.block_references()), [alloc.refcount(b) for b in range(16)])
    with pytest.raises(exc, match=match):
        calls[case]()
    after = (cache.stats(), sorted(cache.block_references()), [alloc.refcount(b) for b in range(16)])
    for s in (before[0], after[0]):   # a rejected lookup may still count as a lookup; nothing else moves
        s.pop("lookups"), s.pop("lookup_tokens"), s.pop("hit_rate")
    assert before == after
    cache.check()


def test_buffers_are_released_after_use_and_after_rejection():
    _, cache = cached()
    good, bad = np.array(PROMPTS[0], dtype=np.int32), np.ones(3)   # float64 is rejected after it was read
    before = sys.getrefcount(good), sys.getrefcount(bad)
    for _ in range(3):
        assert cache.match(good, "a").length == len(PROMPTS[0])
        with pytest.raises(TypeError, match="format 'd'"):
            cache.match(bad, "a")
    assert (sys.getrefcount(good), sys.getrefcount(bad)) == before


@pytest.mark.parametrize("call", [
    lambda c: c.match(torch.ones(3), "a", False),
    lambda c: c.match(torch.ones(2, 3, dtype=torch.int64), "a", False),
    lambda c: c.match(torch.tensor([1, 2**32]), "a", False),
    lambda c: c.insert(torch.arange(6), torch.tensor([0]), "a", False),
    lambda c: c.match_ragged(torch.arange(3), torch.tensor([0, 2, 1, 3]), "a", False),
    lambda c: c.match_ragged(torch.arange(3), torch.tensor([0, 2]), "a", False),
    lambda c: c.insert_ragged(torch.arange(4), torch.tensor([0, 4]), torch.tensor([0, 1]), torch.tensor([0, 2, 2]),
                              "a", False),
    lambda c: c.unlock(12345),
    lambda c: c.evict(-1),
])
def test_both_ways_in_reject_bad_input_alike(call):
    alloc, cache = cached()
    fast = kvcache._C._PrefixTree(cache.native.core_id())
    with pytest.raises(Exception) as via_torch:
        call(cache.native)
    with pytest.raises(Exception) as via_pybind:
        call(fast)
    assert type(via_pybind.value) is type(via_torch.value)
    assert str(via_pybind.value) == str(via_torch.value).splitlines()[0]


# ---- namespaces, block counts and exported types (issue 21) ------------------------------------
def every_lookup(cache, tokens, ns, *, lock):
    """Each lookup form once (both front ends, and an insert of nothing), in namespace ``ns``: the
    lengths and node handles they returned."""
    key = ns.key if isinstance(ns, kvcache.Namespace) else ns
    flat, cu, page = torch.tensor(tokens + tokens), [0, len(tokens), 2 * len(tokens)], cache.allocator.page_size
    row, table = torch.zeros(-(-len(tokens) // page), dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    m, into = cache.match(tokens, ns, lock=lock), cache.match_into(tokens, row, ns, lock=lock)
    ragged = cache.match_ragged(flat, cu, ns, lock=lock)
    ragged_into = cache.match_ragged_into(flat, cu, table, ns, lock=lock)
    many = cache.match_many([tokens, tokens[:1]], ns, lock=lock)
    length, _, node = cache.native.match(torch.tensor(tokens), key, lock)
    native_ragged = cache.native.match_ragged(flat, torch.tensor(cu), key, lock)
    empty = cache.insert([], [], ns, lock=lock)
    empty_ragged = cache.insert_ragged([], [0, 0], [], [0, 0], ns, lock=lock)
    lengths = [m.length, into.length, *ragged.lengths.tolist(), *ragged_into.lengths.tolist(),
               *(x.length for x in many), length, *native_ragged[0].tolist(), empty.prefix_length,
               *empty_ragged[0].tolist()]
    nodes = [m.node, into.node, *ragged.nodes.tolist(), *ragged_into.nodes.tolist(), *(x.node for x in many), node,
             *native_ragged[3].tolist(), empty.node, *empty_ragged[1].tolist()]
    return lengths, nodes


@pytest.mark.parametrize("field, bad", [("model", 5), ("model", None), ("salt", ["x"]), ("revision", b"r")])
def test_namespace_fields_are_strings(field, bad):
    with pytest.raises(TypeError, match=rf"Namespace {field}={re.escape(repr(bad))} must be a str"):
        kvcache.Namespace(**{field: bad})
    assert kvcache.Namespace(model="m", kv_format=kvcache.CacheFormat.parse("int8")).key == \
        kvcache.Namespace(model="m", kv_format="int8").key  # (a CacheFormat is keyed by its str)


def test_lookups_in_unknown_namespaces_leave_no_state_behind():
    """A lookup in a namespace the cache never saw used to register it for good (issue 21: 10,000
    salted misses, 10,001 namespaces). Every lookup form, locking or not, in 1,000 fresh namespaces
    (salted Namespaces and plain keys) now misses without a trace: the same namespaces, nodes, locks and
    blocks as before. A miss's node is 0, the empty prefix's handle: locking it pins nothing."""
    alloc, cache = cached()
    before = cache.stats()
    tokens = PROMPTS[0]
    for i in range(1000):
        ns = kvcache.Namespace(model="m", salt=f"user-{i}") if i % 2 else f"tenant-{i}"
        lock = i % 3 == 0
        lengths, nodes = every_lookup(cache, tokens, ns, lock=lock)
        assert cache.stats()["namespaces"] == 1, f"namespace {i} was registered by a lookup"
        assert set(lengths) == {0} and set(nodes) == {0}, (lengths, nodes)
        if lock:
            for node in nodes:
                cache.unlock(node)
        cache.lock(0)       # the empty prefix: nothing to pin, nothing to count
        cache.unlock(0)
    after = cache.stats()
    assert (after["namespaces"], before["namespaces"]) == (1, 1)
    for s in (before, after):   # counted, but state: nothing else moved
        for key in ("lookups", "lookup_tokens", "hit_rate", "inserts"):
            s.pop(key)
    assert after == before
    assert alloc.stats()["used"] == before["device_blocks"]
    assert every_lookup(cache, tokens, "a", lock=False)[0][0] == len(tokens)   # the known one still hits
    cache.check()


def test_namespaces_are_reclaimed_when_their_last_node_goes():
    """A namespace lives as long as it has nodes: eviction of its last leaf, clear(), or its last host
    node dropped from a full host tier reclaims it, and it works as new afterwards."""
    alloc = kvcache.BlockAllocator(32, 4)
    cache = kvcache.PrefixCache(alloc)
    tokens = list(range(8))
    for ns in ("a", "b", "c"):                 # 2 blocks each; "a" is the least recently used
        table = alloc.allocate(2)
        cache.insert(tokens, table, ns)
        alloc.free(table)
    assert cache.stats()["namespaces"] == 3
    assert cache.evict(1) == 2 and cache.stats()["namespaces"] == 2     # a's only leaf went, and "a" with it
    assert cache.match(tokens, "a").length == 0 and cache.stats()["namespaces"] == 2
    m = cache.match(tokens, "b", lock=True)     # a locked path keeps its namespace through clear()
    assert cache.clear() == 2 and cache.stats()["namespaces"] == 1
    cache.unlock(m.node)
    assert cache.clear() == 2
    s = cache.stats()
    assert (s["namespaces"], s["nodes"], alloc.num_free) == (0, 0, 32)
    table = alloc.allocate(2)                   # a reclaimed namespace is a namespace like any other
    cache.insert(tokens, table, "a")
    alloc.free(table)
    assert cache.match(tokens, "a").length == 8 and cache.stats()["namespaces"] == 1
    cache.check()

    # With a host tier, nodes on the host keep their namespace until the host drops them.
    device = kvcache.PageLayout(4, 4, 1, 1, torch.float32).allocate(fill=0.0)
    host = kvcache.PageLayout(2, 4, 1, 1, torch.float32).allocate(fill=0.0)
    alloc = kvcache.BlockAllocator(4, 4)
    cache = kvcache.PrefixCache(alloc, host_pools=host, device_pools=device)
    for ns in ("a", "b"):
        table = alloc.allocate(2)
        cache.insert(tokens, table, ns)
        alloc.free(table)
        assert cache.evict(2) == 2            # to the host (2 blocks: room for one prefix)
        s = cache.stats()
        assert (s["namespaces"], s["host_nodes"], s["nodes"]) == (1, 1, 1), s   # "b" pushed "a" out
    assert cache.match(tokens, "a").length == 0 and cache.match(tokens, "b").length == 8
    cache.check()


def test_device_blocks_counts_distinct_blocks_and_device_block_refs_the_references():
    """A block is referenced by every node that touches its page (a page split between a parent and its
    child, the same blocks cached under two namespaces): device_blocks counts blocks, the number the
    allocator shows as used and clear() frees; device_block_refs counts the references (issue 21: 8,236
    "blocks" reported for 8,046)."""
    alloc = kvcache.BlockAllocator(16, 4)
    cache = kvcache.PrefixCache(alloc)
    table = alloc.allocate(3)                                # 10 tokens: pages 0, 1, 2
    cache.insert(list(range(6)), table[:2], "a")             # [0, 6): pages 0, 1
    cache.insert(list(range(10)), table, "a")                # [6, 10): pages 1, 2 (page 1 in both nodes)
    cache.insert(list(range(10)), table, "b")                # [0, 10) again, another namespace: 3 more refs
    alloc.free(table)
    s = cache.stats()
    assert (s["device_blocks"], s["device_block_refs"]) == (3, 7)
    assert s["device_block_refs"] == len(cache.block_references())
    assert s["device_blocks"] == len(set(cache.block_references())) == alloc.stats()["used"]
    assert (s["host_blocks"], s["host_block_refs"]) == (0, 0)
    assert cache.clear() == s["device_blocks"]
    s = cache.stats()
    assert (s["device_blocks"], s["device_block_refs"], alloc.num_free) == (0, 0, 16)


def test_every_type_of_the_prefix_api_is_importable_from_kvcache():
    """alloc.sequence() takes a Match, which a user of match_into / match_ragged_into builds; every result
    type is importable from kvcache itself (issue 21), and is the type the calls return."""
    from kvcache import Insert, Match, MatchInto, RaggedMatch, RaggedMatchInto

    alloc, cache = cached()
    flat, cu = ragged_queries()
    table = torch.zeros(len(QUERIES), 3, dtype=torch.int32)
    assert type(cache.match(QUERIES[0], "a")) is Match
    assert type(cache.match_many(QUERIES[:2], "a")[1]) is Match
    assert type(cache.match_into(QUERIES[0], table[0], "a")) is MatchInto
    assert type(cache.match_ragged(flat, cu, "a")) is RaggedMatch
    assert type(cache.match_ragged_into(flat, cu, table, "a")) is RaggedMatchInto
    assert type(cache.insert([9], alloc.allocate(1), "a")) is Insert
    lengths, _ = cache.match_ragged_into(flat, cu, table, "a")
    seq = alloc.sequence(Match(int(lengths[0]), table[0, :2], 0))   # what a match_ragged_into user writes
    assert seq.num_tokens == 5 and seq.blocks.tolist() == cache.match(QUERIES[0], "a").blocks.tolist()
    alloc.release(seq)


def test_public_signatures_take_and_return_only_types_importable_from_kvcache():
    """Every kvcache type named in the annotations of a public function or method (of kvcache.__all__,
    and of the __all__ of the submodules it exports) can be imported from kvcache, or from that submodule."""
    import inspect
    import types
    import typing

    def kvcache_types(hint):
        if isinstance(hint, type) and hint.__module__.split(".")[0] == "kvcache":
            yield hint
        for arg in typing.get_args(hint):
            yield from kvcache_types(arg)

    def functions(owner):
        for name, value in vars(owner).items():
            value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            value = value.fget if isinstance(value, property) else value
            if inspect.isfunction(value) and (not name.startswith("_") or name == "__init__"):
                yield f"{owner.__name__}.{name}", value

    missing, checked = [], 0
    modules = [getattr(kvcache, name) for name in kvcache.__all__]
    for home, names in [(kvcache, kvcache.__all__)] + [
            (m, getattr(m, "__all__", ())) for m in modules if isinstance(m, types.ModuleType)]:
        for name in names:
            obj = getattr(home, name)
            found = functions(obj) if inspect.isclass(obj) else [(name, obj)] if inspect.isfunction(obj) else []
            for where, fn in found:
                for hint in typing.get_type_hints(fn).values():
                    for t in kvcache_types(hint):
                        checked += 1
                        if getattr(kvcache, t.__name__, None) is not t and getattr(home, t.__name__, None) is not t:
                            missing.append(f"{t.__module__}.{t.__name__} (in {home.__name__}.{where})")
    assert checked > 40 and not missing, sorted(set(missing))


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
def test_lookups_in_changing_namespaces_keep_memory_flat():
    """A server that salts per user and mostly misses: 100,000 lookups, each in a namespace never seen
    before, grow the process's resident memory by less than 8 MB after a warm-up (each such namespace
    used to cost ~200 bytes for good: ~20 MB here, ~39 MB for the issue's 200,000)."""
    alloc, cache = cached()
    row = torch.zeros(2, dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    flat, cu = torch.tensor(PROMPTS[0] + PROMPTS[1][:1]), torch.tensor([0, 7, 8])

    def lookups(first: int, n: int) -> None:
        for i in range(first, first + n):
            ns = f"user-{i}"
            if i % 4 == 0:
                cache.match(PROMPTS[0], ns)
            elif i % 4 == 1:
                cache.match_into(PROMPTS[1], row, ns, lock=True)
            elif i % 4 == 2:
                cache.match_ragged_into(flat, cu, table, ns)
            else:
                cache.match_into(PROMPTS[0], row, kvcache.Namespace(model="m", salt=ns))

    lookups(0, 20_000)           # warm-up: allocator pools, thread-local scratch, interned objects
    gc.collect()
    before = resident_bytes()
    t0 = time.perf_counter()
    lookups(20_000, 100_000)
    elapsed = time.perf_counter() - t0
    gc.collect()
    growth = resident_bytes() - before
    print(f"100,000 lookups in fresh namespaces: {growth / 2**20:+.2f} MB resident, {elapsed:.2f} s")
    assert growth < 8 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MB over 100,000 lookups"
    s = cache.stats()
    assert (s["namespaces"], s["locked_nodes"]) == (1, 0)
    cache.check()


# ---- property-based: random operations against a pure-Python model -------------------------------
class _Node:
    def __init__(self, tokens=(), start=0, parent=None, pages=None, last=0, hits=0):
        self.tokens, self.start, self.parent = tuple(tokens), start, parent
        self.pages = dict(pages or {})   # page index -> block: every page [start, end) touches
        self.children: list[_Node] = []
        self.lock, self.last, self.hits = 0, last, hits

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class RadixModel:
    """The prefix cache's semantics, written plainly: a token trie with run-length edges, one reference
    per (node, page touched), LRU/LFU leaf eviction, counted locks; plus every block's reference count
    (sequences' and the tree's). Block ids are taken from the real allocator's answers and checked."""

    def __init__(self, num_blocks: int, page: int, policy: str):
        self.page, self.policy, self.num_blocks = page, policy, num_blocks
        self.refs = [0] * num_blocks
        self.roots: dict[str, _Node] = {}
        self.clock = 0

    def pages(self, n: int) -> int:
        return -(-n // self.page)

    @property
    def free(self) -> int:
        return self.refs.count(0)

    def nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.parent is not None:
                yield node

    def tree_refs(self) -> Counter:
        return Counter(b for node in self.nodes() for b in node.pages.values())

    def match(self, ns, tokens):
        self.clock += 1
        root = self.roots.setdefault(ns, _Node())
        path, node, pos = [], root, 0
        while pos < len(tokens):
            child = next((c for c in node.children if c.tokens[0] == tokens[pos]), None)
            if child is None:
                break
            k = 0
            while k < len(child.tokens) and pos + k < len(tokens) and child.tokens[k] == tokens[pos + k]:
                k += 1
            path.append(child)
            pos += k
            if k < len(child.tokens):
                break
            node = child
        for n in path:
            n.last, n.hits = self.clock, n.hits + 1
        blocks = [next(n.pages[p] for n in reversed(path) if p in n.pages) for p in range(self.pages(pos))]
        return pos, blocks, path[-1] if path else root

    def split(self, child: _Node, k: int) -> _Node:
        s = child.start + k
        up = _Node(child.tokens[:k], child.start, child.parent, last=child.last, hits=child.hits)
        up.pages = {p: b for p, b in child.pages.items() if p * self.page < s}
        child.pages = {p: b for p, b in child.pages.items() if (p + 1) * self.page > s}
        for p in set(up.pages) & set(child.pages):
            self.refs[up.pages[p]] += 1
        up.lock, up.children = child.lock, [child]
        siblings = child.parent.children
        siblings[siblings.index(child)] = up
        child.tokens, child.start, child.parent = child.tokens[k:], s, up
        return up

    def insert(self, ns, tokens, blocks):
        self.clock += 1
        node, pos = self.roots.setdefault(ns, _Node()), 0
        while pos < len(tokens):
            child = next((c for c in node.children if c.tokens[0] == tokens[pos]), None)
            if child is None:
                break
            k = 0
            while k < len(child.tokens) and pos + k < len(tokens) and child.tokens[k] == tokens[pos + k]:
                k += 1
            length = len(child.tokens)
            if k < length and pos + k < len(tokens):
                child = self.split(child, k)
            child.last, child.hits = self.clock, child.hits + 1
            node, pos = child, pos + k
            if k < length:
                break
        prefix = pos
        if pos < len(tokens):
            leaf = _Node(tokens[pos:], pos, node, {p: blocks[p] for p in range(pos // self.page, self.pages(len(tokens)))},
                         last=self.clock, hits=1)
            for b in leaf.pages.values():
                self.refs[b] += 1
            node.children.append(leaf)
            node = leaf
        return prefix, node

    def lock(self, node: _Node, delta: int) -> None:
        while node is not None:
            node.lock += delta
            node = node.parent

    def evict(self, want: int) -> int:
        freed = 0
        while freed < want:
            leaves = [n for n in self.nodes() if not n.children and n.lock == 0]
            if not leaves:
                break
            key = (lambda n: (n.hits, n.last)) if self.policy == "lfu" else (lambda n: n.last)
            leaves.sort(key=key)
            assert len(leaves) == 1 or key(leaves[0]) != key(leaves[1]), "the model's eviction order has a tie"
            victim = leaves[0]
            victim.parent.children.remove(victim)
            for b in victim.pages.values():
                self.refs[b] -= 1
                freed += self.refs[b] == 0
        return freed

    def append_need(self, blocks: list[int], num_tokens: int, n: int) -> tuple[bool, int]:
        offset = num_tokens % self.page
        cow = bool(offset and n and self.refs[blocks[-1]] > 1)
        return cow, self.pages(num_tokens + n) - self.pages(num_tokens) + cow


class PrefixCacheMachine(RuleBasedStateMachine):
    """allocate / fork / write / free / insert / match / lock / unlock / evict, checked after every step."""

    @initialize(page=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 20), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, page, num_blocks, policy):
        self.alloc = kvcache.BlockAllocator(num_blocks, page)
        self.cache = kvcache.PrefixCache(self.alloc, policy=policy)
        self.pools = Pools(num_blocks, page)
        self.model = RadixModel(num_blocks, page, policy)
        self.seqs: list[tuple[kvcache.Sequence, str, list[int]]] = []
        self.locks: list[tuple[int, _Node]] = []

    # ---- helpers ---------------------------------------------------------------------------------
    def _append(self, seq: kvcache.Sequence, ns: str, tokens: list[int], n: int) -> bool:
        """Grows seq by the last n of `tokens` in both worlds; False if the pool is (predictably) full."""
        model, old = self.model, [int(b) for b in seq.blocks]
        cow, need = model.append_need(old, seq.num_tokens, n)
        if model.free < need and need <= model.num_blocks:
            model.evict(need - model.free)
            cow, need = model.append_need(old, seq.num_tokens, n)
        if model.free < need:
            with pytest.raises(kvcache.OutOfBlocksError):
                self.alloc.append(seq, n, pools=(self.pools.k, self.pools.v))
            return False
        start = seq.num_tokens
        copies = self.alloc.append(seq, n, pools=(self.pools.k, self.pools.v))
        new = [int(b) for b in seq.blocks]
        fresh = ([new[len(old) - 1]] if cow else []) + new[len(old):]
        assert all(model.refs[b] == 0 for b in fresh), "append handed out a block in use"
        assert copies.tolist() == ([[old[-1], new[len(old) - 1]]] if cow else [])
        if cow:
            model.refs[old[-1]] -= 1
        for b in fresh:
            model.refs[b] += 1
        self.pools.write(seq, ns, tokens, start)
        return True

    def _pick(self, data, items):
        return data.draw(st.integers(0, len(items) - 1))

    # ---- rules -----------------------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, 2), max_size=12), ns=st.sampled_from(NAMESPACES), lock=st.booleans(),
          form=st.sampled_from(("match", "into", "ragged_into")))
    def request(self, tokens, ns, lock, form):
        if form == "into":  # into a block-table row with room to spare: only its first entries change
            row = torch.full((-(-len(tokens) // self.alloc.page_size) + 2,), -5, dtype=torch.int32)
            length, node = self.cache.match_into(tokens, row, ns, lock=lock)
            k = -(-length // self.alloc.page_size)
            assert row[k:].tolist() == [-5] * (len(row) - k)
            m = kvcache.prefix.Match(length, row[:k], node)
        elif form == "ragged_into":  # a batch of one, into row 1 of a 3-row table: nothing else changes
            table = torch.full((3, -(-len(tokens) // self.alloc.page_size) + 2), -5, dtype=torch.int32)
            lengths, nodes = self.cache.match_ragged_into(tokens, [0, len(tokens)], table[1:2], ns, lock=lock)
            length, node, k = int(lengths[0]), int(nodes[0]), -(-int(lengths[0]) // self.alloc.page_size)
            assert table[1, k:].tolist() == [-5] * (table.shape[1] - k) and (table[::2] == -5).all()
            m = kvcache.prefix.Match(length, table[1, :k], node)
        else:
            m = self.cache.match(tokens, ns, lock=lock)
        length, blocks, node = self.model.match(ns, tokens)
        assert (m.length, m.blocks.tolist()) == (length, blocks)
        assert self.pools.holds(m.blocks, ns, tokens[:length]), "a match returned a block that lost its KV"
        if lock:
            self.model.lock(node, +1)
            self.locks.append((m.node, node))
        seq = self.alloc.sequence(m)
        for b in blocks:
            self.model.refs[b] += 1
        if self._append(seq, ns, tokens, len(tokens) - length):
            self.seqs.append((seq, ns, list(tokens)))
        else:
            for b in seq.blocks.tolist():
                self.model.refs[b] -= 1
            self.alloc.release(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def write(self, data, more):
        seq, ns, tokens = self.seqs[self._pick(data, self.seqs)]
        if self._append(seq, ns, tokens + more, len(more)):
            tokens.extend(more)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        seq, ns, tokens = self.seqs[self._pick(data, self.seqs)]
        child = self.alloc.fork(seq)
        for b in seq.blocks.tolist():
            self.model.refs[b] += 1
        self.seqs.append((child, ns, list(tokens)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq, _, _ = self.seqs.pop(self._pick(data, self.seqs))
        for b in seq.blocks.tolist():
            self.model.refs[b] -= 1
        self.alloc.release(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), lock=st.booleans())
    def insert(self, data, lock):
        seq, ns, tokens = self.seqs[self._pick(data, self.seqs)]
        cut = data.draw(st.integers(0, len(tokens)))
        r = self.cache.insert(tokens[:cut], seq, ns, lock=lock)
        prefix, node = self.model.insert(ns, tokens[:cut], [int(b) for b in seq.blocks])
        assert r.prefix_length == prefix
        if lock:
            self.model.lock(node, +1)
            self.locks.append((r.node, node))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def lock_again(self, data):
        handle, node = self.locks[self._pick(data, self.locks)]
        self.cache.lock(handle)
        self.model.lock(node, +1)
        self.locks.append((handle, node))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        handle, node = self.locks.pop(self._pick(data, self.locks))
        self.cache.unlock(handle)
        self.model.lock(node, -1)

    @rule(n=st.integers(0, 24))
    def evict(self, n):
        assert self.cache.evict(n) == self.model.evict(n)

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def structure(self):
        if hasattr(self, "cache"):
            self.cache.check()

    @invariant()
    def every_block_is_free_xor_referenced_and_counts_match(self):
        if not hasattr(self, "cache"):
            return
        real = [self.alloc.refcount(b) for b in range(self.model.num_blocks)]
        assert real == self.model.refs
        assert Counter(self.cache.block_references()) == self.model.tree_refs()
        held = Counter(b for seq, _, _ in self.seqs for b in seq.blocks.tolist())
        assert all(real[b] == held[b] + self.model.tree_refs()[b] for b in range(len(real)))
        s = self.alloc.stats()
        assert s["free"] == real.count(0) and s["used"] == len(real) - real.count(0)

    @invariant()
    def stats_count_live_namespaces_and_distinct_blocks(self):
        if not hasattr(self, "cache"):
            return
        s, refs = self.cache.stats(), self.model.tree_refs()
        assert s["namespaces"] == sum(1 for root in self.model.roots.values() if root.children)
        assert (s["device_blocks"], s["device_block_refs"]) == (len(refs), sum(refs.values()))

    @invariant()
    def sequences_keep_their_kv(self):
        for seq, ns, tokens in getattr(self, "seqs", []):
            assert seq.num_tokens == len(tokens) and self.pools.holds(seq.blocks, ns, tokens)

    @invariant()
    def locked_paths_are_never_evicted(self):
        for handle, node in getattr(self, "locks", []):
            self.cache.lock(handle)    # raises IndexError for an evicted (stale) node
            self.cache.unlock(handle)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for seq, _, _ in self.seqs:
            self.alloc.release(seq)
        for handle, _ in self.locks:
            self.cache.unlock(handle)
        self.cache.clear()
        assert self.alloc.num_free == self.model.num_blocks, "blocks leaked after everything was released"
        assert self.cache.stats()["nodes"] == 0


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_against_model = PrefixCacheMachine.TestCase


class HostTierMachine(RuleBasedStateMachine):
    """The same operations with a host tier: content and reference counts stay right on both pools."""

    @initialize(page=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 14), host_blocks=st.integers(1, 10))
    def setup(self, page, num_blocks, host_blocks):
        self.alloc = kvcache.BlockAllocator(num_blocks, page)
        self.pools = Pools(num_blocks, page)
        self.host = Pools(host_blocks, page)
        self.cache = kvcache.PrefixCache(self.alloc, host_pools=(self.host.k, self.host.v),
                                         device_pools=(self.pools.k, self.pools.v))
        self.seqs: list[tuple[kvcache.Sequence, str, list[int]]] = []

    @rule(tokens=st.lists(st.integers(0, 2), max_size=12), ns=st.sampled_from(NAMESPACES), keep=st.booleans())
    def request(self, tokens, ns, keep):
        m = self.cache.match(tokens, ns)
        assert self.pools.holds(m.blocks, ns, tokens[:m.length]), "a match returned a block that lost its KV"
        seq = self.alloc.sequence(m)
        try:
            self.alloc.append(seq, len(tokens) - m.length, pools=(self.pools.k, self.pools.v))
        except kvcache.OutOfBlocksError:
            self.alloc.release(seq)
            return
        self.pools.write(seq, ns, tokens, m.length)
        self.cache.insert(tokens, seq, ns)
        if keep:
            self.seqs.append((seq, ns, list(tokens)))
        else:
            self.alloc.release(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq, _, _ = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.alloc.release(seq)

    @rule(n=st.integers(0, 16))
    def evict(self, n):
        self.cache.evict(n)

    @invariant()
    def counts_and_content(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check()
        held = Counter(b for seq, _, _ in self.seqs for b in seq.blocks.tolist())
        tree = Counter(self.cache.block_references())
        assert [self.alloc.refcount(b) for b in range(self.alloc.num_blocks)] == [
            held[b] + tree[b] for b in range(self.alloc.num_blocks)]
        host = Counter(self.cache.block_references(host=True))
        host_alloc = self.cache.host_allocator
        assert [host_alloc.refcount(b) for b in range(host_alloc.num_blocks)] == [
            host[b] for b in range(host_alloc.num_blocks)]
        s = self.cache.stats()
        assert (s["device_blocks"], s["device_block_refs"]) == (len(tree), sum(tree.values()))
        assert (s["host_blocks"], s["host_block_refs"]) == (len(host), sum(host.values()))
        assert s["host_blocks"] == host_alloc.num_blocks - host_alloc.num_free
        for seq, ns, tokens in self.seqs:
            assert self.pools.holds(seq.blocks, ns, tokens)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for seq, _, _ in self.seqs:
            self.alloc.release(seq)
        self.cache.clear()
        assert self.alloc.num_free == self.alloc.num_blocks


HostTierMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_host_tier_against_invariants = HostTierMachine.TestCase


def test_docstring_examples():
    import doctest

    import kvcache.prefix
    result = doctest.testmod(kvcache.prefix, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_ragged_insert_lets_rows_share_blocks_but_not_repeat_their_own():
    """Distinct blocks per sequence (a repeat in one row is refused: see the bad-input cases), while rows of one batch
    may share a page, as forks and prefix hits do."""
    alloc, cache = cached(num_blocks=16)
    shared, own = alloc.allocate(2)
    lengths = cache.insert_ragged(list(range(40, 44)) + list(range(40, 48)), [0, 4, 12],
                                  torch.tensor([shared, shared, own], dtype=torch.int32), [0, 1, 3], "a")
    assert lengths[0].tolist() == [0, 4]  # the second row found the first's page (it was inserted just before)
    assert cache.match(list(range(40, 48)), "a").blocks.tolist() == [shared, own]
    cache.check()
