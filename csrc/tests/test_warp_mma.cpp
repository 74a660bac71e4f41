// core/warp_mma.cuh under the CUDA emulator: ldmatrix and mma.m16n8k16 against the PTX ISA's fragment
// layouts, written out here independently of the emulator ("Warp-level matrix load instruction: ldmatrix",
// "Matrix Fragments for mma.m16n8k16 with floating point type"), and against a host matrix product.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/warp_mma.cuh"

namespace {

using kvcache::cuda::ldmatrix;
using kvcache::cuda::ldmatrix_trans;
using kvcache::cuda::mma_m16n8k16;
using kvcache::emu::ThreadOrder;

// ldmatrix needs 16-byte aligned rows; a plain uint16_t array promises 2.
struct alignas(16) Rows {
  uint16_t e[32][8];
};
struct alignas(16) Tile {
  uint16_t e[16][16];
};

std::string launch_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : cudaGetErrorString(e);
}

// ---- ldmatrix ---------------------------------------------------------------------------------------

// Stores the 32 rows of 8 elements given in shared memory, row r of the input at slot[r] (so the rows
// a lane addresses are scattered, not one contiguous matrix), and ldmatrix's registers of every lane.
template <int N, bool kTrans>
__global__ void load_fragments(const uint16_t* rows, const int* slot, uint32_t* out) {
  KVC_SHARED(Rows, shared_rows, [1]);
  const int lane = static_cast<int>(threadIdx.x);
  for (int c = 0; c < 8; ++c) shared_rows[0].e[slot[lane]][c] = rows[lane * 8 + c];
  __syncthreads();
  // Lane l gives row l % 8 of matrix l / 8; the lanes ldmatrix ignores give a null pointer.
  const void* row = lane < 8 * N ? shared_rows[0].e[slot[lane]] : nullptr;
  uint32_t r[N];
  if constexpr (kTrans) {
    ldmatrix_trans(r, row);
  } else {
    ldmatrix(r, row);
  }
  for (int m = 0; m < N; ++m) out[lane * N + m] = r[m];
}

template <int N, bool kTrans>
void check_ldmatrix_layout() {
  SCOPED_TRACE(testing::Message() << "x" << N << (kTrans ? ".trans" : ""));
  std::vector<uint16_t> rows(32 * 8);
  for (int i = 0; i < 32 * 8; ++i) rows[i] = static_cast<uint16_t>(0x1000 + i);  // matrix i / 64, row i / 8 % 8
  std::vector<int> slot(32);
  for (int r = 0; r < 32; ++r) slot[r] = (r * 7 + 3) % 32;
  std::vector<uint32_t> out(32 * N, 0xdeadbeefu);
  KVC_LAUNCH(1, 32, nullptr, (load_fragments<N, kTrans>))(rows.data(), slot.data(), out.data());
  ASSERT_EQ(launch_error(), "");
  // The PTX ISA's Figure "ldmatrix fragment layout for one 8x8 Matrix with 16-bit elements": thread t
  // holds row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1, the first in the low half; .trans loads the
  // matrix column-major, so the same thread holds column t / 4, rows 2 (t % 4) and 2 (t % 4) + 1.
  const auto element = [&](int m, int r, int c) { return uint32_t{rows[(8 * m + r) * 8 + c]}; };
  for (int t = 0; t < 32; ++t) {
    for (int m = 0; m < N; ++m) {
      const uint32_t lo = kTrans ? element(m, 2 * (t % 4), t / 4) : element(m, t / 4, 2 * (t % 4));
      const uint32_t hi = kTrans ? element(m, 2 * (t % 4) + 1, t / 4) : element(m, t / 4, 2 * (t % 4) + 1);
      EXPECT_EQ(out[t * N + m], lo | hi << 16) << "lane " << t << ", matrix " << m;
    }
  }
}

TEST(WarpMma, LdmatrixMatchesThePtxLayout) {
  check_ldmatrix_layout<1, false>();
  check_ldmatrix_layout<2, false>();
  check_ldmatrix_layout<4, false>();
  check_ldmatrix_layout<1, true>();
  check_ldmatrix_layout<2, true>();
  check_ldmatrix_layout<4, true>();
}

// ---- mma --------------------------------------------------------------------------------------------

// The C / D fragment of mma.m16n8k16: element i of lane (g = lane / 4, t = lane % 4) is at row g for
// i < 2, g + 8 otherwise, column 2t + (i & 1).
int cd_row(int lane, int i) { return lane / 4 + (i < 2 ? 0 : 8); }
int cd_col(int lane, int i) { return 2 * (lane % 4) + (i & 1); }

enum class BTile {
  kKeysX2,         // B = K^T from a row-major 8 x 16 K (n x k), ldmatrix x2: D is 16 x 8
  kValuesX4Trans,  // B = V from a row-major 16 x 16 V (k x n), ldmatrix x4.trans: D is 16 x 16, two mma
};

// D = A B + C, as a prefill kernel would: the tiles staged row-major in shared memory, fragments loaded
// with ldmatrix, C and D moved between registers and row-major memory by the accumulator layout.
template <class T, BTile kB>
__global__ void tile_product(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  KVC_SHARED(Tile, a_tile, [1]);
  KVC_SHARED(Tile, b_tile, [1]);
  constexpr int kBRows = kB == BTile::kKeysX2 ? 8 : 16, kN = kB == BTile::kKeysX2 ? 8 : 16;
  const int lane = static_cast<int>(threadIdx.x);
  for (int i = lane; i < 16 * 16; i += 32) a_tile[0].e[i / 16][i % 16] = a[i];
  for (int i = lane; i < kBRows * 16; i += 32) b_tile[0].e[i / 16][i % 16] = b[i];
  __syncthreads();
  uint32_t af[4];
  ldmatrix(af, &a_tile[0].e[lane % 16][8 * (lane / 16)]);
  uint32_t bf[kN / 8][2];
  if constexpr (kB == BTile::kKeysX2) {
    ldmatrix(bf[0], &b_tile[0].e[lane % 8][8 * (lane / 8 % 2)]);  // lanes 16-31: repeats of 0-15
  } else {
    uint32_t r[4];
    ldmatrix_trans(r, &b_tile[0].e[lane % 16][8 * (lane / 16)]);
    bf[0][0] = r[0], bf[0][1] = r[1], bf[1][0] = r[2], bf[1][1] = r[3];
  }
  for (int j = 0; j < kN / 8; ++j) {
    float acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = c[cd_row(lane, i) * kN + 8 * j + cd_col(lane, i)];
    mma_m16n8k16<T>(acc, af, bf[j], acc);
    for (int i = 0; i < 4; ++i) d[cd_row(lane, i) * kN + 8 * j + cd_col(lane, i)] = acc[i];
  }
}

struct Tiles {
  std::vector<uint16_t> a, b;  // bits of T
  std::vector<float> c;
};

template <class T>
float to_float(uint16_t bits) {
  return std::is_same_v<T, __nv_bfloat16> ? kvcache::bf16_to_float(bits) : kvcache::fp16_to_float(bits);
}
template <class T>
uint16_t from_float(float f) {
  return std::is_same_v<T, __nv_bfloat16> ? kvcache::float_to_bf16(f) : kvcache::float_to_fp16(f);
}

// Inputs that are small integers (every product and partial sum exact in f32) or random reals.
template <class T>
Tiles make_tiles(BTile kind, bool integers, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(-8, 8), offset(-100, 100);
  std::uniform_real_distribution<float> real(-2.f, 2.f);
  const int n = kind == BTile::kKeysX2 ? 8 : 16;
  Tiles t;
  for (int i = 0; i < 16 * 16; ++i) t.a.push_back(from_float<T>(integers ? small(rng) : real(rng)));
  for (int i = 0; i < n * 16; ++i) t.b.push_back(from_float<T>(integers ? small(rng) : real(rng)));
  for (int i = 0; i < 16 * n; ++i) t.c.push_back(integers ? static_cast<float>(offset(rng)) : 4 * real(rng));
  return t;
}

template <class T>
void check_tile_product(BTile kind, bool integers, ThreadOrder order) {
  SCOPED_TRACE(testing::Message() << (std::is_same_v<T, __nv_bfloat16> ? "bf16" : "fp16")
                                  << (kind == BTile::kKeysX2 ? ", K tile, x2" : ", V tile, x4.trans")
                                  << (integers ? ", integers" : ", random")
                                  << (order == ThreadOrder::kReverse ? ", reverse order" : ""));
  const int n = kind == BTile::kKeysX2 ? 8 : 16;
  const Tiles t = make_tiles<T>(kind, integers, 1234u + static_cast<unsigned>(n));
  std::vector<float> d(16 * n, std::nanf(""));
  const ThreadOrder before = kvcache::emu::thread_order();
  kvcache::emu::set_thread_order(order);
  if (kind == BTile::kKeysX2) {
    KVC_LAUNCH(1, 32, nullptr, (tile_product<T, BTile::kKeysX2>))(t.a.data(), t.b.data(), t.c.data(), d.data());
  } else {
    KVC_LAUNCH(1, 32, nullptr, (tile_product<T, BTile::kValuesX4Trans>))(t.a.data(), t.b.data(), t.c.data(), d.data());
  }
  kvcache::emu::set_thread_order(before);
  ASSERT_EQ(launch_error(), "");
  for (int r = 0; r < 16; ++r) {
    for (int col = 0; col < n; ++col) {
      double sum = t.c[r * n + col], magnitude = std::fabs(sum);
      for (int k = 0; k < 16; ++k) {
        const double bk = to_float<T>(kind == BTile::kKeysX2 ? t.b[col * 16 + k] : t.b[k * n + col]);
        const double term = double{to_float<T>(t.a[r * 16 + k])} * bk;
        sum += term;
        magnitude += std::fabs(term);
      }
      if (integers) {
        EXPECT_EQ(d[r * n + col], static_cast<float>(sum)) << "D[" << r << "][" << col << "]";
      } else {
        // 16 f32 additions: at most ~16 roundings of 2^-24 relative to the sum of magnitudes.
        EXPECT_NEAR(d[r * n + col], sum, 16 * 0x1p-24 * magnitude) << "D[" << r << "][" << col << "]";
      }
    }
  }
}

TEST(WarpMma, Bf16TileProductFromSharedMemory) {
  for (ThreadOrder order : {ThreadOrder::kForward, ThreadOrder::kReverse}) {
    for (BTile kind : {BTile::kKeysX2, BTile::kValuesX4Trans}) {
      check_tile_product<__nv_bfloat16>(kind, true, order);
      check_tile_product<__nv_bfloat16>(kind, false, order);
    }
  }
}

TEST(WarpMma, Fp16TileProductFromSharedMemory) {
  for (ThreadOrder order : {ThreadOrder::kForward, ThreadOrder::kReverse}) {
    for (BTile kind : {BTile::kKeysX2, BTile::kValuesX4Trans}) {
      check_tile_product<__half>(kind, true, order);
      check_tile_product<__half>(kind, false, order);
    }
  }
}

// The mma alone, its A and B fragments built in registers from the PTX ISA's layout (no ldmatrix). Every
// A[r][k] is distinct and B[k][n] = (k == n) + 2 (k == n + 8), so D[r][n] = C[r][n] + A[r][n] + 2 A[r][n + 8]
// shows which elements of A and B reached which element of D.
__global__ void mma_from_registers(const float* a, const float* b, float* d) {
  const int lane = static_cast<int>(threadIdx.x), g = lane / 4, t = lane % 4;
  const auto pack = [](float lo, float hi) {
    return uint32_t{kvcache::float_to_fp16(lo)} | uint32_t{kvcache::float_to_fp16(hi)} << 16;
  };
  uint32_t af[4], bf[2];
  for (int j = 0; j < 4; ++j) {  // register j holds a_{2j}, a_{2j+1}: row g (+8 for j odd), cols 2t (+8 for j >= 2)
    const int row = g + 8 * (j % 2), col = 2 * t + 8 * (j / 2);
    af[j] = pack(a[row * 16 + col], a[row * 16 + col + 1]);
  }
  for (int j = 0; j < 2; ++j) {  // register j holds b_{2j}, b_{2j+1}: rows 2t, 2t + 1 (+8 for j = 1), col g
    const int row = 2 * t + 8 * j;
    bf[j] = pack(b[row * 8 + g], b[(row + 1) * 8 + g]);
  }
  float c[4], out[4];
  for (int i = 0; i < 4; ++i) c[i] = 1000.f * static_cast<float>(i + 1);
  mma_m16n8k16<__half>(out, af, bf, c);
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = out[i];
}

TEST(WarpMma, Fp16MmaOfRegisterFragments) {
  std::vector<float> a(16 * 16), b(16 * 8, 0.f), d(32 * 4);
  for (int r = 0; r < 16; ++r) {
    for (int k = 0; k < 16; ++k) a[r * 16 + k] = static_cast<float>(r * 16 + k) / 8;  // exact in fp16
  }
  for (int n = 0; n < 8; ++n) b[n * 8 + n] = 1.f, b[(n + 8) * 8 + n] = 2.f;
  KVC_LAUNCH(1, 32, nullptr, mma_from_registers)(a.data(), b.data(), d.data());
  ASSERT_EQ(launch_error(), "");
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const int r = cd_row(lane, i), n = cd_col(lane, i);
      EXPECT_EQ(d[lane * 4 + i], 1000.f * (i + 1) + a[r * 16 + n] + 2 * a[r * 16 + n + 8])
          << "lane " << lane << ", c" << i;
    }
  }
}

// ---- misuse -----------------------------------------------------------------------------------------

__global__ void mma_after_an_exit(float* out) {
  if (threadIdx.x == 5) return;
  const uint32_t a[4] = {}, b[2] = {};
  float c[4] = {}, d[4];
  mma_m16n8k16<__nv_bfloat16>(d, a, b, c);
  out[threadIdx.x] = d[0];
}

__global__ void mma_in_a_partial_warp(float* out) {
  const uint32_t a[4] = {}, b[2] = {};
  float c[4] = {}, d[4];
  mma_m16n8k16<__half>(d, a, b, c);
  out[threadIdx.x] = d[0];
}

__global__ void divergent_mma(float* out) {
  const uint32_t a[4] = {}, b[2] = {};
  float c[4] = {}, d[4] = {};
  if (threadIdx.x < 16) {
    mma_m16n8k16<__half>(d, a, b, c);
  } else {
    d[0] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
  }
  out[threadIdx.x] = d[0];
}

__global__ void ldmatrix_from(int where, uint32_t* out) {
  KVC_SHARED(Rows, shared_rows, [1]);
  const int lane = static_cast<int>(threadIdx.x);
  for (int c = 0; c < 8; ++c) shared_rows[0].e[lane][c] = 0;
  __syncthreads();
  const char* row = reinterpret_cast<const char*>(shared_rows[0].e[lane % 8]);
  if (where == 1 && lane == 3) row += 2;  // misaligned
  if (where == 2 && lane == 6) row = reinterpret_cast<const char*>(out);  // global memory
  uint32_t r[1];
  ldmatrix(r, row);
  out[lane] = r[0];
}

TEST(WarpMma, MisuseFailsTheLaunch) {
  const auto expect_failure = [](const std::string& message, const std::string& part) {
    EXPECT_NE(message.find(part), std::string::npos) << message;
  };
  std::vector<float> out(32);
  KVC_LAUNCH(1, 32, nullptr, mma_after_an_exit)(out.data());
  expect_failure(launch_error(),
                 "warp 0: mma.m16n8k16.f32.bf16.bf16.f32 needs all 32 lanes of the warp, and lane 5 has exited");

  KVC_LAUNCH(1, 48, nullptr, mma_in_a_partial_warp)(out.data());  // warp 1 has 16 threads
  expect_failure(launch_error(), "warp 1: mma.m16n8k16.f32.f16.f16.f32 needs all 32 lanes of the warp, and the "
                                 "block (48 threads) gives this warp 16");

  KVC_LAUNCH(1, 32, nullptr, divergent_mma)(out.data());
  expect_failure(launch_error(), "divergent lanes");

  std::vector<uint32_t> regs(32);
  KVC_LAUNCH(1, 32, nullptr, ldmatrix_from)(0, regs.data());
  EXPECT_EQ(launch_error(), "");
  KVC_LAUNCH(1, 32, nullptr, ldmatrix_from)(1, regs.data());
  expect_failure(launch_error(), "ldmatrix.m8n8.x1.b16: lane 3's row address");
  KVC_LAUNCH(1, 32, nullptr, ldmatrix_from)(2, regs.data());
  const std::string outside = launch_error();
  expect_failure(outside, "lane 6's row");
  expect_failure(outside, "is not inside a shared array");
}

// ---- bank conflicts (the access log's count, issue #23 check 4) ---------------------------------------

// An x4 ldmatrix over 16 rows of a tile whose rows are `stride` bytes apart (8 columns each for the matrices'
// two halves), and an mma, under the access log.
__global__ void ldmatrix_rows_apart(int stride, uint32_t* out) {
  KVC_SHARED(uint4, tile, [16 * 1040 / 16]);  // 16 rows up to 1,040 bytes apart
  const int lane = static_cast<int>(threadIdx.x);
  const char* base = reinterpret_cast<const char*>(tile);
  uint32_t r[4];
  ldmatrix(r, base + (lane % 16) * stride + 16 * (lane / 16));
  const uint32_t b[2] = {r[0], r[1]};
  float d[4] = {};
  mma_m16n8k16<__nv_bfloat16>(d, r, b, d);
  out[lane] = r[0];
}

TEST(WarpMma, AccessLogCountsBankConflictsOfLdmatrix) {
  std::vector<uint32_t> out(32);
  const auto extra_wavefronts = [&](int stride) {
    kvcache::emu::start_access_log();
    KVC_LAUNCH(1, 32, nullptr, ldmatrix_rows_apart)(stride, out.data());
    EXPECT_EQ(launch_error(), "");
    const kvcache::emu::AccessSummary s = kvcache::emu::stop_access_log();
    EXPECT_EQ(s.ldmatrix, 1);
    EXPECT_EQ(s.mma, 1);
    return s.ldmatrix_extra_wavefronts;
  };
  // rows 1,024 bytes apart (a 512-dim bf16 row): the 8 rows of a matrix share banks 0-3 (4 matrices x 7)
  EXPECT_EQ(extra_wavefronts(1024), 28);
  // padded by 16 bytes (the MLA stage's rows): 8 rows, 8 bank quads
  EXPECT_EQ(extra_wavefronts(1040), 0);
  // 32 bytes (one row's two halves are its matrices 0 and 2): rows r and r + 4 share banks
  EXPECT_EQ(extra_wavefronts(32), 4);
  // 16 bytes: one contiguous 128-byte matrix per 8 rows
  EXPECT_EQ(extra_wavefronts(16), 0);
}

}  // namespace
