// The CPU cache kernels on raw arrays: append a strided batch, gather it back padded and ragged,
// copy blocks; every value is traced back to where it came from.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cache/cache_cpu_kernels.h"

using namespace kvcache;

namespace {
// key value of (b, h, q, d), unique and never zero
uint16_t val(int64_t b, int64_t h, int64_t q, int64_t d) { return static_cast<uint16_t>(1 + d + 10 * q + 100 * h + 1000 * b); }
}  // namespace

// Appends a strided batch whose V rows are Dv wide (K rows: 4), gathers it back padded and ragged.
void append_then_gather_round_trips(int64_t Dv) {
  const int64_t B = 2, H = 3, Q = 5, D = 4, P = 2, NB = 8;
  const PagedLayout L(NB, P, H, D, Dv);
  ASSERT_EQ(L.side(true).pool_elements(), NB * H * P * Dv);
  // key stored as [B, Q, H, D] and viewed as [B, H, Q, D]: the transposed layout HF hands over (value: Dv).
  std::vector<uint16_t> key(B * Q * H * D), value(B * Q * H * Dv);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < D; ++d) key[((b * Q + q) * H + h) * D + d] = val(b, h, q, d);
        for (int64_t d = 0; d < Dv; ++d) value[((b * Q + q) * H + h) * Dv + d] = static_cast<uint16_t>(val(b, h, q, d) + 30000);
      }
  // sequence 0 -> blocks 5, 2, 7 ; sequence 1 -> blocks 0, 3, 6 ; token 4 of sequence 1 skipped
  const std::vector<int32_t> table = {5, 2, 7, 0, 3, 6};
  std::vector<int64_t> slots(B * Q);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t q = 0; q < Q; ++q) slots[b * Q + q] = table[b * 3 + q / P] * P + q % P;
  slots[1 * Q + 4] = -1;

  std::vector<uint16_t> kc(L.pool_elements(), 0), vc(L.side(true).pool_elements(), 0);
  AppendArgs a;
  a.key = key.data();
  a.value = value.data();
  const int64_t strides[4] = {Q * H * D, D, H * D, 1}, v_strides[4] = {Q * H * Dv, Dv, H * Dv, 1};
  for (int i = 0; i < 4; ++i) {
    a.key_strides[i] = strides[i];
    a.value_strides[i] = v_strides[i];
  }
  a.batch = B;
  a.q_len = Q;
  a.slots = slots.data();
  a.slot_strides[0] = Q;
  a.slot_strides[1] = 1;
  a.k_cache = kc.data();
  a.v_cache = vc.data();
  a.layout = L;
  cpu::append_rows<uint16_t>(a, 0, B * Q * H);
  // every V row sits where the V pool's layout puts it
  ASSERT_EQ(vc[L.side(true).slot_offset(table[3] * P + 1, 2) + Dv - 1], static_cast<uint16_t>(val(1, 2, 1, Dv - 1) + 30000));

  // padded gather, max_len 6 > lengths (5, 4)
  const int64_t max_len = 6;
  const std::vector<int32_t> lens = {5, 4};
  std::vector<uint16_t> ko(B * H * max_len * D, 77), vo(B * H * max_len * Dv, 77);
  GatherArgs g;
  g.k_cache = kc.data();
  g.v_cache = vc.data();
  g.layout = L;
  g.block_table = table.data();
  g.table_stride = 3;
  g.batch = B;
  g.seq_lens = lens.data();
  g.max_len = max_len;
  g.k_out = ko.data();
  g.v_out = vo.data();
  cpu::gather_padded<uint16_t>(g, 0, B * H);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < max_len; ++t) {
        for (int64_t d = 0; d < D; ++d) {
          const uint16_t expect = t < lens[b] ? val(b, h, t, d) : 0;
          ASSERT_EQ(ko[((b * H + h) * max_len + t) * D + d], expect) << b << " " << h << " " << t << " " << d;
        }
        for (int64_t d = 0; d < Dv; ++d) {
          const uint16_t expect = t < lens[b] ? static_cast<uint16_t>(val(b, h, t, d) + 30000) : 0;
          ASSERT_EQ(vo[((b * H + h) * max_len + t) * Dv + d], expect) << b << " " << h << " " << t << " " << d;
        }
      }

  // ragged gather: rows [0, 5) then [5, 9), layout [total, H, D] (V: [total, H, Dv])
  const std::vector<int32_t> cu = {0, 5, 9};
  std::vector<uint16_t> kr(9 * H * D, 0), vr(9 * H * Dv, 0);
  g.cu_seq_lens = cu.data();
  g.k_out = kr.data();
  g.v_out = vr.data();
  cpu::gather_ragged<uint16_t>(g, 0, B * H);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < cu[b + 1] - cu[b]; ++t)
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < D; ++d) ASSERT_EQ(kr[((cu[b] + t) * H + h) * D + d], val(b, h, t, d));
        for (int64_t d = 0; d < Dv; ++d) {
          ASSERT_EQ(vr[((cu[b] + t) * H + h) * Dv + d], static_cast<uint16_t>(val(b, h, t, d) + 30000));
        }
      }
}

TEST(CpuKernels, AppendThenGatherRoundTrips) { append_then_gather_round_trips(4); }

TEST(CpuKernels, AppendThenGatherRoundTripsWithValueRowsOfAnotherWidth) {
  append_then_gather_round_trips(7);  // wider V rows
  append_then_gather_round_trips(1);  // narrower
}

TEST(CpuKernels, CopyBlockPairsCopiesWholeBlocks) {
  const int64_t block_bytes = 8;
  std::vector<char> k(4 * block_bytes), v(4 * block_bytes);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<char>(i);
    v[i] = static_cast<char>(100 + i);
  }
  const std::vector<int64_t> pairs = {0, 3, 1, 2};
  BlockCopyArgs a;
  a.pairs = pairs.data();
  a.n = 2;
  a.block_bytes = block_bytes;
  a.v_block_bytes = block_bytes;
  a.k_src = k.data();
  a.v_src = v.data();
  a.k_dst = k.data();
  a.v_dst = v.data();
  cpu::copy_block_pairs(a, 0, 2);
  for (int64_t i = 0; i < block_bytes; ++i) {
    EXPECT_EQ(k[3 * block_bytes + i], static_cast<char>(i));
    EXPECT_EQ(k[2 * block_bytes + i], static_cast<char>(block_bytes + i));
    EXPECT_EQ(v[3 * block_bytes + i], static_cast<char>(100 + i));
  }
}

TEST(CpuKernels, CopyBlockPairsCopiesKAndVBlocksOfTheirOwnSizes) {
  const int64_t k_bytes = 8, v_bytes = 3;  // V rows narrower than K rows
  std::vector<char> k(4 * k_bytes), v(4 * v_bytes);
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<char>(i);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<char>(100 + i);
  const std::vector<int64_t> pairs = {0, 3, 1, 2};
  BlockCopyArgs a;
  a.pairs = pairs.data();
  a.n = 2;
  a.block_bytes = k_bytes;
  a.v_block_bytes = v_bytes;
  a.k_src = a.k_dst = k.data();
  a.v_src = a.v_dst = v.data();
  cpu::copy_block_pairs(a, 0, 2);
  for (int64_t i = 0; i < k_bytes; ++i) {
    EXPECT_EQ(k[3 * k_bytes + i], static_cast<char>(i));
    EXPECT_EQ(k[2 * k_bytes + i], static_cast<char>(k_bytes + i));
  }
  for (int64_t i = 0; i < v_bytes; ++i) {
    EXPECT_EQ(v[3 * v_bytes + i], static_cast<char>(100 + i));
    EXPECT_EQ(v[2 * v_bytes + i], static_cast<char>(100 + v_bytes + i));
    EXPECT_EQ(v[0 * v_bytes + i], static_cast<char>(100 + i));  // sources untouched
  }
}
