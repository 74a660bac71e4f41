#include "core/strcat.h"
#include "prefix/block_allocator.h"

#include <algorithm>
#include <sstream>

#include "core/paged_layout.h"

namespace kvcache {
namespace prefix {
namespace {


}  // namespace

BlockAllocator::BlockAllocator(int64_t num_blocks, int64_t page_size) : page_size_(page_size) {
  if (num_blocks < 0 || num_blocks > INT32_MAX) {
    throw std::invalid_argument(cat("num_blocks = ", num_blocks, " must be in [0, 2^31)"));
  }
  if (!is_supported_page_size(page_size)) {
    throw std::invalid_argument(cat("page_size = ", page_size, " must be a power of two from 1 to ", kMaxPageSize));
  }
  refs_.assign(static_cast<size_t>(num_blocks), 0);
  fill_.assign(static_cast<size_t>(num_blocks), 0);
  free_.resize(static_cast<size_t>(num_blocks));
  // Stack top = lowest id, so a fresh allocator hands out 0, 1, 2, ...
  for (int64_t i = 0; i < num_blocks; ++i) free_[static_cast<size_t>(i)] = static_cast<int32_t>(num_blocks - 1 - i);
}

int64_t BlockAllocator::num_free() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int64_t>(free_.size());
}

void BlockAllocator::check_in_range(const char* what, const int32_t* blocks, int64_t n) const {
  // One branch-free pass (it vectorizes) for the common case; the slow one names the culprit.
  const uint32_t limit = static_cast<uint32_t>(num_blocks());
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint32_t>(blocks[i]) >= limit;
  if (!bad) return;
  for (int64_t i = 0; i < n; ++i) {
    if (blocks[i] < 0 || blocks[i] >= num_blocks()) {
      throw std::out_of_range(cat(what, "[", i, "] = ", blocks[i], " is not a block id: ids are in [0, ",
                                  num_blocks(), ")"));
    }
  }
}

void BlockAllocator::check_held_locked(const char* what, const int32_t* blocks, int64_t n) const {
  check_in_range(what, blocks, n);
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) bad |= refs_[static_cast<size_t>(blocks[i])] == 0;
  if (!bad) return;
  for (int64_t i = 0; i < n; ++i) {
    if (refs_[static_cast<size_t>(blocks[i])] == 0) {
      throw std::invalid_argument(cat(what, "[", i, "] = block ", blocks[i], " is free; only blocks in use can be passed here"));
    }
  }
}

void BlockAllocator::check_held(const char* what, const int32_t* blocks, int64_t n) const {
  std::lock_guard<std::mutex> g(mu_);
  check_held_locked(what, blocks, n);
}

int32_t BlockAllocator::pop_free(int16_t fill) {
  const int32_t b = free_.back();
  free_.pop_back();
  refs_[static_cast<size_t>(b)] = 1;
  fill_[static_cast<size_t>(b)] = fill;
  return b;
}

void BlockAllocator::reclaim(std::unique_lock<std::mutex>& lock, int64_t n) {
  // NOTE: the reclaimer (the prefix cache) takes its own mutex and then calls free(), which takes
  // ours; so ours is released around the call. One request per shortage: the cache evicts until it
  // freed enough or has nothing left, so asking again could not help (except under contention, where
  // another thread may take the reclaimed blocks first and the caller reports the shortage).
  std::shared_ptr<Reclaimer> reclaimer = reclaimer_.lock();
  const int64_t short_by = n - static_cast<int64_t>(free_.size());
  if (!reclaimer || short_by <= 0 || n > num_blocks()) return;  // nothing to do, or nothing that could help
  lock.unlock();
  reclaimer->reclaim(short_by);
  lock.lock();
}

std::vector<int32_t> BlockAllocator::allocate(int64_t n) {
  if (n < 0) throw std::invalid_argument(cat("num_blocks = ", n, " must be >= 0"));
  std::unique_lock<std::mutex> lock(mu_);
  reclaim(lock, n);
  if (static_cast<int64_t>(free_.size()) < n) {
    throw OutOfBlocks(cat("out of blocks: need ", n, ", ", free_.size(), " free of ", num_blocks(),
                          " (after evicting what the prefix cache could)"));
  }
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& b : out) b = pop_free(static_cast<int16_t>(page_size_));
  return out;
}

bool BlockAllocator::try_allocate(int64_t n, std::vector<int32_t>* out) {
  std::lock_guard<std::mutex> g(mu_);
  if (n < 0 || static_cast<int64_t>(free_.size()) < n) return false;
  out->resize(static_cast<size_t>(n));
  for (auto& b : *out) b = pop_free(static_cast<int16_t>(page_size_));
  return true;
}

void BlockAllocator::share(const int32_t* blocks, int64_t n) {
  std::lock_guard<std::mutex> g(mu_);
  check_held_locked("blocks", blocks, n);
  for (int64_t i = 0; i < n; ++i) ++refs_[static_cast<size_t>(blocks[i])];
}

int64_t BlockAllocator::free(const int32_t* blocks, int64_t n) {
  std::lock_guard<std::mutex> g(mu_);
  check_in_range("blocks", blocks, n);
  int64_t released = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = blocks[i];
    if (refs_[static_cast<size_t>(b)] == 0) {
      // Undo this call's earlier entries (in reverse, so a block it freed is on top of the stack).
      for (int64_t j = i - 1; j >= 0; --j) {
        if (refs_[static_cast<size_t>(blocks[j])]++ == 0) free_.pop_back();
      }
      const int64_t before = std::count(blocks, blocks + i, b);  // the references b had
      if (before == 0) throw std::invalid_argument(cat("block ", b, " is free; cannot free it again"));
      throw std::invalid_argument(cat("block ", b, " is freed ", std::count(blocks, blocks + n, b),
                                      " times but has only ", before, " reference(s)"));
    }
    if (--refs_[static_cast<size_t>(b)] == 0) {
      free_.push_back(b);
      ++released;
    }
  }
  return released;
}

std::vector<BlockCopy> BlockAllocator::append(std::vector<int32_t>* table, int64_t num_tokens, int64_t n) {
  // (messages in the Python wrapper's names: append(seq, num_tokens) passes seq.num_tokens and num_tokens)
  if (n < 0) throw std::invalid_argument(cat("num_tokens = ", n, " must be >= 0 (tokens to make room for)"));
  if (num_tokens < 0) throw std::invalid_argument(cat("seq.num_tokens = ", num_tokens, " must be >= 0"));
  const int64_t pages = pages_for(num_tokens);
  if (static_cast<int64_t>(table->size()) != pages) {
    throw std::invalid_argument(cat("the block table has ", table->size(), " blocks but ", num_tokens,
                                    " tokens occupy ceil(", num_tokens, " / ", page_size_, ") = ", pages));
  }
  const int64_t offset = num_tokens % page_size_;  // tokens already in the last page (0: none or full)
  const int64_t new_pages = pages_for(num_tokens + n) - pages;
  std::unique_lock<std::mutex> lock(mu_);
  check_held_locked("block_table", table->data(), pages);
  for (bool reclaimed = false;; reclaimed = true) {
    // Recomputed after reclaiming: eviction may have dropped the cache's reference to the last page.
    const bool cow = offset != 0 && n > 0 && refs_[static_cast<size_t>(table->back())] > 1;
    const int64_t need = new_pages + (cow ? 1 : 0);
    if (static_cast<int64_t>(free_.size()) < need) {
      if (reclaimed) {
        throw OutOfBlocks(cat("out of blocks: appending ", n, " tokens to a sequence of ", num_tokens, " needs ",
                              need, " blocks, ", free_.size(), " free of ", num_blocks(),
                              " (after evicting what the prefix cache could)"));
      }
      reclaim(lock, need);
      check_held_locked("block_table", table->data(), pages);
      continue;
    }
    std::vector<BlockCopy> copies;
    int64_t left = n;
    if (offset != 0 && n > 0) {
      int32_t& last = table->back();
      if (cow) {
        const int32_t dst = pop_free(static_cast<int16_t>(offset));
        copies.push_back({last, dst});
        --refs_[static_cast<size_t>(last)];  // > 1, so it stays in use
        last = dst;
      }
      const int64_t written = std::min(left, page_size_ - offset);
      int16_t& fill = fill_[static_cast<size_t>(last)];
      fill = static_cast<int16_t>(std::max<int64_t>(fill, offset + written));
      left -= written;
    }
    for (int64_t p = 0; p < new_pages; ++p) {
      const int64_t written = std::min(left, page_size_);
      table->push_back(pop_free(static_cast<int16_t>(written)));
      left -= written;
    }
    return copies;
  }
}

int32_t BlockAllocator::refcount(int32_t block) const {
  std::lock_guard<std::mutex> g(mu_);
  check_in_range("block", &block, 1);
  return refs_[static_cast<size_t>(block)];
}

AllocatorStats BlockAllocator::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  AllocatorStats s;
  s.num_blocks = num_blocks();
  s.page_size = page_size_;
  s.free = static_cast<int64_t>(free_.size());
  for (size_t b = 0; b < refs_.size(); ++b) {
    if (refs_[b] == 0) continue;
    ++s.used;
    s.shared += refs_[b] > 1;
    s.references += refs_[b];
    s.filled_tokens += fill_[b];
  }
  s.waste_tokens = s.used * page_size_ - s.filled_tokens;
  return s;
}

void BlockAllocator::set_reclaimer(std::weak_ptr<Reclaimer> reclaimer) {
  std::lock_guard<std::mutex> g(mu_);
  if (!reclaimer.expired() && !reclaimer_.expired()) {
    throw std::invalid_argument("this allocator already serves a prefix cache; one cache per allocator");
  }
  reclaimer_ = std::move(reclaimer);
}

}  // namespace prefix
}  // namespace kvcache
