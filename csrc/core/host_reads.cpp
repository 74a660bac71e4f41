#include "core/host_reads.h"

#include <ATen/ATen.h>

namespace kvcache {

std::atomic<int64_t>& host_index_reads() {
  static std::atomic<int64_t> reads{0};
  return reads;
}

at::Tensor read_on_host(const at::Tensor& t) {
  host_index_reads().fetch_add(1, std::memory_order_relaxed);
  return t.is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
}

}  // namespace kvcache
