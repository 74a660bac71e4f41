#include "attention/attention_prepare.h"

#include <ATen/ATen.h>

#include <cmath>
#include <sstream>
#include <utility>

#include "cache/cache_prepare.h"
#include "core/check.h"
#include "core/host_reads.h"
#include "core/index_checks.h"
#include "plan/step_plan.h"

namespace kvcache {
namespace {

void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, name, " has dtype ", s,
                   "; supported: float32, float16, bfloat16");
}

}  // namespace

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK_TYPE(false, "unsupported dtype ", t, "; supported: float32, float16, bfloat16");
  }
}

namespace {

/// Every check of a paged_attention call that reads no index values, and the arguments it packs (all but
/// the index pointers).
AttentionArgs check_attention_call(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   double scale, int64_t window_left, int64_t sink_tokens, double softcap,
                                   const at::Tensor& out, const std::optional<at::Tensor>& lse_arg,
                                   const PoolFormats& formats, int64_t k_format, int64_t v_format) {
  TORCH_CHECK_VALUE(is_kivi(formats.k_kind) == is_kivi(formats.v_kind),
                    "paged_attention reads kivi keys only with kivi values; got k_format = ", k_format,
                    " and v_format = ", v_format);
  const PagedLayout layout = check_formatted_pools(k_cache, v_cache, formats);
  // Pools of two widths (MLA latents: kv_nope as K, k_rot as V) hold no per-head K/V that attention could read
  // directly; their attention is the absorbed MLA one (mla_attention).
  TORCH_CHECK_VALUE(layout.equal_widths(), "paged_attention reads K and V rows of one width, but k_cache holds rows of "
                    "head_dim = ", layout.head_dim, " and v_cache rows of head_dim = ", layout.v_head_dim,
                    " (pools of two widths, e.g. MLA latents, are read by mla_attention or through paged_gather)");
  TORCH_CHECK_VALUE((formats.k_kind == KVKind::kFull) == (formats.v_kind == KVKind::kFull),
                    "paged_attention reads K and V both full precision or both quantized; got k_format = ", k_format,
                    " and v_format = ", v_format);
  KVC_CHECK_DIM(query, 3);
  check_float_dtype(query, "query");
  KVC_CHECK_SAME_DEVICE(query, k_cache);
  KVC_CHECK_SIZE(query, 2, layout.head_dim, "head_dim of the cache");
  const int64_t q_heads = query.size(1);
  TORCH_CHECK_VALUE(q_heads > 0 && q_heads % layout.num_kv_heads == 0, "query has ", q_heads,
                    " heads, which must be a positive multiple of the cache's num_kv_heads = ", layout.num_kv_heads);
  KVC_CHECK_FINITE_FLOAT32(scale);
  TORCH_CHECK_VALUE(window_left >= -1, "window_left = ", window_left, " must be -1 (no window) or >= 0");
  TORCH_CHECK_VALUE(sink_tokens >= 0, "sink_tokens = ", sink_tokens, " must be >= 0");
  // The kernels divide by softcap in float32 (2 / softcap): a positive cap must be a normal float32, so that it
  // neither rounds to 0 (which would turn the cap off) nor overflows the division.
  TORCH_CHECK_VALUE(softcap == 0 || (softcap >= double(FLT_MIN) && softcap <= double(FLT_MAX)), "softcap = ", softcap,
                    " must be 0 (off) or positive, in [", double(FLT_MIN), ", ", double(FLT_MAX),
                    "] (a normal float32: the kernels compute with it in float32)");
  KVC_CHECK_DIM(out, 3);
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), "out has shape ", out.sizes(), " but must match query's ",
                    query.sizes());
  KVC_CHECK_DTYPE(out, query.scalar_type());
  KVC_CHECK_SAME_DEVICE(out, k_cache);
  KVC_CHECK_CONTIGUOUS(out);
  check_lse_out(lse_arg, query.size(0), q_heads, k_cache);
  AttentionArgs a;
  a.query = query.data_ptr();
  for (int d = 0; d < 3; ++d) a.q_strides[d] = query.stride(d);
  a.q_dtype = to_dtype(query.scalar_type());
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.kv_dtype = formats.quantized() ? DType::kFloat32 : to_dtype(k_cache.scalar_type());
  a.k_kind = formats.k_kind;
  a.v_kind = formats.v_kind;
  a.k_scale = formats.quantized() ? static_cast<const float*>((*formats.k_scale)->data_ptr()) : nullptr;
  a.v_scale = formats.quantized() ? static_cast<const float*>((*formats.v_scale)->data_ptr()) : nullptr;
  a.k_rot = formats.k_rot;
  a.v_rot = formats.v_rot;
  a.layout = layout;
  a.q_heads = q_heads;
  a.group = q_heads / layout.num_kv_heads;
  a.scale = static_cast<float>(scale);
  a.window_left = window_left;
  a.sink_tokens = sink_tokens;
  a.softcap = static_cast<float>(softcap);
  a.out = out.data_ptr();
  a.lse = lse_arg.has_value() ? lse_arg->data_ptr<float>() : nullptr;
  return a;
}

}  // namespace

void check_index_tensors(const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_q_lens,
                         const at::Tensor& device_of) {
  KVC_CHECK_DIM(seq_lens, 1);
  KVC_CHECK_DTYPE(seq_lens, at::kInt);
  KVC_CHECK_SAME_DEVICE(seq_lens, device_of);
  KVC_CHECK_DIM(cu_q_lens, 1);
  KVC_CHECK_DTYPE(cu_q_lens, at::kInt);
  KVC_CHECK_SAME_DEVICE(cu_q_lens, device_of);
  const int64_t batch = seq_lens.size(0);
  KVC_CHECK_SIZE(cu_q_lens, 0, batch + 1, "len(seq_lens) + 1");
  KVC_CHECK_DIM(block_tables, 2);
  KVC_CHECK_DTYPE(block_tables, at::kInt);
  KVC_CHECK_SAME_DEVICE(block_tables, device_of);
  KVC_CHECK_SIZE(block_tables, 0, batch, "the batch size (len(seq_lens))");
  TORCH_CHECK_VALUE(block_tables.stride(1) == 1 || block_tables.size(1) <= 1,
                    "block_tables must have unit stride along its last dimension (strides ", block_tables.strides(), ")");
}

void check_index_values(const int32_t* cu, const int32_t* lens, const int32_t* table, int64_t table_stride,
                        int64_t table_width, int64_t batch, int64_t total_q, const char* total_q_what,
                        const PagedLayout& layout, AttentionHostInfo* host) {
  kvc_raise_index_error(check_cu_seq_lens("cu_q_lens", cu, batch, total_q, total_q_what, &host->q_lens));
  host->kv_lens.assign(lens, lens + batch);
  for (int64_t b = 0; b < batch; ++b) {
    if (host->q_lens[b] > host->kv_lens[b]) {
      std::ostringstream m;
      m << "sequence " << b << " has " << host->q_lens[b] << " queries (cu_q_lens) but seq_lens[" << b
        << "] = " << host->kv_lens[b] << "; the queries are the last tokens of the sequence, so q_len <= seq_len";
      kvc_raise_index_error(m.str());
    }
  }
  kvc_raise_index_error(check_block_table("block_tables", table, batch, table_width, table_stride, "seq_lens",
                                          host->kv_lens.data(), layout.page_size, layout.num_blocks, INT64_MAX,
                                          "the maximum"));
}

void check_indices_on_host(const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_q_lens,
                           const at::Tensor& k_cache, int64_t total_q, const char* total_q_what,
                           const PagedLayout& layout, AttentionHostInfo* host) {
  check_index_tensors(block_tables, seq_lens, cu_q_lens, k_cache);
  // The kernels read the lengths and offsets through their data pointers, element after element (plan_step
  // copies them, so it takes any strides).
  KVC_CHECK_CONTIGUOUS(seq_lens);
  KVC_CHECK_CONTIGUOUS(cu_q_lens);
  // Index values, on the host: q offsets, lengths, the blocks those lengths use.
  const at::Tensor cu_host = read_on_host(cu_q_lens);
  const at::Tensor lens_host = read_on_host(seq_lens);
  const at::Tensor table_host = read_on_host(block_tables);
  check_index_values(cu_host.data_ptr<int32_t>(), lens_host.data_ptr<int32_t>(), table_host.data_ptr<int32_t>(),
                     block_tables.size(1), block_tables.size(1), seq_lens.size(0), total_q, total_q_what, layout, host);
}

void check_lse_out(const std::optional<at::Tensor>& lse_arg, int64_t total_q, int64_t q_heads,
                   const at::Tensor& k_cache) {
  if (!lse_arg.has_value()) return;
  const at::Tensor& lse = *lse_arg;  // named lse: the check macros write the expression into their messages
  KVC_CHECK_DIM(lse, 2);
  KVC_CHECK_DTYPE(lse, at::kFloat);
  KVC_CHECK_SAME_DEVICE(lse, k_cache);
  KVC_CHECK_CONTIGUOUS(lse);
  TORCH_CHECK_VALUE(lse.size(0) == total_q && lse.size(1) == q_heads, "lse has shape ", lse.sizes(),
                    " but must be [total_q, q_heads] = [", total_q, ", ", q_heads, "]");
}

AttentionArgs prepare_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& cu_q_lens, double scale, int64_t window_left,
                                int64_t sink_tokens, double softcap, const at::Tensor& out,
                                const std::optional<at::Tensor>& lse, AttentionHostInfo* host,
                                const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                                int64_t k_format, int64_t v_format) {
  const PoolFormats formats = make_formats(k_format, v_format, k_scale, v_scale);
  AttentionArgs a = check_attention_call(query, k_cache, v_cache, scale, window_left, sink_tokens, softcap, out, lse,
                                         formats, k_format, v_format);
  check_indices_on_host(block_tables, seq_lens, cu_q_lens, k_cache, query.size(0),
                        "query.shape[0] (total query tokens)", a.layout, host);
  const int64_t batch = seq_lens.size(0);
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.table_stride = block_tables.stride(0);
  a.kv_lens = seq_lens.data_ptr<int32_t>();
  a.cu_q_lens = cu_q_lens.data_ptr<int32_t>();
  a.batch = batch;
  return a;
}

AttentionArgs prepare_attention_planned(const at::Tensor& query, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& plan_host,
                                        const at::Tensor& plan_device, double scale, int64_t window_left,
                                        int64_t sink_tokens, double softcap, const at::Tensor& out,
                                        const std::optional<at::Tensor>& lse,
                                        const std::optional<at::Tensor>& k_scale,
                                        const std::optional<at::Tensor>& v_scale, int64_t k_format,
                                        int64_t v_format, int64_t backend, const StepPlanHeader** header) {
  const PoolFormats formats = make_formats(k_format, v_format, k_scale, v_scale);
  AttentionArgs a = check_attention_call(query, k_cache, v_cache, scale, window_left, sink_tokens, softcap, out, lse,
                                         formats, k_format, v_format);
  const StepPlanHeader& h = check_step_plan(plan_host, plan_device, k_cache, a.layout, k_format, v_format, backend);
  TORCH_CHECK_VALUE(h.num_tasks >= 0 && h.q_heads == a.q_heads && h.total_q == query.size(0), "query has shape ",
                    query.sizes(), " but the plan was made for ", h.total_q, " query tokens of ", h.q_heads, " heads");
  const uint8_t* d = static_cast<const uint8_t*>(plan_device.data_ptr());
  a.block_tables = reinterpret_cast<const int32_t*>(d + h.tables_at);
  a.table_stride = h.table_width;
  a.kv_lens = reinterpret_cast<const int32_t*>(d + h.seq_lens_at);
  a.cu_q_lens = reinterpret_cast<const int32_t*>(d + h.cu_q_lens_at);
  a.batch = h.batch;
  *header = &h;
  return a;
}

PartialStates allocate_partials(int64_t num_slots, int64_t rows_per_slot, int64_t head_dim,
                                const at::TensorOptions& options, at::Tensor* o, at::Tensor* lse) {
  if (num_slots == 0) return {};
  *o = at::empty({num_slots, rows_per_slot, head_dim}, options.dtype(at::kFloat));
  *lse = at::empty({num_slots, rows_per_slot}, options.dtype(at::kFloat));
  return {o->data_ptr<float>(), lse->data_ptr<float>(), rows_per_slot};
}

void check_merge_states(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b,
                        const at::Tensor& lse_b, const at::Tensor& v_out, const at::Tensor& lse_out) {
  KVC_CHECK_DIM(v_a, 3);
  check_float_dtype(v_a, "v_a");
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&v_b, "v_b"}, {&v_out, "v_out"}}) {
    TORCH_CHECK_VALUE(t->sizes() == v_a.sizes(), "v_b and v_out must have v_a's shape ", v_a.sizes(), " but have ",
                      v_b.sizes(), " and ", v_out.sizes());
    TORCH_CHECK_TYPE(t->scalar_type() == v_a.scalar_type(), "v_a, v_b and v_out must share a dtype but have ",
                     v_a.scalar_type(), ", ", v_b.scalar_type(), ", ", v_out.scalar_type());
    TORCH_CHECK_VALUE(t->device() == v_a.device(), name, " is on ", t->device(), " but v_a is on ", v_a.device(),
                      "; they must be on the same device");
  }
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&lse_a, "lse_a"}, {&lse_b, "lse_b"},
                                {&lse_out, "lse_out"}}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == v_a.size(0) && t->size(1) == v_a.size(1),
                      "lse tensors must be [tokens, heads] = [", v_a.size(0), ", ", v_a.size(1), "] but got ",
                      t->sizes());
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, "lse tensors must be float32 but got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == v_a.device(), name, " is on ", t->device(), " but v_a is on ", v_a.device(),
                      "; they must be on the same device");
  }
  KVC_CHECK_CONTIGUOUS(v_out);
  KVC_CHECK_CONTIGUOUS(lse_out);
  TORCH_CHECK_VALUE(!v_out.is_alias_of(v_a) && !v_out.is_alias_of(v_b) && !lse_out.is_alias_of(lse_a) &&
                        !lse_out.is_alias_of(lse_b),
                    "merge_states writes v_out/lse_out, which must not share memory with its inputs");
}

}  // namespace kvcache
