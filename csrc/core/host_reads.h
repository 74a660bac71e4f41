// Host reads of index values. Every time host code needs the values of an index tensor (lengths, block
// tables, slots) it goes through read_on_host, which counts the read: on a CUDA tensor such a read is a
// device-to-host copy, that is a synchronization. CPU tensors are read in place, but counted all the same,
// so that a test on a machine without a GPU can assert that the per-layer calls of a planned step make
// none (kvcache.ops.host_index_reads()).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>

namespace kvcache {

/// Reads of index tensors by host code since the library was loaded.
std::atomic<int64_t>& host_index_reads();

/// `t` as a contiguous CPU tensor (a device-to-host copy for a device tensor), counted.
at::Tensor read_on_host(const at::Tensor& t);

}  // namespace kvcache
