// The Python module `kvcache._C`. Importing it runs the static TORCH_LIBRARY registrations of every
// op in this shared library; the module itself only reports how the library was built.
#include <pybind11/pybind11.h>

#include <sys/mman.h>

#include <cstdint>
#include <string>

#include "attention/attention_cpu.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvcache native ops (registered under torch.ops.kvcache)";
  py::dict info;
  info["torch_version"] = std::string(KVCACHE_TORCH_VERSION);
#ifdef KVCACHE_WITH_CUDA
  info["cuda"] = true;
  info["cuda_archs"] = std::string(KVCACHE_CUDA_ARCHS);
#else
  info["cuda"] = false;
  info["cuda_archs"] = std::string();
#endif
  m.attr("build_info") = info;

  // Transparent huge pages for a CPU pool, asked for before its pages are first touched. A decode step
  // reads each (block, head) run of a few KiB and jumps: with 4 KiB pages nearly every run costs a TLB
  // miss, with 2 MiB pages almost none (measured ~20% faster decode). Only the 2 MiB-aligned interior
  // of the buffer is advised; returns whether the kernel accepted the advice.
  m.def("advise_huge_pages", [](std::uintptr_t ptr, std::size_t nbytes) {
    constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
    const std::uintptr_t begin = (ptr + kHuge - 1) & ~(kHuge - 1), end = (ptr + nbytes) & ~(kHuge - 1);
    if (end <= begin) return false;
    return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
  });

  // Instruction set of the CPU attention kernel: "avx512bf16", "avx512", "avx2" or "generic" (tests run each).
  static const char* kIsaNames[] = {"generic", "avx2", "avx512", "avx512bf16"};
  m.def("cpu_isa", [] { return std::string(kIsaNames[static_cast<int>(kvcache::cpu::current_isa())]); });
  m.def("best_cpu_isa", [] { return std::string(kIsaNames[static_cast<int>(kvcache::cpu::best_supported_isa())]); });
  m.def("set_cpu_isa", [](const std::string& name) {
    for (int i = 0; i < 4; ++i) {
      if (name == kIsaNames[i]) return kvcache::cpu::set_isa(static_cast<kvcache::cpu::Isa>(i));
    }
    throw py::value_error("unknown instruction set '" + name + "'; use avx512bf16, avx512, avx2 or generic");
  });
}
