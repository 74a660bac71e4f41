// The Python module `kvcache._C`. Importing it runs the static TORCH_LIBRARY registrations of every
// op in this shared library; the module itself only reports how the library was built.
#include <pybind11/pybind11.h>

#include <string>

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
}
