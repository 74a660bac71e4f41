"""Soak tests (issue #21): kvcache.Engine and kvcache.PagedCache on thousands of random requests, every KV
format, with a pool too small for them, so that the prefix cache evicts, the host tier moves prefixes out and
back, the Engine preempts requests (and refuses up front those that could not fit alone), and PagedCache
requests fail with OutOfBlocksError; each of those must have happened at least once. Afterwards
every block is free and the radix tree's invariants hold, and every output equals the output of the same
request run alone with an unbounded pool: exactly in full precision, within the format's tolerance
otherwise.

The default run takes well under a minute. ``pytest --soak-long`` runs ten times as many requests, and
``KVCACHE_SOAK_STEPS=n`` sets the number of requests per case (every failure names its seed, so it
reproduces with the same n).

The Engine soak runs a tiny random Llama (weights drawn with std 0.2, so that attention is sharp and a
wrong page moves the logits by ~2, against 0.05 for int8 storage). The PagedCache soak drives the cache
layer directly with K/V that are a function of each row's whole token prefix, so a wrong page, a page
reused too early, a crop, fork or beam reorder gone wrong all show as wrong values.
"""

from __future__ import annotations

import copy
import gc
import os
import random
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvcache  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: a second torch thread only adds synchronization (and, on a loaded 2-core
    machine, OpenMP spinning that slowed the Engine soak 20x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the Engine --------------------------------------------------------------------------------------
VOCAB, EOS, PAGE = 64, 0, 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2)
    return transformers.LlamaForCausalLM(config).eval()


class RecordingEngine(kvcache.Engine):
    """An Engine that keeps each request's logits (``result.logits``, one row per generated token) and,
    with ``script``, feeds scripted tokens instead of sampling (teacher forcing): then two runs of a
    request see the same tokens whatever their logits, and the logits can be compared step by step."""

    script = None  # (prompt, step) -> token

    def _forward(self, running, stats):
        logits = super()._forward(running, stats)
        for req, row in zip(running, logits):
            req.result.__dict__.setdefault("logits", []).append(row.clone())
        self._running = running
        return logits

    def _sample(self, logits, *args):
        if self.script is None:
            return kvcache.Engine._sample(logits, *args)
        return torch.tensor([self.script(r.result.prompt, len(r.result.tokens)) for r in self._running])


def scripted_token(prompt, step: int) -> int:
    """A token that depends only on the request and the step; EOS now and then (an early finish)."""
    h = hash((tuple(prompt), step)) & 0xFFFFFFFF
    return EOS if step and h % 11 == 0 else 1 + h % (VOCAB - 1)


# (id, kv_format, residual_length, residual_sink_tokens); None = the model's dtype (float32)
ENGINE_FORMATS = [
    ("model-dtype", None, None, 0),
    ("bf16", "bf16", None, 0),
    ("fp16", "fp16", None, 0),
    ("int8", "int8", 0, 0),
    ("int8-window", "int8", 8, 0),
    ("int8-hadamard", "int8(hadamard)", 0, 0),
    # fp8 with a given scale (this model's K/V stay within +-8): without one a pool takes its scale from the
    # first tokens written, which in a shared pool are another request's (the PagedCache soak covers that)
    ("fp8_e4m3", "fp8_e4m3(scale=0.025)", 0, 0),
    ("fp8_e5m2-window-sinks", "fp8_e5m2(scale=0.0002)", 8, 4),
    ("int4", "int4", 0, 0),
    ("int4-hadamard-window", "int4(hadamard)", 6, 0),
    ("k=int8,v=int4", "k=int8,v=int4", 0, 0),
    ("kivi4-window", "kivi4", 8, 0),
    ("kivi2", "kivi2", 0, 0),
    ("kivi2-window-sinks", "kivi2", 12, 4),
]
CAPACITY = 96  # tokens in the soak's pool (24 pages): a few requests at a time


def soak_requests(request, default: int) -> int:
    """Requests per case: ``default``, x10 with ``--soak-long``, or KVCACHE_SOAK_STEPS."""
    if os.environ.get("KVCACHE_SOAK_STEPS"):
        return int(os.environ["KVCACHE_SOAK_STEPS"])
    return default * (10 if request.config.getoption("--soak-long") else 1)


def random_prompts(rng: random.Random, systems: list[list[int]], n: int) -> list[list[int]]:
    prompts = []
    for _ in range(n):
        r = rng.random()
        if r < 0.04:    # longer than the whole pool: fails alone too
            p = [rng.randrange(1, VOCAB) for _ in range(CAPACITY + rng.randrange(1, 20))]
        elif r < 0.7:   # a shared system prompt (a prefix hit once it is cached), maybe cut inside a page
            s = rng.choice(systems)
            p = s[: rng.randrange(1, len(s) + 1)] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 12))]
        else:
            p = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))]
        prompts.append(p)
    return prompts


def assert_no_leak(engine) -> None:
    """Between generate calls the only blocks in use are the prefix cache's, and nothing is locked."""
    alloc, tree = engine.store.allocator, engine.store.prefix_cache
    s = tree.stats()
    assert alloc.num_blocks - alloc.num_free == s["device_blocks"]
    assert alloc.stats()["references"] == s["device_block_refs"]
    assert s["locked_nodes"] == 0


@pytest.mark.parametrize("name, kv_format, residual, sinks", ENGINE_FORMATS, ids=[f[0] for f in ENGINE_FORMATS])
def test_engine_soak(model, request, name, kv_format, residual, sinks):
    n_requests = soak_requests(request, 50)
    seed = sum(map(ord, name))
    rng = random.Random(seed)
    exact = kv_format is None  # the model's dtype: greedy tokens compared exactly
    kw = dict(kv_format=kv_format, residual_length=residual, residual_sink_tokens=sinks, page_size=PAGE)
    engine = RecordingEngine(model, prefix_cache=True, max_tokens=CAPACITY, **kw)
    if not exact:
        engine.script = scripted_token
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 48))] for _ in range(6)]
    alone_cache: dict = {}

    def alone(prompt, max_new, fmt_kw):
        """The request alone, in a fresh engine with an unbounded pool and no prefix cache."""
        key = (tuple(prompt), max_new, tuple(sorted(fmt_kw.items())))
        if key not in alone_cache:
            e = RecordingEngine(model, prefix_cache=False, **fmt_kw)
            e.script = engine.script
            alone_cache[key] = e.generate([prompt], max_new_tokens=max_new, eos_token_id=EOS)[0]
        return alone_cache[key]

    def never_fits(prompt, max_new):  # more pages than the pool, even alone: refused before any work
        return -(-(len(prompt) + max_new - 1) // PAGE) > CAPACITY // PAGE

    events, diffs, errors = Counter(), [], []  # errors: the format's own error (vs full precision) per request
    done, batches = 0, 0
    while done < n_requests:
        prompts = random_prompts(rng, systems, rng.randrange(1, 9))
        max_new = rng.randrange(1, 7)
        engine.max_batch = rng.randrange(1, 7)
        if batches == 0:  # whatever the seed: one request longer than the whole pool...
            prompts[rng.randrange(len(prompts))] = [rng.randrange(1, VOCAB) for _ in range(CAPACITY + 1)]
        elif batches == 1:  # ...and six that fit one by one but not together (the engine preempts)
            prompts = [[rng.randrange(1, VOCAB) for _ in range(24)] for _ in range(6)]
            engine.max_batch = 6
        batches += 1
        if any(never_fits(p, max_new) for p in prompts):
            before = engine.store.prefix_cache.stats()
            with pytest.raises(kvcache.OutOfBlocksError, match=r"prompts\[\d+\]: \d+ tokens \+ max_new_tokens"):
                engine.generate(prompts, max_new_tokens=max_new, eos_token_id=EOS)
            after = engine.store.prefix_cache.stats()  # refused before any work: not even a lookup
            assert (after["lookups"], after["nodes"]) == (before["lookups"], before["nodes"])
            events["refused"] += 1
            assert_no_leak(engine)
            kept = [not never_fits(p, max_new) for p in prompts]
            prompts = [p for p, k in zip(prompts, kept) if k]
            if not prompts:
                continue
        # every request fits alone, so all of them finish, however the pool is shared
        results = engine.generate(prompts, max_new_tokens=max_new, eos_token_id=EOS)
        events["preemptions"] += engine.stats()["preemptions"]
        events["recomputed_tokens"] += engine.stats()["recomputed_tokens"]
        assert sum(r.preemptions for r in results) == engine.stats()["preemptions"]
        assert_no_leak(engine)
        for p, r in zip(prompts, results):
            done += 1
            events["prefix_hits"] += r.cached_tokens > 0
            events["preempted_requests"] += r.preemptions > 0
            ref = alone(p, max_new, kw)
            assert r.tokens == ref.tokens, f"seed {seed}: tokens of a {len(p)}-token prompt differ from it run alone"
            got, want = torch.stack(r.logits), torch.stack(ref.logits)
            diffs.append((got - want).abs().max().item())
            if not exact:
                full = alone(p, max_new, dict(page_size=PAGE))  # the same tokens, pages in full precision
                errors.append((want - torch.stack(full.logits)).abs().max().item())
        if rng.random() < 0.1:
            engine.store.prefix_cache.check()

    tree = engine.store.prefix_cache
    s = tree.stats()
    same = sum(d <= 1e-3 for d in diffs) / len(diffs)
    print(f"{name}: {done} requests, {dict(events)}, evicted {s['evicted_blocks']} blocks, max logit diff "
          f"{max(diffs):.3g}, {same:.0%} within 1e-3" + (f", format error {max(errors):.3g}" if errors else ""))
    assert events["preempted_requests"] >= 1 and events["refused"] >= 1 and events["prefix_hits"] >= 5, events
    assert s["evicted_blocks"] >= 1
    if exact:
        # Batching and prefix hits change the shapes of the matrix products, so float32 logits may move
        # in their last bits; the tokens above are compared exactly.
        assert max(diffs) <= 1e-4, f"seed {seed}: logits differ by {max(diffs):.3g} from the request alone"
    else:
        # Within the format's tolerance: at most twice its own error (the largest logit difference between
        # its pages and full-precision pages over these requests), as the two runs may round the same values
        # differently: float noise from other batch shapes flips a code now and then, and a prefix hit reads
        # pages that an earlier request sealed (quantized) where the request alone has them in full precision
        # (its prefill never attends to itself quantized).
        tol = 2 * max(errors) + 1e-4
        assert max(diffs) <= tol, f"seed {seed}: logits differ by {max(diffs):.3g} > {tol:.3g} from the request alone"
        # Those are the exceptions: 4-bit and 2-bit errors are as large as a wrong page's, so most requests
        # must match the request alone to float noise.
        assert same >= 0.5, f"seed {seed}: only {same:.0%} of the requests match the request alone"
    tree.check()
    tree.clear()
    alloc = engine.store.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.stats()["references"] == 0
    assert tree.stats()["nodes"] == 0


# ---- PagedCache, driven directly -------------------------------------------------------------------
LAYERS, HEADS, DIM, TABLE = 2, 2, 32, 1021
CACHE_CAPACITY = 32  # pages of 4 tokens: a few requests of up to ~40 tokens at a time


class Request:
    """One PagedCache of the soak's shared store, and the same request alone (``ref``: a fresh PagedCache
    with an unbounded pool) driven in lockstep. ``rows`` are the token ids each row holds; the K/V at a
    position is ``values[layer][hash of the row's tokens up to there]``, so it depends on the whole prefix."""

    def __init__(self, cache, ref, rows):
        self.cache, self.ref, self.rows = cache, ref, rows

    @staticmethod
    def hashes(tokens):
        h, out = 7, []
        for t in tokens:
            h = (h * 31 + t + 1) % 1_000_003
            out.append(h % TABLE)
        return out


@pytest.fixture(scope="module")
def values():
    g = torch.Generator().manual_seed(3)
    return torch.randn(LAYERS, 2, TABLE, HEADS, DIM, generator=g)  # [layer, k/v, hash, head, dim]


def kv_of(values, layer: int, rows, start: int, end: int):
    """K and V [batch, heads, end - start, dim] of the rows' positions [start, end)."""
    idx = torch.tensor([Request.hashes(r[:end])[start:] for r in rows])
    return tuple(values[layer, j][idx].permute(0, 2, 1, 3) for j in (0, 1))


# (id, kv_format, residual_length, residual_sink_tokens, host tier, error bound). The bound is the format's
# tolerance: the largest |stored - true| value seen in the default run, x1.5 (the values are drawn from a fixed
# N(0, 1) table, so longer runs see no larger ones). It holds the request alone to the truth, so that a bug
# shared by both runs is caught too, and the soak to the request alone within twice as much.
CACHE_FORMATS = [
    ("fp32", None, None, 0, False, 0.0),
    ("fp32-host-tier", None, None, 0, True, 0.0),
    ("fp16-host-tier", "fp16", None, 0, True, 0.004),
    ("bf16", "bf16", None, 0, False, 0.03),
    ("int8", "int8", 0, 0, False, 0.03),
    ("int8-window", "int8", 6, 0, False, 0.03),
    ("fp8_e4m3", "fp8_e4m3", 0, 0, False, 3.0),  # its scale comes from the first tokens: later ones saturate
    ("fp8_e5m2-window", "fp8_e5m2(scale=0.05)", 8, 4, False, 0.6),
    ("int4-hadamard", "int4(hadamard)", 0, 0, False, 0.7),
    ("k=int8,v=int4-window", "k=int8,v=int4", 8, 0, False, 0.35),
    ("kivi4-window", "kivi4", 8, 0, False, 0.35),
    ("kivi2", "kivi2", 0, 0, False, 2.1),
    ("kivi2-window-sinks", "kivi2", 8, 4, False, 2.1),
]


def soak_store(kv_format, residual, sinks, host_tier):
    """The soak's store: CACHE_CAPACITY pages with a prefix cache (and a host tier of twice as many pages)."""
    kw = dict(page_size=PAGE, kv_format=kv_format, residual_length=residual, residual_sink_tokens=sinks)
    if not host_tier:
        return kvcache.PagedStore(max_tokens=CACHE_CAPACITY * PAGE, prefix_cache=True, **kw)
    alloc = kvcache.BlockAllocator(CACHE_CAPACITY, PAGE)
    dtype = {None: torch.float32, "fp16": torch.float16}[kv_format]
    pools = {layer: kvcache.KVPool.allocate(CACHE_CAPACITY, PAGE, HEADS, DIM, dtype) for layer in range(LAYERS)}
    host = [kvcache.PageLayout(2 * CACHE_CAPACITY, PAGE, HEADS, DIM, dtype).allocate() for _ in range(LAYERS)]
    tree = kvcache.PrefixCache(alloc, host_pools=host, device_pools=[(p.k, p.v) for p in pools.values()])
    store = kvcache.PagedStore(prefix_cache=tree, **kw)
    store.pools.update(pools)  # the pages the host tier copies from and to (a fixed-size store never regrows them)
    return store


@pytest.mark.parametrize("name, kv_format, residual, sinks, host_tier, error_bound", CACHE_FORMATS,
                         ids=[f[0] for f in CACHE_FORMATS])
def test_paged_cache_soak(values, request, name, kv_format, residual, sinks, host_tier, error_bound):
    n_requests = soak_requests(request, 80)
    seed = sum(map(ord, name)) + 1
    rng = random.Random(seed)
    store = soak_store(kv_format, residual, sinks, host_tier)
    tree, alloc = store.prefix_cache, store.allocator
    fmt_kw = dict(page_size=PAGE, kv_format=kv_format, residual_length=residual, residual_sink_tokens=sinks)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 24))] for _ in range(4)]
    exact = kv_format is None
    # Formats whose soak output must equal the request alone bit for bit: each token is quantized alone, from
    # the same values. With residual pages a page may be sealed sooner in the soak (it is shared with another
    # request that let it age out), and fp8 without a given scale takes the pool's first tokens'.
    deterministic = residual is None or (residual == 0 and not sinks and "kivi" not in kv_format)
    deterministic = deterministic and not (kv_format or "").startswith("fp8_e4m3")
    events, diffs, errors, live, started, step = Counter(), [], [], [], 0, 0
    fork = None

    def check(req, outs):
        """The outputs (per layer: the dense K/V update returned) against the request alone and the truth."""
        length = len(req.rows[0])
        for layer, (got, want) in enumerate(outs):
            truth = kv_of(values, layer, req.rows, 0, length)
            for g, w, t in zip(got, want, truth):
                assert g.shape == t.shape, f"seed {seed} step {step}: shape {tuple(g.shape)} != {tuple(t.shape)}"
                if exact:
                    assert torch.equal(g, t) and torch.equal(w, t), f"seed {seed} step {step}: wrong K/V"
                    continue
                d = (g - w).abs().max().item() if g.numel() else 0.0
                if deterministic:
                    assert d == 0, f"seed {seed} step {step}: K/V differ by {d:.3g} from the request alone"
                diffs.append(d)
                errors.append((w - t).abs().max().item() if w.numel() else 0.0)

    def update(req, start, end):
        """Both caches take the rows' positions [start, end) (the soak cache from `start`, the rows' own)."""
        outs = [None] * LAYERS
        for layer in range(LAYERS):
            got = req.cache.update(*kv_of(values, layer, req.rows, req.skip, end), layer)
            want = req.ref.update(*kv_of(values, layer, req.rows, start, end), layer)
            outs[layer] = (got, want)
        req.skip = end
        check(req, outs)

    def drop(req):
        req.cache.free()
        req.ref.free()
        live.remove(req)

    def start_request():
        nonlocal started
        batch = rng.choice([1, 1, 1, 2, 3])
        if started == 1:  # whatever the seed: one request larger than the pool
            batch, rows = 3, [[rng.randrange(1, VOCAB) for _ in range(CACHE_CAPACITY * PAGE // 2)] for _ in range(3)]
        elif batch == 1 and rng.random() < 0.8:
            s = rng.choice(systems)
            rows = [s[: rng.randrange(1, len(s) + 1)] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 8))]]
        else:
            n = rng.randrange(1, 20)
            rows = [[rng.randrange(1, VOCAB) for _ in range(n)] for _ in range(batch)]
        started += 1
        req = Request(kvcache.PagedCache(store=store, num_layers=LAYERS),
                      kvcache.PagedCache(num_layers=LAYERS, **fmt_kw), rows)
        req.skip = req.cache.load_prefix(torch.tensor(rows[0])) if batch == 1 else 0
        events["prefix_hits"] += req.skip > 0
        live.append(req)
        update(req, 0, len(rows[0]))

    while started < n_requests or live:
        step += 1
        req = None
        try:
            if started < n_requests and (not live or (len(live) < 4 and rng.random() < 0.3)):
                start_request()
                continue
            req = rng.choice(live)
            op, length = rng.random(), len(req.rows[0])
            if op < 0.45:                                    # decode / extend every row
                n = rng.randrange(1, 5)
                for r in req.rows:
                    r += [rng.randrange(1, VOCAB) for _ in range(n)]
                update(req, length, length + n)
            elif op < 0.55 and length > 1:                   # crop (speculative decoding's rejection)
                n = rng.randrange(1, min(length, 6))
                req.cache.crop(-n)
                req.ref.crop(-n)
                req.rows = [r[:-n] for r in req.rows]
                req.skip = length - n
            elif op < 0.65:                                  # beam reorder: rows copied, shared copy-on-write
                beams = [rng.randrange(len(req.rows)) for _ in req.rows]
                req.cache.reorder_cache(torch.tensor(beams))
                req.ref.reorder_cache(torch.tensor(beams))
                req.rows = [list(req.rows[b]) for b in beams]
            elif op < 0.7 and len(req.rows) <= 2:            # num_return_sequences
                req.cache.batch_repeat_interleave(2)
                req.ref.batch_repeat_interleave(2)
                req.rows = [list(r) for r in req.rows for _ in range(2)]
            elif op < 0.78 and len(live) < 5:                # fork (copy.deepcopy): pages shared copy-on-write
                fork = Request(copy.deepcopy(req.cache), copy.deepcopy(req.ref), [list(r) for r in req.rows])
                fork.skip = req.skip
                live.append(fork)
                events["forks"] += 1
            elif op < 0.88:                                  # cache a row's tokens for later requests
                row = rng.randrange(len(req.rows))
                req.cache.save_prefix(torch.tensor(req.rows[row]), row)
            else:                                            # finished: its first row cached, as an Engine does
                req.cache.save_prefix(torch.tensor(req.rows[0]), 0)
                drop(req)
        except kvcache.OutOfBlocksError:
            events["out_of_blocks"] += 1
            drop(req or live[-1])  # the request that asked for the blocks fails (a new one is the last)
        if step % 50 == 0:
            tree.check()

    s = tree.stats()
    print(f"{name}: {started} requests, {step} steps, {dict(events)}, evicted {s['evicted_blocks']} blocks, "
          f"demoted {s['demoted_blocks']}, loaded {s['loaded_blocks']}"
          + (f", max K/V diff {max(diffs):.3g}, format error {max(errors):.3g}" if diffs else ""))
    assert events["out_of_blocks"] >= 1 and events["prefix_hits"] >= 3 and events["forks"] >= 5, events
    assert s["evicted_blocks"] >= 1
    if host_tier:
        assert s["demoted_blocks"] >= 1 and s["loaded_blocks"] >= 1
    if diffs:  # within the format's tolerance
        assert max(errors) <= error_bound, f"seed {seed}: the request alone is {max(errors):.3g} off the true K/V"
        assert max(diffs) <= 2 * error_bound, f"seed {seed}: K/V differ by {max(diffs):.3g} from the request alone"
    tree.check()
    assert s["locked_nodes"] == 0
    assert alloc.num_blocks - alloc.num_free == s["device_blocks"]  # every request gave its pages back
    tree.clear()  # to the host tier, if there is one: it keeps what it holds until the cache goes
    assert alloc.num_free == alloc.num_blocks and alloc.stats()["references"] == 0
    if host_tier:
        host = tree.host_allocator
        assert host.num_blocks - host.num_free == tree.stats()["host_blocks"] > 0
        del tree, store, req, fork, live  # the last PagedCache objects, which hold the store and so the tree
        gc.collect()
        assert host.num_free == host.num_blocks and host.stats()["references"] == 0
