// The CPU emulator of the CUDA execution model (csrc/cuda_emulation), on small kernels written as CUDA:
// barriers, shuffles, shared memory and launch parameters behave as on a GPU, and the misuses the
// emulator promises to report (divergent barriers, shuffles over exited lanes, bad configurations)
// fail the launch with a message.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/cp_async.cuh"
#include "cuda_emulation/emulator.h"

namespace {

__global__ void block_sum(const int* in, int* out, int n) {
  KVC_SHARED(int, partial, [256]);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  partial[threadIdx.x] = i < n ? in[i] : 0;
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
  }
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}

TEST(CudaEmulator, SharedMemoryReductionAcrossBarriers) {
  std::vector<int> in(1000), out(4, -1);
  for (int i = 0; i < 1000; ++i) in[i] = i;
  KVC_LAUNCH(4, 256, nullptr, block_sum)(in.data(), out.data(), 1000);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int b = 0; b < 4; ++b) {
    int expect = 0;
    for (int i = 256 * b; i < std::min(1000, 256 * (b + 1)); ++i) expect += i;
    EXPECT_EQ(out[b], expect) << "block " << b;
  }
}

__global__ void warp_ops(float* sums, int* down, int* idx) {
  const int t = threadIdx.x, lane = t % 32;
  float x = static_cast<float>(t);
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  sums[t] = x;
  down[t] = __shfl_down_sync(0xffffffffu, t, 5);
  idx[t] = static_cast<int>(blockIdx.y * 1000 + threadIdx.y * 100) + lane;
}

TEST(CudaEmulator, WarpShufflesAndIndices) {
  std::vector<float> sums(64);
  std::vector<int> down(64), idx(64);
  KVC_LAUNCH(1, 64, nullptr, warp_ops)(sums.data(), down.data(), idx.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < 64; ++t) {
    const int w = t / 32;
    EXPECT_EQ(sums[t], static_cast<float>(32 * 32 * w + 31 * 32 / 2)) << t;  // every lane holds its warp's sum
    EXPECT_EQ(down[t], t % 32 + 5 < 32 ? t + 5 : t) << t;                      // past the warp: its own value
    EXPECT_EQ(idx[t], t % 32);
  }
}

__global__ void grid_indices(int* out) {
  const unsigned b = blockIdx.y * gridDim.x + blockIdx.x;
  out[b * blockDim.x * blockDim.y + threadIdx.y * blockDim.x + threadIdx.x] = static_cast<int>(b);
}

TEST(CudaEmulator, TwoDimensionalGridsAndBlocks) {
  std::vector<int> out(3 * 2 * 4 * 8, -1);
  KVC_LAUNCH(dim3(3, 2), dim3(4, 8), nullptr, grid_indices)(out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], static_cast<int>(i / 32)) << i;
}

struct Params {
  int value;
};
__global__ void own_copy(Params p, int* out) {
  p.value += static_cast<int>(threadIdx.x);  // a by-value parameter is each thread's own
  out[threadIdx.x] = p.value;
}

TEST(CudaEmulator, ByValueParametersAreCopiedPerThread) {
  std::vector<int> out(32);
  KVC_LAUNCH(1, 32, nullptr, own_copy)(Params{10}, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < 32; ++t) EXPECT_EQ(out[t], 10 + t);
}

__global__ void reads_unwritten_shared(float* out) {
  KVC_SHARED(float, tile, [64]);
  if (threadIdx.x < 32) tile[threadIdx.x] = 1.f;  // the upper half is never written
  __syncthreads();
  out[blockIdx.x * 64 + threadIdx.x] = tile[threadIdx.x];
  __syncthreads();
  tile[threadIdx.x] = 2.f;  // ...in this block: the next block starts from NaN again
}

TEST(CudaEmulator, SharedMemoryStartsEveryBlockAsNaN) {
  std::vector<float> out(2 * 64);
  KVC_LAUNCH(2, 64, nullptr, reads_unwritten_shared)(out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int i = 0; i < 2 * 64; ++i) {
    if (i % 64 < 32) {
      EXPECT_EQ(out[i], 1.f) << i;
    } else {
      EXPECT_TRUE(std::isnan(out[i])) << i << ": " << out[i];
    }
  }
}

// Reads the value its left neighbour writes, with and without the barrier that makes it safe.
__global__ void neighbour_read(float* out, bool sync) {
  KVC_SHARED(float, row, [64]);
  const int i = static_cast<int>(threadIdx.x);
  row[i] = static_cast<float>(i);
  if (sync) __syncthreads();
  out[i] = i > 0 ? row[i - 1] : -1.f;
}

TEST(CudaEmulator, ReversedThreadOrderExposesAnUnsynchronizedRead) {
  const auto run = [](kvcache::emu::ThreadOrder order, bool sync) {
    kvcache::emu::set_thread_order(order);
    std::vector<float> out(64, 0.f);
    KVC_LAUNCH(1, 64, nullptr, neighbour_read)(out.data(), sync);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    return out;
  };
  using kvcache::emu::ThreadOrder;
  const ThreadOrder before = kvcache::emu::thread_order();
  const std::vector<float> forward = run(ThreadOrder::kForward, false), reverse = run(ThreadOrder::kReverse, false);
  const std::vector<float> forward_sync = run(ThreadOrder::kForward, true), reverse_sync = run(ThreadOrder::kReverse, true);
  kvcache::emu::set_thread_order(before);
  for (int i = 1; i < 64; ++i) {
    EXPECT_EQ(forward[i], i - 1.f) << i;  // forward order hides the race: the neighbour ran first
    EXPECT_TRUE(std::isnan(reverse[i])) << i << ": " << reverse[i];  // reversed, it reads the NaN fill
    EXPECT_EQ(forward_sync[i], i - 1.f) << i;
    EXPECT_EQ(reverse_sync[i], i - 1.f) << i;  // with the barrier, both orders agree
  }
}

// Each thread notes (phase, thread) as it runs: phase 0 up to a shuffle, 1 up to __syncthreads, 2 after it.
__global__ void note_turns(std::vector<int>* turns) {
  const int t = threadIdx.x;
  turns->push_back(t);  // the fibers share one OS thread: a plain vector is safe
  const int from = __shfl_down_sync(0xffffffffu, t, 1);
  turns->push_back(1000 + from);
  __syncthreads();
  turns->push_back(2000 + t);
}

TEST(CudaEmulator, FibersRunInTurnsOnReusedStacksInEitherOrder) {
  // A round runs every fiber that is not waiting, in thread order (or reversed), each to its next barrier;
  // launches of growing and shrinking size reuse this OS thread's stacks.
  using kvcache::emu::ThreadOrder;
  const ThreadOrder before = kvcache::emu::thread_order();
  for (ThreadOrder order : {ThreadOrder::kForward, ThreadOrder::kReverse}) {
    kvcache::emu::set_thread_order(order);
    for (int threads : {64, 1024, 32, 1024, 96}) {
      std::vector<int> turns;
      KVC_LAUNCH(1, threads, nullptr, note_turns)(&turns);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      std::vector<int> expect;
      for (int phase = 0; phase < 3; ++phase) {
        for (int k = 0; k < threads; ++k) {
          const int t = order == ThreadOrder::kForward ? k : threads - 1 - k;
          const int from = t % 32 < 31 ? t + 1 : t;  // past the warp: its own value
          expect.push_back(phase == 0 ? t : phase == 1 ? 1000 + from : 2000 + t);
        }
      }
      EXPECT_EQ(turns, expect) << threads << " threads, " << (order == ThreadOrder::kForward ? "forward" : "reverse");
    }
  }
  kvcache::emu::set_thread_order(before);
}

// Lane l of each warp copies 16 bytes at src + stride * (32 * warp + l), `times` times; lanes >= active skip.
// With `split`, odd lanes copy from a second call site (two instructions, each of half a warp).
__global__ void copy_units(const char* src, int stride, int times, int active, bool split) {
  KVC_SHARED(uint4, dst, [64]);
  const int lane = threadIdx.x % 32;
  if (lane >= active) return;
  const char* p = src + stride * threadIdx.x;
  for (int n = 0; n < times; ++n) {
    if (split && lane % 2 == 1) {
      kvcache::cuda::cp_async_16(&dst[threadIdx.x], p);
    } else {
      kvcache::cuda::cp_async_16(&dst[threadIdx.x], p);
    }
    __syncthreads();  // the fibers interleave: the log must still group a warp's n-th copies together
  }
  kvcache::cuda::cp_async_commit();
  kvcache::cuda::cp_async_wait<0>();
}

TEST(CudaEmulator, AccessLogGroupsWarpLoadsInEitherThreadOrder) {
  using kvcache::emu::ThreadOrder;
  std::vector<char> src(64 * 64);
  const auto log = [&](ThreadOrder order, int stride, int times, int active, bool split) {
    kvcache::emu::set_thread_order(order);
    kvcache::emu::start_access_log();
    KVC_LAUNCH(1, 64, nullptr, copy_units)(src.data(), stride, times, active, split);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    return kvcache::emu::stop_access_log();
  };
  const ThreadOrder before = kvcache::emu::thread_order();
  for (ThreadOrder order : {ThreadOrder::kForward, ThreadOrder::kReverse}) {
    // contiguous 16-byte units: 2 warps x 3 trips, 512 B each, every sector whole, the same bytes 3 times
    auto s = log(order, 16, 3, 32, false);
    EXPECT_EQ(s.warp_loads, 6);
    EXPECT_EQ(s.bytes, 6 * 512);
    EXPECT_EQ(s.sector_bytes, s.bytes);
    EXPECT_EQ(s.min_warp_bytes, 512);
    EXPECT_EQ(s.bytes_read_again, 2 * 64 * 16);
    // a 64-byte stride: each unit alone in its 32-byte sector -> half of every fetched sector unused
    s = log(order, 64, 1, 32, false);
    EXPECT_EQ(s.warp_loads, 2);
    EXPECT_EQ(s.sector_bytes, 2 * s.bytes);
    EXPECT_EQ(s.bytes_read_again, 0);
    // two call sites: 4 warp loads of 16 lanes
    s = log(order, 16, 1, 32, true);
    EXPECT_EQ(s.warp_loads, 4);
    EXPECT_EQ(s.min_warp_bytes, 256);
    // 20 active lanes of each warp
    s = log(order, 16, 1, 20, false);
    EXPECT_EQ(s.min_warp_bytes, 20 * 16);
  }
  kvcache::emu::set_thread_order(before);
  // nothing is logged once the log is closed
  KVC_LAUNCH(1, 64, nullptr, copy_units)(src.data(), 16, 1, 32, false);
  EXPECT_EQ(kvcache::emu::stop_access_log().warp_loads, 0);
}

// Lane l of each warp reads `bytes` bytes (4, 8 or 16) of a shared array at element (l * stride) % 64 of that
// size, through shared_load (the loads the access log counts bank conflicts of).
__global__ void strided_shared_reads(int bytes, int stride, float* out) {
  KVC_SHARED(float4, tile, [64 * 4]);
  const int lane = threadIdx.x % 32, i = (lane * stride) % 64;
  float x = 0.f;
  if (bytes == 4) x = kvcache::cuda::shared_load(reinterpret_cast<const float*>(tile) + i);
  if (bytes == 8) x = kvcache::cuda::shared_load(reinterpret_cast<const float2*>(tile) + i).x;
  if (bytes == 16) x = kvcache::cuda::shared_load(tile + i).x;
  out[threadIdx.x] = x;
}

TEST(CudaEmulator, AccessLogCountsBankConflictsOfSharedLoads) {
  std::vector<float> out(64);
  const auto extra = [&](int bytes, int stride) {
    kvcache::emu::start_access_log();
    KVC_LAUNCH(1, 64, nullptr, strided_shared_reads)(bytes, stride, out.data());
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    const kvcache::emu::AccessSummary s = kvcache::emu::stop_access_log();
    EXPECT_EQ(s.shared_loads, 2);  // one per warp
    return s.shared_extra_wavefronts;
  };
  EXPECT_EQ(extra(4, 1), 0);        // consecutive words
  EXPECT_EQ(extra(4, 0), 0);        // one word for every lane: a broadcast
  EXPECT_EQ(extra(4, 2), 2 * 1);    // lanes l and l + 16 on one bank, different words: 2 wavefronts per warp
  EXPECT_EQ(extra(4, 32), 2 * 1);   // elements 0 and 32 (lanes even / odd): 2 words on bank 0
  EXPECT_EQ(extra(8, 1), 0);        // 16 lanes x 8 bytes per 128-byte phase
  EXPECT_EQ(extra(8, 2), 2 * 2 * 1);  // every other 8 bytes: each half-warp phase spans 256 bytes, 2 per bank
  EXPECT_EQ(extra(16, 1), 0);       // 8 lanes x 16 bytes per phase
  EXPECT_EQ(extra(16, 8), 2 * 4 * 7);  // 128 bytes apart: a phase's 8 lanes on banks 0-3
}

__global__ void divergent_barrier() {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    __syncwarp();  // waits for lane 0, which waits for everyone at __syncthreads
  }
}

__global__ void shuffle_after_exit(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

__global__ void nothing() {}

TEST(CudaEmulator, ReportsDivergenceExitedLanesAndBadConfigurations) {
  KVC_LAUNCH(1, 64, nullptr, divergent_barrier)();
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_NE(std::string(cudaGetErrorString(cudaErrorLaunchFailure)).find("divergent"), std::string::npos)
      << cudaGetErrorString(cudaErrorLaunchFailure);

  std::vector<float> out(32);
  KVC_LAUNCH(1, 32, nullptr, shuffle_after_exit)(out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_NE(std::string(cudaGetErrorString(cudaErrorLaunchFailure)).find("lane 16, which has exited"),
            std::string::npos)
      << cudaGetErrorString(cudaErrorLaunchFailure);

  KVC_LAUNCH(1, 2048, nullptr, nothing)();
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // reading the error clears it, as in CUDA

  KVC_LAUNCH(2, 32, nullptr, nothing)();  // the emulator is usable after a failed launch
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
