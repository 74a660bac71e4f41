// Memory of large CPU pools (see pool_memory.h).
//
// NOTE: why a mapping of our own: a decode step reads each (block, head) run of a few KiB and jumps; with
// 4 KiB pages nearly every jump is a TLB miss (8 x 32k on Zen 4: bf16 steps 1.04x, int8 1.1x as long as on
// 2 MiB pages). The advice only shapes pages not yet touched, and torch.empty may hand back heap memory a
// freed tensor already touched (glibc serves allocations up to its grown mmap threshold, 32 MiB, from the
// heap): a pool made there kept its 4 KiB pages.
#include "pool_memory.h"

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <sys/mman.h>

#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>

namespace kvcache {
namespace {

constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;

/// Advises the 2 MiB-aligned interior of [ptr, ptr + nbytes); false if there is none or the kernel refused.
bool advise_huge_pages(std::uintptr_t ptr, std::size_t nbytes) {
  const std::uintptr_t begin = (ptr + kHuge - 1) & ~(kHuge - 1), end = (ptr + nbytes) & ~(kHuge - 1);
  if (end <= begin) return false;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
}

/// A uint8 tensor of nbytes on a fresh anonymous mapping, 2 MiB-aligned and advised to huge pages, not yet
/// touched (reads give zeros). Unmapped when the tensor's storage is freed.
at::Tensor huge_page_tensor(int64_t nbytes) {
  if (nbytes <= 0) throw std::invalid_argument("huge_page_tensor: nbytes must be positive, got " + std::to_string(nbytes));
  const std::size_t size = (static_cast<std::size_t>(nbytes) + kHuge - 1) & ~(kHuge - 1);
  const std::size_t mapped = size + kHuge;  // room to align the start
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) throw std::bad_alloc();
  const std::uintptr_t start = (reinterpret_cast<std::uintptr_t>(base) + kHuge - 1) & ~(kHuge - 1);
  advise_huge_pages(start, size);  // (refused where huge pages are off: 4 KiB pages, still correct)
  return at::from_blob(
      reinterpret_cast<void*>(start), {nbytes}, [base, mapped](void*) { munmap(base, mapped); },
      at::TensorOptions().dtype(at::kByte));
}

}  // namespace

void register_pool_memory(pybind11::module_& m) {
  // Returns whether the kernel accepted the advice.
  m.def("advise_huge_pages", &advise_huge_pages);
  m.def("huge_page_tensor", &huge_page_tensor);
}

}  // namespace kvcache
