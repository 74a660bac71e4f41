"""Prefix tiers beyond one process: a disk directory and a shared Redis store of KV chunks.

A prompt is cut into chunks of ``chunk_tokens`` tokens (whole pages; 256 by default). Chunk ``i``'s key is
BLAKE2b-128 over chunk ``i - 1``'s key and chunk ``i``'s token ids (int32, little-endian); chunk 0 chains
from the *namespace id*, BLAKE2b-128 over the canonical JSON of everything besides the tokens that changes
K/V (:func:`describe`: model, revision, adapter, the format of each side with its options such as the
Hadamard rotation, the residual window, page size, layers, heads, head_dim, dtype, positional encoding and
salt). So a chunk is never shared across any of those, and a key names a whole prefix, not one chunk.

Each chunk is one self-describing blob (format in ``docs/tiers.md``): a fixed header, a JSON header,
the chunk's token ids, then every layer's pages exactly as stored (codes and scales; pages still open in
a quantized cache's full-precision window travel as they are too). Loading checks every field and size
and the checksum before a pool is touched; a bad blob is a miss, counted in the stats, and deleted (the next
write of its chunk replaces it). fp8 codes are read with their pool's per-head scales, so a chunk stored under
other scales than the ones the loading pool reads with is a miss too (kept: it is right for the processes that
share its scales). No pickle.

Tier chunks outlive the process and serve whoever opens the same directory or Redis server, so the namespace
must say which weights computed them: an :class:`kvcache.Engine` over a model without a ``name_or_path`` (a
config made in code) is refused with ``disk=`` / ``remote=`` unless ``namespace=`` names the model.

:class:`DiskTier` keeps the blobs as files (atomic writes, LRU bounded in bytes, safe to share between
processes of one machine); :class:`RedisTier` keeps them in Redis (``SET NX`` with a TTL, one pipelined
lookup per prompt, timeouts and a circuit breaker). :class:`PrefixTiers` binds them to an
:class:`kvcache.Engine`'s pages: after the local radix match it fetches the rest of a prompt's chain
(disk first, then Redis, up to the first miss, if the :class:`CostModel` expects the fetch to beat
recomputing) and inserts it into the local tree; when a request finishes its new full chunks are written
behind by a thread, from a bounded queue that drops work rather than block generation.

>>> import kvcache
>>> root = kvcache.tiers.namespace_id({"model": "m"})
>>> keys = kvcache.tiers.chunk_keys(root, list(range(600)), chunk_tokens=256)
>>> len(keys), len(keys[0])          # two full chunks; the last 88 tokens are not a chunk
(2, 16)
>>> keys == kvcache.tiers.chunk_keys(root, list(range(512)) + [7], chunk_tokens=256)
True
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import numbers
import os
import queue
import re
import struct
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._args import integer_arg

__all__ = [
    "BlobError", "CostModel", "DiskTier", "PrefixTiers", "RedisTier", "chunk_keys", "decode_blob", "describe",
    "encode_blob", "namespace_id", "DEFAULT_CHUNK_TOKENS",
]

# 256 tokens: a whole number of pages for every page size (1..256); big enough that a chunk's bytes
# (0.5-12 MB for small models) amortize a round trip, small enough that a shared system prompt or
# few-shot block of a few hundred tokens already fills one (LMCache uses the same default).
DEFAULT_CHUNK_TOKENS = 256

MAGIC = b"KVCHUNK\0"
VERSION = 2  # 2: the header and namespace carry v_head_dim (K and V rows may differ in width)
# magic, version, flags, JSON header length, payload length, BLAKE2b-128 checksum of everything after it
_FIXED = struct.Struct("<8sHHIQ16s")
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn,
    torch.float8_e5m2)}
if sys.byteorder != "little":  # blobs are little-endian; tensors are written as their memory
    raise ImportError("kvcache.tiers needs a little-endian machine")


class BlobError(ValueError):
    """A blob that must not be loaded; ``reason`` names the check it failed."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ---- identity ------------------------------------------------------------------------------------
def describe(namespace, *, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             k_format: str, v_format: str, residual: str = "", rope: str = "", v_head_dim: int | None = None) -> dict:
    """The full description of a chain root: the :class:`kvcache.Namespace` fields plus the page geometry
    (the width of K rows, ``head_dim``, and of V rows, ``v_head_dim``: they differ for MLA latents) and the
    format of each side (stored once beside the chunks, as ``namespace.json`` / ``<prefix>:namespace``)."""
    return {
        "model": namespace.model, "revision": namespace.revision, "adapter": namespace.adapter,
        "kv_format": str(namespace.kv_format), "rope": namespace.rope or rope, "salt": namespace.salt,
        "k_format": k_format, "v_format": v_format, "residual": residual, "page_size": int(page_size),
        "num_layers": int(num_layers), "num_kv_heads": int(num_kv_heads), "head_dim": int(head_dim),
        "v_head_dim": int(head_dim if v_head_dim is None else v_head_dim),
        "dtype": str(dtype).removeprefix("torch."), "blob_version": VERSION,
    }


def namespace_id(description: dict) -> bytes:
    """BLAKE2b-128 of the description's canonical JSON (sorted keys): the root of every chunk chain."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(text, digest_size=16, person=b"kvcache-ns").digest()


def _token_bytes(tokens) -> bytes:
    t = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.int64)
    return t.to(torch.int32).contiguous().numpy().tobytes()


def chunk_keys(root: bytes, tokens, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[bytes]:
    """The chained keys (16 bytes each) of the full chunks of ``tokens``."""
    raw = _token_bytes(tokens)
    step = 4 * chunk_tokens
    keys, prev = [], root
    for i in range(len(raw) // step):
        prev = hashlib.blake2b(prev + raw[i * step:(i + 1) * step], digest_size=16, person=b"kvcache-chunk").digest()
        keys.append(prev)
    return keys


# ---- blobs ---------------------------------------------------------------------------------------
def encode_blob(ns: bytes, key: bytes, tokens, pages: str, tensors: list[tuple[str, torch.Tensor]],
                meta: dict) -> bytes:
    """One chunk's blob: ``pages`` (one letter per page: ``S`` sealed in the pool, ``O`` open in the
    full-precision window), ``tensors`` in their stored dtype (named, in order) and ``meta`` (the layout
    fields the loader compares with its own)."""
    header = dict(meta, ns=ns.hex(), key=key.hex(), pages=pages,
                  tensors=[[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors])
    tok = _token_bytes(tokens)
    header["tokens"] = len(tok) // 4
    hjson = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    parts = [t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for _, t in tensors]
    payload_len = sum(map(len, parts))
    h = hashlib.blake2b(digest_size=16)
    for part in (hjson, tok, *parts):
        h.update(part)
    fixed = _FIXED.pack(MAGIC, VERSION, 0, len(hjson), payload_len, h.digest())
    return b"".join((fixed, hjson, tok, *parts))


def peek_header(blob: bytes) -> dict:
    """The JSON header of a blob (checked for framing only)."""
    if len(blob) < _FIXED.size:
        raise BlobError("truncated", f"{len(blob)} bytes is shorter than the {_FIXED.size}-byte fixed header")
    magic, version, _, hlen, _, _ = _FIXED.unpack_from(blob)
    if magic != MAGIC:
        raise BlobError("magic", f"{magic!r}")
    if version != VERSION:
        raise BlobError("version", f"blob version {version}, this kvcache reads {VERSION}")
    try:
        return json.loads(blob[_FIXED.size:_FIXED.size + hlen])
    except (ValueError, UnicodeDecodeError) as err:
        raise BlobError("header", str(err)) from None


def decode_blob(blob: bytes, *, ns: bytes, key: bytes, tokens, meta: dict, expect_tensors) -> tuple[str, dict]:
    """Checks a blob against what the loader expects, field by field; returns ``(pages, {name: tensor})``.

    ``expect_tensors(pages)`` gives the ``[(name, dtype, shape), ...]`` the loader's pools need for that page
    pattern. Raises :class:`BlobError` on any difference: framing, sizes, namespace, key, layout, formats,
    tensor list, token ids (a key collision) or checksum."""
    header = peek_header(blob)
    _, _, _, hlen, payload_len, checksum = _FIXED.unpack_from(blob)
    tok = _token_bytes(tokens)
    start = _FIXED.size + hlen
    if len(blob) != start + len(tok) + payload_len:
        raise BlobError("truncated", f"{len(blob)} bytes, the header says {start + len(tok) + payload_len}")
    if header.get("ns") != ns.hex():
        raise BlobError("namespace", f"blob of namespace {header.get('ns')}, expected {ns.hex()}")
    if header.get("key") != key.hex():
        raise BlobError("key", f"blob of key {header.get('key')}, expected {key.hex()}")
    if header.get("tokens") != len(tok) // 4:
        raise BlobError("tokens", f"{header.get('tokens')} tokens, expected {len(tok) // 4}")
    for name, value in meta.items():
        if header.get(name) != value:
            raise BlobError("layout", f"{name}={header.get(name)!r}, expected {value!r}")
    pages = header.get("pages")
    if not isinstance(pages, str) or set(pages) - {"S", "O"} or len(pages) != meta.get("pages_per_chunk", len(pages)):
        raise BlobError("layout", f"pages={pages!r}")
    expected = [[n, str(d).removeprefix("torch."), list(s)] for n, d, s in expect_tensors(pages)]
    if header.get("tensors") != expected:
        raise BlobError("layout", "the tensor list differs from this cache's pools")
    sizes = [_DTYPES[d].itemsize * _numel(s) for _, d, s in expected]
    if sum(sizes) != payload_len:
        raise BlobError("layout", f"payload of {payload_len} bytes, the tensors need {sum(sizes)}")
    if blob[start:start + len(tok)] != tok:
        raise BlobError("collision", "the blob holds other token ids under this key")
    h = hashlib.blake2b(digest_size=16)
    h.update(memoryview(blob)[_FIXED.size:])
    if h.digest() != checksum:
        raise BlobError("checksum")
    buf = bytearray(memoryview(blob)[start + len(tok):])  # writable, for torch.frombuffer
    out, off = {}, 0
    for (name, d, s), n in zip(expected, sizes):
        out[name] = (torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off).view(_DTYPES[d]).view(s)
                     if n else torch.empty(s, dtype=_DTYPES[d]))
        off += n
    return pages, out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- the cost model ------------------------------------------------------------------------------
@dataclass
class CostModel:
    """Fetch a run of chunks only if ``round_trip_s + bytes / bytes_per_s + bytes / load_bytes_per_s`` (the
    lookup, the transfer, then checking and copying the blobs into the pools) is below ``margin`` times
    ``tokens * compute_s_per_token`` (recomputing them).

    The constants start at the given priors; the first measurement replaces a prior, later ones are
    averaged in (exponential moving average): the round trip from each lookup, the transfer rate from
    fetches of at least 256 KB, the load rate from the blobs loaded, the compute time per token from the
    engine's prefill forwards. Until a prefill has been measured the model fetches (a cold process has
    nothing to compare with). ``enabled=False`` fetches every hit."""

    round_trip_s: float = 5e-4
    bytes_per_s: float = 5e8
    load_bytes_per_s: float = 1e9
    compute_s_per_token: float | None = None
    margin: float = 1.0
    enabled: bool = True
    smoothing: float = 0.3
    measured: set = field(default_factory=set, repr=False)

    def worth(self, tokens: int, nbytes: int) -> bool:
        if not self.enabled or self.compute_s_per_token is None:
            return True
        return self.fetch_s(nbytes) < self.margin * tokens * self.compute_s_per_token

    def fetch_s(self, nbytes: int) -> float:
        """The expected seconds to look up, fetch and load ``nbytes`` of blobs."""
        return self.round_trip_s + nbytes / self.bytes_per_s + nbytes / self.load_bytes_per_s

    def _observe(self, name: str, value: float) -> None:
        old = getattr(self, name)
        if name not in self.measured or old is None:
            self.measured.add(name)
            setattr(self, name, value)
        else:
            setattr(self, name, (1 - self.smoothing) * old + self.smoothing * value)

    def observe_round_trip(self, seconds: float) -> None:
        self._observe("round_trip_s", seconds)

    def observe_fetch(self, nbytes: int, seconds: float) -> None:
        """A fetch of ``nbytes`` took ``seconds`` (one round trip included)."""
        transfer = seconds - self.round_trip_s
        if nbytes >= (256 << 10) and transfer > 0:
            self._observe("bytes_per_s", nbytes / transfer)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes >= (256 << 10) and seconds > 0:
            self._observe("load_bytes_per_s", nbytes / seconds)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._observe("compute_s_per_token", seconds / tokens)

    def constants(self) -> dict:
        return {"round_trip_s": self.round_trip_s, "bytes_per_s": self.bytes_per_s,
                "load_bytes_per_s": self.load_bytes_per_s, "compute_s_per_token": self.compute_s_per_token,
                "margin": self.margin, "enabled": self.enabled}


# ---- tiers ---------------------------------------------------------------------------------------
class DiskTier:
    """Blobs as files under ``path/<namespace id>/<key>.kvc``, at most ``max_bytes`` in all (LRU by
    access time, which reads refresh). A chain's chunks are stamped as used one nanosecond apart, its first
    chunk last: a lookup reads a chain from its start, so a tail without its head is never read, and under a
    budget smaller than a prompt's chain the head is what stays. Writes go to a temporary file renamed into
    place, so a reader in another process sees a whole blob or none; a file evicted under a reader is a miss."""

    name = "disk"

    def __init__(self, path, max_bytes: int = 8 << 30):
        max_bytes = integer_arg("max_bytes", max_bytes, "the tier's budget in bytes")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be positive")
        if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
            # ("" is the current directory: chunks landed beside the user's files, and trim() deleted */*.kvc there)
            raise ValueError(f"disk={path!r} must be the path of a directory")
        self.path, self.max_bytes = Path(path), max_bytes
        for p in (self.path, *self.path.parents):  # the nearest part of the path that exists must be a directory
            if p.exists() or p.is_symlink():
                if not p.is_dir():  # (mkdir answers with a bare FileExistsError / NotADirectoryError)
                    what = "it is a file" if p == self.path and p.is_file() else f"{str(p)!r} exists and is not a directory"
                    raise ValueError(f"disk={str(path)!r} must be a directory (made if missing), but {what}: the disk "
                                     f"tier writes its prefix chunks as files under it")
                break
        self.path.mkdir(parents=True, exist_ok=True)
        self.cost = CostModel(round_trip_s=1e-4, bytes_per_s=1e9)
        self._written_since_scan = 0

    def _file(self, ns: bytes, key: bytes) -> Path:
        return self.path / ns.hex() / f"{key.hex()}.kvc"

    def put_namespace(self, ns: bytes, description: dict) -> None:
        target = self.path / ns.hex() / "namespace.json"
        if not target.exists():
            self._write(target, json.dumps(description, sort_keys=True, indent=1).encode())

    def lookup(self, ns: bytes, keys: list[bytes]) -> list[int]:
        """Sizes of the blobs present, up to the first missing key."""
        sizes = []
        for key in keys:
            try:
                sizes.append(self._file(ns, key).stat().st_size)
            except OSError:
                break
        return sizes

    def fetch(self, ns: bytes, keys: list[bytes]) -> list[bytes | None]:
        """The blobs of ``keys`` (a run of one chain, in chain order; None where one is missing)."""
        out = []
        for key in keys:
            try:
                out.append(self._file(ns, key).read_bytes())
            except OSError:
                out.append(None)
        self.touch(ns, keys)
        return out

    def touch(self, ns: bytes, keys: list[bytes], used_ns: int | None = None) -> None:
        """Marks a run of one chain's chunks (chain order) as used at ``used_ns`` (a time.time_ns() stamp;
        now by default), each later chunk 1 ns older: recency for the LRU, the chain's head the most recent.
        Missing files are skipped."""
        used_ns = time.time_ns() if used_ns is None else used_ns
        for i, key in enumerate(keys):
            try:
                os.utime(self._file(ns, key), ns=(used_ns - i, used_ns - i))
            except OSError:
                pass

    def discard(self, ns: bytes, key: bytes) -> None:
        """Deletes a blob (found bad: the next write of its chunk replaces it)."""
        self._file(ns, key).unlink(missing_ok=True)

    def put(self, ns: bytes, key: bytes, blob: bytes, used_ns: int | None = None) -> bool:
        """Writes a blob unless its file exists; ``used_ns``: its recency for the LRU (a time.time_ns()
        stamp; by default the write's time)."""
        target = self._file(ns, key)
        if target.exists():
            return False
        self._write(target, blob)
        if used_ns is not None:
            os.utime(target, ns=(used_ns, used_ns))
        self._written_since_scan += len(blob)
        if self._written_since_scan >= self.max_bytes // 16:
            self.trim()
        return True

    def _write(self, target: Path, data: bytes) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def trim(self) -> int:
        """Deletes least recently used blobs until the tier fits ``max_bytes``; returns the bytes freed."""
        self._written_since_scan = 0
        files = []
        for f in self.path.glob("*/*.kvc"):
            try:
                st = f.stat()
            except OSError:
                continue
            files.append((st.st_mtime_ns, st.st_size, f))  # (ns: a chain's chunks are 1 ns apart)
        total, freed = sum(s for _, s, _ in files), 0
        for _, size, f in sorted(files):
            if total - freed <= self.max_bytes:
                break
            f.unlink(missing_ok=True)
            freed += size
        return freed

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.glob("*/*.kvc"))


class RedisTier:
    """Blobs in Redis at ``redis://host:port/db``, keys ``<prefix>:<namespace id>:<chunk key>``.

    Every call is bounded by ``timeout`` seconds (connect and socket timeouts, no retries). A timeout, a
    refused connection or a dead server opens the circuit breaker: for ``breaker_s`` seconds no call is
    made (lookups are misses, writes are dropped); then one call tries again. Writes use ``SET NX`` with
    ``ttl_s`` (a chunk is immutable: whoever writes it first wins)."""

    name = "remote"

    def __init__(self, url: str, *, timeout: float = 0.5, breaker_s: float = 10.0, ttl_s: int = 24 * 3600,
                 prefix: str = "kvcache"):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ImportError(f"remote={url!r} needs the redis client: pip install kvcache[redis]") from None
        for name, value, low in (("timeout", timeout, 0.0), ("breaker_s", breaker_s, None), ("ttl_s", ttl_s, 0.0)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name}={value!r} must be a number of seconds, not {type(value).__name__}")
            if not math.isfinite(value) or value < 0 or (low is not None and value <= low):
                raise ValueError(f"{name}={value!r} must be a finite number of seconds, "
                                 + ("> 0" if low is not None else ">= 0"))
        if ttl_s < 0.001:
            raise ValueError(f"ttl_s={ttl_s!r} must be at least 0.001 s (Redis expiries are in milliseconds)")
        # (ttl_s=0.5 was int()-ed to an expiry of 0, which Redis refuses: every write failed, silently)
        self.url, self.timeout, self.breaker_s, self.prefix = url, float(timeout), float(breaker_s), prefix
        self.ttl_s, self._ttl_ms = float(ttl_s), max(1, round(float(ttl_s) * 1000))
        self._errors = (redis.RedisError, OSError)
        self._down_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        # a server that answers but refuses us (password, ACL): configuration, not an outage
        ex = redis.exceptions
        self._refusals = tuple(getattr(ex, n) for n in ("AuthenticationError", "AuthorizationError",
                                                         "NoPermissionError") if hasattr(ex, n))
        self._response_error = ex.ResponseError
        self.last_error: str | None = None  # the last error, type and message (stats: remote_last_error)
        self._warned = False
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self.cost = CostModel()
        self.open_until = 0.0
        self.counters = {"errors": 0, "breaker_trips": 0, "skipped_calls": 0, "foreign_keys": 0}
        self._lock = threading.Lock()

    def _key(self, ns: bytes, key: bytes) -> str:
        return f"{self.prefix}:{ns.hex()}:{key.hex()}"

    @property
    def breaker_open(self) -> bool:
        return time.monotonic() < self.open_until

    def _call(self, fn):
        """Runs ``fn(client)``; an error is ``None`` (and opens the breaker when the server is unreachable)."""
        if self.breaker_open:
            with self._lock:
                self.counters["skipped_calls"] += 1
            return None
        try:
            return fn(self.client)
        except self._errors as err:
            with self._lock:
                self.counters["errors"] += 1
                self.last_error = f"{type(err).__name__}: {err}"  # (redis-py 8's repr hides the message)
                if isinstance(err, self._down_errors):
                    self.counters["breaker_trips"] += 1
                    self.open_until = time.monotonic() + self.breaker_s
                refused = isinstance(err, self._refusals) or (isinstance(err, self._response_error)
                                                              and "DB index" in str(err))  # SELECT of a bad db
                warn = refused and not self._warned
                self._warned |= warn
            if warn:  # once: every later call fails alike, and a misconfiguration must not pass for an outage
                warnings.warn(f"the Redis tier at {self._safe_url()} refuses this client ({self.last_error}): its "
                              f"lookups are misses and its writes are dropped; check the URL's password and database",
                              RuntimeWarning, stacklevel=2)
            return None

    def _safe_url(self) -> str:
        """The URL without its password."""
        return re.sub(r"//([^@/]*):[^@/]*@", r"//\1:***@", self.url)

    def put_namespace(self, ns: bytes, description: dict) -> None:
        self._call(lambda c: c.set(f"{self.prefix}:{ns.hex()}:namespace", json.dumps(description, sort_keys=True),
                                   px=self._ttl_ms))

    def lookup(self, ns: bytes, keys: list[bytes]) -> list[int]:
        """Sizes of the blobs present, up to the first missing key: one pipelined round trip. A key that
        holds no string (something else wrote it) is a miss and is deleted, as a bad blob is: the next
        write of its chunk replaces it."""
        def run(c):
            pipe = c.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self._key(ns, key))
            sizes = pipe.execute(raise_on_error=False)
            for size in sizes:  # only a key of another type is the key's own failure; the rest fail the call
                if isinstance(size, Exception) and "WRONGTYPE" not in str(size):
                    raise size
            return sizes
        sizes = self._call(run) if keys else []
        out = []
        for i, size in enumerate(sizes or []):
            if isinstance(size, Exception):
                with self._lock:
                    self.counters["foreign_keys"] += 1
                    self.last_error = f"{type(size).__name__}: {size}"
                self.discard(ns, keys[i])
                break
            if not size:
                break
            out.append(int(size))
        return out

    def fetch(self, ns: bytes, keys: list[bytes]) -> list[bytes | None]:
        values = self._call(lambda c: c.mget([self._key(ns, k) for k in keys])) if keys else []
        return list(values) if values is not None else [None] * len(keys)

    def put(self, ns: bytes, key: bytes, blob: bytes) -> bool | None:
        """True: written; False: the key was there already (SET NX); None: the call failed (an error, a key of
        another type, the breaker open), so nothing is known to be there."""
        result = self._call(lambda c: c.set(self._key(ns, key), blob, nx=True, px=self._ttl_ms) or False)
        return None if result is None else bool(result)

    def discard(self, ns: bytes, key: bytes) -> None:
        """Deletes a blob (found bad: the next write of its chunk replaces it)."""
        self._call(lambda c: c.delete(self._key(ns, key)))

    def close(self) -> None:
        self.client.close()


def check_chunk_tokens(chunk_tokens, page_size: int) -> int:
    """``chunk_tokens`` as an int (numpy and 0-d torch integers too), a positive multiple of ``page_size``."""
    chunk_tokens = integer_arg("chunk_tokens", chunk_tokens, "tokens per chunk of the tiers")
    if not (chunk_tokens > 0 and chunk_tokens % page_size == 0):
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive multiple of page_size={page_size}")
    return chunk_tokens


def check_identity(namespace, model_name: str, model_class: str, *, disk=None, remote=None) -> None:
    """Refuses tiers for a model that nothing names. Tier chunks outlive the process and serve whoever opens
    the same directory or Redis server: without a ``name_or_path`` (a config made in code rather than loaded
    with ``from_pretrained``) and without an explicit ``namespace``, the chain root would carry the model's
    class name alone, which every other model of that class shares, and each would load the other's K/V as
    its own. (In one process the prefix cache tells models apart by the objects; across processes nothing
    can.)"""
    if namespace is not None or model_name:
        return
    # the Redis URL is not repeated: it may hold a password
    given = " and ".join(filter(None, (f"disk={str(getattr(disk, 'path', disk))!r}" if disk is not None else "",
                                       "remote=" if remote is not None else "")))
    raise ValueError(f"{given}: this model has no name_or_path (its config was not loaded with from_pretrained), "
                     f"so its tier chunks would be keyed by its class name {model_class!r} alone, as those of any "
                     f"other {model_class} sharing the tier: one would load the other's K/V as its own; pass "
                     f"namespace=kvcache.Namespace(model=..., revision=...) naming these weights, the same in "
                     f"every process that should share the chunks")


def _as_tier(spec, kind: str):
    if spec is None or isinstance(spec, (DiskTier, RedisTier)):
        return spec
    if kind == "remote":
        if not isinstance(spec, str) or not spec.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"remote={spec!r} must be a redis:// URL or a kvcache.tiers.RedisTier")
        return RedisTier(spec)
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"disk={spec!r} must be a directory path or a kvcache.tiers.DiskTier")
    return DiskTier(spec)


def _stop_writer(q: queue.Queue) -> None:
    try:
        q.put_nowait(None)
    except queue.Full:  # the writer stops at its next item anyway: its tiers are gone
        pass


def _flush_at_exit(ref) -> None:
    tiers = ref()
    if tiers is not None:
        tiers.flush(10.0)


def _item_bytes(item) -> int:
    if item[0] == "disk":
        return len(item[2])
    return sum(t.nbytes for _, t in item[4])


# ---- binding to an engine's pages ------------------------------------------------------------------
@dataclass
class PrefixTiers:
    """A disk and/or Redis tier bound to a :class:`kvcache.PagedStore` (its pages, allocator, prefix
    tree and namespace). :class:`kvcache.Engine` makes one from its ``disk=`` / ``remote=`` options.

    The namespace is the store's when the tiers are made (``store.namespace``, which must be set: it names
    the model whose K/V the chunks hold); chunks are fetched into, and matched in, that namespace of the
    tree even when another Engine sharing the store later sets its own."""

    store: object
    config: object
    dtype: torch.dtype
    device: torch.device
    disk: DiskTier | None = None
    remote: RedisTier | None = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    queue_size: int = 64
    max_queued_bytes: int = 256 << 20
    stats_: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.disk, self.remote = _as_tier(self.disk, "disk"), _as_tier(self.remote, "remote")
        page = self.store.page_size
        self.chunk_tokens = check_chunk_tokens(self.chunk_tokens, page)
        if self.store.prefix_cache is None:
            raise ValueError("disk and remote tiers need the prefix cache (prefix_cache=True)")
        # kept: an Engine sharing the store sets store.namespace to its own, and chunks of this model's chain
        # inserted there would be hits for that model
        self.namespace = self.store.namespace
        if self.namespace is None:
            raise ValueError("namespace: the store has none, and tier chunks must say which model computed them; "
                             "make it with PagedStore(namespace=kvcache.Namespace(model=..., revision=...))")
        cfg = self.config
        self.num_layers = cfg.num_hidden_layers
        from .hf_cache import cache_geometry
        self.num_kv_heads, self.head_dim, self.v_head_dim = cache_geometry(cfg)  # MLA: latent and rope widths
        from .formats import CacheFormat
        self.format = self.store.kv_format or CacheFormat.parse(self.dtype)
        rope = json.dumps({k: getattr(cfg, k, None) for k in ("rope_theta", "rope_scaling", "rope_parameters",
                                                              "max_position_embeddings", "sliding_window")},
                          sort_keys=True, default=str)
        self.description = describe(self.namespace, page_size=page, num_layers=self.num_layers,
                                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                                    k_format=str(self.format.k), v_format=str(self.format.v),
                                    residual=self.store.residual_label, rope=rope, v_head_dim=self.v_head_dim)
        self.ns = namespace_id(self.description)
        self.meta = {"layers": self.num_layers, "page_size": page, "kv_heads": self.num_kv_heads,
                     "head_dim": self.head_dim, "v_head_dim": self.v_head_dim, "k_format": str(self.format.k),
                     "v_format": str(self.format.v),
                     "dtype": str(self.dtype).removeprefix("torch."), "pages_per_chunk": self.chunk_tokens // page}
        self.stats_ = {k: 0 for k in (
            "lookups", "local_hit_tokens", "disk_hit_tokens", "remote_hit_tokens", "disk_fetch_bytes",
            "remote_fetch_bytes", "disk_written_chunks", "remote_written_chunks", "dropped_writes",
            "bad_blobs", "declined_fetches", "declined_tokens", "missing_during_fetch", "no_room")}
        self.stats_.update(disk_fetch_s=0.0, remote_fetch_s=0.0, bad_blob_reasons={}, last_lookup={})
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=self.queue_size)
        self._namespace_written: set = set()
        self._remote_known: OrderedDict = OrderedDict()
        self._queued_bytes = 0
        self._worker = threading.Thread(target=PrefixTiers._write_loop, args=(weakref.ref(self), self._queue),
                                        name="kvcache-tiers", daemon=True)
        self._worker.start()
        weakref.finalize(self, _stop_writer, self._queue)
        # a notebook or script that never calls close() still gets its queued chunks written (10 s at most)
        atexit.register(_flush_at_exit, weakref.ref(self))

    # ---- lookups ----------------------------------------------------------------------------------
    def chain(self, tokens) -> list[bytes]:
        return chunk_keys(self.ns, tokens, self.chunk_tokens)

    def explain(self, tokens) -> dict:
        """Where ``tokens`` diverge from the longest cached prefix, tier by tier, fetching nothing:
        ``local_tokens`` (the radix tree), ``disk_tokens`` / ``remote_tokens`` (whole chunks present from
        the start of the chain) and ``diverged_at`` (the first token no tier holds)."""
        tokens = list(tokens)
        local = self.store.prefix_cache.cached_length(tokens, self.namespace)  # (a match would count as a use)
        keys = self.chain(tokens)
        disk = len(self.disk.lookup(self.ns, keys)) * self.chunk_tokens if self.disk else 0
        remote = len(self.remote.lookup(self.ns, keys)) * self.chunk_tokens if self.remote else 0
        return {"prompt_tokens": len(tokens), "local_tokens": local, "disk_tokens": disk, "remote_tokens": remote,
                "diverged_at": max(local, disk, remote)}

    def fill(self, tokens, held: list | None = None) -> int:
        """Brings the chunks of ``tokens`` beyond the local match into the prefix tree, from disk then
        Redis, up to the first miss (or bad blob) and only where the cost model expects a gain. Returns
        the tokens added. Never raises for a tier's failure. ``held``: when given, what is loaded stays
        locked in the tree (its node appended to ``held``; the caller unlocks it): a batch's next fill, which
        may need room, would otherwise evict it before the batch's match pins it, and fetch it again later."""
        tokens = list(tokens)
        tree, ns_local = self.store.prefix_cache, self.namespace
        keys = self.chain(tokens)
        s = self.stats_
        s["lookups"] += 1
        m = tree.match(tokens, ns_local, lock=True)
        try:
            start = m.length // self.chunk_tokens
            info = {"prompt_tokens": len(tokens), "local_tokens": m.length, "disk_tokens": 0, "remote_tokens": 0}
            s["local_hit_tokens"] += m.length
            s["last_lookup"] = info
            if start >= len(keys):
                info["diverged_at"] = m.length
                return 0
            blobs: list[tuple[int, bytes, str]] = []  # (chunk index, blob, tier name)
            pos = start
            for tier in (self.disk, self.remote):
                if tier is None or pos >= len(keys):
                    continue
                t0 = time.perf_counter()
                sizes = tier.lookup(self.ns, keys[pos:])
                lookup_s = time.perf_counter() - t0
                s[f"{tier.name}_fetch_s"] += lookup_s
                if tier is self.remote and pos + len(sizes) < len(keys) and not tier.breaker_open:
                    self._forget_remote([keys[pos + len(sizes)]])  # the first chunk the server lacks
                if not sizes:
                    continue
                tier.cost.observe_round_trip(lookup_s)
                n_tokens = len(sizes) * self.chunk_tokens
                if not tier.cost.worth(n_tokens, sum(sizes)):
                    s["declined_fetches"] += 1
                    s["declined_tokens"] += n_tokens
                    continue
                if not self._room_for(len(sizes)):  # no bytes read that could not be loaded
                    s["no_room"] += 1
                    break
                t0 = time.perf_counter()
                data = tier.fetch(self.ns, keys[pos:pos + len(sizes)])
                got = 0
                for d in data:
                    if d is None:
                        s["missing_during_fetch"] += 1
                        break
                    blobs.append((pos + got, d, tier.name))
                    got += 1
                seconds = time.perf_counter() - t0
                nbytes = sum(len(d) for _, d, _ in blobs[len(blobs) - got:])
                tier.cost.observe_fetch(nbytes, seconds)
                s[f"{tier.name}_fetch_s"] += seconds
                s[f"{tier.name}_fetch_bytes"] += nbytes
                pos += got
                if got < len(sizes):
                    break
            t0 = time.perf_counter()
            added = self._load(tokens, keys, m, start, blobs, info, held) if blobs else 0
            if added:
                load_s = time.perf_counter() - t0
                for tier in (self.disk, self.remote):
                    nbytes = sum(len(b) for _, b, t in blobs if tier is not None and t == tier.name)
                    if nbytes:
                        tier.cost.observe_load(nbytes, load_s * nbytes / sum(len(b) for _, b, _ in blobs))
            info["diverged_at"] = m.length + added if added else max(m.length, start * self.chunk_tokens)
            return added
        finally:
            tree.unlock(m.node)

    def _room_for(self, chunks: int) -> bool:
        """Whether ``chunks`` chunks' pages can be had now (evicting unlocked prefixes, as loading them would)."""
        from .prefix import OutOfBlocksError
        alloc = self.store.allocator
        try:
            alloc.free(alloc.allocate(chunks * (self.chunk_tokens // self.store.page_size)))
        except OutOfBlocksError:
            return False
        return True

    def _load(self, tokens, keys, m, start: int, blobs, info, held: list | None = None) -> int:
        """Validates every blob (up to the first bad one, or the first whose fp8 scales differ), then writes
        them into new blocks of every layer and inserts the prefix into the tree. Nothing is written before
        all are validated."""
        C, P = self.chunk_tokens, self.store.page_size
        decoded = []
        for i, blob, tier_name in blobs:
            try:
                decoded.append(decode_blob(blob, ns=self.ns, key=keys[i], tokens=tokens[i * C:(i + 1) * C],
                                           meta=self.meta, expect_tensors=self._expected_tensors))
            except BlobError as err:
                self._bad(err.reason)
                # deleted, so that the next write of this chunk (when a request computes it) replaces it: a bad
                # blob kept would block its chunk and every later one of the chain for every process
                (self.disk if tier_name == "disk" else self.remote).discard(self.ns, keys[i])
                if tier_name != "disk":
                    self._forget_remote([keys[i]])
                break
        agree, new_scales = self._fp8_agreement(decoded)
        if agree < len(decoded):
            # not deleted: the blob is sound, and right for every process whose pools read with its scales
            self._bad("scales")
            decoded = decoded[:agree]
        if not decoded:
            return 0
        from .prefix import OutOfBlocksError
        alloc = self.store.allocator
        try:
            blocks = alloc.allocate(len(decoded) * (C // P))
        except OutOfBlocksError:  # the pool is full of locked prefixes: recompute instead
            self.stats_["no_room"] += 1
            return 0
        try:
            try:
                self._write_pages(blocks, decoded, new_scales)
            except BlobError as err:  # refused before any page is written: nothing was inserted
                self._bad(err.reason)
                return 0
            end = (start + len(decoded)) * C
            table = torch.cat([m.blocks[:start * (C // P)].to(torch.int32), blocks])
            ins = self.store.prefix_cache.insert(torch.tensor(tokens[:end]), table, self.namespace,
                                                 lock=held is not None)
            if held is not None:
                held.append(ins.node)
        finally:
            alloc.free(blocks)  # the tree holds its own references now
        loaded = blobs[:len(decoded)]
        disk_n = sum(1 for _, _, t in loaded if t == "disk") * C
        remote_n = len(loaded) * C - disk_n
        info["disk_tokens"], info["remote_tokens"] = disk_n, remote_n
        self.stats_["disk_hit_tokens"] += disk_n
        self.stats_["remote_hit_tokens"] += remote_n
        if self.disk is not None:  # remote hits are kept on disk too
            stamp = time.time_ns()  # (recency: DiskTier)
            for i, blob, t in loaded:
                if t == "remote":
                    self._enqueue(("disk", keys[i], blob, stamp - i))
        self._remember_remote([keys[i] for i, _, t in loaded if t == "remote"])
        return len(loaded) * C

    def _bad(self, reason: str) -> None:
        with self._lock:
            self.stats_["bad_blobs"] += 1
            reasons = self.stats_["bad_blob_reasons"]
            reasons[reason] = reasons.get(reason, 0) + 1

    def _expected_tensors(self, pages: str) -> list:
        """(name, dtype, shape) of a chunk's tensors for its page pattern, in blob order: per layer, the
        sealed pages' codes and scales of K then V, then the open pages' K and V in the model's dtype."""
        n_sealed, n_open = pages.count("S"), pages.count("O")
        H, P = self.num_kv_heads, self.store.page_size
        dims = {"k": self.head_dim, "v": self.v_head_dim}  # K and V rows may differ in width (MLA latents)
        out = []
        for layer in range(self.num_layers):
            for role, f in (("k", self.format.k), ("v", self.format.v)):
                out.append((f"{layer}.{role}", f.code_dtype, f.code_shape(n_sealed, H, P, dims[role])))
                shape = f.scale_shape(n_sealed, H, P, dims[role], role)
                if shape is not None:
                    out.append((f"{layer}.{role}_scale", f.scale_dtype, shape))
            if n_open:
                for role in ("k", "v"):
                    out.append((f"{layer}.open_{role}", self.dtype, (n_open, H, P, dims[role])))
        return out

    def _fp8_agreement(self, decoded) -> tuple[int, dict]:
        """How many of the ``decoded`` chunks, from the first, were stored under the fp8 per-head scales
        this cache reads with, and the scales to give the pools whose own are still unset.

        An fp8 code means ``code * scale`` with one scale per kv head for the whole pool, so a chunk stored
        under other scales would be read as other K/V (processes that took their scales from different first
        tokens write such chunks into one chain). The reference, per layer and side, is the pool's scales
        once set (given in the format, or taken from the first tokens stored or loaded), else those of the
        first chunk being loaded that holds a sealed page (a chunk of open pages only holds no fp8 codes:
        its scales are not compared, nor taken)."""
        sides = [(layer, role, f) for layer in range(self.num_layers)
                 for role, f in (("k", self.format.k), ("v", self.format.v)) if f.kind.startswith("fp8")]
        if not sides:
            return len(decoded), {}
        ref, new = {}, {}
        for layer, role, f in sides:
            pool = self.store.pools.get(layer)
            if pool is not None and pool._scales_set[role]:
                ref[layer, role] = getattr(pool, f"{role}_scale").detach().cpu()
            elif pool is None and f.scale is not None:  # what the pool will hold once made
                ref[layer, role] = torch.full((self.num_kv_heads,), f.scale, dtype=f.scale_dtype)
        for n, (pages, tensors) in enumerate(decoded):
            if "S" not in pages:
                continue
            taken = {}  # the scales this chunk sets, kept only if all of its sides agree
            for layer, role, _ in sides:
                scale = tensors[f"{layer}.{role}_scale"]
                want = ref.get((layer, role))
                if want is None:
                    taken[layer, role] = scale
                elif not torch.equal(want, scale):  # bit for bit: any difference changes the codes' meaning
                    return n, new
            ref.update(taken)
            new.update(taken)
        return len(decoded), new

    def _write_pages(self, blocks: torch.Tensor, decoded, new_scales: dict) -> None:
        """Writes validated chunks into ``blocks`` of every layer's pools (sealed pages into the pools,
        open ones into residual slots). The chunks' fp8 scales were checked (:meth:`_fp8_agreement`);
        ``new_scales`` are the ones the pools whose scales are unset take."""
        store = self.store
        pages = "".join(p for p, _ in decoded)
        ids = blocks.tolist()
        sealed = torch.tensor([b for b, p in zip(ids, pages) if p == "S"], dtype=torch.int64)
        opened = [b for b, p in zip(ids, pages) if p == "O"]
        if opened and store.residual is None:
            raise BlobError("layout", "open pages for a cache without a full-precision window")
        dummy = torch.empty(0, self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        dummy_v = torch.empty(0, self.num_kv_heads, 0, self.v_head_dim, dtype=self.dtype, device=self.device)
        need = int(blocks.max()) + 1
        pools = [store.pool(layer, dummy, dummy_v, need) for layer in range(self.num_layers)]
        store.ensure_blocks(need)
        pools = [store.pools[layer] for layer in range(self.num_layers)]

        def cat(layer, name):
            return torch.cat([t[f"{layer}.{name}"] for p, t in decoded if f"{layer}.{name}" in t])

        residual = store.residual
        if residual is not None:
            for b in sealed.tolist():
                residual.close(b)  # a reused block id may still name an old slot
        slots = [residual.open(b) for b in opened] if opened else []
        for layer, pool in enumerate(pools):
            dev = pool.k.device
            for role in ("k", "v"):
                if sealed.numel():
                    getattr(pool, role).index_copy_(0, sealed.to(dev), cat(layer, role).to(dev))
                scale_t = getattr(pool, f"{role}_scale")
                if scale_t is None:
                    continue
                if scale_t.dim() == 1:  # fp8: one scale per kv head for the whole pool, unset until now
                    if (layer, role) in new_scales and not pool._scales_set[role]:
                        scale_t.copy_(new_scales[layer, role])
                        pool._scales_set[role] = True
                elif sealed.numel():
                    scale_t.index_copy_(0, sealed.to(dev), cat(layer, f"{role}_scale").to(dev))
            if opened:
                rpool = store.residual_pool(layer, dummy, residual.num_slots)
                idx = torch.tensor(slots, dtype=torch.int64, device=rpool.k.device)
                rpool.k.index_copy_(0, idx, cat(layer, "open_k").to(rpool.k.device))
                rpool.v.index_copy_(0, idx, cat(layer, "open_v").to(rpool.v.device))

    # ---- writes -----------------------------------------------------------------------------------
    def publish(self, tokens, blocks: torch.Tensor) -> int:
        """Queues the full chunks of ``tokens`` (whose pages are ``blocks``) that no tier is known to hold,
        as snapshots of their pages now; a thread encodes and writes them. Returns the chunks queued."""
        tokens = list(tokens)
        keys = self.chain(tokens)
        if not keys:
            return 0
        C, P = self.chunk_tokens, self.store.page_size
        targets = [t for t in (self.disk, self.remote) if t is not None]
        known = {id(t): len(t.lookup(self.ns, keys)) if isinstance(t, DiskTier) else None for t in targets}
        if self.remote is not None:  # chunks fetched from or written to Redis lately are not sent again
            now = time.monotonic()
            with self._lock:
                known[id(self.remote)] = next((i for i, k in enumerate(keys) if not self._remote_holds(k, now)),
                                              len(keys))
        queued = 0
        residual = self.store.residual
        block_list = blocks.tolist()
        stamp = time.time_ns()  # the chain's recency on disk, its head the most recent (DiskTier)
        if self.disk is not None and known[id(self.disk)]:  # the chunks it holds were used now too: newer than the
            self.disk.touch(self.ns, keys[:known[id(self.disk)]], stamp)  # ones queued below, which they precede
        for i, key in enumerate(keys):
            if all(known[id(t)] is not None and i < known[id(t)] for t in targets):
                continue
            ids = block_list[i * (C // P):(i + 1) * (C // P)]
            pages = "".join("O" if residual is not None and b in residual.slot_of else "S" for b in ids)
            tensors = self._snapshot(ids, pages)
            item = ("chunk", key, tokens[i * C:(i + 1) * C], pages, tensors,
                    [t.name for t in targets if not (known[id(t)] is not None and i < known[id(t)])], stamp - i)
            if self._enqueue(item):
                queued += 1
        return queued

    def _snapshot(self, ids: list[int], pages: str) -> list[tuple[str, torch.Tensor]]:
        store = self.store
        sealed = torch.tensor([b for b, p in zip(ids, pages) if p == "S"], dtype=torch.int64)
        open_slots = [store.residual.slot_of[b] for b, p in zip(ids, pages) if p == "O"]
        out = []
        for layer in range(self.num_layers):
            pool = store.pools[layer]
            for role in ("k", "v"):
                out.append((f"{layer}.{role}", getattr(pool, role).index_select(0, sealed.to(pool.k.device)).cpu()))
                scale_t = getattr(pool, f"{role}_scale")
                if scale_t is not None:
                    out.append((f"{layer}.{role}_scale", scale_t.clone().cpu() if scale_t.dim() == 1 else
                                scale_t.index_select(0, sealed.to(scale_t.device)).cpu()))
            if open_slots:
                rpool = store.residual_pools[layer]
                idx = torch.tensor(open_slots, dtype=torch.int64, device=rpool.k.device)
                out.append((f"{layer}.open_k", rpool.k.index_select(0, idx).cpu()))
                out.append((f"{layer}.open_v", rpool.v.index_select(0, idx).cpu()))
        return out

    def _enqueue(self, item) -> bool:
        """Queues a write unless the queue is full (``queue_size`` items or ``max_queued_bytes``): never
        block generation on a slow tier."""
        nbytes = _item_bytes(item)
        with self._lock:
            if self._queued_bytes + nbytes > self.max_queued_bytes and self._queue.unfinished_tasks:
                self.stats_["dropped_writes"] += 1
                return False
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.stats_["dropped_writes"] += 1
                return False
            self._queued_bytes += nbytes
            return True

    @staticmethod
    def _write_loop(ref, q: queue.Queue) -> None:
        # holds the tiers only while writing, so that an engine dropped without close() can be collected
        while True:
            item = q.get()
            try:
                tiers = ref() if item is not None else None
                if tiers is None:
                    return
                try:
                    tiers._write(item)
                except Exception as err:  # noqa: BLE001 - a failed write is a lost chunk, never a crash
                    with tiers._lock:
                        tiers.stats_["write_errors"] = tiers.stats_.get("write_errors", 0) + 1
                        tiers.stats_["last_write_error"] = repr(err)
                finally:
                    with tiers._lock:
                        tiers._queued_bytes -= _item_bytes(item)
                    del tiers
            finally:
                q.task_done()

    def _write(self, item) -> None:
        if item[0] == "disk":
            _, key, blob, used_ns = item
            self._put(self.disk, key, blob, used_ns)
            return
        _, key, tokens, pages, tensors, names, used_ns = item
        blob = encode_blob(self.ns, key, tokens, pages, tensors, self.meta)
        for tier in (self.disk, self.remote):
            if tier is not None and tier.name in names:
                self._put(tier, key, blob, used_ns)

    def _put(self, tier, key: bytes, blob: bytes, used_ns: int) -> None:
        if tier.name not in self._namespace_written:
            tier.put_namespace(self.ns, self.description)
            self._namespace_written.add(tier.name)
        written = tier.put(self.ns, key, blob, used_ns) if tier is self.disk else tier.put(self.ns, key, blob)
        if tier is self.remote and written is not None:
            self._remember_remote([key])  # written now, or already there (SET NX); not after a failed call
        if written:
            with self._lock:
                self.stats_[f"{tier.name}_written_chunks"] += 1

    def _remember_remote(self, keys) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._remote_known[key] = now
                self._remote_known.move_to_end(key)
            while len(self._remote_known) > 65536:
                self._remote_known.popitem(last=False)

    def _forget_remote(self, keys) -> None:
        """Keys the server was found not to hold (a miss, a bad or foreign blob deleted): written again when a
        request computes their chunks. (Remembered for good, they were never rewritten: after a TTL expiry, a
        restart or a deleted bad blob, that engine stopped sharing those prefixes.)"""
        with self._lock:
            for key in keys:
                self._remote_known.pop(key, None)

    def _remote_holds(self, key: bytes, now: float) -> bool:
        """Whether ``key`` was written to or read from the server lately: within its TTL, after which the server
        drops it."""
        seen = self._remote_known.get(key)
        return seen is not None and now - seen < self.remote.ttl_s

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued write is done (or ``timeout`` seconds); True if the queue drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Finishes the queued writes (up to ``timeout`` seconds) and stops the writer thread."""
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._worker.join(timeout=1.0)

    def stats(self) -> dict:
        """Counters since the tiers were made, the cost model's constants per tier and the breaker."""
        with self._lock:
            s = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.stats_.items()}
        s["chunk_tokens"] = self.chunk_tokens
        s["namespace_id"] = self.ns.hex()
        if self.disk is not None:
            s["disk_cost_model"] = self.disk.cost.constants()
        if self.remote is not None:
            s["remote_cost_model"] = self.remote.cost.constants()
            s["remote_breaker_open"] = self.remote.breaker_open
            s.update({f"remote_{k}": v for k, v in self.remote.counters.items()})
            s["remote_last_error"] = self.remote.last_error
        s["queued_writes"] = self._queue.unfinished_tasks
        return s

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """A prefill forward computed ``tokens`` tokens in ``seconds`` (for every tier's cost model)."""
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.cost.observe_compute(tokens, seconds)
