"""Pure-PyTorch references: the specification of every kvcache op.

Tests compare each kernel against these functions, benchmarks use them as the "plain PyTorch" baseline,
and they double as a slow fallback. They use :class:`kvcache.layout.PageLayout` for every page offset and
mirror the ops' destination-passing signatures: writers mutate their cache/output arguments in place.

K and V pools may differ in row width (``PageLayout.v_head_dim``, MLA latents): every storage function here
indexes blocks, heads and positions only, so each side keeps its own width (V tensors end in ``v_head_dim``).
"""

from __future__ import annotations

import torch

from . import quant
from .formats import ROTATED, KVFormat
from .layout import PageLayout


def append(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    """Writes K/V of new tokens into the pools at their slots (-1 skips a token).

    key, value: [batch, num_kv_heads, q_len, head_dim] (value: v_head_dim); slot_mapping: [batch, q_len] int64.
    """
    layout = PageLayout.of(k_cache)
    keep = slot_mapping >= 0                                     # [batch, q_len]
    block, offset = layout.split_slot(slot_mapping[keep])        # [n], [n]
    k_cache[block, :, offset, :] = key.transpose(1, 2)[keep]     # [n, num_kv_heads, head_dim]
    v_cache[block, :, offset, :] = value.transpose(1, 2)[keep]


def _gather_one(k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor,
                length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence, [length, num_kv_heads, head_dim] (V: v_head_dim)."""
    layout = PageLayout.of(k_cache)
    positions = torch.arange(length, device=k_cache.device)
    block, offset = layout.split_slot(layout.token_slots(table_row, positions))
    return k_cache[block, :, offset, :], v_cache[block, :, offset, :]


def paged_gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Pages -> padded [batch, num_kv_heads, max_len, head_dim]; rows past each length are zero."""
    k_out.zero_()
    v_out.zero_()
    for b, length in enumerate(seq_lens.tolist()):
        k, v = _gather_one(k_cache, v_cache, block_tables[b], length)
        k_out[b, :, :length] = k.transpose(0, 1)
        v_out[b, :, :length] = v.transpose(0, 1)


def paged_gather_ragged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        cu_seq_lens: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Pages -> packed [total_tokens, num_kv_heads, head_dim], sequence b at rows cu[b]:cu[b+1]."""
    cu = cu_seq_lens.tolist()
    for b in range(len(cu) - 1):
        k, v = _gather_one(k_cache, v_cache, block_tables[b], cu[b + 1] - cu[b])
        k_out[cu[b]:cu[b + 1]] = k
        v_out[cu[b]:cu[b + 1]] = v


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """k_cache[dst] = k_cache[src] (and V) for each (src, dst) row of block_mapping [n, 2]."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def swap_blocks(k_src: torch.Tensor, v_src: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """k_dst[dst] = k_src[src] (and V) across pools, possibly on different devices."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    k_dst[dst.to(k_dst.device)] = k_src[src.to(k_src.device)].to(k_dst.device)
    v_dst[dst.to(v_dst.device)] = v_src[src.to(v_src.device)].to(v_dst.device)


def attention_mask(q_len: int, kv_len: int, window_left: int = -1, sink_tokens: int = 0,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """[q_len, kv_len] bool: query i (at position kv_len - q_len + i) may see key j."""
    pos = torch.arange(kv_len - q_len, kv_len, device=device).view(-1, 1)
    key = torch.arange(kv_len, device=device).view(1, -1)
    visible = key <= pos                                             # causal, aligned bottom-right
    if window_left >= 0:
        visible &= (key >= pos - window_left) | (key < sink_tokens)  # sliding window + attention sinks
    return visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_left: int = -1,
              sink_tokens: int = 0, softcap: float = 0.0,
              compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence. q [q_len, q_heads, d]; k, v [kv_len, kv_heads, d].

    Returns out [q_len, q_heads, d] (q's dtype) and lse [q_len, q_heads] (float32). With
    ``compute_dtype=q.dtype`` the matmuls run in the input precision, as a plain PyTorch user's would;
    ``compute_dtype=torch.float64`` gives the ground truth that tests measure both against.
    """
    q_len, q_heads, _ = q.shape
    kv_len, kv_heads, _ = k.shape
    group = q_heads // kv_heads
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32    # softmax precision
    qh = q.transpose(0, 1).to(compute_dtype)                                    # [q_heads, q_len, d]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0).to(compute_dtype)   # [q_heads, kv_len, d]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0).to(compute_dtype)
    scores = (qh @ kh.transpose(1, 2)).to(acc) * scale                         # [q_heads, q_len, kv_len]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~attention_mask(q_len, kv_len, window_left, sink_tokens, q.device), float("-inf"))
    # weights relative to the row's max, normalized by their sum: exp(score - lse) lost the log of the key count
    # where lse is large (scores ~1e8 over 4 equal keys: lse rounds to the max, and the output was 4x the mean)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak).nan_to_num(0.0)                         # rows with no key: 0
    total = weights.sum(dim=-1, keepdim=True)
    lse = (peak + torch.log(total)).squeeze(-1)                                # [q_heads, q_len]
    probs = (weights / total).nan_to_num(0.0)
    out = (probs.to(compute_dtype) @ vh).to(acc)
    return out.transpose(0, 1).to(q.dtype), lse.transpose(0, 1).float()


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_q_lens: torch.Tensor, scale: float, window_left: int,
                    sink_tokens: int, softcap: float, out: torch.Tensor, lse: torch.Tensor | None = None,
                    compute_dtype: torch.dtype = torch.float32) -> None:
    """Attention of a ragged batch of queries over the pages: gather each sequence, then :func:`attention`."""
    cu = cu_q_lens.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        if cu[b + 1] == cu[b]:
            continue
        k, v = _gather_one(k_cache, v_cache, block_tables[b], kv_len)
        o, l = attention(query[cu[b]:cu[b + 1]], k, v, scale, window_left, sink_tokens, softcap, compute_dtype)
        out[cu[b]:cu[b + 1]] = o
        if lse is not None:
            lse[cu[b]:cu[b + 1]] = l


def mla_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_q_lens: torch.Tensor, scale: float,
                  out: torch.Tensor, lse: torch.Tensor | None = None,
                  compute_dtype: torch.dtype = torch.float32) -> None:
    """Absorbed MLA attention over latent pages (full-precision pools; :func:`dequantize_pool` others).

    ``k_cache`` holds each token's latent ``c`` (kv_lora_rank dims), ``v_cache`` its rotated key part; the key
    of head ``h`` is ``[c | k_rope]`` against the query ``[q_latent | q_rope]``, and the value is ``c`` itself:
    :func:`attention` with those keys and values."""
    cu = cu_q_lens.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        if cu[b + 1] == cu[b]:
            continue
        c, k_rope = _gather_one(k_cache, v_cache, block_tables[b], kv_len)    # [kv_len, kv_heads, d]
        rows = slice(cu[b], cu[b + 1])
        query = torch.cat([q_latent[rows], q_rope[rows]], dim=-1)
        o, l = attention(query, torch.cat([c, k_rope], dim=-1).to(query.dtype), c.to(query.dtype), scale,
                         compute_dtype=compute_dtype)
        out[rows] = o
        if lse is not None:
            lse[rows] = l


def plan_step(block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_q_lens: torch.Tensor,
              slot_mapping: torch.Tensor | None = None) -> dict:
    """A step's plan as the reference sees it: the index tensors themselves (a kernel plan adds validation,
    done once, and a task list, neither of which changes what the planned ops compute)."""
    return {"block_tables": block_tables, "seq_lens": seq_lens, "cu_q_lens": cu_q_lens, "slot_mapping": slot_mapping}


def paged_attention_planned(plan: dict, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            scale: float, window_left: int, sink_tokens: int, softcap: float, out: torch.Tensor,
                            lse: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float32) -> None:
    """:func:`paged_attention` with the plan's tables, lengths and query offsets."""
    paged_attention(query, k_cache, v_cache, plan["block_tables"], plan["seq_lens"], plan["cu_q_lens"], scale,
                    window_left, sink_tokens, softcap, out, lse, compute_dtype)


def append_planned(plan: dict, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> None:
    """:func:`append` at the plan's slot_mapping."""
    append(key, value, k_cache, v_cache, plan["slot_mapping"])


def merge_states(v_a: torch.Tensor, lse_a: torch.Tensor, v_b: torch.Tensor, lse_b: torch.Tensor,
                 v_out: torch.Tensor, lse_out: torch.Tensor) -> None:
    """The state over the union of two disjoint key sets: weights exp(lse_x - lse), lse = logaddexp. The weights
    are taken from the difference of the two lse (exp(lse_x - lse) in float32 stopped summing to 1 where the lse are
    large: equal ones of 1e8 gave v_a + v_b)."""
    lse = torch.logaddexp(lse_a, lse_b)
    empty = lse == -torch.inf  # both sets empty: weights 0 (not -inf - -inf = NaN); a NaN or +inf lse stays NaN
    peak = torch.maximum(lse_a, lse_b)
    e_a, e_b = torch.exp(lse_a - peak), torch.exp(lse_b - peak)
    w_a = torch.where(empty, 0.0, e_a / (e_a + e_b)).unsqueeze(-1)
    w_b = torch.where(empty, 0.0, e_b / (e_a + e_b)).unsqueeze(-1)
    v_out.copy_(w_a * v_a.float() + w_b * v_b.float())
    lse_out.copy_(lse)


# ---- quantized pools (kvcache.KVPool): format ids 1 = int8, 2 = fp8 e4m3, 3 = fp8 e5m2, 4 = int4 -------
# (+ 16: rows Hadamard-rotated before quantizing, kvcache.quant.rotate); 5 = kivi4, 6 = kivi2


def _kivi_key_pages(key: torch.Tensor, slot_mapping: torch.Tensor, pool: torch.Tensor, meta: torch.Tensor,
                    bits: int) -> None:
    """KIVI keys: each run of page_size slots of a row is one whole page (or -1): per channel, min/max over
    the page's tokens; codes planar, metadata [blocks, heads, d / 32, 2, 32] (scales, then zeros)."""
    page = pool.shape[2]
    batch, heads, q_len, d = key.shape
    for b in range(batch):
        for t0 in range(0, q_len, page):
            first = int(slot_mapping[b, t0])
            if first < 0:
                continue
            block = first // page
            codes, scale, zero = quant.uint_quantize(key[b, :, t0:t0 + page], bits, dim=1)  # [heads, page, d]
            pool[block] = quant.pack_planar(codes, bits)
            meta[block] = torch.stack([scale.half().view(heads, d // 32, 32), zero.half().view(heads, d // 32, 32)],
                                      dim=2)


def append_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                     k_format: int, v_format: int) -> None:
    """append into pools of any format: full precision copies, int8 / fp8 quantize with kvcache.quant.

    Bad values follow kvcache.quant: scales and zero points from finite values only, NaN as fp8's NaN code or
    a NaN scale of its token's int8 row / int4 or KIVI-value group (KIVI keys: the code nearest 0), +-Inf as
    the largest code of its sign."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page = k_cache.shape[2]
    block, offset = torch.div(slots, page, rounding_mode="floor"), slots % page
    for x, pool, scale, fmt_id in ((key, k_cache, k_scale, k_format), (value, v_cache, v_scale, v_format)):
        fmt = KVFormat.from_kernel_id(fmt_id, pool.dtype if pool.is_floating_point() else torch.float32)
        rows = x.transpose(1, 2)[keep]                                   # [n, kv_heads, head_dim]
        if fmt.hadamard:
            rows = quant.rotate(rows)
        if fmt.kind.startswith("kivi") and pool is k_cache:
            _kivi_key_pages(x, slot_mapping, pool, scale, fmt.bits)
        elif fmt.kind.startswith("kivi"):  # values: per token, groups of 32, planar codes
            codes, group_scale, zero = quant.group_quantize(rows, fmt.bits, 32)
            pool[block, :, offset, :] = quant.pack_planar(codes, fmt.bits)
            scale[block, :, offset] = torch.stack([group_scale.half(), zero.half()], dim=-1)
        elif not fmt.quantized:
            pool[block, :, offset, :] = rows
        elif fmt.kind == "int8":
            codes, row_scale = quant.int8_quantize(rows)
            pool[block, :, offset, :] = codes
            scale[block, :, offset] = row_scale
        elif fmt.kind == "int4":  # groups of 32, codes packed two per byte, fp16 (scale, zero)
            codes, group_scale, zero = quant.group_quantize(rows, 4, 32)
            pool[block, :, offset, :] = quant.pack(codes, 4)
            scale[block, :, offset] = torch.stack([group_scale.half(), zero.half()], dim=-1)
        else:
            per_head = scale.view(1, -1, 1)
            pool[block, :, offset, :] = quant.fp8_quantize(rows, per_head, fmt.kind.removeprefix("fp8_")).to(pool.dtype)


def dequantize_pool(pool: torch.Tensor, scale: torch.Tensor | None, fmt_id: int) -> torch.Tensor:
    """The values a pool of any format (its kernel id, :attr:`kvcache.KVFormat.kernel_id`) stands for, in
    float32, shaped like the pool."""
    fmt = KVFormat.from_kernel_id(fmt_id)
    if fmt.hadamard:
        return quant.unrotate(dequantize_pool(pool, scale, fmt_id - ROTATED))
    if fmt.kind.startswith("kivi"):
        codes = quant.unpack_planar(pool, fmt.bits).float()              # [blocks, heads, page, d]
        if scale.shape[-1] == 32:                                         # keys: [blocks, heads, d / 32, 2, 32]
            s = scale[:, :, :, 0].reshape(*scale.shape[:2], 1, -1).float()
            z = scale[:, :, :, 1].reshape(*scale.shape[:2], 1, -1).float()
            return codes * s + z
        return quant.group_dequantize(codes.to(torch.uint8), scale[..., 0].float(), scale[..., 1].float())
    if not fmt.quantized:
        return pool.float()
    if fmt.kind == "int8":
        return quant.int8_dequantize(pool, scale)
    if fmt.kind == "int4":
        return quant.group_dequantize(quant.unpack(pool, 4), scale[..., 0].float(), scale[..., 1].float())
    return quant.fp8_dequantize(pool.view(torch.uint8), scale.view(1, -1, 1, 1), fmt.kind.removeprefix("fp8_"))
