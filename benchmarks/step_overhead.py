"""Per-layer host overhead of a decode step: append + paged_attention, unplanned vs planned once per step.

A 1-token decode over a 16-token context keeps the kernels themselves short, so what is timed is the host
side: Python wrappers, the dispatcher, validation, index reads and planning. The unit is a tiny
``torch.add`` (two 1-element tensors, out=), timed in the same rounds, so the figure travels between
machines. Rounds interleave (add, unplanned layer, planned layer, ...); medians of per-round figures.

    python benchmarks/step_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import kvcache
from common import machine, write_results


def per_call(fn, calls: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=32, help="layers sharing one plan (its cost is spread)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(2)
    q_heads, kv_heads, dim, page, ctx, batch = 32, 8, 128, 16, 16, args.batch
    rows = []
    for fmt in ("bf16", "int8"):
        pool = kvcache.KVPool.allocate(batch * 2 + 1, page, kv_heads, dim, fmt)
        table = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2)
        lens = torch.full((batch,), ctx + 1, dtype=torch.int32)
        cu = torch.arange(batch + 1, dtype=torch.int32)
        x = torch.randn(batch, kv_heads, ctx + 1, dim).to(torch.bfloat16)
        for b in range(batch):
            pool.append(x[b:b + 1], x[b:b + 1], pool.layout.token_slots(table[b], torch.arange(ctx + 1)).view(1, -1))
        slots = torch.stack([pool.layout.token_slots(table[b], torch.tensor([ctx])) for b in range(batch)])
        key = x[:, :, -1:].contiguous()
        q = torch.randn(batch, q_heads, dim).to(torch.bfloat16)
        a, b_, c = torch.ones(1), torch.ones(1), torch.empty(1)

        def tiny_add():
            torch.add(a, b_, out=c)

        def unplanned():
            pool.append(key, key, slots)
            pool.attention(q, table, lens, cu)

        plan = pool.plan(table, lens, cu, slots, q_heads=q_heads)

        def planned():
            pool.append(key, key, plan)
            pool.attention_planned(q, plan)

        def make_plan():
            pool.plan(table, lens, cu, slots, q_heads=q_heads)

        # The host part alone: the same calls on a step with no queries and no new tokens (every check, read
        # and plan, no task to run), so the kernel's own minimum work (a 16-key tile per KV head) drops out.
        no_q, no_cu, no_slots = q[:0], torch.zeros(batch + 1, dtype=torch.int32), slots[:, :0]
        no_key = key[:, :, :0]
        empty_plan = pool.plan(table, lens, no_cu, no_slots, q_heads=q_heads)

        def unplanned_host():
            pool.append(no_key, no_key, no_slots)
            pool.attention(no_q, table, lens, no_cu)

        def planned_host():
            pool.append(no_key, no_key, empty_plan)
            pool.attention_planned(no_q, empty_plan)

        got = {"add": [], "unplanned": [], "planned": [], "plan": [], "unplanned_host": [], "planned_host": []}
        for _ in range(args.rounds):
            got["add"].append(per_call(tiny_add, args.calls))
            got["unplanned"].append(per_call(unplanned, args.calls // 4))
            got["planned"].append(per_call(planned, args.calls // 4))
            got["plan"].append(per_call(make_plan, args.calls // 4))
            got["unplanned_host"].append(per_call(unplanned_host, args.calls // 4))
            got["planned_host"].append(per_call(planned_host, args.calls // 4))
        ratio = lambda name: statistics.median(t / add for t, add in zip(got[name], got["add"]))  # noqa: E731
        planned_step = statistics.median((p + s / args.layers) / add
                                         for p, s, add in zip(got["planned"], got["plan"], got["add"]))
        rows.append({"format": fmt, "batch": batch, "add_us": statistics.median(got["add"]) * 1e6,
                     "unplanned_adds": ratio("unplanned"), "planned_adds": ratio("planned"),
                     "plan_adds": ratio("plan"), "planned_with_plan_adds": planned_step,
                     "speedup": ratio("unplanned") / planned_step,
                     "unplanned_host_adds": ratio("unplanned_host"), "planned_host_adds": ratio("planned_host")})
    info = machine()
    lines = [f"Measured {info['date']} on {info['cpu']}, torch {info['torch']}: per-layer host cost of a 1-token decode "
             f"over a {ctx}-token context (32 q / 8 kv heads, d 128, batch {batch}), in tiny torch.add calls "
             f"(median of {args.rounds} interleaved rounds); the plan is made once per step for {args.layers} layers.",
             "The host columns time the same calls on a step with no queries and no new tokens: every check, "
             "index read and plan, but no task to run.",
             "", "| format | tiny add (us) | unplanned append + attention | planned append + attention | plan_step "
             f"| planned + plan / {args.layers} | unplanned / planned | host part: unplanned | host part: planned |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['add_us']:.2f} | {r['unplanned_adds']:.1f} | {r['planned_adds']:.1f} | "
                     f"{r['plan_adds']:.1f} | {r['planned_with_plan_adds']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['unplanned_host_adds']:.1f} | {r['planned_host_adds']:.1f} |")
    table_md = "\n".join(lines) + "\n"
    print(table_md)
    write_results("step_overhead", {"machine": info, "rows": rows}, table_md, args.out)


if __name__ == "__main__":
    main()
