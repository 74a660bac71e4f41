#include "core/strcat.h"
#include "prefix/radix_tree.h"

#include <algorithm>
#include <sstream>

namespace kvcache {
namespace prefix {
namespace {

uint64_t edge_key(int32_t parent, int32_t token) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
}

// A sequence's pages are distinct blocks: one id given twice would serve one page's K/V as another's to every
// later match. `offset`: where these entries start in the caller's argument (for the message).
void check_distinct(const char* what, const int32_t* blocks, int64_t n, int64_t offset) {
  if (n < 2) return;
  std::vector<int32_t> sorted(blocks, blocks + n);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup == sorted.end()) return;
  const int64_t first = std::find(blocks, blocks + n, *dup) - blocks;
  const int64_t second = std::find(blocks + first + 1, blocks + n, *dup) - blocks;
  throw std::invalid_argument(cat(what, "[", offset + second, "] = block ", *dup, " is ", what, "[", offset + first,
                                  "] too: a sequence's pages are distinct blocks"));
}

}  // namespace

void check_ragged(const Ragged& r, const char* what, const char* size_name) {
  if (r.batch < 0) throw std::invalid_argument(cat(what, " must have batch + 1 >= 1 entries"));
  if (r.cu[0] != 0) throw std::out_of_range(cat(what, "[0] = ", r.cu[0], " must be 0"));
  for (int64_t i = 1; i <= r.batch; ++i) {
    if (r.cu[i] < r.cu[i - 1]) {
      throw std::out_of_range(cat(what, " must be non-decreasing but ", what, "[", i, "] = ", r.cu[i], " < ", what, "[",
                                  i - 1, "] = ", r.cu[i - 1]));
    }
  }
  if (r.cu[r.batch] != r.size) {
    throw std::out_of_range(cat(what, "[-1] = ", r.cu[r.batch], " must equal ", size_name, " = ", r.size));
  }
}

// ---- edge map ------------------------------------------------------------------------------------

size_t RadixTree::EdgeMap::slot(uint64_t key) const {
  // Fibonacci hashing: token ids are small and parents dense, so mix before taking the top bits.
  return static_cast<size_t>((key * 0x9e3779b97f4a7c15ull) >> 32) & (keys_.size() - 1);
}

int32_t RadixTree::EdgeMap::find(uint64_t key) const {
  if (keys_.empty()) return -1;
  for (size_t i = slot(key);; i = (i + 1) & (keys_.size() - 1)) {
    if (keys_[i] == key) return values_[i];
    if (keys_[i] == kEmpty) return -1;
  }
}

void RadixTree::EdgeMap::prefetch(uint64_t key) const {
  if (keys_.empty()) return;
  const size_t i = slot(key);
  __builtin_prefetch(&keys_[i]);
  __builtin_prefetch(&values_[i]);
}

void RadixTree::EdgeMap::set(uint64_t key, int32_t child) {
  if (2 * (size_ + 1) > keys_.size()) grow();  // load <= 1/2 keeps probe runs short
  size_t i = slot(key);
  while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & (keys_.size() - 1);
  size_ += keys_[i] == kEmpty;
  keys_[i] = key;
  values_[i] = child;
}

void RadixTree::EdgeMap::erase(uint64_t key) {
  if (keys_.empty()) return;
  const size_t mask = keys_.size() - 1;
  size_t i = slot(key);
  while (keys_[i] != key) {
    if (keys_[i] == kEmpty) return;
    i = (i + 1) & mask;
  }
  // Backward-shift deletion: pull later entries of the run into the hole (no tombstones).
  for (size_t j = (i + 1) & mask; keys_[j] != kEmpty; j = (j + 1) & mask) {
    const size_t home = slot(keys_[j]);
    if (((j - home) & mask) >= ((j - i) & mask)) {  // i lies on j's probe path: j may move there
      keys_[i] = keys_[j];
      values_[i] = values_[j];
      i = j;
    }
  }
  keys_[i] = kEmpty;
  --size_;
}

void RadixTree::EdgeMap::grow() {
  std::vector<uint64_t> keys(std::max<size_t>(64, 2 * keys_.size()), kEmpty);
  std::vector<int32_t> values(keys.size());
  keys.swap(keys_);
  values.swap(values_);
  size_ = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] != kEmpty) set(keys[i], values[i]);
  }
}

std::shared_ptr<RadixTree> RadixTree::create(std::shared_ptr<BlockAllocator> device, EvictionPolicy policy) {
  auto tree = std::make_shared<RadixTree>(device, policy);
  device->set_reclaimer(tree);
  return tree;
}

RadixTree::RadixTree(std::shared_ptr<BlockAllocator> device, EvictionPolicy policy)
    : device_(std::move(device)), policy_(policy), page_(device_->page_size()) {}

RadixTree::~RadixTree() {
  for (const Node& nd : nodes_) {
    if (nd.alive && !nd.blocks.empty()) pool(nd.on_host).free(nd.blocks.data(), static_cast<int64_t>(nd.blocks.size()));
  }
}

void RadixTree::set_host_tier(std::shared_ptr<BlockAllocator> host, CopyFn copy) {
  std::lock_guard<std::mutex> g(mu_);
  if (host_) throw std::invalid_argument("this prefix cache already has a host tier");
  if (!host || !copy) throw std::invalid_argument("a host tier needs a host allocator and a copy function");
  if (host->page_size() != page_) {
    throw std::invalid_argument(cat("the host pool has page_size ", host->page_size(), " but the device pool has ", page_));
  }
  host_ = std::move(host);
  copy_ = std::move(copy);
}

// ---- nodes, handles, eviction order --------------------------------------------------------------

int32_t RadixTree::new_node() {
  int32_t id;
  if (!free_nodes_.empty()) {
    id = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    if (nodes_.size() >= static_cast<size_t>(INT32_MAX)) throw std::length_error("the prefix tree is full (2^31 nodes)");
    id = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& nd = nodes_[id];
  nd.reset();
  if (++nd.generation == 0) ++nd.generation;  // a wrapped slot 0 must not hand out kEmptyPrefix
  nd.alive = true;
  return id;
}

int32_t RadixTree::find_root(std::string_view ns) {
  if (last_root_ >= 0 && ns == last_ns_) return last_root_;
  const auto it = roots_.find(std::string(ns));
  if (it == roots_.end()) return -1;  // and nothing remembered: a lookup there leaves no trace
  last_root_ = -1;  // until last_ns_ holds the key (assign may throw)
  last_ns_.assign(ns);
  last_root_ = it->second;
  return last_root_;
}

int32_t RadixTree::make_root(std::string_view ns) {
  const int32_t found = find_root(ns);
  if (found >= 0) return found;
  const int32_t id = new_node();
  try {
    const auto it = roots_.emplace(std::string(ns), id).first;
    try {
      root_names_.emplace(id, &it->first);
    } catch (...) {
      roots_.erase(it);
      throw;
    }
  } catch (...) {  // out of memory: the slot goes back unused
    nodes_[id].reset();
    free_nodes_.push_back(id);
    throw;
  }
  nodes_[id].is_root = true;
  return id;
}

void RadixTree::drop_root_if_empty(int32_t root) {
  Node& nd = nodes_[root];
  if (!nd.alive || !nd.is_root || !nd.children.empty()) return;
  // No lock to keep: locks are taken on nodes (a root has no handle), and pass through a root only
  // on the way up from one of its children.
  free_nodes_.push_back(root);
  const auto name = root_names_.find(root);
  roots_.erase(roots_.find(*name->second));
  root_names_.erase(name);
  if (last_root_ == root) last_root_ = -1;
  nd.reset();
}

int32_t RadixTree::resolve(int64_t handle) const {
  const int64_t id = handle & 0xffffffff;
  const int64_t generation = handle >> 32;
  if (handle < 0 || id >= static_cast<int64_t>(nodes_.size()) || !nodes_[id].alive || nodes_[id].is_root ||
      nodes_[id].generation != generation) {
    throw std::out_of_range(cat("node handle ", handle, " is unknown or stale (its node was evicted)"));
  }
  return static_cast<int32_t>(id);
}

RadixTree::Candidate RadixTree::candidate(int32_t id) const {
  const Node& nd = nodes_[id];
  if (policy_ == EvictionPolicy::kLfu) return {nd.hits, nd.last_access, id, nd.generation};
  return {nd.last_access, 0, id, nd.generation};
}

bool RadixTree::evictable(int32_t id) const {
  const Node& nd = nodes_[id];
  // A device node is evictable when no child is on the device; a host node when it has no child.
  return nd.alive && !nd.is_root && nd.lock == 0 && (nd.on_host ? nd.children.empty() : nd.device_children == 0);
}

void RadixTree::queue(int32_t id) {
  Node& nd = nodes_[id];
  if (!evictable(id) || nd.queued[nd.on_host]) return;
  nd.queued[nd.on_host] = true;
  heaps_[nd.on_host].push_back(candidate(id));
  std::push_heap(heaps_[nd.on_host].begin(), heaps_[nd.on_host].end(), std::greater<Candidate>());
}

int32_t RadixTree::next_victim(bool host) {
  std::vector<Candidate>& heap = heaps_[host];
  if (stale_touches_[host] > heap.size()) refresh_heap(host);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<Candidate>());
    const Candidate c = heap.back();
    heap.pop_back();
    Node& nd = nodes_[c.id];
    if (!nd.alive || nd.generation != c.generation) continue;  // the slot holds another node now
    nd.queued[host] = false;
    if (nd.on_host != host || !evictable(c.id)) continue;      // moved, or no longer an evictable leaf
    const Candidate now = candidate(c.id);
    if (now.primary != c.primary || now.secondary != c.secondary) {  // touched since it was queued
      queue(c.id);
      continue;
    }
    return c.id;
  }
  return -1;
}

void RadixTree::refresh_heap(bool host) {
  std::vector<Candidate>& heap = heaps_[host];
  size_t kept = 0;
  for (const Candidate& c : heap) {
    Node& nd = nodes_[c.id];
    if (!nd.alive || nd.generation != c.generation) continue;  // the slot holds another node now
    if (nd.on_host != host || !evictable(c.id)) {               // moved, or no longer an evictable leaf
      nd.queued[host] = false;
      continue;
    }
    heap[kept++] = candidate(c.id);
  }
  heap.resize(kept);
  std::make_heap(heap.begin(), heap.end(), std::greater<Candidate>());
  stale_touches_[host] = 0;
}

void RadixTree::touch(int32_t id, uint64_t tick) {
  Node& nd = nodes_[id];
  nd.last_access = tick;  // its queued candidate, if any, is now stale: see next_victim
  ++nd.hits;
  stale_touches_[nd.on_host] += nd.queued[nd.on_host];
}

void RadixTree::lock_path(int32_t id, int delta) {
  for (int32_t x = id; x != -1; x = nodes_[x].parent) {
    nodes_[x].lock += delta;
    queue(x);
  }
}

// ---- structure ---------------------------------------------------------------------------------

int32_t RadixTree::split(int32_t id, int64_t k) {
  const int32_t up = new_node();  // may reallocate nodes_: take references after it
  Node& lo = nodes_[id];
  Node& u = nodes_[up];
  const int64_t s = lo.start + k;  // the split position
  const int64_t first = lo.start / page_;
  const int64_t upper_pages = pages_for(s) - first;
  const int64_t lower_skip = s / page_ - first;  // pages entirely above s
  u.tokens.assign_prefix(lo.tokens, k);
  lo.tokens.erase_prefix(k);
  u.blocks.assign(lo.blocks.begin(), lo.blocks.begin() + upper_pages);
  lo.blocks.erase(lo.blocks.begin(), lo.blocks.begin() + lower_skip);
  // A split inside a page leaves that page in both halves: one reference each.
  if (s % page_ != 0) pool(lo.on_host).share(&u.blocks.back(), 1);
  u.start = lo.start;
  lo.start = s;
  u.parent = lo.parent;
  lo.parent = up;
  u.lock = lo.lock;
  u.on_host = lo.on_host;
  u.last_access = lo.last_access;
  u.hits = lo.hits;
  u.children.push_back(id);
  u.device_children = lo.on_host ? 0 : 1;
  edges_.set(edge_key(u.parent, u.tokens[0]), up);
  edges_.set(edge_key(up, lo.tokens[0]), id);
  std::vector<int32_t>& siblings = nodes_[u.parent].children;
  *std::find(siblings.begin(), siblings.end(), id) = up;
  return up;
}

void RadixTree::adopt(int32_t id, const int32_t* blocks) {
  Node& nd = nodes_[id];
  const int64_t first = nd.start / page_;
  std::vector<int32_t> device_blocks(blocks + first, blocks + first + nd.blocks.size());
  device_->share(device_blocks.data(), static_cast<int64_t>(device_blocks.size()));
  host_->free(nd.blocks.data(), static_cast<int64_t>(nd.blocks.size()));
  nd.blocks = std::move(device_blocks);
  nd.on_host = false;
  ++nodes_[nd.parent].device_children;
  queue(id);
}

bool RadixTree::load(int32_t id) {
  const int64_t n = static_cast<int64_t>(nodes_[id].blocks.size());
  std::vector<int32_t> device_blocks;
  if (!allocate_device(n, &device_blocks)) return false;
  Node& nd = nodes_[id];
  std::vector<BlockCopy> copies(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) copies[static_cast<size_t>(i)] = {nd.blocks[i], device_blocks[i]};
  try {
    copy_(CopyDirection::kHostToDevice, copies);
  } catch (...) {
    device_->free(device_blocks.data(), n);
    throw;
  }
  host_->free(nd.blocks.data(), n);
  nd.blocks = std::move(device_blocks);
  nd.on_host = false;
  ++nodes_[nd.parent].device_children;
  queue(id);
  ++counters_.loaded_nodes;
  counters_.loaded_blocks += n;
  return true;
}

// ---- match / insert ------------------------------------------------------------------------------

MatchResult RadixTree::match(std::string_view ns, const int32_t* tokens, int64_t n, bool lock) {
  MatchResult r;
  r.length = match_into(ns, tokens, n, lock, &r.blocks, &r.node);
  return r;
}

int64_t RadixTree::cached_length(std::string_view ns, const int32_t* tokens, int64_t n) {
  if (n < 0) throw std::invalid_argument(cat("n = ", n, " tokens; must be >= 0"));
  std::lock_guard<std::mutex> g(mu_);
  int64_t pos = 0;
  for (int32_t id = find_root(ns); id >= 0 && pos < n;) {  // the walk of match_locked's step 1, read only
    const int32_t child = edges_.find(edge_key(id, tokens[pos]));
    if (child < 0) break;
    const Node& nd = nodes_[child];
    const int64_t len = nd.tokens.size();
    const int64_t k = nd.tokens.common_prefix(tokens + pos, std::min(len, n - pos));
    pos += k;
    if (k < len) break;
    id = child;
  }
  return pos;
}

int64_t RadixTree::match_into(std::string_view ns, const int32_t* tokens, int64_t n, bool lock,
                              std::vector<int32_t>* blocks, int64_t* node) {
  if (n < 0) throw std::invalid_argument(cat("n = ", n, " tokens; must be >= 0"));
  std::lock_guard<std::mutex> g(mu_);
  return match_locked(find_root(ns), tokens, n, lock, blocks, node);
}

bool RadixTree::try_match_into(std::string_view ns, const int32_t* tokens, int64_t n, bool lock,
                               std::vector<int32_t>* blocks, int64_t* node, int64_t* length) {
  if (n < 0) throw std::invalid_argument(cat("n = ", n, " tokens; must be >= 0"));
  std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock() || host_) return false;
  *length = match_locked(find_root(ns), tokens, n, lock, blocks, node);
  return true;
}

void RadixTree::match_ragged(std::string_view ns, const Ragged& tokens, bool lock, int64_t* lengths,
                             std::vector<int32_t>* blocks, int64_t* cu_blocks, int64_t* nodes) {
  check_ragged(tokens, "cu_lens", "len(tokens)");
  std::lock_guard<std::mutex> g(mu_);
  match_ragged_locked(find_root(ns), tokens, lock, lengths, blocks, cu_blocks, nodes);
}

bool RadixTree::try_match_ragged(std::string_view ns, const Ragged& tokens, bool lock, int64_t* lengths,
                                 std::vector<int32_t>* blocks, int64_t* cu_blocks, int64_t* nodes) {
  check_ragged(tokens, "cu_lens", "len(tokens)");
  std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock() || host_) return false;
  match_ragged_locked(find_root(ns), tokens, lock, lengths, blocks, cu_blocks, nodes);
  return true;
}

void RadixTree::match_ragged_locked(int32_t root, const Ragged& tokens, bool lock, int64_t* lengths,
                                    std::vector<int32_t>* blocks, int64_t* cu_blocks, int64_t* nodes) {
  const size_t base = blocks->size();
  cu_blocks[0] = 0;
  if (root < 0) {  // a namespace without nodes: every sequence misses (counted, nothing to fetch ahead)
    for (int64_t i = 0; i < tokens.batch; ++i) {
      lengths[i] = match_locked(root, tokens.at(i), tokens.length(i), lock, blocks, &nodes[i]);
      cu_blocks[i + 1] = 0;
    }
    return;
  }
  // With a host tier, a match may evict device nodes to load what it found; it must not evict what
  // this call returned for an earlier sequence, whose caller has had no chance to lock it yet. So
  // every sequence's path stays locked until the batch is done.
  const bool hold = host_ != nullptr && !lock;
  struct Held {  // unlocked when the call returns or throws
    RadixTree& tree;
    std::vector<int32_t> ids;
    ~Held() {
      for (int32_t id : ids) tree.lock_path(id, -1);
    }
  } held{*this, {}};

  // A match waits on a chain of cache misses (edge map slot -> node -> its tokens and blocks), and
  // between two waves of requests the tree has usually left the caches. The first edge of each
  // sequence is fetched a step at a time ahead of its match, so the chain overlaps earlier matches:
  // sequence i + 3's map slot, i + 2's node, i + 1's first tokens and blocks.
  constexpr int kAhead = 3;
  int32_t first[kAhead] = {-1, -1, -1};  // first[j % kAhead]: the child of the root for sequence j
  const auto stage = [&](int64_t j) -> int32_t& { return first[j % kAhead]; };
  const auto first_key = [&](int64_t j) { return edge_key(root, tokens.at(j)[0]); };
  for (int64_t j = 0; j < std::min<int64_t>(tokens.batch, kAhead); ++j) {
    stage(j) = tokens.length(j) ? edges_.find(first_key(j)) : -1;
  }
  for (int64_t i = 0; i < tokens.batch; ++i) {
    if (i + 3 < tokens.batch && tokens.length(i + 3)) edges_.prefetch(first_key(i + 3));
    if (i + 2 < tokens.batch && i >= 1) {
      int32_t& c = stage(i + 2);
      c = tokens.length(i + 2) ? edges_.find(first_key(i + 2)) : -1;
      if (c >= 0) {
        const char* node = reinterpret_cast<const char*>(&nodes_[c]);
        for (size_t line = 0; line < sizeof(Node); line += 64) __builtin_prefetch(node + line);
      }
    }
    if (i + 1 < tokens.batch && stage(i + 1) >= 0) {
      const Node& next = nodes_[stage(i + 1)];
      const char* t = static_cast<const char*>(next.tokens.data());
      for (int line = 0; line < 4; ++line) __builtin_prefetch(t + 64 * line);
      const char* b = reinterpret_cast<const char*>(next.blocks.data());
      for (size_t line = 0; line < next.blocks.size() * sizeof(int32_t); line += 64) __builtin_prefetch(b + line);
    }
    // The sequence's own tokens are not prefetched: the compare streams them in order, which the
    // hardware prefetcher follows, and a prefetch per line of the next sequence (136 for a 2k-token
    // prompt) cost more than it saved, even with the tokens in DRAM (Zen 1: 520 -> 390 ns per request
    // with everything in cache, 810 -> 740 ns with the tokens flushed).
    lengths[i] = match_locked(root, tokens.at(i), tokens.length(i), lock || hold, blocks, &nodes[i]);
    cu_blocks[i + 1] = static_cast<int64_t>(blocks->size() - base);
    if (hold && nodes[i] != kEmptyPrefix) held.ids.push_back(resolve(nodes[i]));
  }
}

int64_t RadixTree::match_locked(int32_t root, const int32_t* tokens, int64_t n, bool lock,
                                std::vector<int32_t>* blocks, int64_t* node) {
  const uint64_t tick = ++clock_;
  ++counters_.lookups;
  counters_.lookup_tokens += n;
  if (root < 0) {  // a namespace without nodes
    *node = kEmptyPrefix;
    return 0;
  }

  // 1. The longest common prefix, through device and host nodes alike.
  path_.clear();
  int64_t pos = 0;
  for (int32_t id = root; pos < n;) {
    const int32_t child = edges_.find(edge_key(id, tokens[pos]));
    if (child < 0) break;
    const Node& nd = nodes_[child];
    const int64_t len = nd.tokens.size();
    const int64_t k = nd.tokens.common_prefix(tokens + pos, std::min(len, n - pos));
    path_.push_back(child);
    pos += k;
    if (k < len) break;
    id = child;
  }

  // 2. Load host-resident nodes back (they follow the device ones); stop where the device is full.
  size_t first_host = 0;
  while (first_host < path_.size() && !nodes_[path_[first_host]].on_host) ++first_host;
  if (first_host < path_.size()) {
    const int32_t deepest = path_.back();
    lock_path(deepest, +1);  // neither the path nor the nodes being loaded may be evicted meanwhile
    size_t loaded = first_host;
    try {
      while (loaded < path_.size() && load(path_[loaded])) ++loaded;
    } catch (...) {
      lock_path(deepest, -1);
      throw;
    }
    lock_path(deepest, -1);
    if (loaded < path_.size()) {
      pos = nodes_[path_[loaded]].start;
      path_.resize(loaded);
    }
  }

  // 3. Blocks: for each page, the deepest node on the path that touches it.
  const size_t base = blocks->size();
  for (int32_t id : path_) {
    touch(id, tick);
    const Node& nd = nodes_[id];
    blocks->resize(base + static_cast<size_t>(nd.start / page_));
    blocks->insert(blocks->end(), nd.blocks.begin(), nd.blocks.end());
  }
  blocks->resize(base + static_cast<size_t>(pages_for(pos)));
  if (path_.empty()) {
    *node = kEmptyPrefix;  // nothing to lock: the empty prefix holds no block
  } else {
    if (lock) lock_path(path_.back(), +1);
    *node = handle(path_.back());
  }
  counters_.hit_tokens += pos;
  return pos;
}

InsertResult RadixTree::insert(std::string_view ns, const int32_t* tokens, int64_t n, const int32_t* blocks,
                               int64_t num_blocks, bool lock) {
  if (n < 0) throw std::invalid_argument(cat("n = ", n, " tokens; must be >= 0"));
  if (num_blocks != pages_for(n)) {
    throw std::invalid_argument(cat("blocks has ", num_blocks, " entries but ", n, " tokens occupy ceil(", n, " / ",
                                    page_, ") = ", pages_for(n), " pages"));
  }
  check_distinct("blocks", blocks, num_blocks, 0);
  std::lock_guard<std::mutex> g(mu_);
  device_->check_held("blocks", blocks, num_blocks);
  const int32_t root = n > 0 ? make_root(ns) : find_root(ns);  // an empty insert is a lookup
  try {
    return insert_locked(root, tokens, n, blocks, lock);
  } catch (...) {
    if (root >= 0) drop_root_if_empty(root);  // made for this insert, which failed
    throw;
  }
}

void RadixTree::insert_ragged(std::string_view ns, const Ragged& tokens, const Ragged& blocks, bool lock,
                              int64_t* prefix_lengths, int64_t* nodes) {
  check_ragged(tokens, "cu_lens", "len(tokens)");
  check_ragged(blocks, "cu_blocks", "len(blocks)");
  if (tokens.batch != blocks.batch) {
    throw std::invalid_argument(cat("cu_lens has ", tokens.batch + 1, " entries but cu_blocks has ", blocks.batch + 1,
                                    "; both are [batch + 1]"));
  }
  for (int64_t i = 0; i < tokens.batch; ++i) {
    const int64_t n = tokens.length(i), pages = pages_for(n);
    if (blocks.length(i) != pages) {
      throw std::invalid_argument(cat("sequence ", i, " has ", n, " tokens = ", pages, " pages but ", blocks.length(i),
                                      " blocks"));
    }
    check_distinct("blocks", blocks.at(i), pages, blocks.at(i) - blocks.values);  // (rows may share blocks)
  }
  std::lock_guard<std::mutex> g(mu_);
  device_->check_held("blocks", blocks.values, blocks.size);
  const int32_t root = tokens.size > 0 ? make_root(ns) : find_root(ns);  // a batch of empty inserts is a lookup
  try {
    for (int64_t i = 0; i < tokens.batch; ++i) {
      const InsertResult r = insert_locked(root, tokens.at(i), tokens.length(i), blocks.at(i), lock);
      prefix_lengths[i] = r.prefix_length;
      nodes[i] = r.node;
    }
  } catch (...) {
    if (root >= 0) drop_root_if_empty(root);
    throw;
  }
}

InsertResult RadixTree::insert_locked(int32_t root, const int32_t* tokens, int64_t n, const int32_t* blocks, bool lock) {
  const int64_t num_blocks = pages_for(n);
  const uint64_t tick = ++clock_;
  ++counters_.inserts;
  if (n == 0) return {};  // the empty prefix (root is -1 if the namespace has no nodes)

  int32_t id = root;
  int64_t pos = 0;
  while (pos < n) {
    int32_t child = edges_.find(edge_key(id, tokens[pos]));
    if (child < 0) break;
    const int64_t len = nodes_[child].tokens.size();
    const int64_t k = nodes_[child].tokens.common_prefix(tokens + pos, std::min(len, n - pos));
    // Split where the sequence leaves the edge (a new branch goes there), or where it ends inside a
    // host node (whose covered part is adopted below). Ending inside a device node needs no split.
    if (k < len && (pos + k < n || nodes_[child].on_host)) child = split(child, k);
    if (nodes_[child].on_host) adopt(child, blocks);  // the caller's blocks hold the same KV
    touch(child, tick);
    pos += k;
    id = child;
    if (k < len) break;
  }
  InsertResult r;
  r.prefix_length = pos;
  if (pos < n) {
    const int32_t leaf = new_node();
    Node& nd = nodes_[leaf];
    nd.tokens.assign(tokens + pos, tokens + n);
    nd.start = pos;
    nd.parent = id;
    nd.blocks.assign(blocks + pos / page_, blocks + num_blocks);
    nd.last_access = tick;
    nd.hits = 1;
    device_->share(nd.blocks.data(), static_cast<int64_t>(nd.blocks.size()));
    edges_.set(edge_key(id, tokens[pos]), leaf);
    nodes_[id].children.push_back(leaf);
    ++nodes_[id].device_children;
    queue(leaf);
    counters_.inserted_tokens += n - pos;
    id = leaf;
  }
  if (lock) lock_path(id, +1);
  r.node = handle(id);
  return r;
}

void RadixTree::lock(int64_t node) {
  if (node == kEmptyPrefix) return;
  std::lock_guard<std::mutex> g(mu_);
  const int32_t id = resolve(node);
  if (nodes_[id].on_host) {
    throw std::invalid_argument(cat("node handle ", node, " is on the host tier; match it again to load it back"));
  }
  lock_path(id, +1);
}

void RadixTree::unlock(int64_t node) {
  if (node == kEmptyPrefix) return;
  std::lock_guard<std::mutex> g(mu_);
  const int32_t id = resolve(node);
  if (nodes_[id].lock == 0) throw std::invalid_argument(cat("node handle ", node, " is not locked; unlock without lock"));
  lock_path(id, -1);
}

// ---- eviction -----------------------------------------------------------------------------------

int64_t RadixTree::evict(int64_t num_blocks) {
  if (num_blocks < 0) throw std::invalid_argument(cat("num_blocks = ", num_blocks, "; must be >= 0"));
  std::lock_guard<std::mutex> g(mu_);
  return evict_locked(num_blocks);
}

int64_t RadixTree::evict_locked(int64_t num_blocks) {
  // Victims lie scattered in memory and an eviction touches little of each, so a cold tree makes it
  // wait on cache misses (~3x slower than warm). The next victim is the heap's top: its node was
  // fetched an iteration ago, so fetch its arrays now; the one after is the smaller child of the
  // top: fetch its node. ~20% faster when cold. (Written inline: GCC drops calls to a function that
  // does nothing but prefetch, as if it had no effect.)
  const std::vector<Candidate>& heap = heaps_[0];
  int64_t freed = 0;
  for (int32_t victim; freed < num_blocks && (victim = next_victim(false)) >= 0;) {
    if (!heap.empty()) {
      const Node& next = nodes_[heap[0].id];
      __builtin_prefetch(next.blocks.data());
      __builtin_prefetch(next.tokens.data());
      if (heap.size() > 1) {
        const Candidate& after = heap.size() > 2 && heap[1] > heap[2] ? heap[2] : heap[1];
        const char* node = reinterpret_cast<const char*>(&nodes_[after.id]);
        for (size_t line = 0; line < sizeof(Node); line += 64) __builtin_prefetch(node + line);
      }
    }
    freed += evict_leaf(victim);
  }
  return freed;
}

bool RadixTree::allocate_device(int64_t n, std::vector<int32_t>* out) {
  // try_allocate, never allocate: the reclaimer path of allocate() would re-enter this tree.
  while (!device_->try_allocate(n, out)) {
    if (evict_locked(n - device_->num_free()) == 0) return false;
  }
  return true;
}

bool RadixTree::make_host_room(int64_t n) {
  if (n > host_->num_blocks()) return false;
  for (int32_t victim; host_->num_free() < n && (victim = next_victim(true)) >= 0;) delete_subtree(victim);
  return host_->num_free() >= n;
}

int64_t RadixTree::evict_leaf(int32_t id) {
  if (host_ && make_host_room(static_cast<int64_t>(nodes_[id].blocks.size()))) {
    Node& nd = nodes_[id];
    const int64_t n = static_cast<int64_t>(nd.blocks.size());
    std::vector<int32_t> host_blocks;
    host_->try_allocate(n, &host_blocks);  // cannot fail: make_host_room under our mutex
    std::vector<BlockCopy> copies(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) copies[static_cast<size_t>(i)] = {nd.blocks[i], host_blocks[i]};
    try {
      copy_(CopyDirection::kDeviceToHost, copies);  // before the device blocks can be reused
    } catch (...) {
      host_->free(host_blocks.data(), n);
      throw;
    }
    const int64_t freed = device_->free(nd.blocks.data(), n);
    nd.blocks = std::move(host_blocks);
    nd.on_host = true;
    --nodes_[nd.parent].device_children;
    queue(id);
    queue(nd.parent);
    ++counters_.demoted_nodes;
    counters_.demoted_blocks += n;
    counters_.evicted_blocks += freed;
    return freed;
  }
  return nodes_[id].children.empty() ? delete_leaf(id) : delete_subtree(id);
}

int64_t RadixTree::delete_subtree(int32_t id) {
  // Children before parents (only host nodes can hang below an evicted device leaf).
  std::vector<int32_t> order{id};
  for (size_t i = 0; i < order.size(); ++i) {
    for (int32_t c : nodes_[order[i]].children) order.push_back(c);
  }
  int64_t freed = 0;
  for (auto it = order.rbegin(); it != order.rend(); ++it) freed += delete_leaf(*it);
  return freed;
}

int64_t RadixTree::delete_leaf(int32_t id) {
  Node& nd = nodes_[id];
  const int32_t parent_id = nd.parent;
  const int64_t released = pool(nd.on_host).free(nd.blocks.data(), static_cast<int64_t>(nd.blocks.size()));
  const int64_t freed = nd.on_host ? 0 : released;
  Node& parent = nodes_[parent_id];
  std::vector<int32_t>& siblings = parent.children;
  *std::find(siblings.begin(), siblings.end(), id) = siblings.back();
  siblings.pop_back();
  parent.device_children -= nd.on_host ? 0 : 1;
  edges_.erase(edge_key(nd.parent, nd.tokens[0]));
  queue(nd.parent);
  nd.reset();
  free_nodes_.push_back(id);
  ++counters_.evicted_nodes;
  counters_.evicted_blocks += freed;
  drop_root_if_empty(parent_id);  // the namespace's last node: reclaim the namespace
  return freed;
}

// ---- introspection ------------------------------------------------------------------------------

TreeStats RadixTree::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  TreeStats s = counters_;
  s.namespaces = static_cast<int64_t>(roots_.size());
  std::vector<bool> seen[2] = {std::vector<bool>(static_cast<size_t>(device_->num_blocks())),
                               std::vector<bool>(static_cast<size_t>(host_ ? host_->num_blocks() : 0))};
  for (const Node& nd : nodes_) {
    if (!nd.alive || nd.is_root) continue;
    ++s.nodes;
    s.locked_nodes += nd.lock > 0;
    s.evictable_leaves += !nd.on_host && evictable(static_cast<int32_t>(&nd - nodes_.data()));
    int64_t distinct = 0;
    for (const int32_t b : nd.blocks) {
      distinct += !seen[nd.on_host][static_cast<size_t>(b)];
      seen[nd.on_host][static_cast<size_t>(b)] = true;
    }
    const int64_t tokens = nd.tokens.size();
    const int64_t refs = static_cast<int64_t>(nd.blocks.size());
    if (nd.on_host) {
      ++s.host_nodes;
      s.host_tokens += tokens;
      s.host_blocks += distinct;
      s.host_block_refs += refs;
    } else {
      s.device_tokens += tokens;
      s.device_blocks += distinct;
      s.device_block_refs += refs;
    }
  }
  return s;
}

std::vector<int32_t> RadixTree::block_references(bool host) const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int32_t> out;
  for (const Node& nd : nodes_) {
    if (nd.alive && nd.on_host == host) out.insert(out.end(), nd.blocks.begin(), nd.blocks.end());
  }
  return out;
}

std::string RadixTree::check_invariants() const {
  std::lock_guard<std::mutex> g(mu_);
  for (int32_t id = 0; id < static_cast<int32_t>(nodes_.size()); ++id) {
    const Node& nd = nodes_[id];
    if (!nd.alive) continue;
    std::vector<int32_t> children_locks;
    int32_t device_children = 0;
    for (int32_t c : nd.children) {
      const Node& ch = nodes_[c];
      if (!ch.alive || ch.parent != id) return cat("node ", id, ": child ", c, " is dead or has another parent");
      if (ch.start != nd.end()) return cat("node ", c, " starts at ", ch.start, " but its parent ends at ", nd.end());
      if (edges_.find(edge_key(id, ch.tokens[0])) != c) return cat("node ", c, " is missing from the edge map");
      if (nd.on_host && !ch.on_host) return cat("node ", c, " is on the device below host node ", id);
      if (ch.lock > nd.lock) return cat("node ", c, " has more locks than its parent ", id);
      device_children += !ch.on_host;
    }
    if (device_children != nd.device_children) return cat("node ", id, " miscounts its device children");
    if (evictable(id) && !nd.queued[nd.on_host]) return cat("node ", id, " is an evictable leaf but not queued as one");
    if (nd.is_root) continue;
    if (nd.tokens.empty()) return cat("node ", id, " has no tokens");
    const int64_t pages = pages_for(nd.end()) - nd.start / page_;
    if (static_cast<int64_t>(nd.blocks.size()) != pages) {
      return cat("node ", id, " covers [", nd.start, ", ", nd.end(), ") = ", pages, " pages but holds ", nd.blocks.size(),
                 " blocks");
    }
  }
  for (bool host : {false, true}) {
    if (heaps_[host].size() > nodes_.size()) return "an eviction heap holds more entries than there are nodes";
  }
  if (root_names_.size() != roots_.size()) {
    return cat(roots_.size(), " namespaces but ", root_names_.size(), " root names");
  }
  size_t roots = 0;
  for (const Node& nd : nodes_) roots += nd.alive && nd.is_root;
  if (roots != roots_.size()) return cat(roots, " roots for ", roots_.size(), " namespaces");
  for (const auto& [name, id] : roots_) {
    const Node& root = nodes_[id];
    const auto it = root_names_.find(id);
    if (!root.alive || !root.is_root || it == root_names_.end() || *it->second != name) {
      return cat("namespace ", name, " maps to node ", id, ", which is not its root");
    }
    if (root.children.empty()) return cat("namespace ", name, " has no nodes but was not reclaimed");
    int32_t child_locks = 0;
    for (int32_t c : root.children) child_locks += nodes_[c].lock;
    if (root.lock != child_locks) {
      return cat("the root of namespace ", name, " holds ", root.lock, " locks but its children ", child_locks);
    }
  }
  if (last_root_ >= 0 && (roots_.count(last_ns_) == 0 || roots_.at(last_ns_) != last_root_)) {
    return cat("the remembered root ", last_root_, " is not the root of namespace ", last_ns_);
  }
  const size_t children = nodes_.size() - free_nodes_.size() - roots_.size();  // every alive non-root node
  if (edges_.size() != children) return cat("the edge map has ", edges_.size(), " entries for ", children, " nodes");
  return "";
}

}  // namespace prefix
}  // namespace kvcache
