// Online-softmax states and their merge, shared by the CPU and CUDA attention kernels and by
// merge_states. A state summarizes attention over a subset of keys for one (query, head):
//   o   = sum_j p_j v_j / sum_j p_j   (normalized partial output)
//   lse = log(sum_j exp(s_j))         (natural log-sum-exp of the scaled scores; -inf if no keys)
// Two states over disjoint key sets merge exactly:  lse = logaddexp(lse_a, lse_b),
//   o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace kvcache {

/// Weights (w_a, w_b) of two states in their merge, and the merged lse. Empty states (lse = -inf)
/// get weight 0; two empty states give lse = -inf and weights 0 (the merged output is 0).
struct MergeWeights {
  float w_a, w_b, lse;
};

KVC_HOST_DEVICE MergeWeights merge_weights(float lse_a, float lse_b) {
  const float m = lse_a > lse_b ? lse_a : lse_b;
  if (m == -INFINITY) return {0.f, 0.f, -INFINITY};
  const float ea = expf(lse_a - m), eb = expf(lse_b - m);
  const float sum = ea + eb;
  return {ea / sum, eb / sum, m + logf(sum)};
}

/// Row r of the partial states of slots [first_slot, first_slot + num_slots) (o [slots, rows_per_slot, D] and
/// lse [slots, rows_per_slot], float32: split tasks' outputs) merged into acc[0, D); returns the merged lse.
KVC_HOST_DEVICE float merge_slot_rows(const float* o, const float* lse, int64_t rows_per_slot, int64_t D,
                                      int64_t first_slot, int64_t num_slots, int64_t r, float* acc) {
  float acc_lse = -INFINITY;
  for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t slot_row = (first_slot + s) * rows_per_slot + r;
    const MergeWeights w = merge_weights(acc_lse, lse[slot_row]);
    const float* os = o + slot_row * D;
    for (int64_t d = 0; d < D; ++d) acc[d] = w.w_a * acc[d] + w.w_b * os[d];
    acc_lse = w.lse;
  }
  return acc_lse;
}

}  // namespace kvcache
