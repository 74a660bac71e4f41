// Running n work items on torch's thread pool with dynamic scheduling (the CPU attention and MLA
// registrations): items differ in cost (split tasks, short and long sequences), so each worker takes the next
// item when it is done rather than a fixed share. Host side: needs ATen.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvcache::cpu {

template <class Fn>
void run_dynamic(int64_t n, Fn fn) {
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  if (workers <= 1) {  // one item (or one thread): no parallel region to open
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
    }
  });
}

}  // namespace kvcache::cpu
