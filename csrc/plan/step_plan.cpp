#include "plan/step_plan.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "attention/attention_prepare.h"
#include "cache/cache_prepare.h"
#include "core/check.h"
#include "core/host_reads.h"

namespace kvcache {
namespace {

int64_t align8(int64_t n) { return (n + 7) / 8 * 8; }

const char* backend_name(int64_t backend) { return backend == kPlanForCuda ? "CUDA" : "CPU"; }

/// 64-bit FNV-1a of `n` bytes, continuing from `hash`.
uint64_t fnv1a(const uint8_t* p, int64_t n, uint64_t hash = 0xcbf29ce484222325ull) {
  for (int64_t i = 0; i < n; ++i) hash = (hash ^ p[i]) * 0x100000001b3ull;
  return hash;
}

/// The memory of a host half made for a device plan, and the device half's storage, which it keeps alive: on a
/// GPU, plan_device at that storage's address is then that very tensor (no other can take the address).
struct HostPlanContext {
  at::Tensor host;
  c10::Storage device;
};
void delete_host_plan_context(void* ctx) { delete static_cast<HostPlanContext*>(ctx); }

int64_t host_bytes(const StepPlanHeader& h) {
  return int64_t(sizeof(StepPlanHeader)) + h.num_tasks * int64_t(sizeof(AttentionTask)) +
         h.num_splits * int64_t(sizeof(AttentionPlan::Split));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> build_step_plan(
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& cu_q_lens, const std::optional<at::Tensor>& slot_mapping, int64_t q_heads,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, int64_t k_format,
    int64_t v_format, int64_t backend, const PlanOptionsFn& options) {
  const PoolFormats formats = make_formats(k_format, v_format, k_scale, v_scale);
  TORCH_CHECK_VALUE(is_kivi(formats.k_kind) == is_kivi(formats.v_kind) &&
                        (formats.k_kind == KVKind::kFull) == (formats.v_kind == KVKind::kFull),
                    "a step's pools hold K and V both full precision, both quantized (int8, fp8, int4) or both "
                    "kivi; got k_format = ", k_format, " and v_format = ", v_format);
  const PagedLayout layout = check_formatted_pools(k_cache, v_cache, formats);
  TORCH_CHECK_VALUE(q_heads > 0 && q_heads % layout.num_kv_heads == 0, "q_heads = ", q_heads,
                    " must be a positive multiple of the cache's num_kv_heads = ", layout.num_kv_heads);
  // The index tensors may live on the host while the pools are on a device (the usual case: no sync).
  check_index_tensors(block_tables, seq_lens, cu_q_lens, block_tables);
  const int64_t batch = seq_lens.size(0), width = block_tables.size(1);

  const at::Tensor cu_host = read_on_host(cu_q_lens);
  const at::Tensor lens_host = read_on_host(seq_lens);
  const at::Tensor table_host = read_on_host(block_tables);
  const int32_t* cu = cu_host.data_ptr<int32_t>();
  const int32_t* table = table_host.data_ptr<int32_t>();
  AttentionHostInfo host;
  check_index_values(cu, lens_host.data_ptr<int32_t>(), table, width, width, batch, cu[batch],
                     "cu_q_lens[-1] (the step's query tokens)", layout, &host);
  StepPlanHeader h;
  h.backend = backend;
  h.batch = batch;
  h.total_q = cu[batch];
  h.q_heads = q_heads;
  h.page_size = layout.page_size;
  h.kv_heads = layout.num_kv_heads;
  h.head_dim = layout.head_dim;
  h.v_head_dim = layout.v_head_dim;
  h.k_format = k_format;
  h.v_format = v_format;
  h.table_width = width;
  for (int64_t b = 0; b < batch; ++b) {  // the largest block id the lengths use
    const int64_t pages = (host.kv_lens[b] + layout.page_size - 1) / layout.page_size;
    for (int64_t p = 0; p < pages; ++p) h.required_blocks = std::max<int64_t>(h.required_blocks, table[b * width + p] + 1);
  }
  at::Tensor slots_host;
  if (slot_mapping.has_value()) {
    const at::Tensor& s = *slot_mapping;
    TORCH_CHECK_VALUE(s.dim() == 2, "slot_mapping must be a 2-D tensor but has shape ", s.sizes());
    TORCH_CHECK_TYPE(s.scalar_type() == at::kLong, "slot_mapping must have dtype Long but has ", s.scalar_type());
    TORCH_CHECK_VALUE(s.device() == block_tables.device(), "slot_mapping is on ", s.device(),
                      " but block_tables is on ", block_tables.device(), "; the index tensors must share a device");
    slots_host = read_on_host(s);
    check_slot_values(slots_host.data_ptr<int64_t>(), s.size(0), s.size(1), layout, formats.k_kind);
    h.slot_rows = s.size(0);
    h.slot_cols = s.size(1);
    const int64_t* p = slots_host.data_ptr<int64_t>();
    for (int64_t i = 0; i < s.numel(); ++i) {
      if (p[i] >= 0) h.required_blocks = std::max(h.required_blocks, p[i] / layout.page_size + 1);
    }
  }

  AttentionArgs a;  // what the planner reads: shapes and formats
  a.layout = layout;
  a.batch = batch;
  a.q_heads = q_heads;
  a.group = q_heads / layout.num_kv_heads;
  a.k_kind = formats.k_kind;
  a.v_kind = formats.v_kind;
  a.kv_dtype = formats.quantized() ? DType::kFloat32 : to_dtype(k_cache.scalar_type());
  const AttentionPlan plan = make_attention_plan(a, host, options(a));
  h.num_tasks = static_cast<int64_t>(plan.tasks.size());
  h.num_splits = static_cast<int64_t>(plan.splits.size());
  h.num_prefill_tasks = plan.num_prefill_tasks;
  h.rows_per_slot = plan.rows_per_slot;
  h.num_slots = plan.num_slots;

  const int64_t task_bytes = h.num_tasks * int64_t(sizeof(AttentionTask));
  const int64_t split_bytes = h.num_splits * int64_t(sizeof(AttentionPlan::Split));
  h.tables_at = 8;  // after the plan's id
  h.seq_lens_at = align8(h.tables_at + batch * width * 4);
  h.cu_q_lens_at = align8(h.seq_lens_at + batch * 4);
  h.slots_at = align8(h.cu_q_lens_at + (batch + 1) * 4);
  h.tasks_at = align8(h.slots_at + h.slot_rows * h.slot_cols * 8);
  h.splits_at = align8(h.tasks_at + task_bytes);
  h.device_bytes = h.splits_at + split_bytes;

  // On a GPU the upload comes from pinned memory without blocking, so the host does not wait for the
  // device's queue (the caching host allocator keeps the buffer until the copy has run).
  const bool to_gpu = !k_cache.is_cpu();
  at::Tensor staged = at::zeros({h.device_bytes}, at::dtype(at::kByte).pinned_memory(to_gpu));
  uint8_t* dp = staged.data_ptr<uint8_t>();
  if (batch * width > 0) std::memcpy(dp + h.tables_at, table, batch * width * 4);
  if (batch) std::memcpy(dp + h.seq_lens_at, lens_host.data_ptr<int32_t>(), batch * 4);
  std::memcpy(dp + h.cu_q_lens_at, cu, (batch + 1) * 4);
  if (h.slot_rows * h.slot_cols > 0) std::memcpy(dp + h.slots_at, slots_host.data_ptr<int64_t>(), h.slot_rows * h.slot_cols * 8);
  if (task_bytes) std::memcpy(dp + h.tasks_at, plan.tasks.data(), task_bytes);
  if (split_bytes) std::memcpy(dp + h.splits_at, plan.splits.data(), split_bytes);
  h.plan_id = static_cast<int64_t>(fnv1a(dp + 8, h.device_bytes - 8, fnv1a(reinterpret_cast<const uint8_t*>(&h), sizeof h)));
  std::memcpy(dp, &h.plan_id, 8);
  at::Tensor device_plan = to_gpu ? staged.to(k_cache.device(), /*non_blocking=*/true) : staged;

  at::Tensor host_plan = at::zeros({host_bytes(h)}, at::dtype(at::kByte));
  uint8_t* hp = host_plan.data_ptr<uint8_t>();
  std::memcpy(hp, &h, sizeof h);
  if (task_bytes) std::memcpy(hp + sizeof h, plan.tasks.data(), task_bytes);
  if (split_bytes) std::memcpy(hp + sizeof h + task_bytes, plan.splits.data(), split_bytes);
  if (to_gpu) {
    host_plan = at::for_blob(hp, host_plan.sizes())
                    .context(new HostPlanContext{host_plan, device_plan.storage()}, &delete_host_plan_context)
                    .options(host_plan.options())
                    .make_tensor();
  }
  return {host_plan, device_plan};
}

const StepPlanHeader& check_step_plan(const at::Tensor& plan_host, const at::Tensor& plan_device,
                                      const at::Tensor& k_cache, const PagedLayout& layout, int64_t k_format,
                                      int64_t v_format, int64_t backend) {
  TORCH_CHECK_VALUE(plan_host.is_cpu() && plan_host.scalar_type() == at::kByte && plan_host.dim() == 1 &&
                        plan_host.is_contiguous() && plan_host.numel() >= int64_t(sizeof(StepPlanHeader)),
                    "plan_host must be the first tensor plan_step returned (1-D uint8 on the CPU) but is ",
                    plan_host.scalar_type(), " of shape ", plan_host.sizes(), " on ", plan_host.device());
  const StepPlanHeader& h = *static_cast<const StepPlanHeader*>(plan_host.data_ptr());
  TORCH_CHECK_VALUE(h.magic == kStepPlanMagic && plan_host.numel() == host_bytes(h),
                    "plan_host is not a plan made by plan_step");
  TORCH_CHECK_VALUE(h.backend == backend, "the plan was made for the ", backend_name(h.backend),
                    " kernels but this call runs the ", backend_name(backend), " ones (plan and run on the pools' device)");
  KVC_CHECK_SAME_DEVICE(plan_device, k_cache);
  TORCH_CHECK_VALUE(plan_device.scalar_type() == at::kByte && plan_device.dim() == 1 && plan_device.is_contiguous() &&
                        plan_device.numel() == h.device_bytes,
                    "plan_device must be the second tensor plan_step returned (", h.device_bytes,
                    " bytes) but is ", plan_device.scalar_type(), " of shape ", plan_device.sizes());
  // The halves of one plan: plan_device's first 8 bytes are the id its header records. On the CPU they are
  // read in place. On a GPU, the device tensor plan_step made with this host half is known without a read (its
  // HostPlanContext); any other (a copy of a plan) is read, a synchronization per call.
  int64_t device_id = h.plan_id;
  const at::DataPtr& host_memory = plan_host.storage().data_ptr();
  const bool made_together = !plan_device.is_cpu() && host_memory.get_deleter() == &delete_host_plan_context &&
                             static_cast<const HostPlanContext*>(host_memory.get_context())->device.data_ptr().get() ==
                                 plan_device.data_ptr();
  if (plan_device.is_cpu()) {
    std::memcpy(&device_id, plan_device.data_ptr(), 8);
  } else if (!made_together) {
    const at::Tensor id = plan_device.narrow(0, 0, 8).to(at::kCPU);
    std::memcpy(&device_id, id.data_ptr(), 8);
  }
  TORCH_CHECK_VALUE(device_id == h.plan_id, "plan: plan_host and plan_device are not the two tensors of one "
                    "plan_step call (plan_host belongs to plan ", h.plan_id, ", plan_device holds plan id ", device_id,
                    "); pass a plan's two tensors together, unmodified");
  TORCH_CHECK_VALUE(layout.page_size == h.page_size && layout.num_kv_heads == h.kv_heads &&
                        layout.head_dim == h.head_dim && layout.v_head_dim == h.v_head_dim,
                    "the pools have page_size ", layout.page_size, ", num_kv_heads ", layout.num_kv_heads,
                    " and head_dim ", layout.head_dim, " but the plan was made for page_size ", h.page_size,
                    ", num_kv_heads ", h.kv_heads, " and head_dim ", h.head_dim, " (V rows: v_head_dim ",
                    layout.v_head_dim, " in the pools, ", h.v_head_dim, " in the plan)");
  TORCH_CHECK_VALUE(k_format == h.k_format && v_format == h.v_format, "k_format = ", k_format, " and v_format = ",
                    v_format, " but the plan was made for k_format = ", h.k_format, " and v_format = ", h.v_format);
  TORCH_CHECK_INDEX(layout.num_blocks >= h.required_blocks, "the pools hold ", layout.num_blocks,
                    " blocks but the plan uses block ids up to ", h.required_blocks - 1);
  return h;
}

}  // namespace kvcache
