// Validation and argument packing of mla_attention, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "attention/attention_plan.h"
#include "mla/mla_args.h"

namespace kvcache {

/// Checks every argument (shapes, dtypes, devices, formats; the index values on the host, as paged_attention)
/// and packs them. `host` receives the lengths read.
MlaArgs prepare_mla_attention(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& cu_q_lens, double scale,
                              const at::Tensor& out, const std::optional<at::Tensor>& lse,
                              const std::optional<at::Tensor>& k_scale,
                              const std::optional<at::Tensor>& v_scale, int64_t k_format,
                              int64_t v_format, AttentionHostInfo* host);

/// The CUDA kernel's limits on the row widths (mla/mla_cuda_launch.h), as a ValueError that names them.
void check_mla_cuda_limits(const MlaArgs& a);

}  // namespace kvcache
