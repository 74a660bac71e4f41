"""Prefix cache: kvcache.PrefixCache (C++ radix tree) vs SGLang's RadixCache (Python), same trace.

One seeded trace of two workloads, replayed by both caches in the same order:
  - shared prefix: 64 groups x 16 prompts, each a group's 2048-token system prompt plus its own
    128-token question, arriving shuffled;
  - multi-turn chat: 20 conversations x 4 turns (a 512-token opening message, then per turn a
    256-token answer and a 128-token user message), turn by turn across the conversations.
The replay goes in waves of 16 requests: match every request of the wave, then insert each one's
prompt (chat: prompt + answer). Afterwards everything is evicted, in calls of one request's worth
(2176 tokens = 136 pages). Timed: the match calls, the insert calls, the evict calls; every input
(token arrays, block ids, SGLang's RadixKey/values) is built before the clock starts. Results are
kept until the waves are done, so freeing them is not timed either, for either cache. Each wave's
token arrays are copied from the trace's as the wave arrives, untimed (a server matches tokens its
tokenizer has just written, so they are in cache; all of a replay's inputs together are ~36 MB,
and read from DRAM, a C++ match of a 2k-token prompt measures the memory's bandwidth rather than
the tree). Each cache first answers an empty lookup and insert, untimed (a first call pays one-time
costs: ~30 us for ours, a third of a wave's match). The configurations take turns, replay by
replay, so a noisy neighbour slows all of them alike; each keeps its best replay.

Ours runs with pages of 16 tokens in four forms: one request per call (``match`` / ``insert``); one
request per call with ``match_into`` writing the blocks into the request's row of a block table (made
untimed as the wave arrives, as a server keeps one), which spares the result tensor; one wave per
call (``match_ragged`` / ``insert_ragged``); and one wave per call with ``match_ragged_into`` writing
into the wave's block table and length and node arrays (made untimed likewise), which spares the four
result tensors. SGLang runs with page_size=1 (token-exact, like
ours at any page size: its match lengths must equal ours) and page_size=16 (it truncates keys to
whole pages: its lengths must equal ours rounded down to a page).

SGLang is driven standalone: ``pip install --no-deps sglang`` plus the light packages its import
chain needs (orjson, psutil, pybase64, requests, triton, pillow, starlette, msgspec, pydantic, pyzmq,
ipython, aiohttp, transformers, apache-tvm-ffi, ...). Three of its modules that radix_cache.py imports
only for type annotations and metrics (memory_pool, allocator, metrics_collector) pull in model
configs and GPU kernels; they are replaced by empty placeholder modules here. Without SGLang the
benchmark still runs ours and says so.

    python benchmarks/prefix.py            # the full run
    python benchmarks/prefix.py --quick    # a smoke run (2 repeats, fewer groups)
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import random
import statistics
import sys
import time
import types
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

import kvcache
from common import machine, positive_int, write_results

PAGE = 16
WAVE = 16
VOCAB = 32000
EVICT_TOKENS = 2048 + 128


# ---- the trace ----------------------------------------------------------------------------------
@dataclass
class Request:
    prompt: list[int]
    cached: list[int]   # what is inserted afterwards: the prompt, or prompt + answer


def make_trace(groups: int, per_group: int, conversations: int, turns: int, seed: int = 0) -> dict[str, list[Request]]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    shared = []
    for _ in range(groups):
        system = tok(2048)
        shared += [Request(system + q, system + q) for q in (tok(128) for _ in range(per_group))]
    rng.shuffle(shared)
    histories = [tok(512) for _ in range(conversations)]
    chat = []
    for _ in range(turns):
        for c in range(conversations):
            answer = tok(256)
            chat.append(Request(list(histories[c]), histories[c] + answer))
            histories[c] = histories[c] + answer + tok(128)
    return {"shared prefix": shared, "multi-turn chat": chat}


def waves(requests: list, size: int = WAVE):
    return [requests[i:i + size] for i in range(0, len(requests), size)]


# ---- ours ---------------------------------------------------------------------------------------
def ragged(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat(seqs), torch.tensor([0] + [len(x) for x in seqs]).cumsum(0)


def run_ours(trace: list[Request], form: str, evict_all: bool = False) -> dict:
    """form: "call" (match / insert), "into" (match_into a block-table row / insert), "batched"
    (match_ragged / insert_ragged) or "batched_into" (match_ragged_into the wave's block table and
    length / node arrays / insert_ragged)."""
    batched = form in ("batched", "batched_into")
    pages = lambda n: -(-n // PAGE)  # noqa: E731
    alloc = kvcache.BlockAllocator(sum(pages(len(r.cached)) for r in trace), PAGE)
    cache = kvcache.PrefixCache(alloc)
    ns = kvcache.Namespace(model="bench")
    all_prompts = [torch.tensor(r.prompt, dtype=torch.int32) for r in trace]
    all_cached = [torch.tensor(r.cached, dtype=torch.int32) for r in trace]
    match, insert, match_ragged, insert_ragged = cache.match, cache.insert, cache.match_ragged, cache.insert_ragged
    match_into, match_ragged_into = cache.match_into, cache.match_ragged_into
    width = max(pages(len(r.prompt)) for r in trace)
    table_rows = lambda n: torch.empty(n, width, dtype=torch.int32).unbind(0)  # noqa: E731  (one row a request)
    # A server's per-batch arrays: the block table, and each request's cached length and node.
    batch_tables = lambda n: (torch.empty(n, width, dtype=torch.int32), torch.empty(n, dtype=torch.int64),  # noqa: E731
                              torch.empty(n, dtype=torch.int64))
    none, zero = torch.empty(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    if batched:  # the warm-up: an empty batch, which caches nothing
        match_ragged(none, zero, ns), insert_ragged(none, zero, none, zero, ns)
    else:
        match(none, ns), match_into(none, none, ns), insert(none, none, ns)
    lengths, tables, t_match, t_insert = [], [], 0.0, 0.0
    kept = []  # every wave's results, so that a wave's assignment frees nothing inside the clock
    for wave in waves(list(range(len(trace)))):
        # The wave arrives: its token arrays (fresh copies), and each request's own blocks (its prefill).
        blocks = [alloc.allocate(pages(len(trace[i].cached))) for i in wave]
        tables += blocks
        if batched:
            (p, cu), (c, cu_c) = ragged([all_prompts[i] for i in wave]), ragged([all_cached[i] for i in wave])
            b, cu_b = ragged(blocks)
            if form == "batched_into":
                table, got, nodes = batch_tables(len(wave))
                t0 = time.perf_counter()
                ms = match_ragged_into(p, cu, table, ns, lengths=got, nodes=nodes)
                t1 = time.perf_counter()
            else:
                t0 = time.perf_counter()
                ms = match_ragged(p, cu, ns)
                t1 = time.perf_counter()
            insert_ragged(c, cu_c, b, cu_b, ns)
            t2 = time.perf_counter()
            lengths += ms.lengths.tolist()
            kept.append(ms)
        else:
            prompts, cached = [all_prompts[i].clone() for i in wave], [all_cached[i].clone() for i in wave]
            rows = table_rows(len(wave))
            t0 = time.perf_counter()
            if form == "into":
                ms = [match_into(p, row, ns) for p, row in zip(prompts, rows)]
            else:
                ms = [match(p, ns) for p in prompts]
            t1 = time.perf_counter()
            for c, b in zip(cached, blocks):
                insert(c, b, ns)
            t2 = time.perf_counter()
            lengths += [m.length for m in ms]
            kept.append(ms)
        t_match, t_insert = t_match + t1 - t0, t_insert + t2 - t1
    del kept
    prompts = [p.clone() for p in all_prompts]  # every request again, all at once
    if batched:
        everything = ragged(prompts)
        if form == "batched_into":
            table, got, nodes = batch_tables(len(prompts))
            t0 = time.perf_counter()
            warm = match_ragged_into(*everything, table, ns, lengths=got, nodes=nodes)
        else:
            t0 = time.perf_counter()
            warm = match_ragged(*everything, ns)
        t_warm = time.perf_counter() - t0
        warm = warm.lengths.tolist()
    elif form == "into":
        rows = table_rows(len(prompts))
        t0 = time.perf_counter()
        warm = [match_into(p, row, ns) for p, row in zip(prompts, rows)]
        t_warm = time.perf_counter() - t0
        warm = [m.length for m in warm]
    else:
        t0 = time.perf_counter()
        warm = [match(p, ns) for p in prompts]
        t_warm = time.perf_counter() - t0
        warm = [m.length for m in warm]
    for t in tables:          # the requests finish: the cache holds the only references left
        alloc.free(t)
    stats = cache.stats()
    evict, calls, t0 = cache.evict, 0, time.perf_counter()
    if evict_all:
        evict(alloc.num_blocks)
    else:
        while evict(EVICT_TOKENS // PAGE) > 0:
            calls += 1
    t_evict = time.perf_counter() - t0
    assert alloc.num_free == alloc.num_blocks and cache.stats()["nodes"] == 0
    return {"lengths": lengths, "warm_lengths": warm, "match_s": t_match, "insert_s": t_insert, "warm_match_s": t_warm,
            "evict_s": t_evict, "evict_calls": calls + 1, "cached_tokens": stats["device_tokens"],
            "hit_rate": stats["hit_rate"]}  # (PrefixCache.stats: since the cache was made, the warm pass included)


# ---- SGLang -------------------------------------------------------------------------------------
class _Placeholder(types.ModuleType):
    """A module whose every attribute is an empty class (the names are only used in annotations)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {})
        setattr(self, name, cls)
        return cls


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in self.names else None

    def create_module(self, spec):
        return _Placeholder(spec.name)

    def exec_module(self, module):
        pass


def load_sglang():
    """(RadixCache, RadixKey, params module, version) or None with the reason printed."""
    finder = _PlaceholderFinder({"sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.allocator",
                                 "sglang.srt.observability.metrics_collector"})
    sys.meta_path.insert(0, finder)
    try:
        import importlib.metadata
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.mem_cache import base_prefix_cache as params
            from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        return RadixCache, RadixKey, params, importlib.metadata.version("sglang")
    except Exception as err:  # noqa: BLE001 - any import failure means "skip the peer"
        print(f"SGLang is not importable here ({type(err).__name__}: {err}); benchmarking kvcache only. "
              f"To compare: pip install --no-deps sglang, plus the packages named in this file's docstring.")
        return None
    finally:
        sys.meta_path.remove(finder)


class _FreeNothing:
    """SGLang's evict() frees KV through the allocator; in simulation there is nothing to free."""

    device = "cpu"

    def free_segment(self, *args, **kwargs):
        pass


def run_sglang(sgl, trace: list[Request], page: int, evict_all: bool = False) -> dict:
    RadixCache, RadixKey, params, _ = sgl
    cache = RadixCache.create_simulated(mock_allocator=_FreeNothing(), page_size=page)
    all_prompts, all_cached = [array("q", r.prompt) for r in trace], [array("q", r.cached) for r in trace]
    key = lambda seq: RadixKey(array("q", seq))  # noqa: E731  (a fresh copy)
    match, insert = cache.match_prefix, cache.insert
    match(params.MatchPrefixParams(key=key([]))), insert(params.InsertParams(key=key([])))  # the warm-up
    lengths, offset, t_match, t_insert = [], 0, 0.0, 0.0
    kept = []  # as in run_ours: freeing a wave's results is not timed
    for wave in waves(list(range(len(trace)))):
        prompts, inserts = [params.MatchPrefixParams(key=key(all_prompts[i])) for i in wave], []
        for i in wave:  # values: the KV slots of the request's tokens
            n = len(all_cached[i])
            inserts.append(params.InsertParams(key=key(all_cached[i]),
                                               value=torch.arange(offset, offset + n, dtype=torch.int64)))
            offset += n
        t0 = time.perf_counter()
        ms = [match(p) for p in prompts]
        t1 = time.perf_counter()
        for x in inserts:
            insert(x)
        t2 = time.perf_counter()
        t_match, t_insert = t_match + t1 - t0, t_insert + t2 - t1
        lengths += [m.device_prefix_len for m in ms]
        kept.append(ms)
    del kept
    prompts = [params.MatchPrefixParams(key=key(p)) for p in all_prompts]
    t0 = time.perf_counter()
    warm = [match(p) for p in prompts]
    t_warm = time.perf_counter() - t0
    warm = [m.device_prefix_len for m in warm]
    cached = cache.total_size()
    chunk = params.EvictParams(num_tokens=cached if evict_all else EVICT_TOKENS)
    evict, calls, t0 = cache.evict, 0, time.perf_counter()
    if evict_all:
        evict(chunk)
    else:
        while evict(chunk).num_tokens_evicted > 0:
            calls += 1
    t_evict = time.perf_counter() - t0
    assert cache.total_size() == 0
    return {"lengths": lengths, "warm_lengths": warm, "match_s": t_match, "insert_s": t_insert, "warm_match_s": t_warm,
            "evict_s": t_evict, "evict_calls": calls + 1, "cached_tokens": cached}


# ---- report -------------------------------------------------------------------------------------
def best_of(configs: dict, repeats: int) -> dict:
    """Each configuration's best replay (and median); the configurations take turns, replay by replay."""
    runs = {name: [] for name in configs}
    evict_all = {name: [] for name in configs}
    for _ in range(repeats):
        for name, fn in configs.items():
            runs[name].append(fn())
            evict_all[name].append(fn(evict_all=True)["evict_s"])
    out = {}
    for name, rs in runs.items():
        out[name] = dict(rs[0])
        for key in ("match_s", "insert_s", "warm_match_s", "evict_s"):
            out[name][key] = min(r[key] for r in rs)
            out[name][key + "_median"] = statistics.median(r[key] for r in rs)
        out[name]["evict_all_s"] = min(evict_all[name])
    return out


OPS = {  # op -> (result key, what one unit is)
    "match": ("match_s", "request"),
    "insert": ("insert_s", "request"),
    "match, warm cache": ("warm_match_s", "request"),
    "evict, 2176 tokens per call": ("evict_s", "2176 tokens"),
    "evict all, one call": ("evict_all_s", "2176 tokens"),
}


def per_unit(row: dict, res: dict, op: str) -> float:
    key, unit = OPS[op]
    units = row["requests"] if unit == "request" else res["cached_tokens"] / EVICT_TOKENS
    return res[key] / units * 1e6


def markdown(info: dict, rows: list[dict], sgl_version: str | None) -> str:
    load = info["load_average"]
    busy = f" (other jobs shared its {os.cpu_count()} cores, caches and memory bandwidth)" if load > 1.5 else ""
    lines = [f"Measured {info['date']} on {info['cpu']}, torch {info['torch']}, one thread, machine load average "
             f"{load:.1f}{busy}; "
             f"{'SGLang ' + sgl_version + ' RadixCache' if sgl_version else 'SGLang not installed'}. "
             f"Best of {rows[0]['repeats']} replays, the configurations taking turns; each wave's inputs are built "
             f"(untimed) as it arrives. Microseconds per request (match, insert) or per 2176 tokens "
             f"evicted (each cache counting its own tokens). Ours: pages of {PAGE}; *per call* = one request per "
             f"call (`match` / `insert`), *into a row* = the same with `match_into` writing each request's blocks "
             f"into its row of a block table (no result tensor; insert and evict as per call), "
             f"*batched* = one call per wave of {WAVE} requests (`match_ragged` / "
             f"`insert_ragged`; warm match: the whole trace in one call; evict is one call either way), "
             f"*batched into a table* = the same with `match_ragged_into` writing into the wave's block table "
             f"and length and node arrays (made untimed as the wave arrives, as a server keeps them). "
             f"Speed-ups are SGLang time / ours.", ""]
    forms = ("ours", "ours_into", "ours_batched", "ours_batched_into")
    head = "| workload | op | ours per call | ours into a row | ours batched | ours batched into a table |"
    sep = "|---|---|---|---|---|---|"
    if sgl_version:
        head += (" SGLang p=16 | SGLang p=1 | per call vs p=16 / p=1 | into a row vs p=16 / p=1 | batched vs p=16 / p=1 |"
                 " batched into a table vs p=16 / p=1 |")
        sep += "---|---|---|---|---|---|"
    lines += [head, sep]
    for r in rows:
        for op in OPS:
            ours = [per_unit(r, r[form], op) for form in forms]
            line = f"| {r['workload']} | {op} | " + " | ".join(f"{t:.2f}" for t in ours) + " |"
            if sgl_version:
                s16, s1 = per_unit(r, r["sglang_p16"], op), per_unit(r, r["sglang_p1"], op)
                line += f" {s16:.2f} | {s1:.2f} |" + "".join(f" {s16 / t:.1f}x / {s1 / t:.1f}x |" for t in ours)
            lines.append(line)
    lines += ["", "| workload | requests | tokens looked up (the replay) | hit rate (ours): the replay / with the warm "
                  "pass | cached tokens (ours / SGLang p=1) | match lengths (both passes) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['requests']} | {r['lookup_tokens']} | "
                     f"{r['replay_hit_rate']:.1%} / {r['ours']['hit_rate']:.1%} | "
                     f"{r['ours']['cached_tokens']} / {r.get('sglang_p1', {}).get('cached_tokens', '-')} | "
                     f"{r['lengths_check']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller trace and 2 repeats (unless --repeats), for a smoke run")
    parser.add_argument("--repeats", type=positive_int, default=None, help="replays of the trace, best taken (default: 7)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    repeats = args.repeats or (2 if args.quick else 7)
    trace = make_trace(8, 16, 5, 4) if args.quick else make_trace(64, 16, 20, 4)
    sgl = load_sglang()
    info = machine()
    load_before = os.getloadavg()[0]
    rows = []
    for name, requests in trace.items():
        row = {"workload": name, "requests": len(requests), "repeats": repeats,
               "lookup_tokens": sum(len(r.prompt) for r in requests)}
        configs = {"ours": lambda **kw: run_ours(requests, "call", **kw),
                   "ours_into": lambda **kw: run_ours(requests, "into", **kw),
                   "ours_batched": lambda **kw: run_ours(requests, "batched", **kw),
                   "ours_batched_into": lambda **kw: run_ours(requests, "batched_into", **kw)}
        if sgl:
            configs["sglang_p1"] = lambda **kw: run_sglang(sgl, requests, 1, **kw)
            configs["sglang_p16"] = lambda **kw: run_sglang(sgl, requests, PAGE, **kw)
        row.update(best_of(configs, repeats))
        ours = row["ours"]["lengths"] + row["ours"]["warm_lengths"]
        assert row["ours_batched"]["lengths"] + row["ours_batched"]["warm_lengths"] == ours, "batched != per call"
        assert row["ours_into"]["lengths"] + row["ours_into"]["warm_lengths"] == ours, "match_into != match"
        assert row["ours_batched_into"]["lengths"] + row["ours_batched_into"]["warm_lengths"] == ours, \
            "match_ragged_into != match"
        row["replay_hit_rate"] = sum(row["ours"]["lengths"]) / max(1, row["lookup_tokens"])
        row["lengths_check"] = "ours only"
        if sgl:
            same1 = row["sglang_p1"]["lengths"] + row["sglang_p1"]["warm_lengths"] == ours
            same16 = row["sglang_p16"]["lengths"] + row["sglang_p16"]["warm_lengths"] == [n // PAGE * PAGE for n in ours]
            row["lengths_check"] = (f"{len(ours)} matches: {'identical' if same1 else 'DIFFERENT'} to p=1, "
                                    f"{'identical' if same16 else 'DIFFERENT'} to p=16 (ours rounded down to pages)")
            if not (same1 and same16):
                print(f"WARNING: {name}: match lengths differ from SGLang's")
        for key in ("ours", "ours_into", "ours_batched", "ours_batched_into", "sglang_p1", "sglang_p16"):
            if key in row:
                row[key].pop("lengths")
                row[key].pop("warm_lengths")
        rows.append(row)
    info["load_average"] = (load_before + os.getloadavg()[0]) / 2  # 1-minute averages at the start and the end
    table = markdown(info, rows, sgl[3] if sgl else None)
    print(table)
    write_results("prefix_quick" if args.quick else "prefix",
                  {"machine": info, "sglang": sgl[3] if sgl else None, "page_size": PAGE, "wave": WAVE, "rows": rows},
                  table, args.out)


if __name__ == "__main__":
    main()
