"""KV memory waste: kvcache.BlockAllocator's pages vs a contiguous max-length reservation per request.

A seeded ShareGPT-like workload (prompt and output lengths log-normal with the means reported for
ShareGPT in the vLLM paper, 161 and 338 tokens; a request holds at most the context of 2048 tokens)
runs through continuous batching: up to 64 requests at a time, each step every running request
appends one token, a finished request releases its blocks and the next waiting one is admitted with
its whole prompt. Every step we read the allocator's exact accounting (and check it against the
lengths: waste = sum over requests of pages * page_size - tokens).

  - paged: internal waste = reserved but unwritten slots in the blocks in use, over all steps.
  - contiguous: each running request holds a buffer of the full context (2048 tokens), as a static,
    max-length cache does; waste = unused slots of those buffers.

Memory is for a Llama-3-8B-like geometry (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB/token).

    python benchmarks/memory.py            # page sizes 1 .. 256, 1000 requests
    python benchmarks/memory.py --quick    # page 16 only, 200 requests
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch

import kvcache
from common import machine, positive_int, write_results
from kvcache import memory

CONTEXT = 2048
BATCH = 64
SHAPE = memory.KVShape(num_layers=32, num_kv_heads=8, head_dim=128)
BYTES_PER_TOKEN = int(memory.cache_bytes(SHAPE, [1], dtype="bfloat16"))


def sharegpt_like(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, output) lengths: log-normal with means ~161 and ~338, prompt + output <= CONTEXT."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = max(1, min(CONTEXT - 1, round(rng.lognormvariate(math.log(161) - 0.5, 1.0))))
        output = max(1, min(CONTEXT - prompt, round(rng.lognormvariate(math.log(338) - 0.32, 0.8))))
        out.append((prompt, output))
    return out


def simulate(requests: list[tuple[int, int]], page: int) -> dict:
    alloc = kvcache.BlockAllocator(BATCH * -(-CONTEXT // page), page)
    waiting = list(reversed(requests))
    running: list[list] = []  # [sequence, tokens still to generate]
    paged_waste = paged_slots = contiguous_waste = contiguous_slots = steps = 0
    peak_paged_blocks = peak_running = 0
    while waiting or running:
        while waiting and len(running) < BATCH:
            prompt, output = waiting.pop()
            seq = alloc.sequence()
            alloc.append(seq, prompt)
            running.append([seq, output])
        s = alloc.stats()
        tokens = sum(seq.num_tokens for seq, _ in running)
        expected = sum(-(-seq.num_tokens // page) * page - seq.num_tokens for seq, _ in running)
        assert s["waste_tokens"] == expected and s["filled_tokens"] == tokens, "the allocator's accounting is off"
        paged_waste += s["waste_tokens"]
        paged_slots += s["used"] * page
        contiguous_waste += len(running) * CONTEXT - tokens
        contiguous_slots += len(running) * CONTEXT
        peak_paged_blocks, peak_running = max(peak_paged_blocks, s["used"]), max(peak_running, len(running))
        steps += 1
        for item in running:          # one decode step
            alloc.append(item[0], 1)
            item[1] -= 1
        for item in [r for r in running if r[1] == 0]:
            alloc.release(item[0])
            running.remove(item)
    assert alloc.num_free == alloc.num_blocks
    return {"page_size": page, "steps": steps, "paged_waste": paged_waste / paged_slots,
            "contiguous_waste": contiguous_waste / contiguous_slots,
            "peak_paged_bytes": peak_paged_blocks * page * BYTES_PER_TOKEN,
            "peak_contiguous_bytes": peak_running * CONTEXT * BYTES_PER_TOKEN,
            "mean_paged_bytes": paged_slots / steps * BYTES_PER_TOKEN,
            "mean_contiguous_bytes": contiguous_slots / steps * BYTES_PER_TOKEN}


def markdown(info: dict, rows: list[dict], requests: list[tuple[int, int]]) -> str:
    n = len(requests)
    prompt = sum(p for p, _ in requests) / n
    output = sum(o for _, o in requests) / n
    lines = [f"Measured {info['date']} on {info['cpu']}, torch {info['torch']}. {n} ShareGPT-like requests "
             f"(seed 0; mean prompt {prompt:.0f}, mean output {output:.0f} tokens, context {CONTEXT}), "
             f"continuous batching of up to {BATCH}; waste = unused share of the reserved KV slots, summed over "
             f"all {rows[0]['steps']} decode steps. Bytes: 32 layers x 8 KV heads x 128 x bf16 "
             f"({BYTES_PER_TOKEN // 1024} KiB per token).", "",
             "| page size | paged waste | contiguous waste | mean KV held, paged | mean KV held, contiguous "
             "| peak paged | peak contiguous |", "|---|---|---|---|---|---|---|"]
    gib = 1 << 30
    for r in rows:
        lines.append(f"| {r['page_size']} | {r['paged_waste']:.2%} | {r['contiguous_waste']:.2%} | "
                     f"{r['mean_paged_bytes'] / gib:.2f} GiB | {r['mean_contiguous_bytes'] / gib:.2f} GiB | "
                     f"{r['peak_paged_bytes'] / gib:.2f} GiB | {r['peak_contiguous_bytes'] / gib:.2f} GiB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="page 16 and 200 requests (unless --requests), for a smoke run")
    parser.add_argument("--requests", type=positive_int, default=None, help="requests of the trace (default: 1000)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    requests = sharegpt_like(args.requests or (200 if args.quick else 1000))
    pages = [16] if args.quick else [1, 4, 8, 16, 32, 64, 128, 256]
    info = machine()
    rows = [simulate(requests, p) for p in pages]
    table = markdown(info, rows, requests)
    print(table)
    write_results("memory_quick" if args.quick else "memory", {"machine": info, "rows": rows}, table, args.out)


if __name__ == "__main__":
    main()
