// Online-softmax states and their merge, shared by the CPU and CUDA attention kernels and by
// merge_states. A state summarizes attention over a subset of keys for one (query, head):
//   o   = sum_j p_j v_j / sum_j p_j   (normalized partial output)
//   lse = log(sum_j exp(s_j))         (natural log-sum-exp of the scaled scores; -inf if no keys)
// Two states over disjoint key sets merge exactly:  lse = logaddexp(lse_a, lse_b),
//   o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse).
#pragma once

#include <cmath>

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

}  // namespace kvcache
