// Host-side validation of index tensors (slots, block tables, lengths, block mappings).
//
// Every op checks its indices here before it writes anything, so a bad index raises an error and
// leaves the pool untouched (no partial writes). Each check returns "" when the input is valid and
// otherwise a message naming the argument, the position and the numbers. Torch-free, so the
// GoogleTest suite exercises it directly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace kvcache {

/// slot_mapping: n slots, each -1 (skip) or in [0, num_slots); no slot may repeat, because two
/// tokens written to one slot in one call leave an order-dependent result. `cols` > 0: the slots are a
/// row-major [n / cols, cols] tensor, and messages name a slot by its (row, column), as the user indexes it.
inline std::string check_slots(const char* name, const int64_t* slots, int64_t n, int64_t num_slots, int64_t cols = 0) {
  const auto at = [cols](int64_t i) {
    std::ostringstream m;
    m << "[";
    if (cols > 0) m << i / cols << ", " << i % cols;
    else m << i;
    m << "]";
    return m.str();
  };
  std::vector<std::pair<int64_t, int64_t>> used;  // (slot, position)
  used.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = slots[i];
    if (s < -1 || s >= num_slots) {
      std::ostringstream m;
      m << name << at(i) << " = " << s << " is out of range: slots must be -1 (skip) or in [0, " << num_slots
        << ") (num_blocks * page_size)";
      return m.str();
    }
    if (s >= 0) used.emplace_back(s, i);
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i) {
    if (used[i].first == used[i - 1].first) {
      std::ostringstream m;
      m << name << " writes slot " << used[i].first << " twice (" << name << at(used[i - 1].second) << " and "
        << name << at(used[i].second) << "); each slot may be written once per call";
      return m.str();
    }
  }
  return "";
}

/// Sequence lengths in [0, limit] and the block ids covering them in [0, num_blocks).
/// table: row-major [batch, max_blocks_per_seq] (row_stride elements between rows).
/// lens: `batch` lengths; `limit` is the most tokens a row may hold (its blocks times page_size,
/// capped by the output's capacity when gathering into a padded buffer).
inline std::string check_block_table(const char* table_name, const int32_t* table, int64_t batch,
                                     int64_t max_blocks_per_seq, int64_t row_stride,
                                     const char* lens_name, const int64_t* lens, int64_t page_size,
                                     int64_t num_blocks, int64_t max_len, const char* max_len_what) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    if (len < 0) {
      std::ostringstream m;
      m << lens_name << "[" << b << "] = " << len << " is negative";
      return m.str();
    }
    if (len > max_blocks_per_seq * page_size) {
      std::ostringstream m;
      m << lens_name << "[" << b << "] = " << len << " needs " << (len + page_size - 1) / page_size
        << " blocks but " << table_name << " has " << max_blocks_per_seq << " columns (page_size "
        << page_size << ")";
      return m.str();
    }
    if (len > max_len) {
      std::ostringstream m;
      m << lens_name << "[" << b << "] = " << len << " exceeds " << max_len_what << " = " << max_len;
      return m.str();
    }
    const int64_t pages = (len + page_size - 1) / page_size;
    for (int64_t p = 0; p < pages; ++p) {
      const int64_t id = table[b * row_stride + p];
      if (id < 0 || id >= num_blocks) {
        std::ostringstream m;
        m << table_name << "[" << b << ", " << p << "] = " << id << " is not a block id in [0, "
          << num_blocks << ") (needed for " << lens_name << "[" << b << "] = " << len << ")";
        return m.str();
      }
    }
  }
  return "";
}

/// cu_seq_lens: batch + 1 non-decreasing offsets starting at 0 and ending at `total`.
/// On success writes the per-sequence lengths into `lens_out`.
inline std::string check_cu_seq_lens(const char* name, const int32_t* cu, int64_t batch, int64_t total,
                                     const char* total_what, std::vector<int64_t>* lens_out) {
  if (cu[0] != 0) {
    std::ostringstream m;
    m << name << "[0] = " << cu[0] << " must be 0";
    return m.str();
  }
  lens_out->assign(static_cast<size_t>(batch), 0);
  for (int64_t b = 0; b < batch; ++b) {
    if (cu[b + 1] < cu[b]) {
      std::ostringstream m;
      m << name << " must be non-decreasing but " << name << "[" << b + 1 << "] = " << cu[b + 1]
        << " < " << name << "[" << b << "] = " << cu[b];
      return m.str();
    }
    (*lens_out)[static_cast<size_t>(b)] = cu[b + 1] - cu[b];
  }
  if (cu[batch] != total) {
    std::ostringstream m;
    m << name << "[" << batch << "] = " << cu[batch] << " must equal " << total_what << " = " << total;
    return m.str();
  }
  return "";
}

/// block_mapping: n (src, dst) pairs, src in [0, num_src_blocks), dst in [0, num_dst_blocks).
/// Every dst at most once; when source and destination are the same pool, no dst may also be a src
/// (the result would depend on the copy order).
inline std::string check_block_mapping(const char* name, const int64_t* pairs, int64_t n,
                                       int64_t num_src_blocks, int64_t num_dst_blocks, bool same_pool) {
  std::vector<std::pair<int64_t, int64_t>> dsts;
  dsts.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t src = pairs[2 * i], dst = pairs[2 * i + 1];
    if (src < 0 || src >= num_src_blocks) {
      std::ostringstream m;
      m << name << "[" << i << ", 0] = " << src << " is not a source block id in [0, " << num_src_blocks << ")";
      return m.str();
    }
    if (dst < 0 || dst >= num_dst_blocks) {
      std::ostringstream m;
      m << name << "[" << i << ", 1] = " << dst << " is not a destination block id in [0, "
        << num_dst_blocks << ")";
      return m.str();
    }
    dsts.emplace_back(dst, i);
  }
  std::sort(dsts.begin(), dsts.end());
  for (size_t i = 1; i < dsts.size(); ++i) {
    if (dsts[i].first == dsts[i - 1].first) {
      std::ostringstream m;
      m << name << " writes destination block " << dsts[i].first << " twice (rows " << dsts[i - 1].second
        << " and " << dsts[i].second << ")";
      return m.str();
    }
  }
  if (same_pool) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t src = pairs[2 * i];
      auto it = std::lower_bound(dsts.begin(), dsts.end(), std::make_pair(src, int64_t{-1}));
      if (it != dsts.end() && it->first == src) {
        std::ostringstream m;
        m << name << " reads block " << src << " (row " << i << ") that it also writes (row " << it->second
          << "); the result would depend on the copy order";
        return m.str();
      }
    }
  }
  return "";
}

}  // namespace kvcache
