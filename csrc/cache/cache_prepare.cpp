#include "cache/cache_prepare.h"

#include <ATen/ATen.h>

#include <vector>

#include "core/check.h"
#include "core/host_reads.h"
#include "core/index_checks.h"
#include "plan/step_plan.h"
#include "core/quant.h"

namespace kvcache {
namespace {

// Index tensors are validated on the host (core/host_reads.h): for CUDA-resident indices that is one
// device-to-host copy per call (a synchronization); a planned step (plan/step_plan.h) validates once.
at::Tensor host_copy(const at::Tensor& t) { return read_on_host(t); }

bool is_kv_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

std::vector<int64_t> to_int64(const at::Tensor& host_int32) {
  const int32_t* p = host_int32.data_ptr<int32_t>();
  return std::vector<int64_t>(p, p + host_int32.numel());
}

void check_out_pair(const at::Tensor& k_out, const at::Tensor& v_out, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const PoolFormats& f, const PagedLayout& layout) {
  // K and V rows may differ in width (layout.v_head_dim): every other dimension matches
  const int64_t last = k_out.dim() - 1;
  TORCH_CHECK_VALUE(v_out.dim() == k_out.dim() && k_out.sizes().slice(0, last) == v_out.sizes().slice(0, last),
                    "k_out has shape ", k_out.sizes(), " but v_out has shape ", v_out.sizes(),
                    "; they must match but for the last dimension (head_dim ", layout.head_dim, " and v_head_dim ",
                    layout.v_head_dim, ")");
  TORCH_CHECK_VALUE(k_out.size(last) == layout.head_dim, "k_out.shape[", last, "] = ", k_out.size(last),
                    " must equal head_dim of the cache = ", layout.head_dim, " (shape ", k_out.sizes(), ")");
  TORCH_CHECK_VALUE(v_out.size(last) == layout.v_head_dim, "v_out.shape[", last, "] = ", v_out.size(last),
                    " must equal v_head_dim of the cache (v_cache's rows) = ", layout.v_head_dim, " (shape ",
                    v_out.sizes(), ")");
  // Full-precision pools gather bit for bit into their own dtype; quantized pools dequantize into any
  // float dtype (k_out and v_out alike).
  const at::Tensor& full = f.k_kind == KVKind::kFull ? k_cache : v_cache;
  const bool any_full = f.k_kind == KVKind::kFull || f.v_kind == KVKind::kFull;
  TORCH_CHECK_TYPE(is_kv_dtype(k_out.scalar_type()) && v_out.scalar_type() == k_out.scalar_type() &&
                       (!any_full || k_out.scalar_type() == full.scalar_type()),
                   "k_out/v_out have dtypes ", k_out.scalar_type(), "/", v_out.scalar_type(),
                   " but the cache holds ", full.scalar_type());
  KVC_CHECK_SAME_DEVICE(k_out, k_cache);
  KVC_CHECK_SAME_DEVICE(v_out, k_cache);
  KVC_CHECK_CONTIGUOUS(k_out);
  KVC_CHECK_CONTIGUOUS(v_out);
}

void check_block_table_tensor(const at::Tensor& block_tables, const at::Tensor& k_cache, int64_t batch_hint) {
  KVC_CHECK_DIM(block_tables, 2);
  KVC_CHECK_DTYPE(block_tables, at::kInt);
  KVC_CHECK_SAME_DEVICE(block_tables, k_cache);
  TORCH_CHECK_VALUE(block_tables.stride(1) == 1 || block_tables.size(1) <= 1,
                    "block_tables must have unit stride along its last dimension (strides ",
                    block_tables.strides(), ")");
  if (batch_hint >= 0) KVC_CHECK_SIZE(block_tables, 0, batch_hint, "the batch size");
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    default: return DType::kBFloat16;
  }
}

void set_gather_formats(GatherArgs& a, const at::Tensor& k_out, const PoolFormats& f) {
  a.out_dtype = dtype_of(k_out);
  a.k_kind = f.k_kind;
  a.v_kind = f.v_kind;
  a.k_scale = f.k_kind != KVKind::kFull ? static_cast<float*>((*f.k_scale)->data_ptr()) : nullptr;
  a.v_scale = f.v_kind != KVKind::kFull ? static_cast<float*>((*f.v_scale)->data_ptr()) : nullptr;
  a.k_rot = f.k_rot;
  a.v_rot = f.v_rot;
}

}  // namespace

int kv_element_bytes(const at::Tensor& cache) { return static_cast<int>(cache.element_size()); }

PagedLayout check_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* k_name,
                        const char* v_name) {
  TORCH_CHECK_VALUE(k_cache.dim() == 4, k_name, " must be a 4-D tensor but has shape ", k_cache.sizes());
  // The K and V pools share blocks, heads and pages; their rows may differ in width (MLA latents).
  TORCH_CHECK_VALUE(v_cache.dim() == 4 && k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3), k_name,
                    " has shape ", k_cache.sizes(), " but ", v_name, " has shape ", v_cache.sizes(),
                    "; the K and V pools must match in [num_blocks, num_kv_heads, page_size] (only head_dim may differ)");
  TORCH_CHECK_TYPE(is_kv_dtype(k_cache.scalar_type()), k_name, " has dtype ", k_cache.scalar_type(),
                   "; supported: float32, float16, bfloat16");
  TORCH_CHECK_TYPE(v_cache.scalar_type() == k_cache.scalar_type(), v_name, " has dtype ", v_cache.scalar_type(),
                   " but ", k_name, " has ", k_cache.scalar_type());
  TORCH_CHECK_VALUE(v_cache.device() == k_cache.device(), v_name, " is on ", v_cache.device(), " but ", k_name,
                    " is on ", k_cache.device(), "; they must be on the same device");
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&k_cache, k_name}, {&v_cache, v_name}}) {
    TORCH_CHECK_VALUE(t->is_contiguous(), name, " must be contiguous (shape ", t->sizes(), ", strides ", t->strides(),
                      ")");
  }
  const int64_t page_size = k_cache.size(2);
  TORCH_CHECK_VALUE(is_supported_page_size(page_size), "page_size (", k_name, ".shape[2]) = ", page_size,
                    " must be a power of two from 1 to ", kMaxPageSize, " (", k_name,
                    " is [num_blocks, num_kv_heads, page_size, head_dim])");
  TORCH_CHECK_VALUE(k_cache.size(1) > 0 && k_cache.size(3) > 0, k_name, " has shape ", k_cache.sizes(),
                    "; num_kv_heads and head_dim must be positive");
  TORCH_CHECK_VALUE(v_cache.size(3) > 0, v_name, " has shape ", v_cache.sizes(), "; head_dim must be positive");
  return PagedLayout(k_cache.size(0), page_size, k_cache.size(1), k_cache.size(3), v_cache.size(3));
}

PoolFormats make_formats(int64_t k_format, int64_t v_format, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {
  for (const auto& [name, f] : {std::pair<const char*, int64_t>{"k_format", k_format}, {"v_format", v_format}}) {
    const int64_t kind = f >= kRotatedFlag ? f - kRotatedFlag : f;
    TORCH_CHECK_VALUE(f >= 0 && kind < kNumKVKinds && (f < kRotatedFlag || (kind > 0 && kind <= 4)), name, " = ", f,
                      " is not a storage format (0 full precision, 1 int8, 2 fp8 e4m3, 3 fp8 e5m2, 4 int4, 5 kivi4, ",
                      "6 kivi2; + ", kRotatedFlag, " for Hadamard-rotated rows of int8, fp8 or int4)");
  }
  PoolFormats p;
  p.k_rot = k_format >= kRotatedFlag;
  p.v_rot = v_format >= kRotatedFlag;
  p.k_kind = static_cast<KVKind>(p.k_rot ? k_format - kRotatedFlag : k_format);
  p.v_kind = static_cast<KVKind>(p.v_rot ? v_format - kRotatedFlag : v_format);
  p.k_scale = &k_scale;
  p.v_scale = &v_scale;
  return p;
}

namespace {

void check_one_pool(const at::Tensor& pool, const char* name, KVKind kind, const std::optional<at::Tensor>* scale,
                    const char* scale_name, bool is_key) {
  const auto dt = pool.scalar_type();
  switch (kind) {
    case KVKind::kFull:
      TORCH_CHECK_TYPE(is_kv_dtype(dt), name, " has dtype ", dt, "; a full-precision pool holds float32, float16 or bfloat16");
      break;
    case KVKind::kInt8:
      TORCH_CHECK_TYPE(dt == at::kChar, name, " has dtype ", dt, "; an int8 pool holds int8 codes");
      break;
    case KVKind::kInt4:
      TORCH_CHECK_TYPE(dt == at::kByte, name, " has dtype ", dt, "; an int4 pool holds uint8 (two codes per byte)");
      break;
    case KVKind::kKivi4:
    case KVKind::kKivi2:
      TORCH_CHECK_TYPE(dt == at::kByte, name, " has dtype ", dt, "; a kivi pool holds uint8 (packed codes)");
      break;
    default:
      TORCH_CHECK_TYPE(dt == at::kByte || dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2, name, " has dtype ", dt,
                       "; an fp8 pool holds uint8 (or float8) codes");
  }
  const bool has_scale = scale != nullptr && scale->has_value();
  if (kind == KVKind::kFull) {
    TORCH_CHECK_VALUE(!has_scale, scale_name, " was given but ", name, " is full precision");
    return;
  }
  TORCH_CHECK_VALUE(has_scale, name, " is quantized and needs ", scale_name);
  const at::Tensor& s = **scale;
  TORCH_CHECK_VALUE(s.device() == pool.device(), scale_name, " is on ", s.device(), " but ", name, " is on ",
                    pool.device(), "; they must be on the same device");
  TORCH_CHECK_VALUE(s.is_contiguous(), scale_name, " must be contiguous");
  if (is_kivi(kind)) {
    TORCH_CHECK_TYPE(s.scalar_type() == at::kHalf, scale_name, " must have dtype Half (kivi scales and zeros) but has ",
                     s.scalar_type());
    const int64_t D = pool.size(3) * dims_per_code(kind);
    TORCH_CHECK_VALUE(D % 32 == 0, name, " holds head_dim = ", D, ", which kivi needs to be a multiple of 32");
    if (is_key) {
      TORCH_CHECK_VALUE(s.dim() == 5 && s.size(0) == pool.size(0) && s.size(1) == pool.size(1) && s.size(2) == D / 32 &&
                            s.size(3) == 2 && s.size(4) == 32,
                        scale_name, " has shape ", s.sizes(), " but kivi keys keep a scale and a zero per channel per page: [",
                        pool.size(0), ", ", pool.size(1), ", ", D / 32, ", 2, 32]");
    } else {
      TORCH_CHECK_VALUE(s.dim() == 5 && s.size(0) == pool.size(0) && s.size(1) == pool.size(1) &&
                            s.size(2) == pool.size(2) && s.size(3) == D / 32 && s.size(4) == 2,
                        scale_name, " has shape ", s.sizes(), " but kivi values keep a (scale, zero) pair per 32 dims: [",
                        pool.size(0), ", ", pool.size(1), ", ", pool.size(2), ", ", D / 32, ", 2]");
    }
    return;
  }
  if (kind == KVKind::kInt4) {
    TORCH_CHECK_TYPE(s.scalar_type() == at::kHalf, scale_name, " must have dtype Half (int4 (scale, zero) pairs) but has ",
                     s.scalar_type());
    const int64_t D = pool.size(3) * 2;
    TORCH_CHECK_VALUE(D % kInt4Group == 0, name, " holds head_dim = ", D, " (2 x ", pool.size(3),
                      "), which int4 needs to be a multiple of ", kInt4Group);
    TORCH_CHECK_VALUE(s.dim() == 5 && s.size(0) == pool.size(0) && s.size(1) == pool.size(1) && s.size(2) == pool.size(2) &&
                          s.size(3) == D / kInt4Group && s.size(4) == 2,
                      scale_name, " has shape ", s.sizes(), " but int4 keeps a (scale, zero) pair per 32 dims: [",
                      pool.size(0), ", ", pool.size(1), ", ", pool.size(2), ", ", D / kInt4Group, ", 2]");
    return;
  }
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, scale_name, " must have dtype Float but has ", s.scalar_type());
  if (has_token_scales(kind)) {
    TORCH_CHECK_VALUE(s.dim() == 3 && s.size(0) == pool.size(0) && s.size(1) == pool.size(1) && s.size(2) == pool.size(2),
                      scale_name, " has shape ", s.sizes(), " but int8 keeps one scale per row: [num_blocks, num_kv_heads, page_size] = ",
                      pool.sizes().slice(0, 3));
  } else {
    TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == pool.size(1), scale_name, " has shape ", s.sizes(),
                      " but fp8 keeps one scale per kv head: [", pool.size(1), "]");
  }
}

}  // namespace

PagedLayout check_formatted_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const PoolFormats& f) {
  if (!f.quantized()) {
    for (const auto* s : {f.k_scale, f.v_scale}) {
      TORCH_CHECK_VALUE(s == nullptr || !s->has_value(), (s == f.k_scale ? "k_scale" : "v_scale"),
                        " was given but the pools are full precision (k_format = v_format = 0)");
    }
    return check_pools(k_cache, v_cache);
  }
  KVC_CHECK_DIM(k_cache, 4);
  KVC_CHECK_DIM(v_cache, 4);
  // Packed formats store head_dim / dims_per_code elements per row: the widths are in dims, not elements.
  // K and V rows may differ in width (MLA latents); blocks, heads and pages match.
  const int64_t k_dim = k_cache.size(3) * dims_per_code(f.k_kind), v_dim = v_cache.size(3) * dims_per_code(f.v_kind);
  TORCH_CHECK_VALUE(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3), "k_cache has shape ",
                    k_cache.sizes(), " (head_dim ", k_dim, ") but v_cache has shape ", v_cache.sizes(), " (head_dim ", v_dim,
                    "); the K and V pools must match in [num_blocks, num_kv_heads, page_size] (only head_dim may differ)");
  KVC_CHECK_SAME_DEVICE(v_cache, k_cache);
  KVC_CHECK_CONTIGUOUS(k_cache);
  KVC_CHECK_CONTIGUOUS(v_cache);
  check_one_pool(k_cache, "k_cache", f.k_kind, f.k_scale, "k_scale", /*is_key=*/true);
  check_one_pool(v_cache, "v_cache", f.v_kind, f.v_scale, "v_scale", /*is_key=*/false);
  if (f.k_kind == KVKind::kFull && f.v_kind == KVKind::kFull) return check_pools(k_cache, v_cache);
  TORCH_CHECK_VALUE(!f.k_rot || quant::rot_supported(k_dim), "k_cache: head_dim = ", k_dim,
                    " must be a power of two (2 to 1024) for Hadamard-rotated formats (k_format)");
  TORCH_CHECK_VALUE(!f.v_rot || quant::rot_supported(v_dim), "v_cache: head_dim = ", v_dim,
                    " must be a power of two (2 to 1024) for Hadamard-rotated formats (v_format)");
  const int64_t page_size = k_cache.size(2);
  TORCH_CHECK_VALUE(is_supported_page_size(page_size), "page_size (k_cache.shape[2]) = ", page_size,
                    " must be a power of two from 1 to ", kMaxPageSize);
  TORCH_CHECK_VALUE(k_cache.size(1) > 0 && k_dim > 0 && v_dim > 0, "k_cache has shape ", k_cache.sizes(),
                    " and v_cache ", v_cache.sizes(), "; num_kv_heads and head_dim must be positive");
  return PagedLayout(k_cache.size(0), page_size, k_cache.size(1), k_dim, v_dim);  // widths in dims, not bytes
}

namespace {

/// Every check of an append that reads no slot values, and its arguments but the slots.
AppendArgs check_append_call(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const PoolFormats& f) {
  const PagedLayout layout = check_formatted_pools(k_cache, v_cache, f);
  KVC_CHECK_DIM(key, 4);
  KVC_CHECK_DIM(value, 4);
  TORCH_CHECK_VALUE(value.sizes().slice(0, 3) == key.sizes().slice(0, 3), "value has shape ", value.sizes(),
                    " but key has shape ", key.sizes(), "; they are [batch, num_kv_heads, q_len, head_dim] and "
                    "[batch, num_kv_heads, q_len, v_head_dim]");
  if (f.k_kind == KVKind::kFull) KVC_CHECK_DTYPE(key, k_cache.scalar_type());
  if (f.v_kind == KVKind::kFull) KVC_CHECK_DTYPE(value, v_cache.scalar_type());
  TORCH_CHECK_TYPE(is_kv_dtype(key.scalar_type()), "key has dtype ", key.scalar_type(), "; supported: float32, float16, bfloat16");
  KVC_CHECK_DTYPE(value, key.scalar_type());
  KVC_CHECK_SAME_DEVICE(key, k_cache);
  KVC_CHECK_SAME_DEVICE(value, k_cache);
  KVC_CHECK_SIZE(key, 1, layout.num_kv_heads, "num_kv_heads of the cache");
  KVC_CHECK_SIZE(key, 3, layout.head_dim, "head_dim of the cache");
  KVC_CHECK_SIZE(value, 3, layout.v_head_dim, "v_head_dim of the cache (v_cache's rows)");
  AppendArgs a;
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  for (int d = 0; d < 4; ++d) {
    a.key_strides[d] = key.stride(d);
    a.value_strides[d] = value.stride(d);
  }
  a.batch = key.size(0);
  a.q_len = key.size(2);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.layout = layout;
  a.in_dtype = dtype_of(key);
  a.k_kind = f.k_kind;
  a.v_kind = f.v_kind;
  a.k_scale = f.k_kind != KVKind::kFull ? static_cast<float*>((*f.k_scale)->data_ptr()) : nullptr;
  a.v_scale = f.v_kind != KVKind::kFull ? static_cast<float*>((*f.v_scale)->data_ptr()) : nullptr;
  a.k_rot = f.k_rot;
  a.v_rot = f.v_rot;
  return a;
}

}  // namespace

void check_slot_values(const int64_t* slots, int64_t rows, int64_t q_len, const PagedLayout& layout, KVKind k_kind) {
  kvc_raise_index_error(check_slots("slot_mapping", slots, rows * q_len, layout.num_slots(), q_len));
  if (is_kivi(k_kind)) {
    // KIVI keys take their per-channel statistics over a whole page: each row writes whole pages.
    const int64_t P = layout.page_size;
    TORCH_CHECK_VALUE(q_len % P == 0, "a kivi key pool is written whole pages at a time, but key has q_len = ", q_len,
                      ", which is not a multiple of page_size = ", P);
    for (int64_t b = 0; b < rows; ++b) {
      for (int64_t t0 = 0; t0 < q_len; t0 += P) {
        const int64_t first = slots[b * q_len + t0];
        for (int64_t i = 0; i < P; ++i) {
          const int64_t got = slots[b * q_len + t0 + i], want = first < 0 ? -1 : first + i;
          TORCH_CHECK_VALUE(got == want && (first < 0 || first % P == 0), "slot_mapping[", b, ", ", t0 + i, "] = ", got,
                            " but a kivi key pool is written whole pages: slots ", t0, "..", t0 + P - 1, " of row ", b,
                            " must be one page in order (block * ", P, " + 0.. ", P - 1, ") or all -1");
        }
      }
    }
  }
}

AppendArgs prepare_append(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slot_mapping, const PoolFormats& f) {
  AppendArgs a = check_append_call(key, value, k_cache, v_cache, f);
  KVC_CHECK_DIM(slot_mapping, 2);
  KVC_CHECK_DTYPE(slot_mapping, at::kLong);
  KVC_CHECK_SAME_DEVICE(slot_mapping, k_cache);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0) && slot_mapping.size(1) == key.size(2),
                    "slot_mapping has shape ", slot_mapping.sizes(), " but must be [batch, q_len] = [",
                    key.size(0), ", ", key.size(2), "] for key of shape ", key.sizes());
  const at::Tensor slots_host = host_copy(slot_mapping);
  check_slot_values(slots_host.data_ptr<int64_t>(), key.size(0), key.size(2), a.layout, f.k_kind);
  a.slots = slot_mapping.data_ptr<int64_t>();
  a.slot_strides[0] = slot_mapping.stride(0);
  a.slot_strides[1] = slot_mapping.stride(1);
  return a;
}

AppendArgs prepare_append_planned(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& plan_host,
                                  const at::Tensor& plan_device, const PoolFormats& f, int64_t k_format,
                                  int64_t v_format, int64_t backend) {
  AppendArgs a = check_append_call(key, value, k_cache, v_cache, f);
  const StepPlanHeader& h = check_step_plan(plan_host, plan_device, k_cache, a.layout, k_format, v_format, backend);
  TORCH_CHECK_VALUE(h.slot_rows > 0 || h.slot_cols > 0 || key.size(0) * key.size(2) == 0,
                    "the plan was made without a slot_mapping, so it cannot append");
  TORCH_CHECK_VALUE(h.slot_rows == key.size(0) && h.slot_cols == key.size(2), "key has shape ", key.sizes(),
                    " but the plan's slot_mapping is [batch, q_len] = [", h.slot_rows, ", ", h.slot_cols, "]");
  a.slots = reinterpret_cast<const int64_t*>(static_cast<const uint8_t*>(plan_device.data_ptr()) + h.slots_at);
  a.slot_strides[0] = h.slot_cols;
  a.slot_strides[1] = 1;
  return a;
}

GatherArgs prepare_gather(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& k_out, const at::Tensor& v_out,
                          const PoolFormats& f) {
  const PagedLayout layout = check_formatted_pools(k_cache, v_cache, f);
  KVC_CHECK_DIM(seq_lens, 1);
  KVC_CHECK_DTYPE(seq_lens, at::kInt);
  KVC_CHECK_SAME_DEVICE(seq_lens, k_cache);
  KVC_CHECK_CONTIGUOUS(seq_lens);  // the kernels read it through its data pointer, element after element
  const int64_t batch = seq_lens.size(0);
  check_block_table_tensor(block_tables, k_cache, batch);
  KVC_CHECK_DIM(k_out, 4);
  KVC_CHECK_SIZE(k_out, 0, batch, "the batch size (len(seq_lens))");
  KVC_CHECK_SIZE(k_out, 1, layout.num_kv_heads, "num_kv_heads of the cache");
  check_out_pair(k_out, v_out, k_cache, v_cache, f, layout);

  const at::Tensor table_host = host_copy(block_tables);
  const std::vector<int64_t> lens = to_int64(host_copy(seq_lens));
  kvc_raise_index_error(check_block_table("block_tables", table_host.data_ptr<int32_t>(), batch,
                                          block_tables.size(1), block_tables.size(1), "seq_lens", lens.data(),
                                          layout.page_size, layout.num_blocks, k_out.size(2),
                                          "k_out.shape[2] (max_len)"));
  GatherArgs a;
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.layout = layout;
  a.block_table = block_tables.data_ptr<int32_t>();
  a.table_stride = block_tables.stride(0);
  a.batch = batch;
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.max_len = k_out.size(2);
  a.k_out = k_out.data_ptr();
  a.v_out = v_out.data_ptr();
  set_gather_formats(a, k_out, f);
  return a;
}

GatherArgs prepare_gather_ragged(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& cu_seq_lens,
                                 const at::Tensor& k_out, const at::Tensor& v_out, const PoolFormats& f) {
  const PagedLayout layout = check_formatted_pools(k_cache, v_cache, f);
  KVC_CHECK_DIM(cu_seq_lens, 1);
  KVC_CHECK_DTYPE(cu_seq_lens, at::kInt);
  KVC_CHECK_SAME_DEVICE(cu_seq_lens, k_cache);
  KVC_CHECK_CONTIGUOUS(cu_seq_lens);  // the kernels read it through its data pointer, element after element
  TORCH_CHECK_VALUE(cu_seq_lens.size(0) >= 1, "cu_seq_lens must hold batch + 1 >= 1 offsets but is empty");
  const int64_t batch = cu_seq_lens.size(0) - 1;
  check_block_table_tensor(block_tables, k_cache, batch);
  KVC_CHECK_DIM(k_out, 3);
  KVC_CHECK_SIZE(k_out, 1, layout.num_kv_heads, "num_kv_heads of the cache");
  check_out_pair(k_out, v_out, k_cache, v_cache, f, layout);

  const at::Tensor cu_host = host_copy(cu_seq_lens);
  std::vector<int64_t> lens;
  kvc_raise_index_error(check_cu_seq_lens("cu_seq_lens", cu_host.data_ptr<int32_t>(), batch, k_out.size(0),
                                          "k_out.shape[0] (total tokens)", &lens));
  const at::Tensor table_host = host_copy(block_tables);
  kvc_raise_index_error(check_block_table("block_tables", table_host.data_ptr<int32_t>(), batch,
                                          block_tables.size(1), block_tables.size(1), "sequence lengths",
                                          lens.data(), layout.page_size, layout.num_blocks, k_out.size(0),
                                          "k_out.shape[0]"));
  GatherArgs a;
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.layout = layout;
  a.block_table = block_tables.data_ptr<int32_t>();
  a.table_stride = block_tables.stride(0);
  a.batch = batch;
  a.cu_seq_lens = cu_seq_lens.data_ptr<int32_t>();
  a.k_out = k_out.data_ptr();
  a.v_out = v_out.data_ptr();
  set_gather_formats(a, k_out, f);
  return a;
}

BlockCopyArgs prepare_block_copy(const at::Tensor& k_src, const at::Tensor& v_src, const at::Tensor& k_dst,
                                 const at::Tensor& v_dst, const at::Tensor& block_mapping, bool same_pool) {
  // named as the op names them: copy_blocks' k_cache / v_cache, swap_blocks' k_src / v_src / k_dst / v_dst
  const PagedLayout src = same_pool ? check_pools(k_src, v_src) : check_pools(k_src, v_src, "k_src", "v_src");
  const PagedLayout dst = same_pool ? src : check_pools(k_dst, v_dst, "k_dst", "v_dst");
  if (!same_pool) {
    TORCH_CHECK_VALUE(k_src.sizes().slice(1) == k_dst.sizes().slice(1), "src pools have K blocks of shape ",
                      k_src.sizes().slice(1), " but dst pools have K blocks of shape ", k_dst.sizes().slice(1));
    TORCH_CHECK_VALUE(v_src.sizes().slice(1) == v_dst.sizes().slice(1), "src pools have V blocks of shape ",
                      v_src.sizes().slice(1), " but dst pools have V blocks of shape ", v_dst.sizes().slice(1));
    TORCH_CHECK_TYPE(k_src.scalar_type() == k_dst.scalar_type(), "src pools hold ", k_src.scalar_type(),
                     " but dst pools hold ", k_dst.scalar_type());
  }
  KVC_CHECK_DIM(block_mapping, 2);
  KVC_CHECK_DTYPE(block_mapping, at::kLong);
  KVC_CHECK_SIZE(block_mapping, 1, 2, "2 ((src, dst) pairs)");
  TORCH_INTERNAL_ASSERT(block_mapping.is_cpu() && block_mapping.is_contiguous());
  kvc_raise_index_error(check_block_mapping("block_mapping", block_mapping.data_ptr<int64_t>(),
                                            block_mapping.size(0), src.num_blocks, dst.num_blocks,
                                            same_pool));
  BlockCopyArgs a;
  a.pairs = block_mapping.data_ptr<int64_t>();
  a.n = block_mapping.size(0);
  a.block_bytes = src.side(false).block_stride() * k_src.element_size();
  a.v_block_bytes = src.side(true).block_stride() * v_src.element_size();
  a.k_src = static_cast<const char*>(k_src.data_ptr());
  a.v_src = static_cast<const char*>(v_src.data_ptr());
  a.k_dst = static_cast<char*>(k_dst.data_ptr());
  a.v_dst = static_cast<char*>(v_dst.data_ptr());
  return a;
}

BlockCopyArgs prepare_swap(const at::Tensor& k_src, const at::Tensor& v_src, const at::Tensor& k_dst,
                           const at::Tensor& v_dst, const at::Tensor& block_mapping) {
  TORCH_CHECK_VALUE(block_mapping.is_cpu(), "block_mapping must be a CPU tensor for swap_blocks but is on ",
                    block_mapping.device());
  for (const at::Tensor* src : {&k_src, &v_src}) {
    for (const at::Tensor* dst : {&k_dst, &v_dst}) {
      TORCH_CHECK_VALUE(!src->is_alias_of(*dst), "swap_blocks needs distinct source and destination pools; "
                        "to copy blocks within one pool use copy_blocks");
    }
  }
  return prepare_block_copy(k_src, v_src, k_dst, v_dst, block_mapping, /*same_pool=*/false);
}

}  // namespace kvcache
