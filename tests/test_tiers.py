"""Prefix tiers beyond one process (kvcache.tiers): chunk identity, blobs, the disk tier and a real Redis
server on 127.0.0.1 (started here), including two worker processes and the server failing under them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import kvcache  # noqa: E402
from kvcache import tiers  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from tiers_support import CHUNK, PAGE, PREFIX_TOKENS, prompts, tiny_model  # noqa: E402

HERE = Path(__file__).parent
FIRST, SECOND = prompts(2, 1), prompts(3, 2)  # worker A's prompts, then worker B's (same prefix)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    """SECOND's tokens with no cache (full precision) and with a local-only cache that saw FIRST (int8)."""
    out = {"None": [r.tokens for r in kvcache.Engine(model, page_size=PAGE, prefix_cache=False)
                    .generate(SECOND, max_new_tokens=4)]}
    local = kvcache.Engine(model, kv_format="int8", page_size=PAGE)
    local.generate(FIRST, max_new_tokens=4)
    out["int8"] = [r.tokens for r in local.generate(SECOND, max_new_tokens=4)]
    return out


@pytest.fixture
def server():
    s = RedisServer().start()
    yield s
    s.stop()  # SIGCONT first if a test left it paused


def _engine(model, **kw):
    kw.setdefault("page_size", PAGE)
    kw.setdefault("chunk_tokens", CHUNK)
    return kvcache.Engine(model, **kw)


def _warm(model, server, **kw):
    """Worker A in this process: FIRST's chunks written to the server."""
    a = _engine(model, remote=server.url, **kw)
    a.generate(FIRST, max_new_tokens=4)
    assert a.tiers.flush(10)
    a.close()
    return a


def _run_worker(args: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(HERE / "tiers_worker.py"), json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- identity and blobs ------------------------------------------------------------------------------
def test_chunk_keys_chain_blake2b_over_the_namespace():
    root = tiers.namespace_id({"model": "m"})
    toks = list(range(100))
    keys = tiers.chunk_keys(root, toks, chunk_tokens=32)
    assert len(keys) == 3
    prev = root  # recomputed from the definition in the README / docs/tiers.md
    for i, key in enumerate(keys):
        raw = torch.tensor(toks[i * 32:(i + 1) * 32], dtype=torch.int32).numpy().tobytes()
        prev = __import__("hashlib").blake2b(prev + raw, digest_size=16, person=b"kvcache-chunk").digest()
        assert key == prev
    other = tiers.chunk_keys(tiers.namespace_id({"model": "m", "salt": "x"}), toks, chunk_tokens=32)
    assert not set(keys) & set(other)
    changed = tiers.chunk_keys(root, [99] + toks[1:], chunk_tokens=32)  # same tokens after the first chunk
    assert changed[0] != keys[0] and changed[1] != keys[1]  # the chain carries the difference


def test_namespace_id_separates_everything_that_changes_kv(model, tmp_path):
    ids = set()
    for kw in ({}, {"kv_format": "int8"}, {"kv_format": "int8(hadamard)"}, {"kv_format": "k=int8,v=fp8_e4m3"},
               {"kv_format": "int8", "residual_length": 0}, {"page_size": 32},
               {"namespace": kvcache.Namespace(model="LlamaForCausalLM", salt="u")},
               {"namespace": kvcache.Namespace(model="LlamaForCausalLM", revision="r2")}):
        e = _engine(model, disk=tmp_path, **kw)
        ids.add(e.tiers.ns)
        e.close()
    assert len(ids) == 8


def _blob_engine(model, tmp_path):
    e = _engine(model, kv_format="int8", disk=tmp_path / "tier")
    e.generate(FIRST, max_new_tokens=4)
    assert e.tiers.flush(10)
    return e


def test_blob_round_trip_and_every_check(model, tmp_path):
    e = _blob_engine(model, tmp_path)
    t = e.tiers
    keys = t.chain(FIRST[0])
    blob = (tmp_path / "tier" / t.ns.hex() / f"{keys[1].hex()}.kvc").read_bytes()
    toks = FIRST[0][CHUNK:2 * CHUNK]
    header = tiers.peek_header(blob)
    assert header["tokens"] == CHUNK and header["k_format"] == "int8" and len(header["pages"]) == CHUNK // PAGE
    pages, tensors = tiers.decode_blob(blob, ns=t.ns, key=keys[1], tokens=toks, meta=t.meta,
                                       expect_tensors=t._expected_tensors)
    assert tensors["0.k"].dtype == torch.int8 and tensors["0.k_scale"].dtype == torch.float32  # as stored
    # the codes are the pool's own (not dequantized and re-quantized)
    blocks = e.store.prefix_cache.match(FIRST[0], e.namespace).blocks
    sealed = [b for b, p in zip(blocks[2:4].tolist(), pages) if p == "S"]
    if sealed:
        assert torch.equal(tensors["0.k"][:len(sealed)], e.store.pools[0].k[sealed])

    def check(bad, reason, **kw):
        args = dict(ns=t.ns, key=keys[1], tokens=toks, meta=t.meta, expect_tensors=t._expected_tensors) | kw
        with pytest.raises(tiers.BlobError) as err:
            tiers.decode_blob(bad, **args)
        assert err.value.reason == reason

    flipped = bytearray(blob)
    flipped[-5] ^= 0x40
    check(bytes(flipped), "checksum")
    check(blob[:-7], "truncated")
    check(blob[:20], "truncated")
    check(b"X" + blob[1:], "magic")
    check(blob, "namespace", ns=bytes(16))
    check(blob, "key", key=keys[0])
    check(blob, "collision", tokens=[t + 1 for t in toks])
    check(blob, "layout", meta=dict(t.meta, k_format="int4"))
    e.close()


# ---- disk -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker_b(model, tmp_path_factory):
    """Worker A (this process) generates FIRST with both tiers and closes; then worker B, another process,
    generates SECOND with Redis only, and then, as if restarted, with the disk only."""
    server = RedisServer().start()
    disk = tmp_path_factory.mktemp("tiers") / "disk"
    try:
        written = {}
        for fmt in (None, "int8"):
            a = _engine(model, kv_format=fmt, remote=server.url, disk=disk)
            a.generate(FIRST, max_new_tokens=4)
            a.close()
            written[str(fmt)] = a.stats()["tiers"]
        phases = _run_worker({"phases": [{"remote": server.url}, {"disk": str(disk)}], "formats": [None, "int8"],
                              "seed": 3, "n": 2})
        yield disk, written, phases
    finally:
        server.stop()


def _check_worker(r: dict, hit: str, reference: list) -> None:
    assert r[hit] == PREFIX_TOKENS, r
    # only the suffixes are prefilled: the prefix came from the tier, the second prompt reuses the first's
    assert r["prefill_tokens"] == r["prompt_tokens"] - PREFIX_TOKENS - _local_hits(SECOND), r
    assert r["tokens"] == reference
    assert r["bad_blobs"] == 0


def test_two_processes_share_prefixes_through_redis(worker_b, reference):
    _, written, (remote, _) = worker_b
    for fmt in ("None", "int8"):
        assert written[fmt]["remote_written_chunks"] >= PREFIX_TOKENS // CHUNK
        _check_worker(remote[fmt], "remote_hit_tokens", reference[fmt])


def test_disk_tier_survives_a_restart_in_another_process(worker_b, reference):
    disk, written, (_, restarted) = worker_b
    assert not list(disk.glob("*/.tmp-*"))  # atomic writes left no temporary files
    assert len(list(disk.glob("*/namespace.json"))) == 2  # one description per namespace
    for fmt in ("None", "int8"):
        assert written[fmt]["disk_written_chunks"] >= PREFIX_TOKENS // CHUNK
        _check_worker(restarted[fmt], "disk_hit_tokens", reference[fmt])


def _local_hits(prompts_):
    """Tokens the later prompts of a batch reuse from the first one's (longest common prefix, minus one)."""
    first = prompts_[0]
    total = 0
    for p in prompts_[1:]:
        n = 0
        while n < min(len(p) - 1, len(first)) and p[n] == first[n]:
            n += 1
        total += n
    return total


def test_disk_tier_is_bounded_lru(tmp_path):
    d = kvcache.DiskTier(tmp_path, max_bytes=10_000)
    ns = bytes(16)
    for i in range(6):
        d.put(ns, bytes([i]) * 16, bytes(3000))
        time.sleep(0.01)
        d.fetch(ns, [bytes([0]) * 16])  # key 0 stays the most recently used
    d.trim()
    assert d.nbytes <= 10_000
    assert d.lookup(ns, [bytes([0]) * 16]) == [3000]  # recently read: kept
    assert d.lookup(ns, [bytes([1]) * 16]) == []      # oldest: evicted
    with pytest.raises(ValueError, match="max_bytes=0"):
        kvcache.DiskTier(tmp_path, max_bytes=0)


# ---- redis: two processes ---------------------------------------------------------------------------
# ---- redis: faults ----------------------------------------------------------------------------------
def _tokens(engine, ps=SECOND):
    return [r.tokens for r in engine.generate(ps, max_new_tokens=4)]


def test_server_killed_mid_run(model, server, reference):
    _warm(model, server)
    b = _engine(model, remote=kvcache.RedisTier(server.url, timeout=0.3, breaker_s=60))
    server.kill()
    t0 = time.perf_counter()
    assert _tokens(b) == reference["None"]
    assert time.perf_counter() - t0 < 20
    s = b.stats()
    assert s["remote_hit_tokens"] == 0 and s["remote_errors"] == 1
    assert s["tiers"]["remote_breaker_open"] and s["tiers"]["remote_breaker_trips"] == 1
    assert b.tiers.flush(5)  # the chunks it tried to write were dropped by the open breaker, quickly
    assert b.stats()["tiers"]["remote_skipped_calls"] >= 1
    b.close()


def test_server_paused_calls_time_out(model, server, reference):
    _warm(model, server)
    timeout = 0.3
    b = _engine(model, remote=kvcache.RedisTier(server.url, timeout=timeout, breaker_s=60))
    server.pause()
    try:
        t0 = time.perf_counter()
        assert _tokens(b) == reference["None"]
        s = b.stats()
        # one lookup waited for its timeout, then the breaker stopped every further call
        assert s["remote_fetch_s"] < 4 * timeout
        assert s["remote_errors"] == 1 and s["tiers"]["remote_breaker_open"]
        assert b.tiers.flush(4 * timeout)
        assert time.perf_counter() - t0 < 30
    finally:
        server.resume()
    b.close()


def test_server_restarted_empty(model, server, reference):
    _warm(model, server)
    b = _engine(model, remote=kvcache.RedisTier(server.url, timeout=0.3, breaker_s=0.2))
    server.restart()
    time.sleep(0.05)
    assert _tokens(b) == reference["None"]
    s = b.stats()
    assert s["remote_hit_tokens"] == 0 and s["bad_blobs"] == 0
    assert b.tiers.flush(10)
    assert b.stats()["tiers"]["remote_written_chunks"] >= PREFIX_TOKENS // CHUNK  # it fills the new server
    b.close()


def test_server_at_its_memory_cap_evicts_inside_a_chain(model, reference):
    server = RedisServer(maxmemory="2mb").start()
    try:
        a = _warm(model, server)
        keys = [a.tiers.remote._key(a.tiers.ns, k) for k in a.tiers.chain(FIRST[0])]
        c = server.client()
        i = 0
        while all(c.exists(k) for k in keys[:PREFIX_TOKENS // CHUNK]):
            c.get(keys[0])  # the chain's first chunk stays recently used
            c.set(f"junk{i}", bytes(64 << 10))
            i += 1
        present = next(n for n, k in enumerate(keys) if not c.exists(k))
        # the hole is made; the junk goes so that nothing more is evicted while worker B runs (Redis's LRU is
        # sampled: under the cap it may evict any chunk at any time), and B's calls get time on a busy host
        c.delete(*[f"junk{j}" for j in range(i)])
        assert all(c.exists(k) for k in keys[:present])
        b = _engine(model, remote=kvcache.RedisTier(server.url, timeout=5.0))
        assert _tokens(b) == reference["None"]
        s = b.stats()
        assert s["remote_hit_tokens"] == present * CHUNK, (s["remote_hit_tokens"], present)  # up to the hole
        assert s["bad_blobs"] == 0
        b.close()
    finally:
        server.stop()


@pytest.mark.parametrize("damage", ["checksum", "truncated", "namespace", "collision"])
def test_corrupt_blobs_are_misses(model, server, reference, damage):
    a = _warm(model, server)
    t = a.tiers
    c = server.client()
    keys = t.chain(FIRST[0])
    name = t.remote._key(t.ns, keys[2])
    blob = c.get(name)
    if damage == "checksum":
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 1
    elif damage == "truncated":
        bad = blob[: len(blob) // 2]
    elif damage == "namespace":  # a whole valid blob of another namespace (salt) under this key
        other = _engine(model, remote=server.url, namespace=kvcache.Namespace(model="m", salt="other"))
        other.generate(FIRST, max_new_tokens=1)
        assert other.tiers.flush(10)
        bad = c.get(other.tiers.remote._key(other.tiers.ns, other.tiers.chain(FIRST[0])[2]))
        other.close()
    else:  # a valid blob with this key and checksum but other tokens: what a hash collision would serve
        pages, tensors = tiers.decode_blob(blob, ns=t.ns, key=keys[2], tokens=FIRST[0][2 * CHUNK:3 * CHUNK],
                                           meta=t.meta, expect_tensors=t._expected_tensors)
        bad = tiers.encode_blob(t.ns, keys[2], [7] * CHUNK, pages, list(tensors.items()), t.meta)
    c.set(name, bytes(bad))
    b = _engine(model, remote=server.url)
    assert _tokens(b) == reference["None"]
    s = b.stats()
    assert s["remote_hit_tokens"] == 2 * CHUNK  # the chunks before the bad one
    assert s["bad_blobs"] == 1
    assert s["tiers"]["bad_blob_reasons"] == {damage: 1}
    b.close()  # its writes land: the bad blob was deleted, so the chunk b computed is written in its place
    assert c.get(name) not in (None, bytes(bad))
    again = _engine(model, remote=server.url)
    assert _tokens(again) == reference["None"]
    s = again.stats()
    assert s["bad_blobs"] == 0 and s["remote_hit_tokens"] == PREFIX_TOKENS // CHUNK * CHUNK  # the whole prefix
    again.close()


def test_a_bad_blob_on_disk_is_replaced(model, tmp_path, reference):
    a = _engine(model, disk=tmp_path)
    a.generate(FIRST, max_new_tokens=4)
    a.close()
    t = a.tiers
    target = t.disk._file(t.ns, t.chain(FIRST[0])[1])
    bad = bytearray(target.read_bytes())
    bad[len(bad) // 2] ^= 1
    target.write_bytes(bytes(bad))
    b = _engine(model, disk=tmp_path)
    assert _tokens(b) == reference["None"]
    assert b.stats()["bad_blobs"] == 1 and b.stats()["disk_hit_tokens"] == CHUNK
    b.close()  # its writes land
    assert target.read_bytes() != bytes(bad)  # deleted, and written again by b
    assert b.explain(SECOND[0])["disk_tokens"] == PREFIX_TOKENS // CHUNK * CHUNK
    c = _engine(model, disk=tmp_path)
    assert _tokens(c) == reference["None"]
    assert c.stats()["bad_blobs"] == 0 and c.stats()["disk_hit_tokens"] == PREFIX_TOKENS // CHUNK * CHUNK
    c.close()


def test_namespaces_never_share(model, server):
    _warm(model, server)
    for kw in ({"kv_format": "int8"}, {"namespace": kvcache.Namespace(model="another")},
               {"namespace": kvcache.Namespace(model="LlamaForCausalLM", salt="tenant-2")}):
        b = _engine(model, remote=server.url, **kw)
        b.generate(SECOND, max_new_tokens=1)
        s = b.stats()
        assert s["remote_hit_tokens"] == 0 and s["bad_blobs"] == 0, kw
        b.close()


def test_cost_model_declines_and_explain_says_where_a_prompt_diverged(model, server, reference):
    _warm(model, server)
    b = _engine(model, remote=kvcache.RedisTier(server.url))
    b.tiers.remote.cost.compute_s_per_token = 1e-12  # recomputing is "free": no fetch is worth it
    assert _tokens(b) == reference["None"]
    s = b.stats()
    assert s["remote_hit_tokens"] == 0 and s["declined_fetches"] >= 1 and s["declined_tokens"] >= PREFIX_TOKENS
    assert s["tiers"]["remote_cost_model"]["compute_s_per_token"] > 0
    turn = SECOND[0][:PREFIX_TOKENS + 1] + [5] * 40
    e = b.explain(turn)
    assert e["remote_tokens"] == PREFIX_TOKENS and e["diverged_at"] >= PREFIX_TOKENS
    b.close()


def test_write_queue_drops_instead_of_blocking(model, server):
    b = _engine(model, remote=server.url)
    b.tiers._queue.maxsize = 1
    answer = threading.Event()
    put = b.tiers.remote.put

    def put_when_answered(*args):  # a tier that does not answer: the writer thread waits in its first write
        answer.wait(60)
        return put(*args)

    # (a paused server is not enough: once a lookup times out the breaker opens, writes are skipped at once
    # and the queue drains, so whether anything is dropped would depend on the order of two threads)
    b.tiers.remote.put = put_when_answered
    t0 = time.perf_counter()
    try:
        b.generate(prompts(5, 3, prefix_seed=9), max_new_tokens=1)
        assert time.perf_counter() - t0 < 30  # generation went on while the writer waited
        assert b.stats()["tiers"]["dropped_writes"] >= 1
    finally:
        answer.set()
    b.close()


def test_bad_options(model, monkeypatch):
    with pytest.raises(ValueError, match="chunk_tokens=24 must be a positive multiple of page_size=16"):
        _engine(model, disk="/tmp/x", chunk_tokens=24)
    with pytest.raises(ValueError, match="chunk_tokens=0 must be a positive multiple of page_size=16"):
        _engine(model, disk="/tmp/x", chunk_tokens=0)  # not the default in disguise
    for bad in (10, 0):  # refused where it is given, also with no tier to use it (the docstring's rule)
        with pytest.raises(ValueError, match=f"chunk_tokens={bad} must be a positive multiple of page_size=16"):
            _engine(model, chunk_tokens=bad)
    alloc = kvcache.BlockAllocator(64, 16)
    for bad in (0, -16, 24):  # the tree's own tier options are checked when it is made
        with pytest.raises(ValueError, match=f"chunk_tokens={bad!r} must be a positive multiple of page_size=16"):
            kvcache.PrefixCache(alloc, disk="/tmp/x", chunk_tokens=bad)
    for bad in (32.0, True):  # (True was taken as 1, 32.0 refused as no multiple)
        with pytest.raises(TypeError, match=f"chunk_tokens={bad!r} must be an int"):
            kvcache.PrefixCache(alloc, disk="/tmp/x", chunk_tokens=bad)
    assert kvcache.PrefixCache(alloc, disk="/tmp/x", chunk_tokens=np.int64(32)).tier_options["chunk_tokens"] == 32
    # bad tier arguments, refused where they are given (nan timeouts crashed the first generate; ttl_s=0.5 became
    # an expiry of 0 that Redis refused on every write; disk="" was the current directory)
    for kw, err, match in ((dict(timeout=float("nan")), ValueError, r"timeout=nan must be a finite number of seconds"),
                           (dict(timeout=float("inf")), ValueError, r"timeout=inf must be a finite"),
                           (dict(breaker_s=float("nan")), ValueError, r"breaker_s=nan must be a finite"),
                           (dict(ttl_s=0), ValueError, r"ttl_s=0 must be a finite number of seconds, > 0"),
                           (dict(timeout="1"), TypeError, r"timeout='1' must be a number of seconds, not str")):
        with pytest.raises(err, match=match):
            kvcache.RedisTier("redis://127.0.0.1:1/0", **kw)
    assert kvcache.RedisTier("redis://127.0.0.1:1/0", ttl_s=0.5)._ttl_ms == 500
    for kw, err, match in ((dict(max_bytes=1.5), TypeError, r"max_bytes=1.5 must be an int"),
                           (dict(max_bytes=True), TypeError, r"max_bytes=True must be an int"),
                           (dict(path=""), ValueError, r"disk='' must be the path of a directory")):
        with pytest.raises(err, match=match):
            kvcache.DiskTier(**{"path": "/tmp/x", **kw})
    with pytest.raises(ValueError, match="remote='http://x' must be a redis:// URL"):
        _engine(model, remote="http://x")
    with pytest.raises(ValueError, match="need the prefix cache"):
        _engine(model, remote="redis://127.0.0.1:1/0", prefix_cache=False)
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"pip install kvcache\[redis\]"):
        kvcache.RedisTier("redis://127.0.0.1:1/0")


def test_prefix_cache_takes_the_tier_options(model, tmp_path, reference):
    alloc = kvcache.BlockAllocator(256, PAGE)
    with pytest.raises(ValueError, match="remote='http://x' must be a redis:// URL"):
        kvcache.PrefixCache(alloc, remote="http://x")
    warm = _engine(model, prefix_cache=kvcache.PrefixCache(kvcache.BlockAllocator(256, PAGE), disk=tmp_path,
                                                           chunk_tokens=CHUNK))
    warm.generate(FIRST, max_new_tokens=4)
    warm.close()
    cache = kvcache.PrefixCache(alloc, disk=tmp_path, chunk_tokens=CHUNK)
    e = kvcache.Engine(model, page_size=PAGE, prefix_cache=cache)
    assert _tokens(e) == reference["None"]
    assert cache.stats()["tiers"]["disk_hit_tokens"] == PREFIX_TOKENS
    e.close()


def test_an_engine_dropped_without_close_is_collected(model, tmp_path):
    import gc
    import weakref
    e = _engine(model, disk=tmp_path)
    e.generate(FIRST, max_new_tokens=1)
    assert e.tiers.flush(10)
    ref, thread = weakref.ref(e.tiers), e.tiers._worker
    del e
    gc.collect()
    assert ref() is None  # the writer thread holds no reference to its tiers (nor their pages)
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize("fmt", ["int4", "kivi2", "fp8_e4m3", "fp8_e4m3(scale=0.05)", "k=int8(hadamard),v=int4"])
def test_every_format_loads_the_stored_state(tmp_path, fmt):
    model = tiny_model(num_attention_heads=2, num_key_value_heads=1)  # head_dim 32, for the grouped formats
    local = _engine(model, kv_format=fmt)
    local.generate(FIRST, max_new_tokens=4)
    expected = _tokens(local)
    a = _engine(model, kv_format=fmt, disk=tmp_path)
    a.generate(FIRST, max_new_tokens=4)
    a.close()
    b = _engine(model, kv_format=fmt, disk=tmp_path)
    assert _tokens(b) == expected  # what a local-only cache gives after FIRST
    s = b.stats()
    assert s["disk_hit_tokens"] == PREFIX_TOKENS and s["bad_blobs"] == 0
    b.close()


# ---- fp8 scales ------------------------------------------------------------------------------------
def _prefix_kv(engine, tokens) -> list:
    """Every layer's K and V of the cached prefix ``tokens`` (whole pages), dequantized as attention reads them."""
    m = engine.store.prefix_cache.match(tokens, engine.namespace)
    pages = len(tokens) // PAGE
    assert m.length >= pages * PAGE, (m.length, len(tokens))
    table = m.blocks[:pages].to(torch.int32).view(1, -1)
    lens = torch.tensor([pages * PAGE], dtype=torch.int32)
    return [engine.store.pools[layer].gather(table, lens) for layer in sorted(engine.store.pools)]


def test_fp8_chunks_stored_under_other_scales_are_misses(model, tmp_path):
    """fp8 without a given scale takes each process's per-head scales from its first tokens. Worker A writes
    the chunks of X; worker B, whose scales came from another prompt, extends X by Y and writes Y's chunks
    under its own scales. A fresh worker C loading X + Y used to read every chunk with the first one's scales,
    so Y's K/V were wrong by B's scale over A's; now Y's first chunk is a miss and C computes it."""
    g = torch.Generator().manual_seed(11)
    X, Y = (torch.randint(3, 128, (2 * CHUNK,), generator=g).tolist() for _ in range(2))
    tail1, tail2 = [4, 5, 6], [7, 8, 9]  # Y[0] != tail1[0]: a local cache of X + tail1 matches X only
    Y[0] = 3
    Q = torch.randint(3, 128, (CHUNK + 5,), generator=g).tolist()
    kw = dict(kv_format="fp8_e4m3", residual_length=0)  # every page sealed: every chunk holds fp8 codes

    def worker(*ps, **extra):
        e = _engine(model, **kw, **extra)
        for p in ps:
            e.generate([p], max_new_tokens=2)
        return e

    a = worker(X + tail1, disk=tmp_path)
    a.close()
    b = worker(Q, disk=tmp_path)
    scales_a, scales_b = a.store.pools[0].k_scale, b.store.pools[0].k_scale
    assert not torch.equal(scales_a, scales_b)  # the premise: B's first prompt gave other scales
    # B's pools read with other scales than A's chunks: refused before anything is allocated or written
    before = [t.clone() for pool in b.store.pools.values() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale)]
    free = b.store.allocator.num_free
    assert b.tiers.fill(X + Y + tail2) == 0
    after = [t for pool in b.store.pools.values() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale)]
    assert all(torch.equal(x, y) for x, y in zip(before, after)) and b.store.allocator.num_free == free
    assert b.tiers.stats()["bad_blob_reasons"] == {"scales": 1}
    b.generate([X + Y + tail2], max_new_tokens=2)
    b.close()
    t = b.tiers
    keys = t.chain(X + Y)
    stored = [tiers.decode_blob(t.disk.fetch(t.ns, [keys[i]])[0], ns=t.ns, key=keys[i],
                                tokens=(X + Y)[i * CHUNK:(i + 1) * CHUNK], meta=t.meta,
                                expect_tensors=t._expected_tensors)[1]["0.k_scale"] for i in range(4)]
    assert torch.equal(stored[0], scales_a) and torch.equal(stored[1], scales_a)  # X's chunks: A's
    assert torch.equal(stored[2], scales_b) and torch.equal(stored[3], scales_b)  # Y's: B's (X's existed)

    c = worker(X + Y + tail2, disk=tmp_path)
    local = worker(X + tail1, X + Y + tail2)  # what C should hold: X as A computed it, Y computed under A's scales
    for layer, ((ck, cv), (lk, lv)) in enumerate(zip(_prefix_kv(c, X + Y), _prefix_kv(local, X + Y))):
        assert torch.equal(ck, lk) and torch.equal(cv, lv), f"layer {layer}: loaded K/V differ from computed"
    assert torch.equal(c.store.pools[0].k_scale, scales_a)
    s = c.stats()
    assert s["disk_hit_tokens"] == 2 * CHUNK  # X only
    assert s["tiers"]["bad_blob_reasons"] == {"scales": 1}
    assert len(t.disk.lookup(t.ns, keys)) == 4  # Y's first chunk kept: it is right for B's scales
    c.close()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "k=fp8_e5m2,v=int8"])
def test_a_chunk_of_open_pages_sets_no_fp8_scales(model, tmp_path, fmt):
    """A chunk of open pages only (the sink pages here) holds no fp8 codes, and the scales stored with it are
    whatever its writer's pool held, set or not. Worker 1, whose prompt sealed nothing, writes such a chunk 0;
    worker 2, whose scales came from another prompt, writes the chunks after it. A fresh reader used to take
    chunk 0's meaningless scales and read worker 2's codes with them; now the scales of the first chunk with a
    sealed page are taken."""
    kw = dict(kv_format=fmt, residual_length=CHUNK, residual_sink_tokens=CHUNK)  # a prompt's chunk 0: its sinks
    w1 = _engine(model, disk=tmp_path, **kw)
    w1.generate([FIRST[0][:CHUNK + 8]], max_new_tokens=2)  # sinks + 10 tokens in the window: nothing sealed
    w1.close()
    assert 0 not in w1.store.pools or not w1.store.pools[0]._scales_set["k"]
    other = prompts(7, 1, prefix_seed=7)  # seals pages: sets worker 2's scales

    def steps(e, *batches):
        return [[r.tokens for r in e.generate(b, max_new_tokens=4)] for b in batches][-1]

    w2 = _engine(model, disk=tmp_path, **kw)
    steps(w2, other, FIRST)
    w2.close()
    scales = w2.store.pools[0].k_scale
    t = w2.tiers
    keys = t.chain(FIRST[0])
    assert len(t.disk.lookup(t.ns, keys)) == PREFIX_TOKENS // CHUNK
    chunk0 = tiers.decode_blob(t.disk.fetch(t.ns, keys[:1])[0], ns=t.ns, key=keys[0], tokens=FIRST[0][:CHUNK],
                               meta=t.meta, expect_tensors=t._expected_tensors)
    assert chunk0[0] == "O" * (CHUNK // PAGE) and not torch.equal(chunk0[1]["0.k_scale"], scales)  # the premise
    expected = steps(_engine(model, **kw), other, FIRST, SECOND)  # the same pages, computed in one process
    r = _engine(model, disk=tmp_path, **kw)
    assert steps(r, SECOND) == expected
    assert torch.equal(r.store.pools[0].k_scale, scales)  # worker 2's, with which its codes were written
    s = r.stats()
    assert s["disk_hit_tokens"] == PREFIX_TOKENS and s["bad_blobs"] == 0
    r.close()


# ---- model identity ---------------------------------------------------------------------------------
def test_tiers_refuse_an_unnamed_model(tmp_path):
    """Two models made in code (no name_or_path) of one class were both keyed by the class name: sharing a
    disk directory or Redis, each loaded the other's K/V as its own. They are refused unless namespace= is given."""
    first, second = tiny_model(seed=0, name=""), tiny_model(seed=1, name="")  # other weights, same class
    cache = kvcache.PrefixCache(kvcache.BlockAllocator(256, PAGE), disk=tmp_path, chunk_tokens=CHUNK)
    for kw, arg in (({"disk": tmp_path}, f"disk={str(tmp_path)!r}"), ({"remote": "redis://127.0.0.1:1/0"}, "remote="),
                    ({"prefix_cache": cache}, f"disk={str(tmp_path)!r}")):
        for m in (first, second):
            with pytest.raises(ValueError, match=rf"^{re.escape(arg)}: this model has no name_or_path .* class name "
                                                 rf"'LlamaForCausalLM' alone.* pass namespace=kvcache\.Namespace"):
                _engine(m, **kw)
    assert cache.store is None  # refused before the cache was bound
    assert not list(tmp_path.glob("*/*.kvc"))
    # named by the user, each finds its own chunks only
    expected = {i: _tokens(_engine(m, prefix_cache=False)) for i, m in enumerate((first, second))}
    for i, m in enumerate((first, second)):
        w = _engine(m, disk=tmp_path, namespace=kvcache.Namespace(model=f"tiny-{i}"))
        w.generate(FIRST, max_new_tokens=4)
        w.close()
    for i, m in enumerate((first, second)):
        e = _engine(m, prefix_cache=cache if i == 0 else True, disk=None if i == 0 else tmp_path,
                    namespace=kvcache.Namespace(model=f"tiny-{i}"))
        assert _tokens(e) == expected[i]
        assert e.stats()["disk_hit_tokens"] == PREFIX_TOKENS and e.stats()["bad_blobs"] == 0
        e.close()


def test_tiers_of_engines_sharing_a_store_keep_their_namespaces(model, tmp_path, reference):
    """Two Engines over one PrefixCache (one store), other models: the second sets store.namespace to its own,
    and the first one's tiers inserted the chunks they fetched under it, where they were the second model's hits
    (and no hits for the first)."""
    other = tiny_model(seed=1)
    w = _engine(model, disk=tmp_path)
    w.generate(FIRST, max_new_tokens=4)
    w.close()
    cache = kvcache.PrefixCache(kvcache.BlockAllocator(512, PAGE), disk=tmp_path, chunk_tokens=CHUNK)
    first = kvcache.Engine(model, page_size=PAGE, prefix_cache=cache)
    second = kvcache.Engine(other, page_size=PAGE, prefix_cache=cache)
    assert _tokens(first) == reference["None"]
    s = first.stats()
    assert s["disk_hit_tokens"] == PREFIX_TOKENS
    assert s["prefill_tokens"] == s["prompt_tokens"] - PREFIX_TOKENS - _local_hits(SECOND)  # the hits were used
    expected = _tokens(_engine(other, prefix_cache=False))
    assert _tokens(second) == expected
    s = second.stats()
    assert s["disk_hit_tokens"] == 0 and s["prefix_hit_tokens"] == _local_hits(SECOND)  # none of the first's
    first.close()
    second.close()


def test_a_bounded_pool_fetches_each_chunk_once(model, tmp_path):
    """Three long prompts on disk, read back by an engine whose pool holds about one of them: each chunk is
    read once and every chunk loaded is used. A batch's fills evicted each other's freshly loaded chunks
    (a pool of 640 tokens read 27 chunks 180 times, counting 4,608 'hit' tokens of 1,800 prompt tokens),
    and chunks were read for a pool with no room for them."""
    import collections
    g = torch.Generator().manual_seed(4)
    big = [torch.randint(3, 128, (600,), generator=g).tolist() for _ in range(3)]
    writer = _engine(model, disk=tmp_path)
    ref = [r.tokens for r in writer.generate(big, max_new_tokens=2)]
    writer.close()

    class CountingDisk(kvcache.DiskTier):
        def fetch(self, ns, keys):
            self.fetched.update(keys)
            return super().fetch(ns, keys)

    chunks = 3 * (599 // CHUNK)
    for max_tokens in (640, 1300, None):
        disk = CountingDisk(tmp_path)
        disk.fetched = collections.Counter()
        reader = _engine(model, disk=disk, max_tokens=max_tokens, max_batch=3)
        out = reader.generate(big, max_new_tokens=2)
        reader.close()
        s = reader.stats()
        assert len(disk.fetched) == chunks and max(disk.fetched.values()) == 1, (max_tokens, disk.fetched)
        assert s["disk_hit_tokens"] == chunks * CHUNK <= s["prompt_tokens"], (max_tokens, s)
        assert [r.tokens for r in out] == ref


def test_a_disk_budget_smaller_than_a_chain_keeps_its_head(model, tmp_path):
    """Lookups read a chain from its first chunk, so the LRU must drop a chain's tail first: with a budget of
    about half a prompt's chunks, the first half stays and is read back. (Every chunk was stamped with its
    write or read time in chain order, so the head was the oldest and went first: 0 tokens from disk.)"""
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(3, 128, (10 * CHUNK + 5,), generator=g).tolist()
    whole = _engine(model, disk=tmp_path / "whole")
    whole.generate([prompt], max_new_tokens=2)
    whole.close()
    size = max(f.stat().st_size for f in (tmp_path / "whole").glob("*/*.kvc"))
    budget = 5 * size + size // 2
    for _ in range(2):  # written once under the budget, then read (and re-stamped) and written again
        e = _engine(model, disk=kvcache.DiskTier(tmp_path / "small", max_bytes=budget))
        e.generate([prompt], max_new_tokens=2)
        e.close()
        assert len(list((tmp_path / "small").glob("*/*.kvc"))) == 5
        reader = _engine(model, disk=kvcache.DiskTier(tmp_path / "small", max_bytes=budget))
        assert reader.explain(prompt)["disk_tokens"] == 5 * CHUNK
        reader.close()


def test_a_foreign_value_at_a_chunk_key_is_a_miss_there_and_is_deleted(model, server):
    """Something else's list at chunk 3's key: the chunks before it still hit, the key is deleted (the next
    write of the chunk replaces it), and nothing else counts as an error. (STRLEN's WRONGTYPE failed the
    whole pipelined lookup: every later lookup was a miss, one remote error each, and the key stayed.)"""
    a = _engine(model, remote=server.url)
    a.generate(FIRST, max_new_tokens=2)
    a.close()
    b = _engine(model, remote=server.url)
    keys = b.tiers.chain(FIRST[0])
    name = b.tiers.remote._key(b.tiers.ns, keys[3])
    client = server.client()
    client.delete(name)
    client.rpush(name, b"not a blob")
    assert b.explain(FIRST[0])["remote_tokens"] == 3 * CHUNK
    s = b.stats()["tiers"]
    assert not client.exists(name) and s["remote_foreign_keys"] == 1 and "WRONGTYPE" in s["remote_last_error"]
    assert s["remote_errors"] == 0 and not s["remote_breaker_open"]
    b.generate(FIRST, max_new_tokens=2)
    b.close()
    assert client.strlen(name) > 0  # written again
    client.close()


def test_the_same_engine_writes_again_what_the_server_lost(model, server):
    """Regression: chunks an engine once wrote or read were remembered as on the server for good, so after their
    TTL expired (or a bad blob was deleted) that engine never wrote them again and stopped sharing the prefix."""
    prompt = FIRST[0]
    ttl = 3.0  # (long enough that a loaded CI host does not see keys expire between the write and the count)
    a = _engine(model, remote=kvcache.RedisTier(server.url, ttl_s=ttl))
    client = server.client()
    chunk_keys = lambda: [k for k in client.keys("kvcache:*") if not k.endswith(b":namespace")]  # noqa: E731
    a.generate([prompt], max_new_tokens=2)
    assert a.tiers.flush(10)
    held = len(chunk_keys())
    assert held == len(prompt) // CHUNK
    deadline = time.monotonic() + ttl + 5
    while chunk_keys() and time.monotonic() < deadline:  # expired on the server
        time.sleep(0.1)
    assert chunk_keys() == []
    a.store.prefix_cache.clear()                  # computed again (nothing local, nothing remote)
    a.generate([prompt], max_new_tokens=2)
    assert a.tiers.flush(10) and len(chunk_keys()) == held
    a.close()
    b = _engine(model, remote=server.url)         # (the default TTL: nothing expires while it repairs)
    b.generate([prompt], max_new_tokens=2)
    assert b.tiers.flush(10)
    for key in chunk_keys():                      # bad blobs: found at the next lookup, deleted, written again
        client.set(key, b"garbage")
    for _ in range(held + 1):                     # (a lookup reads a chain up to its first bad blob: one a round)
        b.store.prefix_cache.clear()
        b.generate([prompt], max_new_tokens=2)
        assert b.tiers.flush(10)
    assert b.stats()["tiers"]["bad_blobs"] >= 1
    assert all(client.get(k).startswith(b"KVCHUNK") for k in chunk_keys()) and len(chunk_keys()) == held
    b.close()
    client.close()


def test_a_redis_that_refuses_the_client_warns_once_and_says_why(model, server):
    """A database index the server does not have (or a wrong password) fails every call alike: one
    RuntimeWarning naming the server without its password, and the reason in stats; generation goes on."""
    url = server.url.replace("redis://", "redis://:topsecret@")[:-1] + "99"  # db 99 of 16
    e = _engine(model, remote=url)
    with pytest.warns(RuntimeWarning, match=r"refuses this client .*DB index") as caught:
        out = e.generate(FIRST, max_new_tokens=2)
    assert len([w for w in caught if "refuses" in str(w.message)]) == 1
    assert "topsecret" not in str(caught[0].message) and ":***@" in str(caught[0].message)
    s = e.stats()["tiers"]
    assert "DB index" in s["remote_last_error"] and s["remote_errors"] >= 1
    e.close()
    assert [r.tokens for r in out] == [r.tokens for r in _engine(model).generate(FIRST, max_new_tokens=2)]
