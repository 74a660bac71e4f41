// The schema of every op in the `kvcache` namespace, declared once: ops.cpp defines them under
// torch.ops.kvcache, and the CUDA emulation tests (csrc/cuda_emulation) define the same schemas under
// torch.ops.kvcache_cuda_emulation for the CUDA kernels run on the CPU. Schemas are honest about
// mutation: each written tensor is marked `(x!)` and writers return nothing, so torch.compile derives
// their fake kernels itself.
#pragma once

namespace kvcache {

inline constexpr const char* kOpSchemas[] = {
  // ---- cache: storage and data movement --------------------------------------------------------
  // Pools: k_cache / v_cache [num_blocks, num_kv_heads, page_size, head_dim], contiguous;
  // slot = block_id * page_size + offset_in_page.

  // Storage formats (core/kv_format.h), per K and V: k_format/v_format 0 = full precision (the pool's
  // dtype), 1 = int8 with k_scale/v_scale [num_blocks, num_kv_heads, page_size] float32 per row,
  // 2 / 3 = fp8 e4m3 / e5m2 with a float32 scale per kv head [num_kv_heads], 4 = int4 with fp16
  // (scale, zero) pairs per 32 dims, 5 / 6 = kivi4 / kivi2 (keys per channel over a page, written whole
  // pages at a time; values per token). + 16 (kRotatedFlag): rows Hadamard-rotated before quantizing
  // (core/quant.h); gather unrotates, paged_attention rotates the query and unrotates the output.

  // key/value [batch, num_kv_heads, q_len, head_dim] (any strides) -> pools at slot_mapping
  // [batch, q_len] int64; a slot of -1 skips that token. Quantized pools quantize on the way in.
  "append(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None, int k_format=0, int v_format=0) -> ()",

  // block_tables [batch, max_blocks] int32 + seq_lens [batch] int32 ->
  // k_out/v_out [batch, num_kv_heads, max_len, head_dim]; rows past a sequence's length are zeroed.
  // Quantized pools dequantize into k_out/v_out of any float dtype.
  "paged_gather(Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor(a!) k_out, Tensor(b!) v_out, Tensor? k_scale=None, Tensor? v_scale=None, int k_format=0, "
      "int v_format=0) -> ()",

  // block_tables [batch, max_blocks] int32 + cu_seq_lens [batch + 1] int32 ->
  // k_out/v_out [total_tokens, num_kv_heads, head_dim], sequence b at rows cu_seq_lens[b]:cu_seq_lens[b+1].
  "paged_gather_ragged(Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seq_lens, "
      "Tensor(a!) k_out, Tensor(b!) v_out, Tensor? k_scale=None, Tensor? v_scale=None, int k_format=0, "
      "int v_format=0) -> ()",

  // Copy-on-write inside one pool: block_mapping [n, 2] int64 (src, dst) pairs.
  "copy_blocks(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_mapping) -> ()",

  // Between two pools of the same block shape, e.g. device <-> host: block_mapping [n, 2] int64 on
  // the CPU, (src block in the src pools, dst block in the dst pools).
  "swap_blocks(Tensor k_src, Tensor v_src, Tensor(a!) k_dst, Tensor(b!) v_dst, "
      "Tensor block_mapping) -> ()",

  // ---- attention: read straight from the pages ----------------------------------------------------
  // query [total_q, q_heads, head_dim] (any strides); sequence b's queries are rows
  // cu_q_lens[b]:cu_q_lens[b+1] [batch + 1] int32 and are its last tokens: query i of a sequence of
  // seq_lens[b] tokens sits at position seq_lens[b] - q_len + i and sees keys j <= position (causal,
  // bottom-right), within window_left keys to its left (-1: no window) or among the first sink_tokens.
  // Scores scale * q.k, soft-capped as softcap * tanh(s / softcap) when softcap > 0. GQA/MQA: query
  // head h reads KV head h / (q_heads / kv_heads). out [total_q, q_heads, head_dim] in query's dtype;
  // lse [total_q, q_heads] float32 (natural log-sum-exp of the scaled scores), if given.
  // Quantized pools (formats as for append) are dequantized in registers, never copied.
  "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor cu_q_lens, float scale, int window_left, int sink_tokens, float softcap, Tensor(a!) out, "
      "Tensor(b!)? lse, Tensor? k_scale=None, Tensor? v_scale=None, int k_format=0, int v_format=0) -> ()",

  // ---- plan once per step, run per layer (plan/step_plan.h) --------------------------------------
  // plan_step reads the step's indices on the host once (block_tables, seq_lens and cu_q_lens as for
  // paged_attention, slot_mapping as for append; they may stay on the host while the pools are on a device),
  // validates them against the pools and returns (plan_host: CPU uint8, plan_device: uint8 on the pools'
  // device). The planned ops take both instead of the index tensors and read no index values on the host:
  // per layer they check shapes, dtypes, devices and formats against the plan. Treat both as read-only.
  "plan_step(Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, Tensor cu_q_lens, "
      "Tensor? slot_mapping, int q_heads, Tensor? k_scale=None, Tensor? v_scale=None, int k_format=0, "
      "int v_format=0) -> (Tensor, Tensor)",
  "paged_attention_planned(Tensor query, Tensor k_cache, Tensor v_cache, Tensor plan_host, Tensor plan_device, "
      "float scale, int window_left, int sink_tokens, float softcap, Tensor(a!) out, Tensor(b!)? lse, "
      "Tensor? k_scale=None, Tensor? v_scale=None, int k_format=0, int v_format=0) -> ()",
  "append_planned(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor plan_host, "
      "Tensor plan_device, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None, int k_format=0, "
      "int v_format=0) -> ()",

  // ---- MLA: absorbed attention over latent pages (mla/) --------------------------------------------
  // An MLA model (DeepSeek-V2/V3) caches per token a latent c of kv_lora_rank dims as its K row and the rotated
  // key part k_rope of qk_rope_head_dim dims as its V row: k_cache / v_cache are pools of two widths, formats
  // as for append (Hadamard-rotated ones refused). The caller folds each head's non-rotary query through the key
  // up-projection: q_latent [total_q, q_heads, kv_lora_rank] = q_nope . W_UK[h]; q_rope [total_q, q_heads,
  // qk_rope_head_dim]. Scores scale * (q_latent . c_j + q_rope . k_rope_j), causal and bottom-right as
  // paged_attention's (no window, sinks or softcap); out [total_q, q_heads, kv_lora_rank] = softmax . c (the
  // caller applies the value up-projection W_UV); lse as paged_attention's.
  "mla_attention(Tensor q_latent, Tensor q_rope, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor cu_q_lens, float scale, Tensor(a!) out, Tensor(b!)? lse, Tensor? k_scale=None, "
      "Tensor? v_scale=None, int k_format=0, int v_format=0) -> ()",

  // Two attention states over disjoint key sets -> the state over their union (split-K, cascade):
  // v_* [tokens, heads, head_dim], lse_* [tokens, heads] float32.
  "merge_states(Tensor v_a, Tensor lse_a, Tensor v_b, Tensor lse_b, Tensor(a!) v_out, "
      "Tensor(b!) lse_out) -> ()",
};

}  // namespace kvcache
