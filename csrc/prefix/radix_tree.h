// RadixTree: a page-aware prefix cache of KV blocks, keyed by token ids within a namespace.
//
// Structure. One root per namespace (a string that captures everything that changes K/V: model and
// revision, adapter, KV format, positional encoding, salt); namespaces never share nodes. A root exists
// only while its namespace has nodes: an insert makes it, the removal of its last node reclaims it, and
// a lookup never makes one (a miss in a namespace the tree never saw leaves no trace). Each edge
// holds a run of tokens; a node covers the sequence positions [start, end) and owns one block
// reference for every page it touches:
//
//     blocks = pages floor(start / P) .. ceil(end / P) - 1            (P = page_size)
//
// Nodes split at any token, so a page can straddle a parent and its child; both then hold a
// reference on that block (its first tokens are the parent's, the rest the child's). Siblings that
// diverge inside a page each have their own block for it. The blocks of a path are read as: for each
// page, the block of the deepest node on the path that touches it. Tree blocks are never written:
// the allocator's copy-on-write (refcount > 1) guarantees a request copies a cached page before it
// writes into it, which is how a match that ends inside a page is reused.
//
// Operations. match() walks the longest common prefix and returns the matched token count, the
// blocks covering it (the last one possibly partial) and a handle of the last node; insert() adds
// the part of a sequence the tree lacks, taking a reference on the caller's blocks for it; lock()
// pins a node and its ancestors; evict() removes unlocked leaves, least recently used first (or
// least frequently used), until enough blocks went back to the allocator. The tree is also the
// allocator's Reclaimer: an allocation that runs short evicts through it.
//
// Host tier (optional). Evicted nodes move to a host pool (another BlockAllocator; the KV is copied
// by the CopyFn callback, e.g. kvcache.swap_blocks) and stay in the tree; a later match loads them
// back. The device-resident part of every path is a prefix of it. Host leaves are dropped (LRU) when
// the host pool is full.
//
// Handles are (generation << 32 | node index), so a handle of an evicted node is rejected rather than
// aliasing a reused slot. Roots have no handles: a match of nothing returns kEmptyPrefix. Every call
// validates its input before changing anything. Thread-safe (one internal mutex; lock order: tree,
// then allocators; a ragged batch holds it once for all its sequences). Torch-free C++17.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "prefix/block_allocator.h"
#include "prefix/edge_tokens.h"

namespace kvcache {
namespace prefix {

enum class EvictionPolicy { kLru, kLfu };
enum class CopyDirection { kDeviceToHost, kHostToDevice };
/// Copies blocks between the device and host pools: (src id, dst id) pairs in the given direction.
using CopyFn = std::function<void(CopyDirection, const std::vector<BlockCopy>&)>;

/// The handle of the empty prefix: what a match of nothing (or an insert of nothing) returns, in any
/// namespace. lock() and unlock() of it do nothing: it holds no block. No node ever has this handle
/// (generations start at 1).
constexpr int64_t kEmptyPrefix = 0;

struct MatchResult {
  int64_t length = 0;           // matched tokens
  std::vector<int32_t> blocks;  // ceil(length / page_size) device blocks; the last may be partial
  int64_t node = kEmptyPrefix;  // handle of the node holding the last matched token; kEmptyPrefix if length is 0
};

struct InsertResult {
  int64_t prefix_length = 0;    // tokens that were already cached (the caller's blocks for them are unused)
  int64_t node = kEmptyPrefix;  // handle of the node holding the last inserted token; kEmptyPrefix if n is 0
};

/// A ragged batch, varlen style: sequence i is values[cu[i], cu[i + 1]), for i < batch (cu has
/// batch + 1 entries, cu[0] = 0, non-decreasing, cu[batch] = size = the entries of values).
struct Ragged {
  const int32_t* values = nullptr;
  int64_t size = 0;
  const int64_t* cu = nullptr;
  int64_t batch = 0;
  int64_t length(int64_t i) const { return cu[i + 1] - cu[i]; }
  const int32_t* at(int64_t i) const { return values + cu[i]; }
};

/// Throws unless `cu` is a valid offset array for `size` values (see Ragged): std::invalid_argument
/// for batch < 0, std::out_of_range for a bad offset. The message names the array (`what`, e.g.
/// "cu_lens") and the size (`size_name`, e.g. "len(tokens)").
void check_ragged(const Ragged& r, const char* what, const char* size_name);

struct TreeStats {
  // Counters since construction.
  int64_t lookups = 0, lookup_tokens = 0, hit_tokens = 0;
  int64_t inserts = 0, inserted_tokens = 0;
  int64_t evicted_nodes = 0;    // nodes dropped from the tree
  int64_t evicted_blocks = 0;   // device blocks returned to the allocator by eviction
  int64_t demoted_nodes = 0, demoted_blocks = 0;  // moved to the host tier
  int64_t loaded_nodes = 0, loaded_blocks = 0;    // brought back from it
  // Current state.
  int64_t namespaces = 0;  // namespaces with at least one node
  int64_t nodes = 0, host_nodes = 0, locked_nodes = 0, evictable_leaves = 0;
  int64_t device_tokens = 0, host_tokens = 0;  // tokens on the edges of device / host nodes
  // Distinct blocks the tree holds a reference on: what evicting everything would release, and (for
  // blocks nobody else holds) what the allocator counts as used.
  int64_t device_blocks = 0, host_blocks = 0;
  // References the tree holds: more than the blocks when several nodes touch one page (a page split
  // between a parent and its child, or the same blocks inserted in two namespaces).
  int64_t device_block_refs = 0, host_block_refs = 0;
};

class RadixTree : public Reclaimer {
 public:
  /// A tree over `device` that also becomes its reclaimer (use this, not the constructor).
  static std::shared_ptr<RadixTree> create(std::shared_ptr<BlockAllocator> device,
                                           EvictionPolicy policy = EvictionPolicy::kLru);
  RadixTree(std::shared_ptr<BlockAllocator> device, EvictionPolicy policy);
  ~RadixTree() override;  // drops every block reference the tree holds
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  /// Adds a host tier: evicted nodes are copied to `host` blocks by `copy` instead of dropped.
  void set_host_tier(std::shared_ptr<BlockAllocator> host, CopyFn copy);

  /// Longest cached prefix of tokens[0, n); host-tier hits are loaded back first. With `lock`, the
  /// returned node is locked in the same critical section.
  MatchResult match(std::string_view ns, const int32_t* tokens, int64_t n, bool lock = false);
  /// The length match() would find, through device and host nodes, changing nothing: no recency, no hit
  /// counters, no host load (a diagnostic's look must not decide what is evicted next).
  int64_t cached_length(std::string_view ns, const int32_t* tokens, int64_t n);
  /// The same, appending the blocks to `*blocks` (no allocation per match in batched callers);
  /// returns the matched length and sets `*node`.
  int64_t match_into(std::string_view ns, const int32_t* tokens, int64_t n, bool lock, std::vector<int32_t>* blocks,
                     int64_t* node);
  /// match_into() of every sequence of a batch, in order, under one lock: writes lengths[batch],
  /// nodes[batch] and cu_blocks[batch + 1] (offsets of each sequence's blocks in what it appends to *blocks).
  /// Every result holds when the call returns: with a host tier, loading a later sequence's prefix
  /// never evicts an earlier one's (it loads less instead).
  void match_ragged(std::string_view ns, const Ragged& tokens, bool lock, int64_t* lengths, std::vector<int32_t>* blocks,
                    int64_t* cu_blocks, int64_t* nodes);
  /// match_into() / match_ragged() only if they can run at once: they return false, having done
  /// nothing, when another thread holds the tree or a host tier could make the call long (a load
  /// copies KV). For callers that hold a lock of their own, Python's GIL: holding it through a short
  /// call saves releasing and retaking it, and on false they release it and call the waiting form,
  /// so they never wait for the tree while holding it.
  bool try_match_into(std::string_view ns, const int32_t* tokens, int64_t n, bool lock, std::vector<int32_t>* blocks,
                      int64_t* node, int64_t* length);
  bool try_match_ragged(std::string_view ns, const Ragged& tokens, bool lock, int64_t* lengths,
                        std::vector<int32_t>* blocks, int64_t* cu_blocks, int64_t* nodes);
  /// Caches tokens[0, n), whose KV is in `blocks` (ceil(n / page_size) ids the caller holds).
  InsertResult insert(std::string_view ns, const int32_t* tokens, int64_t n, const int32_t* blocks,
                      int64_t num_blocks, bool lock = false);
  /// insert() of every sequence of a batch, in order, under one lock; `blocks` has each sequence's
  /// ceil(n / page_size) ids. Every sequence is validated before the first is inserted. Writes
  /// prefix_lengths[batch] and nodes[batch].
  void insert_ragged(std::string_view ns, const Ragged& tokens, const Ragged& blocks, bool lock,
                     int64_t* prefix_lengths, int64_t* nodes);
  /// Pins a node and its ancestors against eviction (counted: every lock needs one unlock). Both do
  /// nothing for kEmptyPrefix.
  void lock(int64_t node);
  void unlock(int64_t node);
  /// Evicts unlocked leaves until `num_blocks` device blocks went back to the allocator (or nothing
  /// is left to evict); returns how many did.
  int64_t evict(int64_t num_blocks);
  int64_t reclaim(int64_t num_blocks) override { return evict(num_blocks); }

  int64_t page_size() const { return page_; }
  TreeStats stats() const;
  /// Every device (or host) block reference the tree holds, one entry per reference.
  std::vector<int32_t> block_references(bool host) const;
  /// "" if every structural invariant holds, else what is wrong (for tests).
  std::string check_invariants() const;

 private:
  struct Node {
    EdgeTokens tokens;              // the edge from the parent
    std::vector<int32_t> blocks;    // one per page touched by [start, end)
    std::vector<int32_t> children;
    int64_t start = 0;              // sequence position of tokens[0]
    int32_t parent = -1;
    int32_t device_children = 0;    // children resident on the device
    int32_t lock = 0;               // locks of this node and its descendants
    uint32_t generation = 0;
    uint64_t last_access = 0, hits = 0;
    bool alive = false, is_root = false, on_host = false;
    bool queued[2] = {false, false};  // has an entry in the device [0] / host [1] eviction heap
    int64_t end() const { return start + static_cast<int64_t>(tokens.size()); }

    /// A fresh node's state, generation kept. Arrays of at most kKeepBytes keep their storage: a
    /// freed slot is taken by the next new node, which would otherwise allocate again what eviction
    /// just freed (the frees were a quarter of an eviction's instructions). Longer ones are released.
    void reset() {
      static constexpr size_t kKeepBytes = 1024;
      EdgeTokens t = std::move(tokens);
      std::vector<int32_t> b = std::move(blocks), c = std::move(children);
      const uint32_t g = generation;
      *this = Node();
      generation = g;
      t.clear(kKeepBytes);
      for (std::vector<int32_t>* v : {&b, &c}) {
        if (v->capacity() * sizeof(int32_t) > kKeepBytes) {
          std::vector<int32_t>().swap(*v);
        } else {
          v->clear();
        }
      }
      tokens = std::move(t);
      blocks = std::move(b);
      children = std::move(c);
    }
  };
  // An eviction candidate. Keys only grow (a touch raises last_access / hits), so entries are not
  // updated when a node is touched: a popped entry whose key is stale is pushed again with the
  // current key, and one whose node is no longer an evictable leaf is dropped (a lazy heap). Once
  // there have been more touches of queued nodes than entries, the next eviction refreshes every
  // key and re-heapifies instead (O(n), paid for by those touches): after a pass that touched most
  // leaves, each victim then costs one pop rather than a pop, a push and another pop.
  struct Candidate {
    uint64_t primary, secondary;  // LRU: (last_access, 0); LFU: (hits, last_access)
    int32_t id;
    uint32_t generation;
    bool operator>(const Candidate& o) const {
      return std::tie(primary, secondary, id) > std::tie(o.primary, o.secondary, o.id);
    }
  };

  // Open addressing (linear probing) from edge_key(parent, first token) to the child: one probe
  // into a flat array per step of a match, and no allocation per node.
  class EdgeMap {
   public:
    int32_t find(uint64_t key) const;  // -1 if absent
    void prefetch(uint64_t key) const;  // the lines find(key) reads first
    void set(uint64_t key, int32_t child);
    void erase(uint64_t key);
    size_t size() const { return size_; }

   private:
    static constexpr uint64_t kEmpty = ~uint64_t{0};  // parent -1 never has children
    size_t slot(uint64_t key) const;
    void grow();
    std::vector<uint64_t> keys_;
    std::vector<int32_t> values_;
    size_t size_ = 0;
  };

  // Everything below expects mu_ held.
  int64_t match_locked(int32_t root, const int32_t* tokens, int64_t n, bool lock, std::vector<int32_t>* blocks,
                       int64_t* node);
  void match_ragged_locked(int32_t root, const Ragged& tokens, bool lock, int64_t* lengths, std::vector<int32_t>* blocks,
                           int64_t* cu_blocks, int64_t* nodes);
  InsertResult insert_locked(int32_t root, const int32_t* tokens, int64_t n, const int32_t* blocks, bool lock);
  int32_t find_root(std::string_view ns);  // -1 if the namespace has no nodes: lookups never make a root
  int32_t make_root(std::string_view ns);  // find_root(), making the root if there is none
  void drop_root_if_empty(int32_t root);   // reclaims a root without children (and its namespace)
  int32_t new_node();
  int32_t resolve(int64_t handle) const;
  int64_t handle(int32_t id) const {
    return nodes_[id].is_root ? kEmptyPrefix : (static_cast<int64_t>(nodes_[id].generation) << 32) | id;
  }
  int64_t pages_for(int64_t tokens) const { return (tokens + page_ - 1) / page_; }
  BlockAllocator& pool(bool host) const { return host ? *host_ : *device_; }

  Candidate candidate(int32_t id) const;
  bool evictable(int32_t id) const;
  void queue(int32_t id);            // after any change that may have made a node an evictable leaf
  int32_t next_victim(bool host);    // the evictable leaf to go first, or -1
  void refresh_heap(bool host);      // current keys for every entry, dead ones dropped
  void touch(int32_t id, uint64_t tick);
  void lock_path(int32_t id, int delta);

  int32_t split(int32_t id, int64_t k);  // the new upper node, holding the first k tokens
  void adopt(int32_t id, const int32_t* blocks);  // host node -> device, using the caller's blocks
  bool load(int32_t id);                          // host node -> device, by copy
  bool allocate_device(int64_t n, std::vector<int32_t>* out);
  int64_t evict_locked(int64_t num_blocks);
  int64_t evict_leaf(int32_t id);  // demote to the host tier or delete; returns device blocks freed
  bool make_host_room(int64_t n);
  int64_t delete_subtree(int32_t id);
  int64_t delete_leaf(int32_t id);  // a node without children; returns device blocks freed

  mutable std::mutex mu_;
  std::shared_ptr<BlockAllocator> device_, host_;
  CopyFn copy_;
  EvictionPolicy policy_;
  int64_t page_;
  uint64_t clock_ = 0;  // logical time of the last match / insert (LRU)
  std::vector<Node> nodes_;
  std::vector<int32_t> free_nodes_;
  EdgeMap edges_;                                  // (parent << 32 | first token) -> child
  std::unordered_map<std::string, int32_t> roots_;  // namespace -> root, for namespaces with nodes
  std::unordered_map<int32_t, const std::string*> root_names_;  // root -> its key in roots_ (stable)
  std::string last_ns_;                            // the namespace of the last call that found its root,
  int32_t last_root_ = -1;                         // and that root (-1 once reclaimed): no hashing per call
  std::vector<Candidate> heaps_[2];                // device / host eviction candidates (min-heaps)
  size_t stale_touches_[2] = {0, 0};               // touches of queued nodes since the last refresh
  std::vector<int32_t> path_;                      // scratch of match
  TreeStats counters_;
};

}  // namespace prefix
}  // namespace kvcache
