// The Python module `kvcache._C`. Importing it runs the static TORCH_LIBRARY registrations of every
// op in this shared library; the module itself only reports how the library was built.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "attention/attention_cpu.h"
#include "attention/attention_cpu_gemm.h"
#include "core/host_reads.h"
#include "direct_calls.h"
#include "core/quant.h"
#include "pool_memory.h"
#include "prefix/prefix_pybind.h"

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
  kvcache::register_prefix_pybind(m);
  kvcache::register_direct_calls(m);  // the per-layer ops without torch.ops' argument parsing
  // Host reads of index values by the ops (core/host_reads.h): on a GPU each is a synchronization.
  m.def("host_index_reads", [] { return kvcache::host_index_reads().load(); });  // kvcache._C._PrefixTree: the prefix cache without torch's call overhead

  kvcache::register_pool_memory(m);  // huge_page_tensor, advise_huge_pages

  // Test hooks: the scalar quantizers of core/quant.h over raw float32 buffers, so tests/test_quant.py
  // can check them bit for bit against python/kvcache/quant.py (addresses come from tensor.data_ptr()).
  m.def("_quant_int8_rows", [](std::uintptr_t src, std::uintptr_t codes, std::uintptr_t scales, int64_t rows, int64_t d) {
    const float* x = reinterpret_cast<const float*>(src);
    for (int64_t r = 0; r < rows; ++r) {
      float amax = 0.f;
      bool nan = false;
      for (int64_t i = 0; i < d; ++i) {
        amax = std::fmax(amax, kvcache::quant::int8_abs(x[r * d + i]));
        nan |= kvcache::quant::is_nan(x[r * d + i]);
      }
      const float inv = kvcache::quant::int8_inv_scale(amax);
      for (int64_t i = 0; i < d; ++i) reinterpret_cast<int8_t*>(codes)[r * d + i] = kvcache::quant::int8_encode(x[r * d + i], inv);
      reinterpret_cast<float*>(scales)[r] = kvcache::quant::int8_scale(amax, nan);
    }
  });
  m.def("_quant_fp8", [](std::uintptr_t src, std::uintptr_t codes, int64_t n, float scale, bool e4m3) {
    const float inv = 1.f / scale;
    for (int64_t i = 0; i < n; ++i) {
      reinterpret_cast<uint8_t*>(codes)[i] = kvcache::quant::fp8_encode(
          reinterpret_cast<const float*>(src)[i] * inv, e4m3 ? kvcache::quant::kE4M3 : kvcache::quant::kE5M2);
    }
  });
  m.def("_quant_uint_groups", [](std::uintptr_t src, std::uintptr_t codes, std::uintptr_t scales, std::uintptr_t zeros,
                                 int64_t groups, int64_t size, int bits) {
    const float* x = reinterpret_cast<const float*>(src);
    for (int64_t g = 0; g < groups; ++g) {
      float mn = INFINITY, mx = -INFINITY;
      for (int64_t i = 0; i < size; ++i) {
        mn = std::fmin(mn, kvcache::quant::uint_low(x[g * size + i]));
        mx = std::fmax(mx, kvcache::quant::uint_high(x[g * size + i]));
      }
      kvcache::quant::uint_finish(mn, mx);
      const float inv = kvcache::quant::uint_inv_scale(mn, mx, bits);
      for (int64_t i = 0; i < size; ++i) {
        reinterpret_cast<uint8_t*>(codes)[g * size + i] = kvcache::quant::uint_encode(x[g * size + i], mn, inv, bits);
      }
      reinterpret_cast<float*>(scales)[g] = kvcache::quant::uint_scale(mn, mx, bits);
      reinterpret_cast<float*>(zeros)[g] = mn;
    }
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
  // Chunked prefill over bf16 pages with a bf16 query through MKL's bf16 GEMM (avx512bf16 kernel):
  // "auto" (on CPUs with AMX-BF16), "on" (wherever torch's MKL has it: the tests' second path) or "off".
  m.def("set_cpu_bf16_gemm", [](const std::string& mode) {
    static const char* kModes[] = {"auto", "off", "on"};
    for (int i = 0; i < 3; ++i) {
      if (mode == kModes[i]) return kvcache::cpu::set_bf16_gemm(i - 1);
    }
    throw py::value_error("unknown mode '" + mode + "'; use auto, on or off");
  });
  m.def("cpu_bf16_gemm", [] { return kvcache::cpu::bf16_gemm() != nullptr; });
  m.def("cpu_bf16_gemm_available", [] { return kvcache::cpu::bf16_gemm_available(); });
  // bf16 and fp8 pages with a bf16 query in the avx512bf16 kernel: vdpbf16ps ("on"), or the fp32 FMAs of the
  // avx512 kernel ("off"); "auto": off on Intel cores, where vdpbf16ps is the slower of the two.
  m.def("set_cpu_bf16_dot", [](const std::string& mode) {
    static const char* kModes[] = {"auto", "off", "on"};
    for (int i = 0; i < 3; ++i) {
      if (mode == kModes[i]) return kvcache::cpu::set_bf16_dot(i - 1);
    }
    throw py::value_error("unknown mode '" + mode + "'; use auto, on or off");
  });
  m.def("cpu_bf16_dot", [] { return kvcache::cpu::bf16_dot(); });
}
