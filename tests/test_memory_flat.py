"""Memory stays flat (issue #21): creating and freeing PagedCache objects, Engines and prefix caches 10,000
times each, and 100,000 lookups in changing namespaces while namespaces come and go, leave the process's
resident memory where it was.

How it is measured: a warm-up of the same cycle first (allocator pools, torch's and transformers' caches,
interned strings, thread-local scratch reach their steady size), then the resident set of /proc/self/statm
before and after the measured cycles, each time after a garbage collection and glibc's ``malloc_trim(0)``.
The trim matters: glibc keeps freed small blocks in its arenas and returns them to the system in bursts, so
without it the resident set of a loop that frees everything it makes still saws up and down by 100+ MB
(measured here: +140 MB after 10,000 PagedCache cycles, -2 MB once trimmed). What is left after the trim
is memory something still holds.

The bound, 4 MB per 10,000 cycles (400 bytes a cycle, and never below 2 MB), is below what any leak of a cycle's
own objects would cost: a PagedCache holds ~40 KB of pages here (400 MB if they leaked), a prefix tree
~1 KB of nodes, edges and its torch class (10 MB), an Engine a PagedCache, a store and an allocator
(several KB each), and even one leaked Python object per cycle with its dict is ~500 bytes (5 MB). It is
far above the noise of the measurement (the trimmed resident set moved by 0.0-0.4 MB in these tests). The
lookup test's bound is the same for 100,000 lookups (40 bytes a lookup: a namespace that stayed registered
costs ~200).

Time (2 cores, 1 torch thread): a PagedCache cycle takes 1.4-2 ms, an Engine cycle 0.65-0.9 ms, a prefix
cache cycle 0.1-0.4 ms, a lookup ~5 us. So by default the PagedCache and Engine tests run 4,000 cycles
(~8 s and ~3.5 s) and the others 10,000 cycles and 100,000 lookups; ``pytest --soak-long`` runs 10,000 of
each (~35 s in all), KVCACHE_MEMORY_CYCLES=n runs n of each (and n x 10 lookups).
"""

from __future__ import annotations

import ctypes
import gc
import os
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvcache  # noqa: E402

transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")



def cycles(request, default: int) -> int:
    """Cycles of a test: its default, 10,000 with ``--soak-long``, or KVCACHE_MEMORY_CYCLES."""
    if os.environ.get("KVCACHE_MEMORY_CYCLES"):
        return int(os.environ["KVCACHE_MEMORY_CYCLES"])
    return 10_000 if request.config.getoption("--soak-long") else default


def bound(n: int) -> int:
    """400 bytes a cycle (4 MB per 10,000), and never below 2 MB (the measurement's noise is < 0.5 MB)."""
    return max(2 * 2**20, 400 * n)

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc: measure untrimmed
    _malloc_trim = None


def resident_bytes() -> int:
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def growth_of(cycle, n: int, warmup: int) -> tuple[int, float]:
    """Resident bytes gained over ``n`` calls of ``cycle(i)`` after ``warmup`` calls, and the seconds they took."""
    for i in range(warmup):
        cycle(i)
    before = resident_bytes()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + n):
        cycle(i)
    elapsed = time.perf_counter() - t0
    return resident_bytes() - before, elapsed


def report(what: str, n: int, growth: int, elapsed: float, bound: int) -> None:
    print(f"{n:,} {what}: {growth / 2**20:+.2f} MB resident (bound {bound / 2**20:.0f} MB), {elapsed:.1f} s")
    assert growth < bound, f"resident memory grew by {growth / 2**20:.1f} MB over {n:,} {what}"


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: no gain from threads, and OpenMP's pools stay put
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(config).eval()


FORMATS = [(None, None), ("int8", 0), ("int4", 8), ("kivi2", None)]  # (kv_format, residual_length)


def test_paged_caches_keep_memory_flat(model, request):
    """Each cycle makes a PagedCache (formats in turn, residual pages, a prefix cache every sixth; a growing
    pool every fourth, whose allocator alone is ~2.6 MB of bookkeeping for its 2^18 ids), writes a
    few tokens to every layer and frees it; every fourth reorders its rows, every sixth caches its prompt
    and reloads it into another cache, every tenth forks it first."""
    config = model.config
    k = torch.randn(2, 1, 5, 32)
    prompt = torch.arange(1, 6)

    def cycle(i: int) -> None:
        fmt, residual = FORMATS[i % len(FORMATS)]
        cache = kvcache.PagedCache(config=config, kv_format=fmt, residual_length=residual, page_size=4,
                                   prefix_cache=i % 6 == 0, max_tokens=None if i % 4 == 1 else 64)
        for layer in range(2):
            cache.update(k, k, layer)
        if i % 4 == 0:
            cache.reorder_cache(torch.tensor([1, 1]))
        if i % 6 == 0:
            cache.save_prefix(prompt)
            other = kvcache.PagedCache(config=config, store=cache.store)
            assert other.load_prefix(prompt) == 4
            other.free()
        if i % 10 == 0:
            fork = kvcache.PagedCache.__deepcopy__(cache, {})
            fork.free()
        cache.free()

    n = cycles(request, 4_000)
    growth, elapsed = growth_of(cycle, n, warmup=500)
    report("PagedCache cycles", n, growth, elapsed, bound(n))


def test_engines_keep_memory_flat(model, request):
    """Each cycle makes an Engine (with its store, allocator, prefix cache and PagedCache); every 50th also
    generates, so that its pools and prefix tree hold something when it goes."""
    def cycle(i: int) -> None:
        fmt, residual = FORMATS[i % len(FORMATS)]
        engine = kvcache.Engine(model, kv_format=fmt, residual_length=residual, page_size=4)
        if i % 50 == 0:
            engine.generate([[1, 2, 3, 4, 5, 6]], max_new_tokens=2)

    n = cycles(request, 4_000)
    growth, elapsed = growth_of(cycle, n, warmup=200)
    report("Engine cycles", n, growth, elapsed, bound(n))


def test_prefix_caches_keep_memory_flat(request):
    """Each cycle makes a BlockAllocator and a PrefixCache over it (a host tier every fourth), caches prefixes
    in two namespaces, looks them up (locked and not), evicts (to the host, and back on a match) and drops
    both."""
    host = [kvcache.PageLayout(8, 4, 1, 8, torch.float32).allocate(fill=0.0)]
    device = [kvcache.PageLayout(8, 4, 1, 8, torch.float32).allocate(fill=0.0)]
    tokens = list(range(1, 11))

    def cycle(i: int) -> None:
        alloc = kvcache.BlockAllocator(8, 4)
        tiered = i % 4 == 0
        cache = kvcache.PrefixCache(alloc, host_pools=host if tiered else None, device_pools=device if tiered else None)
        for ns in ("a", f"user-{i}"):
            blocks = alloc.allocate(3)
            cache.insert(tokens, blocks, ns)
            alloc.free(blocks)
        m = cache.match(tokens, "a", lock=True)
        cache.unlock(m.node)
        cache.evict(8)
        assert cache.match_many([tokens[:5], tokens], f"user-{i}")[1].length == (10 if tiered else 0)
        cache.check()

    n = cycles(request, 10_000)
    growth, elapsed = growth_of(cycle, n, warmup=500)
    report("PrefixCache cycles", n, growth, elapsed, bound(n))


def test_lookups_while_namespaces_come_and_go_keep_memory_flat(request):
    """100,000 lookups, each in a namespace never seen before, while every 100th lookup's namespace gets a
    prefix (registered) that a later eviction takes away again (reclaimed). tests/test_prefix_cache.py
    (test_lookups_in_changing_namespaces_keep_memory_flat) has the lookups alone."""
    alloc = kvcache.BlockAllocator(64, 4)
    cache = kvcache.PrefixCache(alloc)
    tokens = torch.arange(1, 14, dtype=torch.int32)
    row = torch.zeros(4, dtype=torch.int32)

    def cycle(i: int) -> None:
        ns = f"user-{i}"
        if i % 100 == 0:
            blocks = alloc.allocate(4)
            cache.insert(tokens, blocks, ns)
            alloc.free(blocks)
            assert cache.match_into(tokens, row, ns).length == 13
            cache.evict(64)
        elif i % 2:
            cache.match_into(tokens, row, ns, lock=True)
        else:
            cache.match(tokens, kvcache.Namespace(model="m", salt=ns))

    lookups = 10 * cycles(request, 10_000)
    growth, elapsed = growth_of(cycle, lookups, warmup=20_000)
    report("lookups in changing namespaces", lookups, growth, elapsed, bound(lookups // 10))
    s = cache.stats()
    assert (s["namespaces"], s["nodes"], s["locked_nodes"]) == (0, 0, 0)
    assert alloc.num_free == alloc.num_blocks
    cache.check()
