#include "mla/mla_prepare.h"

#include <ATen/ATen.h>

#include <cmath>

#include "attention/attention_prepare.h"
#include "cache/cache_prepare.h"
#include "core/check.h"

namespace kvcache {

MlaArgs prepare_mla_attention(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& cu_q_lens, double scale,
                              const at::Tensor& out, const std::optional<at::Tensor>& lse_arg,
                              const std::optional<at::Tensor>& k_scale,
                              const std::optional<at::Tensor>& v_scale, int64_t k_format,
                              int64_t v_format, AttentionHostInfo* host) {
  const PoolFormats formats = make_formats(k_format, v_format, k_scale, v_scale);
  // A rotated latent would need the query rotated and every output unrotated over kv_lora_rank dims: not built.
  TORCH_CHECK_VALUE(!formats.k_rot && !formats.v_rot, "mla_attention does not read Hadamard-rotated pools; got "
                    "k_format = ", k_format, " and v_format = ", v_format,
                    " (read them through paged_gather)");
  const PagedLayout layout = check_formatted_pools(k_cache, v_cache, formats);
  KVC_CHECK_DIM(q_latent, 3);
  KVC_CHECK_DIM(q_rope, 3);
  const auto qt = q_latent.scalar_type();
  TORCH_CHECK_TYPE(qt == at::kFloat || qt == at::kHalf || qt == at::kBFloat16, "q_latent has dtype ", qt,
                   "; supported: float32, float16, bfloat16");
  KVC_CHECK_DTYPE(q_rope, qt);
  KVC_CHECK_SAME_DEVICE(q_latent, k_cache);
  KVC_CHECK_SAME_DEVICE(q_rope, k_cache);
  KVC_CHECK_SIZE(q_latent, 2, layout.head_dim, "the latent width of k_cache (kv_lora_rank)");
  KVC_CHECK_SIZE(q_rope, 2, layout.v_head_dim, "the row width of v_cache (qk_rope_head_dim)");
  TORCH_CHECK_VALUE(q_rope.size(0) == q_latent.size(0) && q_rope.size(1) == q_latent.size(1), "q_rope has shape ",
                    q_rope.sizes(), " but q_latent has ", q_latent.sizes(), "; they must agree on tokens and heads");
  const int64_t total_q = q_latent.size(0), q_heads = q_latent.size(1);
  TORCH_CHECK_VALUE(q_heads > 0 && q_heads % layout.num_kv_heads == 0, "q_latent has ", q_heads,
                    " heads, which must be a positive multiple of the cache's num_kv_heads = ", layout.num_kv_heads);
  KVC_CHECK_FINITE_FLOAT32(scale);
  KVC_CHECK_DIM(out, 3);
  TORCH_CHECK_VALUE(out.size(0) == total_q && out.size(1) == q_heads && out.size(2) == layout.head_dim,
                    "out has shape ", out.sizes(), " but must be [total_q, q_heads, kv_lora_rank] = [", total_q, ", ",
                    q_heads, ", ", layout.head_dim, "]");
  KVC_CHECK_DTYPE(out, qt);
  KVC_CHECK_SAME_DEVICE(out, k_cache);
  KVC_CHECK_CONTIGUOUS(out);
  TORCH_CHECK_VALUE(!out.is_alias_of(q_latent) && !out.is_alias_of(q_rope) && !out.is_alias_of(k_cache) &&
                        !out.is_alias_of(v_cache),
                    "mla_attention writes out, which must not share memory with its inputs");
  check_lse_out(lse_arg, total_q, q_heads, k_cache);
  check_indices_on_host(block_tables, seq_lens, cu_q_lens, k_cache, total_q, "q_latent.shape[0] (total query tokens)",
                        layout, host);
  const int64_t batch = seq_lens.size(0);

  MlaArgs a;
  a.q_latent = q_latent.data_ptr();
  a.q_rope = q_rope.data_ptr();
  for (int d = 0; d < 3; ++d) {
    a.ql_strides[d] = q_latent.stride(d);
    a.qr_strides[d] = q_rope.stride(d);
  }
  a.q_dtype = to_dtype(qt);
  a.latent_cache = k_cache.data_ptr();
  a.rope_cache = v_cache.data_ptr();
  a.latent_kind = formats.k_kind;
  a.rope_kind = formats.v_kind;
  a.latent_dtype = formats.k_kind == KVKind::kFull ? to_dtype(k_cache.scalar_type()) : DType::kFloat32;
  a.rope_dtype = formats.v_kind == KVKind::kFull ? to_dtype(v_cache.scalar_type()) : DType::kFloat32;
  a.latent_scale = formats.k_kind != KVKind::kFull ? static_cast<const float*>((*formats.k_scale)->data_ptr()) : nullptr;
  a.rope_scale = formats.v_kind != KVKind::kFull ? static_cast<const float*>((*formats.v_scale)->data_ptr()) : nullptr;
  a.layout = layout;
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.table_stride = block_tables.stride(0);
  a.kv_lens = seq_lens.data_ptr<int32_t>();
  a.cu_q_lens = cu_q_lens.data_ptr<int32_t>();
  a.batch = batch;
  a.total_q = total_q;
  a.q_heads = q_heads;
  a.group = q_heads / layout.num_kv_heads;
  a.scale = static_cast<float>(scale);
  a.out = out.data_ptr();
  a.lse = lse_arg.has_value() ? lse_arg->data_ptr<float>() : nullptr;
  return a;
}

void check_mla_cuda_limits(const MlaArgs& a) {
  // (the limits are mla_cuda_launch.h's kMlaMaxLatentDim / kMlaMaxRopeDim; that header needs the CUDA runtime)
  constexpr int64_t kMaxLatent = 1024, kMaxRope = 256;
  TORCH_CHECK_VALUE(a.latent_dim() <= kMaxLatent && a.rope_dim() <= kMaxRope, "the CUDA mla_attention kernel reads "
                    "latent rows of at most ", kMaxLatent, " and rope rows of at most ", kMaxRope, " values; got ",
                    a.latent_dim(), " and ", a.rope_dim());
}

}  // namespace kvcache
