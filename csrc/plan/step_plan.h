// The once-per-step plan of a decode or prefill step (FlashInfer's plan/run split). plan_step reads the
// step's index tensors on the host once, validates them against the pools (the same checks and messages as
// the unplanned ops), splits the attention into tasks, and lays everything out in two tensors:
//   host   (CPU, uint8):            StepPlanHeader, then the tasks and the splits;
//   device (the pools' device, uint8): the plan's id, block tables, seq_lens, cu_q_lens, slot_mapping, tasks,
//                                      splits.
// The per-layer ops (paged_attention_planned, append_planned) check only shapes, dtypes and devices against
// the header and read their indices from `device`: no host reads, so no synchronization on a GPU. They trust
// `device` to be the one validated with `host`, so check_step_plan ties the two halves together by the plan's
// id (see there); index values changed by hand inside `device` are not detected.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <tuple>

#include "attention/attention_plan.h"
#include "core/paged_layout.h"

namespace kvcache {

constexpr int64_t kStepPlanMagic = 0x316e616c50435656;  // "VVCPlan1"
constexpr int64_t kPlanForCpu = 0, kPlanForCuda = 1;    // whose task list the plan holds

struct StepPlanHeader {
  int64_t magic = kStepPlanMagic;
  int64_t backend = kPlanForCpu;
  // Which device tensor this header goes with: a hash of the header (this field 0) and of the device tensor's
  // bytes after its first 8, which hold plan_id too. A hash rather than a count: plan_step's outputs are a
  // function of its inputs (torch.library.opcheck compares two calls).
  int64_t plan_id = 0;
  int64_t batch = 0, total_q = 0, q_heads = 0;
  // the pools it was validated against: their shape (num_blocks aside) and formats
  int64_t page_size = 0, kv_heads = 0, head_dim = 0, v_head_dim = 0, k_format = 0, v_format = 0;
  int64_t required_blocks = 0;  // pools must hold at least this many blocks: 1 + the largest block id used
  int64_t table_width = 0;      // columns of the block tables
  int64_t slot_rows = 0, slot_cols = 0;  // slot_mapping [rows, cols]; 0 x 0 when the plan has none
  int64_t num_tasks = 0, num_splits = 0, rows_per_slot = 0, num_slots = 0;
  int64_t num_prefill_tasks = 0;  // AttentionPlan::num_prefill_tasks
  // byte offsets into the device tensor
  int64_t tables_at = 0, seq_lens_at = 0, cu_q_lens_at = 0, slots_at = 0, tasks_at = 0, splits_at = 0;
  int64_t device_bytes = 0;
};

/// Backend planning options for the attention of a step (CPU threads, or CUDA SMs), given its arguments.
using PlanOptionsFn = std::function<PlanOptions(const AttentionArgs&)>;

/// plan_step: validates and lays out a step (see above). `slot_mapping` [batch, q_len] int64 is optional.
std::tuple<at::Tensor, at::Tensor> build_step_plan(
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& cu_q_lens, const std::optional<at::Tensor>& slot_mapping, int64_t q_heads,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, int64_t k_format,
    int64_t v_format, int64_t backend, const PlanOptionsFn& options);

/// The header of a plan handed to a per-layer op, checked against that layer's pools (`layout` from
/// check_formatted_pools) and formats: no index reads. Raises ValueError naming what differs.
const StepPlanHeader& check_step_plan(const at::Tensor& plan_host, const at::Tensor& plan_device,
                                      const at::Tensor& k_cache, const PagedLayout& layout, int64_t k_format,
                                      int64_t v_format, int64_t backend);

/// The tasks and splits of a plan (in `plan_host`, or in `plan_device` for kernels that read them there).
inline const AttentionTask* plan_tasks(const at::Tensor& t, const StepPlanHeader& h, bool on_device) {
  const uint8_t* base = static_cast<const uint8_t*>(t.data_ptr());
  return reinterpret_cast<const AttentionTask*>(base + (on_device ? h.tasks_at : int64_t(sizeof(StepPlanHeader))));
}
inline const AttentionPlan::Split* plan_splits(const at::Tensor& t, const StepPlanHeader& h, bool on_device) {
  const uint8_t* base = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t host_at = int64_t(sizeof(StepPlanHeader)) + h.num_tasks * int64_t(sizeof(AttentionTask));
  return reinterpret_cast<const AttentionPlan::Split*>(base + (on_device ? h.splits_at : host_at));
}

}  // namespace kvcache
