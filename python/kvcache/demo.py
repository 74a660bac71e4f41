"""The main job for now: the storage ops and the memory calculator, end to end, in a few seconds.

Run it with ``make demo`` (or ``python -m kvcache.demo`` where kvcache is installed).
"""

from __future__ import annotations

import time

import torch

import kvcache
from kvcache import memory


def storage_demo(device: str = "cpu") -> None:
    torch.manual_seed(0)
    heads, dim, page = 8, 128, 16
    prompt_lens = [100, 37, 250]
    layout = kvcache.PageLayout(num_blocks=64, page_size=page, num_kv_heads=heads, head_dim=dim, dtype=torch.bfloat16)
    k_cache, v_cache = layout.allocate(device, fill=0.0)
    print(f"pool: 2 x {list(layout.shape)} {layout.dtype} = {memory.format_bytes(2 * k_cache.nbytes)}")

    # A toy block manager: hand out blocks in a shuffled order, as a real allocator would after churn.
    free = torch.randperm(layout.num_blocks).tolist()
    tables = [[free.pop() for _ in range(layout.pages_for(n + 8))] for n in prompt_lens]  # room for 8 more
    block_tables = torch.tensor([t + [-1] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)

    # Prefill: each prompt's K/V arrive as HF hands them over, [1, heads, len, dim], non-contiguous.
    history_k, history_v = [], []
    t0 = time.perf_counter()
    for b, n in enumerate(prompt_lens):
        k = torch.randn(1, n, heads, dim, dtype=torch.bfloat16, device=device).transpose(1, 2)
        v = torch.randn(1, n, heads, dim, dtype=torch.bfloat16, device=device).transpose(1, 2)
        slots = layout.token_slots(block_tables[b], torch.arange(n)).view(1, n)
        kvcache.append(k, v, k_cache, v_cache, slots.to(device))
        history_k.append(k)
        history_v.append(v)
    # Decode: 8 steps of one token for every sequence at once, [batch, heads, 1, dim].
    lens = torch.tensor(prompt_lens)
    for _ in range(8):
        k = torch.randn(len(prompt_lens), 1, heads, dim, dtype=torch.bfloat16, device=device).transpose(1, 2)
        v = torch.randn(len(prompt_lens), 1, heads, dim, dtype=torch.bfloat16, device=device).transpose(1, 2)
        slots = torch.stack([layout.token_slots(block_tables[b], lens[b:b + 1]) for b in range(len(lens))])
        kvcache.append(k, v, k_cache, v_cache, slots.to(device))
        for b in range(len(lens)):
            history_k[b] = torch.cat([history_k[b], k[b:b + 1]], dim=2)
            history_v[b] = torch.cat([history_v[b], v[b:b + 1]], dim=2)
        lens += 1
    seq_lens = lens.to(torch.int32)
    gathered_k, gathered_v = kvcache.paged_gather(k_cache, v_cache, block_tables.to(device), seq_lens.to(device))
    elapsed = time.perf_counter() - t0
    exact = all(torch.equal(gathered_k[b, :, :n], history_k[b][0]) and torch.equal(gathered_v[b, :, :n], history_v[b][0])
                for b, n in enumerate(lens.tolist()))
    print(f"appended {sum(prompt_lens)} prompt tokens + 8 decode steps x {len(lens)} sequences, gathered "
          f"{list(gathered_k.shape)} back in {elapsed * 1e3:.1f} ms; identical to what went in: {exact}")

    # Copy-on-write: fork sequence 1, copying its partially filled last block before the fork writes it.
    last = layout.pages_for(int(lens[1])) - 1
    src_block, dst_block = tables[1][last], free.pop()
    kvcache.copy_blocks(k_cache, v_cache, torch.tensor([[src_block, dst_block]]))
    forked_row = block_tables[1].clone()
    forked_row[last] = dst_block
    same = torch.equal(kvcache.paged_gather(k_cache, v_cache, forked_row.view(1, -1).to(device), seq_lens[1:2].to(device))[0][0],
                       gathered_k[1, :, : int(lens[1])])
    print(f"fork of sequence 1: shares {last} full blocks, copied block {src_block} -> {dst_block}; reads back identical: {same}")

    # Host tier: move sequence 2's blocks to a host pool and back into fresh blocks.
    host_k, host_v = layout.allocate("cpu")
    used = tables[2][: layout.pages_for(int(lens[2]))]
    to_host = torch.tensor([[blk, i] for i, blk in enumerate(used)])
    kvcache.swap_blocks(k_cache, v_cache, host_k, host_v, to_host)
    k_cache[used] = 0  # the device blocks are reused by someone else
    fresh = [free.pop() for _ in used]
    kvcache.swap_blocks(host_k, host_v, k_cache, v_cache, torch.tensor([[i, blk] for i, blk in enumerate(fresh)]))
    row = torch.tensor([fresh], dtype=torch.int32)
    back = kvcache.paged_gather(k_cache, v_cache, row.to(device), seq_lens[2:3].to(device))[0][0]
    print(f"swapped {len(used)} blocks of sequence 2 out to host memory and back: identical: "
          f"{torch.equal(back, gathered_k[2, :, : int(lens[2])])}")


def memory_demo() -> None:
    llama3_8b = memory.KVShape(num_layers=32, num_kv_heads=8, head_dim=128)
    print(f"Llama-3-8B geometry: {memory.format_bytes(memory.bytes_per_token(llama3_8b, dtype='bfloat16'))} per token "
          f"(bf16); 8192 tokens = {memory.format_bytes(memory.cache_bytes(llama3_8b, 8192, dtype='bfloat16'))}; "
          f"int8 K + int4 V: {memory.format_bytes(memory.bytes_per_token(llama3_8b, k_bits=8, v_bits=4))} per token")
    torch.manual_seed(0)
    lengths = (torch.distributions.LogNormal(6.0, 1.0).sample((64,)).clamp(16, 4096)).int().tolist()
    paged = memory.paged_memory(llama3_8b, lengths, page_size=16, dtype="bfloat16")
    contiguous = memory.contiguous_memory(llama3_8b, lengths, max_len=4096, dtype="bfloat16")
    print(f"64 requests (log-normal lengths, mean {sum(lengths) / len(lengths):.0f} tokens):")
    print(f"  paged, page 16      : {paged}")
    print(f"  contiguous, max 4096: {contiguous}")


def main() -> None:
    info = kvcache.build_info
    print(f"kvcache {kvcache.__version__} | torch {torch.__version__} | CPU kernels"
          f"{' + CUDA kernels (sm ' + info['cuda_archs'] + ')' if info['cuda'] else ''} | "
          f"CUDA device present: {torch.cuda.is_available()}")
    print("\n== storage ops ==")
    storage_demo("cuda" if torch.cuda.is_available() else "cpu")
    print("\n== memory calculator ==")
    memory_demo()


if __name__ == "__main__":
    main()
