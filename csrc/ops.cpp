// The `kvcache` op library: its schemas (op_schemas.h). Backends only register implementations
// (csrc/<family>/*_cpu.cpp, *_cuda.cpp).
#include <torch/library.h>

#include "op_schemas.h"

TORCH_LIBRARY(kvcache, m) {
  for (const char* schema : kvcache::kOpSchemas) m.def(schema);
}
