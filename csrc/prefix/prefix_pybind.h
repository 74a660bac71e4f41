// The prefix cache's pybind11 fast path (prefix_pybind.cpp): kvcache._C._PrefixTree, over the same
// RadixTree as a torch.classes.kvcache.PrefixCache, which publishes its tree here under an id.
#pragma once

#include <cstdint>
#include <memory>

namespace pybind11 {
class module_;
}

namespace kvcache {
namespace prefix {
class RadixTree;
}

/// Adds _PrefixTree to the extension module (called once, from module.cpp).
void register_prefix_pybind(pybind11::module_& m);

/// Makes `tree` reachable as kvcache._C._PrefixTree(id); returns that id (never reused).
int64_t publish_prefix_tree(std::shared_ptr<prefix::RadixTree> tree);
/// Forgets the id (the torch object is gone; fast-path objects made from it keep the tree alive).
void unpublish_prefix_tree(int64_t id);

}  // namespace kvcache
