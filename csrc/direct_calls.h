// Direct Python entry points of the per-layer ops (see direct_calls.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace kvcache {

/// Adds kvcache._C.append, append_planned, paged_attention and paged_attention_planned.
void register_direct_calls(pybind11::module_& m);

}  // namespace kvcache
