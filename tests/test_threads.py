"""One PrefixCache and one BlockAllocator shared by 4 Python threads (issue #21).

The locking contract: the C++ core (csrc/prefix) is thread-safe by itself: the allocator and the tree each
hold a mutex (lock order: tree, then allocator; the allocator calls its reclaimer, the tree, with its own
mutex released), and both Python front ends call it with the GIL released (the torch class through
torch's custom-class dispatch, ``kvcache._C._PrefixTree`` itself; test_prefix_cache.py checks that another
thread runs during a long call). No Python-level lock is involved, so these threads really run the tree
and the allocator concurrently. csrc/tests has the same mix on 4 std::threads under ASan and UBSan.

Each thread runs what kvcache.Engine does with them (lookups that lock what they return, sequences that
share the matched blocks, appends with copy-on-write, inserts, releases, unlocks) plus forks, raw
allocations, evictions, stats, refcounts and invariant checks, 10,000 steps in all, on a pool too small for
all of them at once (OutOfBlocksError is expected, and must leave nothing behind). Every position of the
pool holds a hash of its namespace and token prefix, written by the thread that owns the block, so a block
handed out twice, a locked prefix evicted, a shared page written or a copy gone wrong reads back wrong;
every thread checks what it matched and what it wrote. At the end: no thread failed, nothing is locked,
the allocator's references are exactly the cache's (no leaked or double-freed block), the tree's invariants
hold, and clearing the cache frees every block.

The ``backend`` fixture runs it once more (2,000 steps) with the storage ops on the CUDA kernels under the
emulator, which ``make test-cuda-asan`` runs under AddressSanitizer: 4 threads in the emulated kernels at once.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
import torch

import kvcache
from conftest import CUDA_EMULATED

THREADS, STEPS, PAGE, BLOCKS = 4, 10_000, 4, 32
EMULATED_STEPS = 2_000  # the emulator runs each kernel's threads as fibers: ~5x slower
NAMESPACES = ("a", "b")


def kv_values(ns: str, tokens) -> torch.Tensor:
    """The value at each position: a rolling hash of (namespace, tokens[:position + 1]), exact in fp32."""
    h, out = NAMESPACES.index(ns) + 1, []
    for t in tokens:
        h = (h * 31 + int(t) + 1) % 1048573
        out.append(float(h))
    return torch.tensor(out)


class Shared:
    """The pool (one layer, [BLOCKS, 1, PAGE, 1], V = -K), its allocator and prefix cache (a host tier of as
    many blocks, if asked), and helpers to write and read a sequence's positions."""

    def __init__(self, host_tier: bool):
        layout = kvcache.PageLayout(BLOCKS, PAGE, 1, 1, torch.float32)
        self.k, self.v = layout.allocate(fill=-1.0)
        self.alloc = kvcache.BlockAllocator(BLOCKS, PAGE)
        host = dict(host_pools=[layout.allocate(fill=-2.0)], device_pools=[(self.k, self.v)]) if host_tier else {}
        self.cache = kvcache.PrefixCache(self.alloc, **host)

    def write(self, seq: kvcache.Sequence, ns: str, tokens, start: int) -> None:
        vals = kv_values(ns, tokens)[start:].view(1, 1, -1, 1)
        if vals.numel():
            kvcache.append(vals, -vals, self.k, self.v, seq.slots(start).view(1, -1))

    def holds(self, blocks, ns: str, tokens) -> bool:
        n = len(tokens)
        if n == 0:
            return True
        table = torch.as_tensor(blocks, dtype=torch.int32)[: -(-n // PAGE)].view(1, -1)
        k, v = kvcache.paged_gather(self.k, self.v, table, torch.tensor([n], dtype=torch.int32))
        want = kv_values(ns, tokens)
        return torch.equal(k.view(-1), want) and torch.equal(v.view(-1), -want)


def worker(shared: Shared, t: int, steps: int, events: Counter, errors: list) -> None:
    rng = random.Random(t)
    alloc, cache = shared.alloc, shared.cache
    systems = [[rng.randrange(1, 50) for _ in range(n)] for n in (9, 16, 22)]  # per thread: each has its own
    systems.append(list(range(1, 13)))                                        # and one all threads share
    row = torch.zeros(16, dtype=torch.int32)
    table = torch.zeros(2, 16, dtype=torch.int32)
    try:
        for step in range(steps):
            op = rng.random()
            if op < 0.6:
                ns = rng.choice(NAMESPACES)
                tokens = rng.choice(systems)[: rng.randrange(1, 23)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))]
                request(shared, rng, ns, tokens, row, table, events)
            elif op < 0.7:
                events["evicted"] += cache.evict(rng.randrange(1, 9))
            elif op < 0.8:
                s = alloc.stats()
                assert s["free"] + s["used"] == BLOCKS and s["references"] >= s["used"], s
                c = cache.stats()
                assert c["device_blocks"] <= c["device_block_refs"] and c["nodes"] >= c["locked_nodes"], c
                assert alloc.refcount(rng.randrange(BLOCKS)) >= 0
            elif op < 0.9:
                try:  # now and then more than the pool holds: reclaims all it can, then fails
                    blocks = alloc.allocate(rng.randrange(1, 4) if step and rng.random() < 0.97 else BLOCKS + 1)
                except kvcache.OutOfBlocksError:
                    events["out_of_blocks"] += 1
                    continue
                alloc.share(blocks)
                assert all(alloc.refcount(b) >= 2 for b in blocks.tolist())
                assert alloc.free(blocks) == 0 and alloc.free(blocks) == len(set(blocks.tolist()))
            elif op < 0.99:
                cache.check()
            else:
                cache.clear()
    except Exception as err:  # noqa: BLE001 - reported by the test
        errors.append(f"thread {t} step {step}: {type(err).__name__}: {err}")


def request(shared: Shared, rng: random.Random, ns: str, tokens: list[int], row, table, events: Counter) -> None:
    """A request as kvcache.Engine runs one: a locked lookup, a sequence sharing what matched, the rest
    computed (copy-on-write of a shared partial page), its prompt cached, then everything given back."""
    alloc, cache = shared.alloc, shared.cache
    key = tokens[:-1]  # the Engine keeps one token to compute
    how = rng.randrange(3)
    if how == 0:
        m = cache.match(key, ns, lock=True)
    elif how == 1:
        length, node = cache.match_into(key, row, ns, lock=True)
        m = kvcache.Match(length, row[: -(-length // PAGE)], node)
    else:  # batched, as the Engine admits: this request and a shorter one
        other = key[: len(key) // 2]
        lengths, nodes = cache.match_ragged_into(torch.tensor(key + other, dtype=torch.int32),
                                                 [0, len(key), len(key) + len(other)], table, ns, lock=True)
        cache.unlock(int(nodes[1]))
        m = kvcache.Match(int(lengths[0]), table[0, : -(-int(lengths[0]) // PAGE)], int(nodes[0]))
    events["hit_tokens"] += m.length
    seqs, nodes = [], [m.node]
    try:
        assert shared.holds(m.blocks, ns, tokens[: m.length]), "a locked match reads wrong values"
        seq = alloc.sequence(m)
        seqs.append(seq)
        alloc.append(seq, len(tokens) - m.length, pools=(shared.k, shared.v))
        shared.write(seq, ns, tokens, m.length)
        assert shared.holds(seq.blocks, ns, tokens), "a sequence reads wrong values after its writes"
        if rng.random() < 0.3:  # beam / parallel sampling: a fork that diverges inside the shared last page
            fork = alloc.fork(seq)
            seqs.append(fork)
            extra = tokens + [rng.randrange(1, 50)]
            alloc.append(fork, 1, pools=(shared.k, shared.v))
            shared.write(fork, ns, extra, len(tokens))
            assert shared.holds(fork.blocks, ns, extra), "a fork reads wrong values"
        if rng.random() < 0.8:
            if rng.random() < 0.5:
                ins = cache.insert(tokens, seq, ns, lock=True)
                nodes.append(ins.node)
            else:
                cache.insert_ragged(torch.tensor(tokens), [0, len(tokens)], seq.blocks, [0, len(seq.blocks)], ns)
        assert shared.holds(seq.blocks, ns, tokens), "a sequence's values changed under it"
    except kvcache.OutOfBlocksError:
        events["out_of_blocks"] += 1
    finally:
        for s in seqs:
            alloc.release(s)
        for node in nodes:
            cache.unlock(node)
    events["requests"] += 1


@pytest.mark.parametrize("host_tier", [False, True], ids=["device", "host-tier"])
def test_threads_share_one_allocator_and_prefix_cache(backend, host_tier):
    shared = Shared(host_tier)
    events, errors = Counter(), []
    steps = STEPS if backend != CUDA_EMULATED else EMULATED_STEPS
    threads = [threading.Thread(target=worker, args=(shared, t, steps // THREADS, events, errors))
               for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]
    alloc, cache = shared.alloc, shared.cache
    s = cache.stats()
    print(f"{dict(events)}, {s['evicted_blocks']} blocks evicted, {s['demoted_blocks']} demoted, "
          f"{s['loaded_blocks']} loaded")
    assert events["requests"] > 0.4 * steps and events["hit_tokens"] > 0 and events["out_of_blocks"] >= 1
    assert s["evicted_blocks"] > 0 and (not host_tier or s["loaded_blocks"] > 0)
    cache.check()
    assert s["locked_nodes"] == 0
    a = alloc.stats()
    # every reference left is one of the cache's: none leaked by a request, none dropped twice
    assert sorted(cache.block_references()) == sorted(b for b in range(BLOCKS) for _ in range(alloc.refcount(b)))
    assert a["used"] == s["device_blocks"] and a["references"] == s["device_block_refs"]
    if host_tier:
        h = cache.host_allocator
        assert h.stats()["references"] == s["host_block_refs"] == len(cache.block_references(host=True))
    cache.clear()
    assert alloc.num_free == BLOCKS and alloc.stats()["references"] == 0
    cache.check()
