"""Decode and chunked-prefill attention over the pages vs PyTorch SDPA, against the machine's read roof.

Llama-3-8B-like layer by default: 32 query heads, 8 KV heads (GQA group 4), head_dim 128, pages of 16
tokens, pages in shuffled order (as after allocator churn); --head-dims and --groups add the other shapes
(32 query heads, 32 / group KV heads). For each configuration, in interleaved rounds of one run:
  - ours:          kvcache.paged_attention on the pages
  - sdpa:          torch SDPA (enable_gqa) on dense, contiguous K/V holding the same values
  - gather+sdpa:   kvcache.paged_gather into a dense buffer, then SDPA (what users do with a paged cache)
  - probe:         a streaming read of 1 GiB (the machine's read bandwidth in that same moment)
Each method cycles through enough layers that its working set is >= 1 GiB (L3 here is far smaller),
so every call streams its K/V from DRAM. Effective bandwidth = K+V bytes / time.

The roof of a decode step is the lower of the read roof and the compute roof: torch's own matrix product
in the kernel's arithmetic (bf16 where the CPU has bf16 dot products, else fp32), divided by the step's
4 FLOP per (query head, key, dim) over its K+V bytes. "% of roof" is the median over the rounds of each
round's ratio (ours and both probes are measured in every round).

    python benchmarks/attention.py            # the full table (several minutes)
    python benchmarks/attention.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import kvcache
from common import GiB, BandwidthProbe, ComputeProbe, best, machine, median, time_call, write_results

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


@dataclass
class Layer:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_dense: torch.Tensor  # [batch, kv_heads, ctx, d]
    v_dense: torch.Tensor


def make_layers(batch: int, ctx: int, dtype: torch.dtype, min_bytes: int, generator: torch.Generator,
                kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, dense: str = "all"):
    """`dense`: which layers also get a dense copy of their K/V ("all" for the peers, "first" for the
    correctness check only)."""
    blocks = batch * ctx // PAGE
    per_layer = 2 * batch * kv_heads * ctx * head_dim * dtype.itemsize
    count = max(1, math.ceil(min_bytes / per_layer))
    table = torch.randperm(blocks, generator=generator).to(torch.int32).view(batch, ctx // PAGE)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    layers = []
    for i in range(count):
        layout = kvcache.PageLayout(blocks, PAGE, kv_heads, head_dim, dtype)
        k_cache, v_cache = layout.allocate()
        k_cache.copy_(torch.randn(layout.shape, generator=generator))
        v_cache.copy_(torch.randn(layout.shape, generator=generator))
        k_dense, v_dense = (kvcache.paged_gather(k_cache, v_cache, table, lens) if dense == "all" or i == 0
                            else (None, None))
        layers.append(Layer(k_cache, v_cache, k_dense, v_dense))
    return layers, table, lens, per_layer


def decode_row(batch: int, ctx: int, dtype: torch.dtype, rounds: int, probe: BandwidthProbe, g: torch.Generator,
               peers: bool = True, compute: ComputeProbe | None = None,
               bf16_compute: ComputeProbe | None = None, group: int = Q_HEADS // KV_HEADS,
               head_dim: int = HEAD_DIM) -> dict:
    """`bf16_compute`: the compute probe in bf16, given where the kernel takes bf16 dot products (AVX-512
    BF16); bf16 pages are then held to it, everything else to the fp32 FMA roof (`compute`)."""
    kv_heads = Q_HEADS // group
    layers, table, lens, per_layer = make_layers(batch, ctx, dtype, GiB, g, kv_heads, head_dim,
                                                 dense="all" if peers else "first")
    q = torch.randn(batch, Q_HEADS, head_dim, generator=g).to(dtype)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    q_sdpa = q.view(batch, Q_HEADS, 1, head_dim)
    gather_out = (torch.empty_like(layers[0].k_dense), torch.empty_like(layers[0].v_dense)) if peers else None

    def ours():
        for layer in layers:
            kvcache.paged_attention(q, layer.k_cache, layer.v_cache, table, lens, cu)

    def sdpa():
        for layer in layers:
            F.scaled_dot_product_attention(q_sdpa, layer.k_dense, layer.v_dense, enable_gqa=True)

    def gather_sdpa():
        for layer in layers:
            k, v = kvcache.paged_gather(layer.k_cache, layer.v_cache, table, lens, out=gather_out)
            F.scaled_dot_product_attention(q_sdpa, k, v, enable_gqa=True)

    # Same answer first: the benchmark compares equal work.
    mine = kvcache.paged_attention(q, layers[0].k_cache, layers[0].v_cache, table, lens, cu)
    theirs = F.scaled_dot_product_attention(q_sdpa.float(), layers[0].k_dense.float(), layers[0].v_dense.float(),
                                            enable_gqa=True).view(batch, Q_HEADS, head_dim)
    max_err = (mine.float() - theirs).abs().max().item()
    assert max_err < 5e-2, f"kernel and SDPA disagree: {max_err}"
    if not peers:  # the dense copy was for this check only
        layers[0].k_dense = layers[0].v_dense = None

    names = ("ours", "sdpa", "gather+sdpa") if peers else ("ours",)
    times = {"probe": [], "compute": [], **{name: [] for name in names}}
    dp = bf16_compute if dtype == torch.bfloat16 else None
    flops = 4 * batch * Q_HEADS * ctx * head_dim  # q.k and p.v for every (query head, key, dim)
    roof_fraction = []  # per round: ours / min(read roof, compute roof of the kernel's arithmetic)
    ours()  # warm-up (thread pool, allocator)
    for _ in range(rounds):
        times["probe"].append(probe.buffer.nbytes / probe.measure())
        if compute is not None:
            times["compute"].append(compute.flops / compute.measure())
        read_roof = probe.buffer.nbytes / times["probe"][-1]
        compute_roof = dp.measure() / (flops / per_layer) if dp is not None else (
            compute.flops / times["compute"][-1] / (flops / per_layer) if compute is not None else math.inf)
        times["ours"].append(time_call(ours) / len(layers))
        roof_fraction.append(per_layer / times["ours"][-1] / min(read_roof, compute_roof))
        if peers:
            times["sdpa"].append(time_call(sdpa) / len(layers))
            times["gather+sdpa"].append(time_call(gather_sdpa) / len(layers))
    roof = probe.buffer.nbytes / best(times["probe"])
    row = {"batch": batch, "context": ctx, "head_dim": head_dim, "group": group,
           "dtype": str(dtype).removeprefix("torch."), "layers": len(layers),
           "kv_bytes_per_call": per_layer, "read_roof_GBps": roof / 1e9, "max_abs_diff_vs_sdpa": max_err}
    for name in names:
        t = best(times[name])
        row[f"{name}_ms"] = t * 1e3
        row[f"{name}_GBps"] = per_layer / t / 1e9
        row[f"{name}_roof_fraction"] = per_layer / t / roof
    row["roof_fraction_median"] = median(roof_fraction)
    row["roof_arithmetic"] = "bf16" if dp is not None else "fp32"
    if compute is not None:  # fp32 multiply-adds of the step: q.k and p.v for every (query head, key)
        row["fma_roof_GFLOPs"] = compute.flops / best(times["compute"]) / 1e9
        row["ours_GFLOPs"] = flops / best(times["ours"]) / 1e9
        row["ours_fma_fraction"] = row["ours_GFLOPs"] / row["fma_roof_GFLOPs"]
    row["ours_ms_all"] = [t * 1e3 for t in times["ours"]]  # every round: the spread on a shared machine
    row["read_roof_GBps_all"] = [probe.buffer.nbytes / t / 1e9 for t in times["probe"]]
    if peers:
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["ours_ms"]
        row["speedup_vs_gather_sdpa"] = row["gather+sdpa_ms"] / row["ours_ms"]
    del layers
    return row


def format_row(fmt: str, batch: int, ctx: int, rounds: int, probe: BandwidthProbe, g: torch.Generator) -> dict:
    """Decode step of a quantized pool (bf16 queries) next to a bf16 pool, interleaved in one run."""
    blocks = batch * ctx // PAGE
    table = torch.randperm(blocks, generator=g).to(torch.int32).view(batch, ctx // PAGE)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    slots = torch.stack([kvcache.PageLayout(blocks, PAGE, KV_HEADS, HEAD_DIM).token_slots(table[b], torch.arange(ctx))
                         for b in range(batch)])

    def layers_of(f: str) -> list[kvcache.KVPool]:
        probe_pool = kvcache.KVPool.allocate(blocks, PAGE, KV_HEADS, HEAD_DIM, f)
        count = max(1, math.ceil(GiB / probe_pool.nbytes))
        pools = [probe_pool] + [kvcache.KVPool.allocate(blocks, PAGE, KV_HEADS, HEAD_DIM, f) for _ in range(count - 1)]
        for pool in pools:
            x = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, generator=g).to(torch.bfloat16)
            pool.append(x, x, slots)
        return pools

    runs = {"bf16": layers_of("bf16"), fmt: layers_of(fmt)}
    times = {name: [] for name in runs}
    for pools in runs.values():
        pools[0].attention(q, table, lens, cu)
    for _ in range(rounds):
        for name, pools in runs.items():
            times[name].append(time_call(lambda: [p.attention(q, table, lens, cu) for p in pools]) / len(pools))
    t_q, t_b = best(times[fmt]), best(times["bf16"])
    nbytes = runs[fmt][0].nbytes
    # the gate is the ratio: per round (the two ran back to back), then the median
    ratio = median([a / b for a, b in zip(times[fmt], times["bf16"])])
    return {"format": fmt, "batch": batch, "context": ctx, "ms": t_q * 1e3, "bf16_ms": t_b * 1e3,
            "step_vs_bf16": ratio, "pool_bytes": nbytes, "GBps": nbytes / t_q / 1e9}


def prefill_row(q_len: int, prefix: int, dtype: torch.dtype, rounds: int, g: torch.Generator,
                compute: ComputeProbe | None = None) -> dict:
    """Chunked prefill: q_len new tokens attend to a cached prefix and causally to each other."""
    ctx = prefix + q_len
    layers, table, lens, _ = make_layers(1, ctx, dtype, 0, g)
    layer = layers[0]
    q = torch.randn(q_len, Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    q_sdpa = q.transpose(0, 1).unsqueeze(0)                                  # [1, heads, q_len, d]
    mask = kvcache.reference.attention_mask(q_len, ctx)                     # bottom-right causal
    ours = lambda: kvcache.paged_attention(q, layer.k_cache, layer.v_cache, table, lens, cu)  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q_sdpa, layer.k_dense, layer.v_dense,  # noqa: E731
                                                  attn_mask=mask, enable_gqa=True)
    max_err = (ours().float() - sdpa().float().squeeze(0).transpose(0, 1)).abs().max().item()
    assert max_err < 5e-2, f"kernel and SDPA disagree: {max_err}"
    times = {"ours": [], "sdpa": [], "compute": []}
    for _ in range(rounds):  # interleaved, like the decode rows
        times["ours"].append(time_call(ours))
        times["sdpa"].append(time_call(sdpa))
        if compute is not None:
            times["compute"].append(compute.flops / compute.measure())
    t_ours, t_sdpa = best(times["ours"]), best(times["sdpa"])
    flops = 4 * Q_HEADS * HEAD_DIM * q_len * (prefix + (q_len + 1) / 2)  # QK and PV over visible keys
    row = {"q_len": q_len, "prefix": prefix, "dtype": str(dtype).removeprefix("torch."),
           "ours_ms": t_ours * 1e3, "sdpa_ms": t_sdpa * 1e3, "ours_GFLOPs": flops / t_ours / 1e9,
           "sdpa_GFLOPs": flops / t_sdpa / 1e9, "speedup_vs_sdpa": t_sdpa / t_ours, "max_abs_diff_vs_sdpa": max_err}
    if compute is not None:
        row["fma_roof_GFLOPs"] = compute.flops / best(times["compute"]) / 1e9
    return row


def markdown(info: dict, decode: list[dict], prefill: list[dict], formats: list[dict]) -> str:
    lines = [
        f"Measured {info['date']} on {info['cpu']}, {info['threads']} threads, torch {info['torch']}, "
        f"kvcache CPU kernel `{info['kvcache_cpu_isa']}`{info['kvcache_cpu_paths']}. Decode step of one layer (32 q heads, 32 / group kv heads, "
        "page 16); bandwidth = K+V bytes / time; read roof = streaming read of 1 GiB, FMA roof = an fp32 "
        "1024^3 matrix product (GFLOP/s), both measured in the same rounds; a step does 4 x 32 x context x head_dim "
        "FLOPs per sequence.",
        "",
        "| dtype | head_dim | group | batch | context | ours ms | ours GB/s | % of roof (median of rounds) | % of read roof (best) "
        "| % of FMA roof | SDPA ms | gather+SDPA ms | vs SDPA | vs gather+SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in decode:
        peers = (f"{r['sdpa_ms']:.2f} | {r['gather+sdpa_ms']:.2f} | {r['speedup_vs_sdpa']:.1f}x | "
                 f"{r['speedup_vs_gather_sdpa']:.1f}x" if "sdpa_ms" in r else "- | - | - | -")
        fma = (f"{100 * r['ours_fma_fraction']:.0f}% of {r['fma_roof_GFLOPs']:.0f}" if "ours_fma_fraction" in r
               else "-")
        lines.append(f"| {r['dtype']} | {r.get('head_dim', HEAD_DIM)} | {r.get('group', Q_HEADS // KV_HEADS)} | "
                     f"{r['batch']} | {r['context']} | {r['ours_ms']:.2f} | {r['ours_GBps']:.1f} | "
                     f"{100 * r['roof_fraction_median']:.0f}% | "
                     f"{100 * r['ours_roof_fraction']:.0f}% of {r['read_roof_GBps']:.1f} | {fma} | {peers} |")
    if prefill:
        lines += ["", "| chunked prefill | dtype | ours ms | SDPA ms (explicit mask) | ours GFLOP/s | % of FMA roof "
                  "| vs SDPA |", "|---|---|---|---|---|---|---|"]
    for r in prefill:
        fma = f"{100 * r['ours_GFLOPs'] / r['fma_roof_GFLOPs']:.0f}%" if "fma_roof_GFLOPs" in r else "-"
        lines.append(f"| {r['q_len']} queries over {r['prefix']} | {r['dtype']} | {r['ours_ms']:.1f} | "
                     f"{r['sdpa_ms']:.1f} | {r['ours_GFLOPs']:.0f} | {fma} | {r['speedup_vs_sdpa']:.2f}x |")
    if formats:
        lines += ["", "| quantized decode (bf16 queries) | batch | context | ms | bf16 ms | step / bf16 step (median of rounds) "
                  "| pool GB/s |",
                  "|---|---|---|---|---|---|---|"]
        for r in formats:
            lines.append(f"| {r['format']} | {r['batch']} | {r['context']} | {r['ms']:.2f} | {r['bf16_ms']:.2f} | "
                         f"{r['step_vs_bf16']:.2f} | {r['GBps']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few small configurations, for a smoke run")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--formats", default="int8,fp8_e4m3,int4,kivi2", help="quantized formats compared with bf16")
    parser.add_argument("--skip-peers", action="store_true", help="only the quantized-format table")
    parser.add_argument("--skip-sdpa", action="store_true",
                        help="decode table without the SDPA columns (ours and the roof only; much faster)")
    parser.add_argument("--contexts", help="comma-separated decode contexts (default 1k..128k)")
    parser.add_argument("--batches", help="comma-separated decode batch sizes (default 1,16)")
    parser.add_argument("--head-dims", default=str(HEAD_DIM), help="comma-separated head dims of the decode table")
    parser.add_argument("--groups", default=str(Q_HEADS // KV_HEADS),
                        help="comma-separated GQA groups (query heads per KV head; 32 query heads) of the decode table")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    contexts = [1024, 8192] if args.quick else [1024, 4096, 16384, 32768, 65536, 131072]
    batches = [1] if args.quick else [1, 16]
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    # batch x context <= 512k tokens: the pages, the dense copy and the gather buffer fit in 24 GiB
    head_dims = [int(d) for d in args.head_dims.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    # The pages and one dense copy (twice more with the SDPA peers: their dense K/V and the gather buffer)
    # must fit in 24 GiB: at most 4 GiB of K+V per layer, 2 GiB with the peers.
    limit = (2 if args.skip_sdpa else 1) << 30
    configs = [(d, hd, gr, b, c) for d in dtypes for hd in head_dims for gr in groups for b in batches
               for c in contexts if b * c * (Q_HEADS // gr) * hd * d.itemsize <= limit]
    probe, compute = BandwidthProbe(), ComputeProbe()
    # the kernel's arithmetic on bf16 pages where it takes bf16 dot products (not on Intel cores: fp32 FMAs there)
    bf16_compute = (ComputeProbe(dtype=torch.bfloat16)
                    if kvcache._C.cpu_isa() == "avx512bf16" and kvcache._C.cpu_bf16_dot() else None)
    info = machine()
    decode, prefill = [], []
    if not args.skip_peers:
        for dtype, head_dim, group, batch, ctx in tqdm(configs, desc="decode", unit="config", disable=args.no_progress):
            decode.append(decode_row(batch, ctx, dtype, args.rounds, probe, g, peers=not args.skip_sdpa,
                                     compute=compute, bf16_compute=bf16_compute, group=group, head_dim=head_dim))
        if not args.skip_sdpa:
            prefill = [prefill_row(512, 1024 if args.quick else 8192, dtype, args.rounds, g, compute)
                       for dtype in tqdm(dtypes, desc="prefill", unit="dtype", disable=args.no_progress)]
    # batch 1 at 1k (a short chat), batch 8 at 32k (1 GiB of bf16 K+V: the step streams from DRAM)
    fmt_configs = [(f, b, c) for f in args.formats.split(",") if f
                   for b, c in ([(1, 1024)] if args.quick else [(1, 1024), (8, 32768)])]
    formats = [format_row(f, b, c, args.rounds, probe, g) for f, b, c in tqdm(fmt_configs, desc="formats", unit="config",
                                                                                    disable=args.no_progress)]
    table = markdown(info, decode, prefill, formats)
    print(table)
    write_results("attention_quick" if args.quick else "attention", {"machine": info, "decode": decode,
                                                                      "prefill": prefill, "formats": formats},
                  table, args.out)


if __name__ == "__main__":
    main()
