// BlockAllocator: one pool of KV block ids shared by every layer, with reference counts.
//
// A block id names one page of `page_size` tokens in every layer's K and V pools (the pools are
// [num_blocks, num_kv_heads, page_size, head_dim] per layer, see core/paged_layout.h). Block ids are
// handed out from a free stack in O(1); each id carries a reference count, and goes back to the free
// stack when its last reference is dropped. A sequence (one request's block table) holds one
// reference on each of its blocks; the prefix tree (radix_tree.h) holds one on each block it caches.
//
// Copy-on-write: a block with more than one reference is read-only. `append` grows a sequence by n
// tokens and, if the sequence must write into a shared partial last page, moves it to a fresh block
// and reports the (src, dst) copy for the caller to apply with kvcache.copy_blocks. Full pages are
// never written again, so they stay shared (fork, prefix hits) for as long as anyone holds them.
//
// Exhaustion: `allocate` and `append` ask the registered Reclaimer (the prefix cache) to evict when
// too few blocks are free, and throw OutOfBlocks if that is still not enough; they never hand out a
// block that is in use.
//
// Every call validates its whole input before it changes anything: on an exception the allocator is
// exactly as it was. Thread-safe (one internal mutex). Torch-free C++17.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvcache {
namespace prefix {

/// Not enough free blocks, even after eviction.
class OutOfBlocks : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// (src, dst) block pair of a copy the caller must perform (copy_blocks / swap_blocks).
struct BlockCopy {
  int32_t src;
  int32_t dst;
};

/// Something that can give blocks back to an allocator when it runs short (the prefix cache).
class Reclaimer {
 public:
  virtual ~Reclaimer() = default;
  /// Tries to return at least `num_blocks` blocks to the allocator; returns how many it returned.
  /// Called without the allocator's mutex held.
  virtual int64_t reclaim(int64_t num_blocks) = 0;
};

struct AllocatorStats {
  int64_t num_blocks = 0;
  int64_t page_size = 0;
  int64_t free = 0;           // blocks on the free stack
  int64_t used = 0;           // blocks with at least one reference
  int64_t shared = 0;         // blocks with more than one reference
  int64_t references = 0;     // sum of all reference counts
  int64_t filled_tokens = 0;  // tokens written into used blocks (append's accounting)
  int64_t waste_tokens = 0;   // used * page_size - filled_tokens: internal fragmentation
};

class BlockAllocator {
 public:
  BlockAllocator(int64_t num_blocks, int64_t page_size);

  int64_t num_blocks() const { return static_cast<int64_t>(refs_.size()); }
  int64_t page_size() const { return page_size_; }
  int64_t num_free() const;
  /// Pages that `num_tokens` tokens occupy.
  int64_t pages_for(int64_t num_tokens) const { return (num_tokens + page_size_ - 1) / page_size_; }

  /// `n` blocks with one reference each; evicts through the reclaimer if needed, else OutOfBlocks.
  /// Raw blocks count as full in the waste accounting (their use is the caller's).
  std::vector<int32_t> allocate(int64_t n);
  /// Like allocate but never reclaims: returns false (and allocates nothing) when short.
  bool try_allocate(int64_t n, std::vector<int32_t>* out);
  /// One more reference on each block (a block may appear several times).
  void share(const int32_t* blocks, int64_t n);
  /// One reference fewer on each block; returns how many blocks went back to the free stack.
  int64_t free(const int32_t* blocks, int64_t n);

  /// Makes room for `n` more tokens in a sequence that holds `num_tokens` tokens in `table`
  /// (ceil(num_tokens / page_size) blocks, one reference each held by the caller). Shared partial
  /// last page -> copied to a new block (returned as a copy to perform before writing); new pages
  /// are appended to `table`. All-or-nothing.
  std::vector<BlockCopy> append(std::vector<int32_t>* table, int64_t num_tokens, int64_t n);

  int32_t refcount(int32_t block) const;
  AllocatorStats stats() const;
  /// Throws unless every block is in range and referenced (the caller's "do I hold these" check).
  void check_held(const char* what, const int32_t* blocks, int64_t n) const;

  /// The one prefix cache that evicts for this allocator (throws if another live one is set).
  void set_reclaimer(std::weak_ptr<Reclaimer> reclaimer);

 private:
  // All private helpers expect mu_ held.
  void check_in_range(const char* what, const int32_t* blocks, int64_t n) const;
  void check_held_locked(const char* what, const int32_t* blocks, int64_t n) const;
  int32_t pop_free(int16_t fill);
  // If fewer than `n` blocks are free, asks the reclaimer (with mu_ released) once for the difference.
  void reclaim(std::unique_lock<std::mutex>& lock, int64_t n);

  mutable std::mutex mu_;
  int64_t page_size_;
  std::vector<int32_t> free_;   // stack of free block ids
  std::vector<int32_t> refs_;   // [num_blocks] reference counts
  std::vector<int16_t> fill_;   // [num_blocks] tokens written (page_size for raw allocations)
  std::weak_ptr<Reclaimer> reclaimer_;
};

}  // namespace prefix
}  // namespace kvcache
