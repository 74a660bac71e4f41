// Memory of large CPU pools: fresh anonymous mappings advised to transparent huge pages before their first
// touch (kvcache._C.huge_page_tensor), and the advice alone for a buffer allocated elsewhere.
#pragma once

#include <pybind11/pybind11.h>

namespace kvcache {

void register_pool_memory(pybind11::module_& m);

}  // namespace kvcache
