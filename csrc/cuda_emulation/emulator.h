// A CPU emulator of the CUDA execution model, for testing the kernels of attention_kernels.cu and
// cache_kernels.cu on machines without a GPU (test builds only: csrc/cuda_emulation/README.md).
//
// Every thread of a block is a fiber (ucontext) on the calling OS thread; blocks run one after
// another. A fiber runs until it reaches a barrier (__syncthreads, __syncwarp, a warp shuffle, ldmatrix,
// mma) or returns, and a barrier opens once every live thread it concerns has arrived. What the emulator
// checks, and a GPU would not report: a __syncthreads() that some live threads never reach, a warp
// shuffle or __syncwarp() over lanes that have exited or are waiting elsewhere (divergence), a
// mask other than the full warp, an ldmatrix or mma not reached by all 32 lanes of the warp, an ldmatrix
// row outside shared memory or misaligned. Such a launch fails with cudaErrorLaunchFailure and a message.
// Shared arrays start every block filled with NaN bytes. Races: fibers interleave only at barriers,
// so a thread sees what the threads scheduled before it wrote since the last barrier; running a test
// in both thread orders (ThreadOrder) turns a read of another thread's unsynchronized write into a
// stale or NaN value in one of them. Not modelled: fast-math intrinsics (__expf is expf).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {  // CUDA's float2 is 8-byte aligned (one 64-bit access)
  float x, y;
};
struct alignas(16) float4 {  // CUDA's float4 is 16-byte aligned (one 128-bit access)
  float x, y, z, w;
};

using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidConfiguration = 9;
constexpr cudaError_t cudaErrorLaunchFailure = 719;
using cudaStream_t = struct CUstream_st*;

namespace kvcache::emu {

/// Runs body() as every thread of every block of the grid; returns cudaSuccess or an error (the
/// message is kept for last_error_message()).
cudaError_t run(dim3 grid, dim3 block, const std::function<void()>& body);

const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

void sync_threads();
void sync_warp(unsigned mask);
/// Exchanges 8 bytes across the warp: returns what lane `src_lane` passed (or the caller's own value
/// when src_lane is outside [0, 32) or names no thread, as CUDA does for shfl_down past the end).
uint64_t shuffle(unsigned mask, uint64_t value, int src_lane);
int lane_id();

/// Warp-level tensor-core operations (core/warp_mma.cuh), with the PTX ISA's fragment layouts (see
/// emulator.cpp). Warp barriers like the shuffles, and stricter, as .sync.aligned instructions: all 32 lanes
/// of the warp must arrive at the same operation; a partial warp, an exited lane or a lane waiting at
/// another warp barrier fails the launch.
/// ldmatrix.sync.aligned.m8n8.x{matrices}{.trans}.shared.b16: `row` is this lane's row address (in a
/// KVC_SHARED array, 16-byte aligned; ignored for lanes >= 8 * matrices); fills out[0, matrices).
void ldmatrix_b16(int matrices, bool trans, const void* row, uint32_t* out);
enum class MmaInput { kF16, kBF16 };
/// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: d[4] = A * B + c, from this lane's
/// a[4], b[2], c[4] and the other lanes' fragments. d may be c.
void mma_m16n8k16(MmaInput type, const uint32_t* a, const uint32_t* b, const float* c, float* d);

/// The order in which a block's threads run between two barriers: by index, or the reverse. A kernel
/// without races gives the same result in both. The default comes from the environment variable
/// KVCACHE_CUDA_EMULATION_THREAD_ORDER ("forward", the default, or "reverse"), read at the first launch.
enum class ThreadOrder { kForward, kReverse };
void set_thread_order(ThreadOrder order);
ThreadOrder thread_order();

/// Global-load log (issue #23, check 4): kernels report their KV loads here (core/cp_async.cuh's
/// cp_async_16 does). While a log is open, each load is kept with its call site and the number of times the
/// calling thread has executed that site in this launch, so that the loads a warp issues together as one
/// instruction (same site, same n-th execution, lanes of one warp) are grouped alike in either thread order.
void log_global_load(int site, const void* address, unsigned bytes);
/// Shared-memory loads (check 4's bank conflicts), grouped into warp-wide instructions the same way; the
/// kernels log theirs through core/cuda_launch.cuh's shared_load.
void log_shared_load(int site, const void* address, unsigned bytes);
/// What the loads logged since start_access_log() add up to (and the tensor-core instructions: ldmatrix and mma
/// report themselves).
struct AccessSummary {
  int64_t warp_loads = 0;        // warp-wide load instructions: (launch, block, warp, site, n-th execution)
  int64_t bytes = 0;             // bytes the lanes asked for
  int64_t sector_bytes = 0;      // 32 x the 32-byte sectors those instructions touch (each counted per instruction)
  int64_t min_warp_bytes = 0;    // the fewest bytes one warp-wide load moved
  int64_t bytes_read_again = 0;  // bytes at an address some earlier logged load already read
  // tensor-core instructions, warp-wide: mma.m16n8k16 and ldmatrix executions, and the shared-memory
  // wavefronts the ldmatrix took beyond one per 8 x 16-byte matrix (bank conflicts)
  int64_t mma = 0;
  int64_t ldmatrix = 0;
  int64_t ldmatrix_extra_wavefronts = 0;
  // warp-wide shared-memory loads logged by log_shared_load, and the wavefronts they took beyond one per
  // phase (a phase: the lanes whose requests fit 128 bytes, i.e. 32 lanes of up to 4 bytes, 16 of 8, 8 of 16)
  int64_t shared_loads = 0;
  int64_t shared_extra_wavefronts = 0;
};
/// Opens the log (dropping any previous one); loads are logged from every launch until it is closed.
void start_access_log();
/// Closes the log and sums it up.
AccessSummary stop_access_log();

/// Registers a shared array (KVC_SHARED) to be filled with 0xff bytes before every block; fills it now.
bool poison_per_block(void* array, size_t bytes);

cudaError_t take_last_error();
const std::string& last_error_message();

template <class T>
T shfl(unsigned mask, T v, int src_lane) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = shuffle(mask, bits, src_lane);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

/// kernel<<<grid, block>>>(args...): the arguments are copied once, as CUDA copies them to the
/// device, and every thread receives its own copy of each by-value parameter.
template <class... P>
struct Launch {
  dim3 grid, block;
  void (*kernel)(P...);
  Launch(dim3 g, dim3 b, void (*k)(P...)) : grid(g), block(b), kernel(k) {}
  template <class... A>
  void operator()(A&&... args) const {
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    run(grid, block, [&] { std::apply(kernel, params); });
  }
};
template <class... P>
Launch(dim3, dim3, void (*)(P...)) -> Launch<P...>;

}  // namespace kvcache::emu

// ---- the CUDA names the kernels use ----------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // blocks run one at a time, so one copy per kernel is enough
// Shared arrays declared with KVC_SHARED (core/cuda_launch.cuh) are filled with 0xff bytes (NaN as
// floats) before every block: a kernel that reads shared memory it has not written in this block gets
// NaN, not a convenient zero or the previous block's data.
#define KVC_SHARED(type, name, dims) \
  static type name dims;             \
  [[maybe_unused]] static const bool name##_is_poisoned_per_block = ::kvcache::emu::poison_per_block(name, sizeof(name))
#define threadIdx (::kvcache::emu::thread_idx())
#define blockIdx (::kvcache::emu::block_idx())
#define blockDim (::kvcache::emu::block_dim())
#define gridDim (::kvcache::emu::grid_dim())
#define KVC_LAUNCH(grid, block, stream, ...) ::kvcache::emu::Launch(dim3(grid), dim3(block), __VA_ARGS__)

inline void __syncthreads() { ::kvcache::emu::sync_threads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::kvcache::emu::sync_warp(mask); }
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = ::kvcache::emu::lane_id();
  return ::kvcache::emu::shfl(mask, v, (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1)));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::kvcache::emu::lane_id();
  const int src = (lane & (width - 1)) + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : -1;
  return ::kvcache::emu::shfl(mask, v, src);
}
inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
template <class T>
inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }

enum cudaMemcpyKind { cudaMemcpyDefault = 4 };
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t) {
  std::memcpy(dst, src, bytes);  // host and device memory are the same here
  return cudaSuccess;
}
/// The emulator has no register file to size CTAs by: 2 resident CTAs per SM, so that with the 4 emulated SMs
/// of emulated_ops.cpp a call asks for 8 tasks (enough to split long sequences, few enough to emulate quickly).
template <class Kernel>
inline int kvc_ctas_per_sm(Kernel, int) { return 2; }
inline cudaError_t cudaGetLastError() { return ::kvcache::emu::take_last_error(); }
inline const char* cudaGetErrorString(cudaError_t) { return ::kvcache::emu::last_error_message().c_str(); }
