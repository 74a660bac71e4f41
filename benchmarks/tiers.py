"""Prefix tiers: time to first token of a second worker whose prompts share a 4k-token prefix with a first
worker's, with no tier (it recomputes the prefix), the disk tier and the Redis tier on loopback.

SmolLM2-135M (kvcache.assets; fp32 weights), full precision and int8 pages. The prefix is 4,096 tokens of
real text (pydoc), each prompt adds a 64-token question. Worker 1 generates one prompt and writes its
chunks (disk and Redis); worker 2 (a new Engine: its own pages and prefix tree, nothing shared in memory)
generates another prompt with the same prefix, and its time to first token is measured, best of
``--repeats`` (each repeat a fresh worker 2). Also reported: the bytes moved per fetched token, and each
tier's cost-model constants as measured.

Then one case the cost model declines: the same Redis behind a slow link (a proxy pacing the bytes to
``--link-mb-s``, 2 MB/s by default), 1,024-token prefix. One RedisTier serves two fresh workers in turn:
the first fetches (the link is not measured yet) and so measures it; the second declines and recomputes.
The decline is right if the first worker's fetch was slower than recomputing (the no-tier row).

A redis-server is started on a free 127.0.0.1 port (no persistence) and stopped at the end.

    python benchmarks/tiers.py             # the full run
    python benchmarks/tiers.py --quick     # 1k-token prefix, one repeat
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

import kvcache
from common import machine, positive_int, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer  # noqa: E402


def _worker(model, fmt, **kw):
    return kvcache.Engine(model, kv_format=fmt, page_size=16, **kw)


def _ttft(engine, prompt) -> tuple[float, dict, list[int]]:
    r = engine.generate([prompt], max_new_tokens=1)
    s = engine.stats()
    return s["ttft_s"], s, r[0].tokens


def measure(model, fmt, prefix, questions, server, disk_dir, repeats, chunk_tokens=256):
    first = _worker(model, fmt, remote=server.url, disk=disk_dir, chunk_tokens=chunk_tokens)
    # a few decode steps, as any real request has: the prefix pages older than the int8 window are sealed
    # (quantized) by then, and the chunks carry them so (after one token they are all still open)
    first.generate([prefix + questions[0]], max_new_tokens=8)
    first.close()
    rows = {}
    for name, kw in (("none", {}), ("disk", {"disk": disk_dir}), ("redis", {"remote": server.url})):
        best, firsts = None, []
        for rep in range(repeats):
            if kw:
                kw = dict(kw, chunk_tokens=chunk_tokens)
            w = _worker(model, fmt, **kw)
            # a short warm-up: every worker has its pools and, with tiers, a measured compute rate
            _ttft(w, questions[1 + rep][:8] * 8)
            _ttft(w, questions[1 + rep][1:8] * 8)
            t, s, tokens = _ttft(w, prefix + questions[1 + rep])  # repeat r: the same prompt for every tier
            w.close()
            firsts.append(tokens[0])
            if best is None or t < best["ttft_s"]:
                tiers = s.get("tiers", {})
                hit = s.get("disk_hit_tokens", 0) + s.get("remote_hit_tokens", 0)
                moved = s.get("disk_fetch_bytes", 0) + s.get("remote_fetch_bytes", 0)
                best = {"tier": name, "ttft_s": t, "prefill_tokens": s["prefill_tokens"], "hit_tokens": hit,
                        "fetch_bytes": moved, "bytes_per_token": moved / hit if hit else 0.0,
                        "fetch_s": s.get("disk_fetch_s", 0) + s.get("remote_fetch_s", 0),
                        "declined_fetches": s.get("declined_fetches", 0),
                        "cost_model": tiers.get(f"{'remote' if name == 'redis' else name}_cost_model")}
        rows[name] = dict(best, first_tokens=firsts)
    for name in ("disk", "redis"):
        rows[name]["speedup"] = rows["none"]["ttft_s"] / rows[name]["ttft_s"]
    return rows


class SlowLink:
    """A TCP proxy to 127.0.0.1:``port`` that paces the server-to-client bytes to ``bytes_per_s``: a slow
    network between a worker and Redis."""

    def __init__(self, port: int, bytes_per_s: float):
        import socket
        import threading
        self.port, self.rate = port, bytes_per_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self._threading, self._socket = threading, socket
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = self._socket.create_connection(("127.0.0.1", self.port))
            self._threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            self._threading.Thread(target=self._pump, args=(upstream, client, self.rate), daemon=True).start()

    @staticmethod
    def _pump(src, dst, rate):
        start, sent = time.perf_counter(), 0
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                if rate:
                    sent += len(data)
                    ahead = sent / rate - (time.perf_counter() - start)
                    if ahead > 0:
                        time.sleep(ahead)
                    else:  # idle gaps earn no credit
                        start, sent = time.perf_counter(), 0
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def decline_case(model, prefix, questions, url) -> dict:
    """One RedisTier (and so one cost model) behind a slow link, used by two fresh workers in turn: the
    first fetches (nothing measured yet about the link) and measures it; the second declines."""
    warm = questions[-1] * 8  # a 512-token prefill: each worker's compute rate per token
    first = kvcache.Engine(model, page_size=16, remote=url)
    first.generate([prefix + questions[0]], max_new_tokens=8)  # writes the chunks through the link
    first.close()
    tier = kvcache.RedisTier(url, timeout=120)
    rows = {}
    for name, kw in (("fetch (link not yet measured)", {"remote": tier}),
                     ("declined (link measured)", {"remote": tier}), ("no tier", {})):
        w = kvcache.Engine(model, page_size=16, **kw)
        w.generate([warm], max_new_tokens=1)  # the first forward is not measured (one-time costs)
        w.generate([warm[1:]], max_new_tokens=1)
        t, s, _ = _ttft(w, prefix + questions[1 + len(rows)])
        rows[name] = {"ttft_s": t, "hit_tokens": s.get("remote_hit_tokens", 0),
                      "declined_fetches": s.get("declined_fetches", 0), "prefill_tokens": s["prefill_tokens"],
                      "cost_model": dict(tier.cost.constants()) if kw else None}
        w.close()  # its writer thread; the RedisTier (and its cost model) goes on to the next worker
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 1,024-token prefix and 1 repeat (unless --repeats)")
    ap.add_argument("--repeats", type=positive_int, default=None, help="fresh second workers, best taken (default: 2)")
    ap.add_argument("--link-mb-s", type=float, default=2.0, help="the slow link of the declined case")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a killed run still stops its redis-server
    repeats = args.repeats or (1 if args.quick else 2)
    prefix_tokens = 1024 if args.quick else 4096

    from kvcache.assets import load_smollm2, real_token_ids
    model, tok = load_smollm2()
    prefix = real_token_ids(tok, prefix_tokens, "pydoc")[0][0].tolist()
    n_questions = max(repeats + 2, 5) + 1  # worker 1's, one per repeat, the decline case's three, a warm-up
    text = real_token_ids(tok, 64 * n_questions, "devil", bos=False)[0][0].tolist()
    questions = [text[i * 64:(i + 1) * 64] for i in range(n_questions)]
    server = RedisServer(maxmemory="2gb").start()
    results, lines = {}, []
    try:
        with tempfile.TemporaryDirectory() as d:
            for fmt in (None, "int8"):
                rows = measure(model, fmt, prefix, questions, server, f"{d}/{fmt}", repeats)
                results[str(fmt or "fp32")] = rows
                # full precision: a fetched prefix gives the tokens recomputing gives (quantized pages
                # give what a local prefix cache gives, which the tests check)
                same = len({tuple(r["first_tokens"]) for r in rows.values()}) == 1
                print(f"{fmt or 'fp32'}: " + ", ".join(f"{k} {v['ttft_s'] * 1e3:.0f} ms" for k, v in rows.items())
                      + f", redis x{rows['redis']['speedup']:.1f}, same first token: {same}", flush=True)
            # a case to decline: the same Redis behind a slow link
            link = SlowLink(server.port, args.link_mb_s * 1e6)
            results["slow_link"] = decline_case(model, prefix[:1024], questions, link.url)
            link.close()
            print("slow link: " + ", ".join(f"{k} {v['ttft_s'] * 1e3:.0f} ms" for k, v in
                                            results["slow_link"].items()), flush=True)
    finally:
        server.stop()
    info = machine()
    md = [f"# Prefix tiers: TTFT of a second worker ({info['date']}, {info['cpu']}, {info['threads']} threads; "
          "shared machine, contended)", "",
          f"SmolLM2-135M fp32 weights, {prefix_tokens}-token shared prefix + 64-token question, page 16, chunks of "
          f"256 tokens; best of {repeats}. Redis {server.binary} on loopback.", "",
          "| pages | tier | TTFT ms | x vs none | prefilled tokens | fetched tokens | bytes / token | fetch ms |",
          "|---|---|---|---|---|---|---|---|"]
    for fmt in ("fp32", "int8"):
        for name, r in results[fmt].items():
            md.append(f"| {fmt} | {name} | {r['ttft_s'] * 1e3:.0f} | {r.get('speedup', 1.0):.1f} | "
                      f"{r['prefill_tokens']} | {r['hit_tokens']} | {r['bytes_per_token']:.0f} | "
                      f"{r['fetch_s'] * 1e3:.0f} |")
    md += ["", "Cost-model constants after the Redis worker (measured):", ""]
    for fmt in ("fp32", "int8"):
        md.append(f"- {fmt}: {results[fmt]['redis']['cost_model']}")
    md += ["", f"A fetch the cost model declines: the same Redis behind a {args.link_mb_s:g} MB/s link "
           "(a pacing proxy), SmolLM2 fp32, 1,024-token prefix; one RedisTier (one cost model) used by two fresh workers in turn:", "",
           "| worker 2 | TTFT ms | fetched tokens | declined fetches | cost model after |", "|---|---|---|---|---|"]
    for name, r in results["slow_link"].items():
        md.append(f"| {name} | {r['ttft_s'] * 1e3:.0f} | {r['hit_tokens']} | {r['declined_fetches']} | "
                  f"{r['cost_model']} |")
    md.append("")
    write_results("tiers", {"machine": info, "prefix_tokens": prefix_tokens, "results": results}, "\n".join(md),
                  args.out)
    print("\n".join(md))


if __name__ == "__main__":
    main()
