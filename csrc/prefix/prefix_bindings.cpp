// torch custom classes over the torch-free prefix core:
//   torch.classes.kvcache.BlockAllocator(num_blocks, page_size)
//   torch.classes.kvcache.PrefixCache(allocator, policy)        policy: "lru" or "lfu"
// Python wraps them in kvcache.BlockAllocator / kvcache.PrefixCache (python/kvcache/prefix.py).
//
// Token ids and block ids cross the boundary as 1-D CPU tensors (tokens int32 or int64, blocks int32;
// ragged batches use the varlen convention: flat values + cu_lens [batch + 1]). Errors of the core
// become IndexError (unknown ids, stale handles), ValueError (bad values, double free, unlock without
// lock) and TypeError (dtypes); an exhausted pool is a RuntimeError starting "out of blocks".
//
// NOTE(GIL): torch runs custom-class methods called from Python with the GIL released
// (torch/csrc/jit/python/pybind_utils.h, runAndInsertCall: `pybind11::gil_scoped_release` around
// `callee.run(stack)`), so nothing here needs to release it; the core's mutexes do the locking.
//
// A call through torch's custom-class machinery costs microseconds (argument boxing, schema
// matching, tensor wrapping), more than a match itself; kvcache.PrefixCache therefore calls the same
// RadixTree through the pybind11 fast path (prefix_pybind.cpp), found by PrefixCache.core_id().
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "prefix/block_allocator.h"
#include "prefix/prefix_pybind.h"
#include "prefix/radix_tree.h"

namespace kvcache {
namespace {

using prefix::BlockCopy;

/// Runs f, turning the core's exceptions into torch's (and so Python's) exception types.
template <class F>
auto translate(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const prefix::OutOfBlocks& e) {
    TORCH_CHECK(false, e.what());
  } catch (const std::out_of_range& e) {
    TORCH_CHECK_INDEX(false, e.what());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

void check_vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor but is on ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 1, name, " must be a 1-D tensor but has shape ", t.sizes());
}

/// int32 view (or checked copy) of a 1-D CPU tensor of int32 or int64 ids.
struct Int32Ids {
  std::vector<int32_t> copy;
  at::Tensor keep;
  const int32_t* data = nullptr;
  int64_t size = 0;

  Int32Ids(const at::Tensor& t, const char* name, const char* what) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " must have dtype int32 or int64 (",
                     what, ") but has ", t.scalar_type());
    check_vector(t, name);
    size = t.size(0);
    if (t.scalar_type() == at::kInt) {
      keep = t.contiguous();
      data = keep.data_ptr<int32_t>();
      return;
    }
    const at::Tensor c = t.contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    copy.resize(static_cast<size_t>(size));
    for (int64_t i = 0; i < size; ++i) {
      TORCH_CHECK_INDEX(p[i] >= INT32_MIN && p[i] <= INT32_MAX, name, "[", i, "] = ", p[i], " does not fit in int32");
      copy[static_cast<size_t>(i)] = static_cast<int32_t>(p[i]);
    }
    data = copy.data();
  }
};

at::Tensor to_tensor(const std::vector<int32_t>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kInt);
  if (!v.empty()) std::memcpy(t.data_ptr<int32_t>(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

at::Tensor copies_tensor(const std::vector<BlockCopy>& copies) {
  at::Tensor t = at::empty({static_cast<int64_t>(copies.size()), 2}, at::kLong);
  int64_t* p = t.data_ptr<int64_t>();
  for (const BlockCopy& c : copies) {
    *p++ = c.src;
    *p++ = c.dst;
  }
  return t;
}

/// cu_lens [batch + 1] int64/int32 (its values are checked by the core, prefix::check_ragged).
std::vector<int64_t> read_cu(const at::Tensor& cu, const char* name) {
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, name,
                   " must have dtype int32 or int64 but has ", cu.scalar_type());
  check_vector(cu, name);
  TORCH_CHECK_VALUE(cu.size(0) >= 1, name, " must have batch + 1 >= 1 entries");
  const at::Tensor c = cu.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.size(0));
}

c10::Dict<std::string, int64_t> allocator_stats(const prefix::AllocatorStats& s) {
  c10::Dict<std::string, int64_t> d;
  d.insert("num_blocks", s.num_blocks);
  d.insert("page_size", s.page_size);
  d.insert("free", s.free);
  d.insert("used", s.used);
  d.insert("shared", s.shared);
  d.insert("references", s.references);
  d.insert("filled_tokens", s.filled_tokens);
  d.insert("waste_tokens", s.waste_tokens);
  return d;
}

// ---- BlockAllocator ------------------------------------------------------------------------------

struct BlockAllocatorClass : torch::CustomClassHolder {
  std::shared_ptr<prefix::BlockAllocator> core;

  BlockAllocatorClass(int64_t num_blocks, int64_t page_size)
      : core(translate([&] { return std::make_shared<prefix::BlockAllocator>(num_blocks, page_size); })) {}

  at::Tensor allocate(int64_t n) {
    return translate([&] { return to_tensor(core->allocate(n)); });
  }
  void share(const at::Tensor& blocks) {
    const Int32Ids ids(blocks, "blocks", "block ids");
    translate([&] { core->share(ids.data, ids.size); });
  }
  int64_t free(const at::Tensor& blocks) {
    const Int32Ids ids(blocks, "blocks", "block ids");
    return translate([&] { return core->free(ids.data, ids.size); });
  }
  // -> (the new block table [pages] int32, copies [k, 2] int64 of (src, dst) to apply before writing)
  std::tuple<at::Tensor, at::Tensor> append(const at::Tensor& table, int64_t num_tokens, int64_t n) {
    const Int32Ids ids(table, "block_table", "block ids");
    std::vector<int32_t> blocks(ids.data, ids.data + ids.size);
    auto copies = translate([&] { return core->append(&blocks, num_tokens, n); });
    return {to_tensor(blocks), copies_tensor(copies)};
  }
  int64_t block_refcount(int64_t block) {
    TORCH_CHECK_INDEX(block >= 0 && block < core->num_blocks(), "block = ", block, " is not a block id: ids are in [0, ",
                      core->num_blocks(), ")");
    return core->refcount(static_cast<int32_t>(block));
  }
  int64_t num_free() { return core->num_free(); }
  int64_t num_blocks() { return core->num_blocks(); }
  int64_t page_size() { return core->page_size(); }
  c10::Dict<std::string, int64_t> stats() { return allocator_stats(core->stats()); }
};

// ---- PrefixCache ---------------------------------------------------------------------------------

prefix::EvictionPolicy parse_policy(const std::string& policy) {
  if (policy == "lru") return prefix::EvictionPolicy::kLru;
  if (policy == "lfu") return prefix::EvictionPolicy::kLfu;
  TORCH_CHECK_VALUE(false, "policy = '", policy, "' is not an eviction policy; use 'lru' or 'lfu'");
}

/// Host tier copies through kvcache::swap_blocks, layer by layer.
struct PoolCopier {
  std::vector<at::Tensor> device_k, device_v, host_k, host_v;

  void operator()(prefix::CopyDirection direction, const std::vector<BlockCopy>& copies) const {
    if (copies.empty()) return;
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::swap_blocks", "");
    const at::Tensor mapping = copies_tensor(copies);
    const bool to_host = direction == prefix::CopyDirection::kDeviceToHost;
    for (size_t layer = 0; layer < device_k.size(); ++layer) {
      torch::jit::Stack stack{to_host ? device_k[layer] : host_k[layer], to_host ? device_v[layer] : host_v[layer],
                              to_host ? host_k[layer] : device_k[layer], to_host ? host_v[layer] : device_v[layer],
                              mapping};
      op.callBoxed(&stack);
    }
  }
};

struct PrefixCacheClass : torch::CustomClassHolder {
  c10::intrusive_ptr<BlockAllocatorClass> allocator;
  c10::intrusive_ptr<BlockAllocatorClass> host;  // null without a host tier
  std::shared_ptr<prefix::RadixTree> tree;
  int64_t id = 0;  // of the fast path's registry

  PrefixCacheClass(c10::intrusive_ptr<BlockAllocatorClass> device, const std::string& policy)
      : allocator(std::move(device)) {
    const prefix::EvictionPolicy p = parse_policy(policy);
    tree = translate([&] { return prefix::RadixTree::create(allocator->core, p); });
    id = publish_prefix_tree(tree);
  }
  ~PrefixCacheClass() override { unpublish_prefix_tree(id); }

  // -> (matched tokens, blocks [ceil(length / page_size)] int32, node handle)
  std::tuple<int64_t, at::Tensor, int64_t> match(const at::Tensor& tokens, const std::string& ns, bool lock) {
    const Int32Ids t(tokens, "tokens", "token ids");
    auto r = translate([&] { return tree->match(ns, t.data, t.size, lock); });
    return {r.length, to_tensor(r.blocks), r.node};
  }
  // -> (tokens that were already cached, node handle)
  std::tuple<int64_t, int64_t> insert(const at::Tensor& tokens, const at::Tensor& blocks, const std::string& ns,
                                      bool lock) {
    const Int32Ids t(tokens, "tokens", "token ids");
    const Int32Ids b(blocks, "blocks", "block ids");
    auto r = translate([&] { return tree->insert(ns, t.data, t.size, b.data, b.size, lock); });
    return {r.prefix_length, r.node};
  }

  // Ragged batch, in order: tokens [total] + cu_lens [batch + 1] ->
  // (lengths [batch] int64, blocks [sum of pages] int32, cu_blocks [batch + 1] int64, nodes [batch] int64).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> match_ragged(const at::Tensor& tokens,
                                                                          const at::Tensor& cu_lens,
                                                                          const std::string& ns, bool lock) {
    const Int32Ids t(tokens, "tokens", "token ids");
    const std::vector<int64_t> cu = read_cu(cu_lens, "cu_lens");
    const int64_t batch = static_cast<int64_t>(cu.size()) - 1;
    at::Tensor lengths = at::empty({batch}, at::kLong), nodes = at::empty({batch}, at::kLong);
    at::Tensor cu_blocks = at::empty({batch + 1}, at::kLong);
    std::vector<int32_t> all_blocks;
    translate([&] {
      tree->match_ragged(ns, prefix::Ragged{t.data, t.size, cu.data(), batch}, lock, lengths.data_ptr<int64_t>(),
                         &all_blocks, cu_blocks.data_ptr<int64_t>(), nodes.data_ptr<int64_t>());
    });
    return {lengths, to_tensor(all_blocks), cu_blocks, nodes};
  }

  // Ragged batch, in order: tokens + cu_lens, blocks + cu_blocks -> (prefix lengths [batch], nodes [batch]).
  // Every sequence is validated before the first is inserted.
  std::tuple<at::Tensor, at::Tensor> insert_ragged(const at::Tensor& tokens, const at::Tensor& cu_lens,
                                                   const at::Tensor& blocks, const at::Tensor& cu_blocks,
                                                   const std::string& ns, bool lock) {
    const Int32Ids t(tokens, "tokens", "token ids");
    const Int32Ids b(blocks, "blocks", "block ids");
    const std::vector<int64_t> cu = read_cu(cu_lens, "cu_lens");
    const std::vector<int64_t> cub = read_cu(cu_blocks, "cu_blocks");
    const int64_t batch = static_cast<int64_t>(cu.size()) - 1;
    at::Tensor prefix_lens = at::empty({batch}, at::kLong), nodes = at::empty({batch}, at::kLong);
    translate([&] {
      tree->insert_ragged(ns, prefix::Ragged{t.data, t.size, cu.data(), batch},
                          prefix::Ragged{b.data, b.size, cub.data(), static_cast<int64_t>(cub.size()) - 1}, lock,
                          prefix_lens.data_ptr<int64_t>(), nodes.data_ptr<int64_t>());
    });
    return {prefix_lens, nodes};
  }

  void lock(int64_t node) { translate([&] { tree->lock(node); }); }
  void unlock(int64_t node) { translate([&] { tree->unlock(node); }); }
  int64_t evict(int64_t num_blocks) { return translate([&] { return tree->evict(num_blocks); }); }

  void set_host_tier(c10::intrusive_ptr<BlockAllocatorClass> host_allocator, std::vector<at::Tensor> device_k,
                     std::vector<at::Tensor> device_v, std::vector<at::Tensor> host_k, std::vector<at::Tensor> host_v) {
    const size_t layers = device_k.size();
    TORCH_CHECK_VALUE(layers >= 1 && device_v.size() == layers && host_k.size() == layers && host_v.size() == layers,
                      "the host tier needs the same number (>= 1) of device K, device V, host K and host V pools; got ",
                      device_k.size(), ", ", device_v.size(), ", ", host_k.size(), ", ", host_v.size());
    // Checked here, once: a copy that failed half-way through an eviction would be hard to undo.
    for (size_t l = 0; l < layers; ++l) {
      for (const at::Tensor* pool : {&device_k[l], &device_v[l], &host_k[l], &host_v[l]}) {
        TORCH_CHECK_VALUE(pool->dim() == 4 && pool->is_contiguous(), "layer ", l,
                          ": pools must be contiguous [num_blocks, num_kv_heads, page_size, head_dim], got shape ",
                          pool->sizes());
        TORCH_CHECK_TYPE(pool->scalar_type() == device_k[0].scalar_type(), "layer ", l, ": pool dtype ",
                         pool->scalar_type(), " differs from ", device_k[0].scalar_type());
        // K and V rows may differ in width (MLA latents): K pools match K pools, V pools V pools
        const bool value = pool == &device_v[l] || pool == &host_v[l];
        const at::Tensor& first = value ? device_v[0] : device_k[0];
        TORCH_CHECK_VALUE(pool->sizes().slice(1) == first.sizes().slice(1), "layer ", l, ": ", value ? "V" : "K",
                          " block shape ", pool->sizes().slice(1), " differs from ", first.sizes().slice(1));
        TORCH_CHECK_VALUE(pool->sizes().slice(1, 2) == device_k[0].sizes().slice(1, 2), "layer ", l, ": ",
                          value ? "V" : "K", " pool shape ", pool->sizes(), " differs from the K pool's ",
                          device_k[0].sizes(), " in num_kv_heads or page_size");
      }
      TORCH_CHECK_VALUE(device_k[l].size(0) == allocator->core->num_blocks() &&
                            device_v[l].size(0) == allocator->core->num_blocks(),
                        "layer ", l, ": the device pools have ", device_k[l].size(0), " blocks but the allocator has ",
                        allocator->core->num_blocks());
      TORCH_CHECK_VALUE(host_k[l].size(0) == host_allocator->core->num_blocks() &&
                            host_v[l].size(0) == host_allocator->core->num_blocks(),
                        "layer ", l, ": the host pools have ", host_k[l].size(0), " blocks but the host allocator has ",
                        host_allocator->core->num_blocks());
      TORCH_CHECK_VALUE(host_k[l].is_cpu() && host_v[l].is_cpu(), "layer ", l, ": host pools must be CPU tensors");
    }
    TORCH_CHECK_VALUE(device_k[0].size(2) == tree->page_size(), "the pools have page_size ", device_k[0].size(2),
                      " but the allocator has ", tree->page_size());
    PoolCopier copier{std::move(device_k), std::move(device_v), std::move(host_k), std::move(host_v)};
    translate([&] { tree->set_host_tier(host_allocator->core, copier); });
    host = std::move(host_allocator);
  }

  c10::Dict<std::string, int64_t> stats() {
    const prefix::TreeStats s = tree->stats();
    c10::Dict<std::string, int64_t> d;
    for (const auto& [key, value] : std::initializer_list<std::pair<const char*, int64_t>>{
             {"lookups", s.lookups}, {"lookup_tokens", s.lookup_tokens}, {"hit_tokens", s.hit_tokens},
             {"inserts", s.inserts}, {"inserted_tokens", s.inserted_tokens}, {"evicted_nodes", s.evicted_nodes},
             {"evicted_blocks", s.evicted_blocks}, {"demoted_nodes", s.demoted_nodes},
             {"demoted_blocks", s.demoted_blocks}, {"loaded_nodes", s.loaded_nodes},
             {"loaded_blocks", s.loaded_blocks}, {"namespaces", s.namespaces}, {"nodes", s.nodes},
             {"host_nodes", s.host_nodes}, {"locked_nodes", s.locked_nodes},
             {"evictable_leaves", s.evictable_leaves}, {"device_tokens", s.device_tokens},
             {"host_tokens", s.host_tokens}, {"device_blocks", s.device_blocks}, {"host_blocks", s.host_blocks},
             {"device_block_refs", s.device_block_refs}, {"host_block_refs", s.host_block_refs}}) {
      d.insert(key, value);
    }
    return d;
  }
  at::Tensor block_references(bool on_host) { return to_tensor(tree->block_references(on_host)); }
  std::string check_invariants() { return tree->check_invariants(); }
  int64_t page_size() { return tree->page_size(); }
  int64_t core_id() { return id; }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache, m) {
  m.class_<BlockAllocatorClass>("BlockAllocator")
      .def(torch::init<int64_t, int64_t>())
      .def("allocate", &BlockAllocatorClass::allocate)
      .def("share", &BlockAllocatorClass::share)
      .def("free", &BlockAllocatorClass::free)
      .def("append", &BlockAllocatorClass::append)
      .def("refcount", &BlockAllocatorClass::block_refcount)
      .def("num_free", &BlockAllocatorClass::num_free)
      .def("num_blocks", &BlockAllocatorClass::num_blocks)
      .def("page_size", &BlockAllocatorClass::page_size)
      .def("stats", &BlockAllocatorClass::stats);

  m.class_<PrefixCacheClass>("PrefixCache")
      .def(torch::init<c10::intrusive_ptr<BlockAllocatorClass>, std::string>())
      .def("match", &PrefixCacheClass::match)
      .def("insert", &PrefixCacheClass::insert)
      .def("match_ragged", &PrefixCacheClass::match_ragged)
      .def("insert_ragged", &PrefixCacheClass::insert_ragged)
      .def("lock", &PrefixCacheClass::lock)
      .def("unlock", &PrefixCacheClass::unlock)
      .def("evict", &PrefixCacheClass::evict)
      .def("set_host_tier", &PrefixCacheClass::set_host_tier)
      .def("stats", &PrefixCacheClass::stats)
      .def("block_references", &PrefixCacheClass::block_references)
      .def("check_invariants", &PrefixCacheClass::check_invariants)
      .def("page_size", &PrefixCacheClass::page_size)
      .def("core_id", &PrefixCacheClass::core_id);
}

}  // namespace kvcache
