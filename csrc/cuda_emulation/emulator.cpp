// The fiber scheduler behind emulator.h.
#include "cuda_emulation/emulator.h"

#include "core/dtype.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
// Switches stacks: saves the callee-saved registers on the current stack, stores its pointer in
// *save_sp, and resumes the stack at load_sp. glibc's swapcontext also saves the signal mask with a
// system call each time, which made it most of an emulated kernel's run time.
extern "C" void kvc_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl kvc_emu_switch
  .hidden kvc_emu_switch
  .type kvc_emu_switch, @function
kvc_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvc_emu_switch, .-kvc_emu_switch
)");
#endif

namespace kvcache::emu {
namespace {

constexpr size_t kStackBytes = 128 * 1024;
// Fiber stacks lie kStackStride apart in one allocation. 128 KiB apart, the hot tops of all a block's stacks
// fell in one set of the L1 and L2 caches (8 ways each), so every switch to a fiber missed them; the extra
// 1,088 bytes (17 lines) walk the tops through the sets.
constexpr size_t kStackStride = kStackBytes + 17 * 64;
constexpr int kWarp = 32;
// What one lane can hand to the others at a warp barrier: an mma's A and B registers (6 x 32 bits) fit.
constexpr int kSlotWords = 4;

enum class Wait { kNone, kBlock, kWarp, kDone };

/// An execution context: a fiber's stack, or the scheduler's (the OS thread's own stack).
struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

void switch_context(Context& from, Context& to) {
#if defined(__x86_64__)
  kvc_emu_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

struct Fiber {
  Context ctx;
  char* stack = nullptr;  // kStackBytes of this OS thread's FiberStacks
  uint3 tid;
  int warp = 0, lane = 0;
  Wait wait = Wait::kNone;
  unsigned mask = 0;  // of the warp barrier it waits at
  // The warp barrier's operation, for messages; `aligned`: a .sync.aligned instruction (ldmatrix, mma),
  // which every lane of the warp must reach, and at the same instruction.
  const char* op = nullptr;
  bool aligned = false;
};

struct Grid {
  dim3 grid, block;
  uint3 bid;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  Context scheduler;
  int current = -1;
  int turn = -1;  // of `current` in this round's order (0 = the first fiber the round runs)
  std::string error;
  // Values exchanged at warp barriers (shuffles, ldmatrix, mma): kSlotWords words per thread,
  // double-buffered (a lane reads buffer g % 2 after warp barrier g; the next barrier's values go to the
  // other buffer, so no lane can overwrite a value still to be read).
  std::vector<uint64_t> slots[2];
  std::vector<int> generation;   // per warp: warp barriers completed
  bool reverse = false;          // ThreadOrder::kReverse
};

// The launch this OS thread runs. Read at every shuffle, barrier and threadIdx: initial-exec, so a read is
// one %fs-relative load instead of a __tls_get_addr call (~15% of an emulated kernel's time); 8 bytes of the
// static TLS surplus glibc keeps for libraries that are dlopen'ed.
__attribute__((tls_model("initial-exec"))) thread_local Grid* active = nullptr;

/// The fiber stacks of this OS thread's launches, kept from one launch to the next: a launch of 256 threads
/// took 256 fresh 128 KiB allocations (each an mmap, its top page faulted in and zeroed, then unmapped).
class FiberStacks {
 public:
  /// The stacks of a launch of `threads` threads: stack i starts at the result + i * kStackStride. Valid
  /// until the next launch on this OS thread. Called once per launch.
  char* for_launch(uint64_t threads) {
    if (threads > count_) {
      memory_.reset(new char[threads * kStackStride]);
      count_ = threads;
    }
#if defined(__SANITIZE_ADDRESS__)
    // A finished fiber never returns from its first frame, so its redzones stay poisoned: a new fiber on
    // the same stack starts from addressable memory, as a fresh allocation does.
    ASAN_UNPOISON_MEMORY_REGION(memory_.get(), threads * kStackStride);
#endif
    return memory_.get();
  }

 private:
  std::unique_ptr<char[]> memory_;
  uint64_t count_ = 0;
};
thread_local FiberStacks fiber_stacks;

/// The open global-load log: every load, grouped by the warp-wide instruction it belongs to.
struct AccessLog {
  std::mutex mutex;  // ops may launch from several Python threads
  std::atomic<bool> open{false};
  uint64_t launches = 0;
  // (launch, block, warp, site, n-th execution) -> (address, bytes) of each lane
  std::map<std::tuple<uint64_t, uint64_t, int, int, uint32_t>, std::vector<std::pair<uintptr_t, unsigned>>> loads;
  std::map<std::tuple<uint64_t, uint64_t, int64_t, int>, uint32_t> executions;  // (launch, block, thread, site)
  int64_t mma = 0, ldmatrix = 0, ldmatrix_extra_wavefronts = 0;  // warp-wide instructions (lane 0 counts)
  // shared-memory loads: (launch, block, warp, site, n-th execution) -> (lane, address, bytes) of each lane
  std::map<std::tuple<uint64_t, uint64_t, int, int, uint32_t>, std::vector<std::tuple<int, uintptr_t, unsigned>>>
      shared;
  std::map<std::tuple<uint64_t, uint64_t, int64_t, int>, uint32_t> shared_executions;
};
AccessLog& access_log() {
  static AccessLog log;
  return log;
}
thread_local uint64_t launch_number = 0;  // of the current launch in the open log

std::vector<std::pair<void*, size_t>>& shared_arrays() {
  static std::vector<std::pair<void*, size_t>> arrays;
  return arrays;
}
thread_local cudaError_t pending_error = cudaSuccess;
thread_local std::string pending_message;

Fiber& self() { return active->fibers[active->current]; }

ThreadOrder order_from_environment() {
  const char* v = std::getenv("KVCACHE_CUDA_EMULATION_THREAD_ORDER");
  if (v == nullptr || std::strcmp(v, "") == 0 || std::strcmp(v, "forward") == 0) return ThreadOrder::kForward;
  if (std::strcmp(v, "reverse") == 0) return ThreadOrder::kReverse;
  throw std::invalid_argument(std::string("KVCACHE_CUDA_EMULATION_THREAD_ORDER = '") + v +
                              "'; must be 'forward' or 'reverse'");
}

std::atomic<int> chosen_order{-1};  // a ThreadOrder, or -1 until set or read from the environment

void fail(const std::string& what) {
  if (active->error.empty()) {
    std::ostringstream s;
    s << "CUDA emulation: block (" << active->bid.x << ", " << active->bid.y << ", " << active->bid.z << "): " << what;
    active->error = s.str();
  }
}

/// The fiber of this round's turn `turn` (the round runs them in index order, or reversed).
int fiber_of_turn(const Grid& L, int turn) {
  const int n = static_cast<int>(L.fibers.size());
  return L.reverse ? n - 1 - turn : turn;
}

/// Runs the next fiber of this round that is not waiting, from turn `turn` on: switches straight from
/// `from` to it (a round of n fibers takes n + 1 switches, not 2 n through the scheduler), or back to the
/// scheduler when the round is over or a fiber failed.
void run_from_turn(Grid& L, Context& from, int turn) {
  const int n = static_cast<int>(L.fibers.size());
  for (; turn < n && L.error.empty(); ++turn) {
    const int i = fiber_of_turn(L, turn);
    if (L.fibers[i].wait != Wait::kNone) continue;
    L.current = i;
    L.turn = turn;
    switch_context(from, L.fibers[i].ctx);
    return;
  }
  switch_context(from, L.scheduler);
}

/// On to the round's next fiber until the barrier this fiber waits at opens.
void yield_until_released() {
  Grid& L = *active;
  run_from_turn(L, L.fibers[L.current].ctx, L.turn + 1);
}

/// A fiber's first frame: the thread's body, then on to the others for good.
void entry() {
  (*active->body)();
  self().wait = Wait::kDone;
  yield_until_released();
  __builtin_trap();  // a finished fiber is never resumed
}

void start_fiber(Fiber& f, Context& scheduler) {
#if defined(__x86_64__)
  // The frame kvc_emu_switch pops: six registers, then the return address (entry); entry then starts
  // with rsp = 8 (mod 16), as after a call.
  auto* top = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~uintptr_t{15});
  void** sp = top - 8;
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[6] = reinterpret_cast<void*>(&entry);
  sp[7] = nullptr;
  f.ctx.sp = sp;
  (void)scheduler;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack;
  f.ctx.uc.uc_stack.ss_size = kStackBytes;
  f.ctx.uc.uc_link = &scheduler.uc;
  makecontext(&f.ctx.uc, entry, 0);
#endif
}

/// Opens the barriers whose threads have all arrived; false if none could open.
bool release(Grid& L) {
  bool any = false;
  const int n = static_cast<int>(L.fibers.size());
  int live = 0, at_block = 0;
  for (const Fiber& f : L.fibers) {
    live += f.wait != Wait::kDone;
    at_block += f.wait == Wait::kBlock;
  }
  if (at_block > 0 && at_block == live) {
    for (Fiber& f : L.fibers) {
      if (f.wait == Wait::kBlock) f.wait = Wait::kNone;
    }
    return true;
  }
  const int warps = (n + kWarp - 1) / kWarp;
  for (int w = 0; w < warps; ++w) {
    int waiting = 0, other = 0;
    unsigned mask = 0;
    for (int i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
      const Fiber& f = L.fibers[i];
      if (f.wait == Wait::kWarp) {
        ++waiting;
        mask = f.mask;
      } else if (f.wait != Wait::kDone) {
        ++other;
      }
    }
    if (waiting == 0 || other > 0) continue;
    const Fiber* collective = nullptr;  // a lane at an ldmatrix or mma, if any
    for (int i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
      if (L.fibers[i].wait == Wait::kWarp && L.fibers[i].aligned) collective = &L.fibers[i];
    }
    for (int i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
      const Fiber& f = L.fibers[i];
      if (f.wait == Wait::kDone && (mask >> f.lane & 1u)) {
        std::ostringstream s;
        if (collective != nullptr) {
          s << "warp " << w << ": " << collective->op << " needs all 32 lanes of the warp, and lane " << f.lane
            << " has exited";
        } else {
          s << "warp " << w << ": a shuffle or __syncwarp names lane " << f.lane << ", which has exited";
        }
        fail(s.str());
        return false;
      }
      // .aligned: every lane at the same instruction (a shuffle in one branch and an mma in the other
      // would otherwise pass as one barrier and exchange unrelated values).
      if (collective != nullptr && f.wait == Wait::kWarp && (!f.aligned || std::strcmp(f.op, collective->op) != 0)) {
        std::ostringstream s;
        s << "warp " << w << ": divergent lanes: lane " << collective->lane << " at " << collective->op << ", lane "
          << f.lane << " at " << f.op << " (a .sync.aligned instruction needs every lane of the warp at it)";
        fail(s.str());
        return false;
      }
    }
    for (int i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
      if (L.fibers[i].wait == Wait::kWarp) L.fibers[i].wait = Wait::kNone;
    }
    ++L.generation[w];
    any = true;
  }
  return any;
}

std::string describe_deadlock(const Grid& L) {
  std::ostringstream s;
  s << "no thread can go on (divergent barriers):";
  int shown = 0;
  for (const Fiber& f : L.fibers) {
    if (f.wait == Wait::kDone || shown >= 8) continue;
    s << " thread " << f.tid.x << " at " << (f.wait == Wait::kBlock ? "__syncthreads" : f.op) << ";";
    ++shown;
  }
  return s.str();
}

void run_block(Grid& L) {
  for (const auto& [array, bytes] : shared_arrays()) std::memset(array, 0xff, bytes);
  const int n = static_cast<int>(L.fibers.size());
  for (int i = 0; i < n; ++i) {
    Fiber& f = L.fibers[i];
    f.wait = Wait::kNone;
    start_fiber(f, L.scheduler);
  }
  std::fill(L.generation.begin(), L.generation.end(), 0);
  for (;;) {
    // a round: every fiber not waiting runs to its next barrier, in turn
    bool ran = false;
    for (const Fiber& f : L.fibers) ran |= f.wait == Wait::kNone;
    if (ran) run_from_turn(L, L.scheduler, 0);
    if (!L.error.empty()) return;
    bool live = false;
    for (const Fiber& f : L.fibers) live |= f.wait != Wait::kDone;
    if (!live) return;
    if (!release(L) && !ran) {
      if (L.error.empty()) fail(describe_deadlock(L));
      return;
    }
    if (!L.error.empty()) return;
  }
}

}  // namespace

cudaError_t run(dim3 grid, dim3 block, const std::function<void()>& body) {
  if (active != nullptr) throw std::logic_error("CUDA emulation: a kernel launched another kernel");
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    pending_error = cudaErrorInvalidConfiguration;
    std::ostringstream s;
    s << "CUDA emulation: invalid launch configuration grid (" << grid.x << ", " << grid.y << ", " << grid.z
      << ") block (" << block.x << ", " << block.y << ", " << block.z << ")";
    pending_message = s.str();
    return pending_error;
  }
  Grid L;
  L.reverse = thread_order() == ThreadOrder::kReverse;  // may throw: before anything is set up
  L.grid = grid;
  L.block = block;
  L.body = &body;
  L.fibers.resize(threads);
  const int warps = static_cast<int>((threads + kWarp - 1) / kWarp);
  L.slots[0].assign(threads * kSlotWords, 0);
  L.slots[1].assign(threads * kSlotWords, 0);
  L.generation.assign(warps, 0);
  char* stacks = fiber_stacks.for_launch(threads);
  for (uint64_t i = 0; i < threads; ++i) {
    Fiber& f = L.fibers[i];
    f.stack = stacks + i * kStackStride;
    f.tid = {static_cast<unsigned>(i % block.x), static_cast<unsigned>(i / block.x % block.y),
             static_cast<unsigned>(i / (uint64_t{block.x} * block.y))};
    f.warp = static_cast<int>(i / kWarp);
    f.lane = static_cast<int>(i % kWarp);
  }
  if (access_log().open) {
    std::lock_guard<std::mutex> lock(access_log().mutex);
    launch_number = ++access_log().launches;
  }
  active = &L;
  for (unsigned z = 0; z < grid.z && L.error.empty(); ++z) {
    for (unsigned y = 0; y < grid.y && L.error.empty(); ++y) {
      for (unsigned x = 0; x < grid.x && L.error.empty(); ++x) {
        L.bid = {x, y, z};
        run_block(L);
      }
    }
  }
  active = nullptr;
  if (!L.error.empty()) {
    pending_error = cudaErrorLaunchFailure;
    pending_message = L.error;
  }
  return L.error.empty() ? cudaSuccess : cudaErrorLaunchFailure;
}

void set_thread_order(ThreadOrder order) { chosen_order = static_cast<int>(order); }

ThreadOrder thread_order() {
  if (chosen_order < 0) chosen_order = static_cast<int>(order_from_environment());
  return static_cast<ThreadOrder>(chosen_order.load());
}

const uint3& thread_idx() { return self().tid; }
const uint3& block_idx() { return active->bid; }
const dim3& block_dim() { return active->block; }
const dim3& grid_dim() { return active->grid; }
int lane_id() { return self().lane; }

void sync_threads() {
  self().wait = Wait::kBlock;
  yield_until_released();
}

namespace {

void wait_at_warp_barrier(unsigned mask, const char* op, bool aligned) {
  if (mask != 0xffffffffu) fail("only full-warp masks (0xffffffff) are emulated");
  Fiber& f = self();
  f.wait = Wait::kWarp;
  f.mask = mask;
  f.op = op;
  f.aligned = aligned;
  yield_until_released();
}

/// Puts this lane's `words` in its slot, waits at a warp barrier, and returns the warp's slots (lane l's at
/// [l * kSlotWords]), readable until this lane's next warp barrier.
const uint64_t* exchange(const uint64_t* words, int count, unsigned mask, const char* op, bool aligned) {
  Fiber& f = self();
  const int g = active->generation[f.warp];
  uint64_t* warp_slots = active->slots[g % 2].data() + static_cast<size_t>(f.warp) * kWarp * kSlotWords;
  std::copy(words, words + count, warp_slots + f.lane * kSlotWords);
  wait_at_warp_barrier(mask, op, aligned);
  return warp_slots;
}

/// ldmatrix and mma are .sync.aligned: the whole warp executes them. A block whose size is not a
/// multiple of 32 has a partial last warp, which cannot.
void require_full_warp(const char* op) {
  const Fiber& f = self();
  const int threads = static_cast<int>(active->fibers.size());
  if ((f.warp + 1) * kWarp > threads) {
    std::ostringstream s;
    s << "warp " << f.warp << ": " << op << " needs all 32 lanes of the warp, and the block (" << threads
      << " threads) gives this warp " << threads - f.warp * kWarp;
    fail(s.str());
  }
}

/// A 16-bit element of an mma operand as f32 (exact: both formats are subsets of f32).
float element(MmaInput type, uint32_t reg, int half) {
  const auto bits = static_cast<uint16_t>(reg >> (16 * half));  // element 2j in the low half, 2j + 1 high
  return type == MmaInput::kBF16 ? bf16_to_float(bits) : fp16_to_float(bits);
}

/// Shared-memory bank conflicts of one warp-wide ldmatrix (issue #23, check 4): the hardware reads one 8 x 16-byte
/// matrix per wavefront when its 8 rows touch each of the 32 4-byte banks once; a bank holding n distinct words
/// of the matrix takes n wavefronts. Counts the wavefronts beyond one per matrix.
void log_ldmatrix(int matrices, const uint64_t* rows) {
  AccessLog& log = access_log();
  if (!log.open) return;
  int64_t extra = 0;
  for (int m = 0; m < matrices; ++m) {
    std::set<uint64_t> words[32];
    for (int r = 0; r < 8; ++r) {
      const uint64_t first = rows[(8 * m + r) * kSlotWords] / 4;
      for (uint64_t w = first; w < first + 4; ++w) words[w % 32].insert(w);
    }
    size_t wavefronts = 1;
    for (const auto& bank : words) wavefronts = std::max(wavefronts, bank.size());
    extra += static_cast<int64_t>(wavefronts) - 1;
  }
  std::lock_guard<std::mutex> lock(log.mutex);
  log.ldmatrix += 1;
  log.ldmatrix_extra_wavefronts += extra;
}

void log_mma() {
  AccessLog& log = access_log();
  if (!log.open) return;
  std::lock_guard<std::mutex> lock(log.mutex);
  log.mma += 1;
}

}  // namespace

void sync_warp(unsigned mask) { wait_at_warp_barrier(mask, "__syncwarp", false); }

uint64_t shuffle(unsigned mask, uint64_t value, int src_lane) {
  const Fiber& f = self();
  const uint64_t* warp_slots = exchange(&value, 1, mask, "a shuffle", false);
  if (src_lane < 0 || src_lane >= kWarp || f.warp * kWarp + src_lane >= static_cast<int>(active->fibers.size())) {
    return value;
  }
  return warp_slots[src_lane * kSlotWords];
}

// PTX ISA, "Warp-level matrix load instruction: ldmatrix" (.m8n8, .b16): lanes 8m .. 8m + 7 give the
// addresses of rows 0..7 of matrix m (lanes from 8 * matrices on are ignored; sm_80 and newer). Each
// address starts 16 bytes of a row and must be 16-byte aligned. Lane t receives, in register m, the
// elements (t / 4, 2 (t % 4)) and (t / 4, 2 (t % 4) + 1) of matrix m, the first in the low 16 bits;
// .trans loads the matrix column-major, so each address starts a column instead: the elements become
// (2 (t % 4), t / 4) and (2 (t % 4) + 1, t / 4).
void ldmatrix_b16(int matrices, bool trans, const void* row, uint32_t* out) {
  static const char* const kNames[2][3] = {
      {"ldmatrix.m8n8.x1.b16", "ldmatrix.m8n8.x2.b16", "ldmatrix.m8n8.x4.b16"},
      {"ldmatrix.m8n8.x1.trans.b16", "ldmatrix.m8n8.x2.trans.b16", "ldmatrix.m8n8.x4.trans.b16"}};
  if (matrices != 1 && matrices != 2 && matrices != 4) {  // core/warp_mma.cuh's static_assert prevents it
    fail("ldmatrix loads 1, 2 or 4 matrices");
    wait_at_warp_barrier(0xffffffffu, "ldmatrix", true);  // the launch ends here
    return;
  }
  const char* op = kNames[trans][matrices / 2];
  require_full_warp(op);
  const Fiber& f = self();
  if (f.lane < 8 * matrices) {
    const auto p = reinterpret_cast<uintptr_t>(row);
    bool shared = false;
    for (const auto& [array, bytes] : shared_arrays()) {
      const auto begin = reinterpret_cast<uintptr_t>(array);
      shared |= begin <= p && p + 16 <= begin + bytes;
    }
    std::ostringstream s;
    if (p % 16 != 0) {
      s << op << ": lane " << f.lane << "'s row address " << row << " is not 16-byte aligned";
      fail(s.str());
    } else if (!shared) {
      s << op << ": lane " << f.lane << "'s row (" << row << ", 16 bytes) is not inside a shared array (KVC_SHARED)";
      fail(s.str());
    }
  }
  const uint64_t mine = reinterpret_cast<uintptr_t>(row);
  const uint64_t* rows = exchange(&mine, 1, 0xffffffffu, op, true);
  if (f.lane == 0) log_ldmatrix(matrices, rows);
  const auto element_at = [&](int m, int r, int c) {  // element c of the 16 bytes lane 8m + r addressed
    uint16_t e;
    std::memcpy(&e, reinterpret_cast<const char*>(rows[(8 * m + r) * kSlotWords]) + 2 * c, 2);
    return uint32_t{e};
  };
  const int t = f.lane;
  uint32_t got[4];
  for (int m = 0; m < matrices; ++m) {
    if (trans) {
      got[m] = element_at(m, 2 * (t % 4), t / 4) | element_at(m, 2 * (t % 4) + 1, t / 4) << 16;
    } else {
      got[m] = element_at(m, t / 4, 2 * (t % 4)) | element_at(m, t / 4, 2 * (t % 4) + 1) << 16;
    }
  }
  // The whole warp reads before any lane goes on, as one instruction: a lane's store after the ldmatrix
  // must not reach another lane's read.
  wait_at_warp_barrier(0xffffffffu, op, true);
  std::copy(got, got + matrices, out);
}

// PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (.f16 / .bf16 multiplicands, .f32
// accumulators), with groupID = lane >> 2, threadID_in_group = lane % 4, element i of a fragment in
// register i / 2 (even i in the low 16 bits):
//   A (16 x 16), a0..a7: row = groupID for i < 2 or 4 <= i < 6, else groupID + 8;
//                        col = threadID_in_group * 2 + (i & 1), + 8 for i >= 4
//   B (16 x 8), b0..b3:  row = threadID_in_group * 2 + (i & 1), + 8 for i >= 2; col = groupID
//   C, D (16 x 8), c0..c3 (one f32 each): row = groupID for i < 2, else groupID + 8;
//                        col = threadID_in_group * 2 + (i & 1)
// The hardware's summation order and intermediate rounding are not specified. Here the products are exact
// (f16 x f16 and bf16 x bf16 fit in f32) and each D element is C, then + A[row][k] * B[k][col] for k = 0..15
// in that order, rounded to f32 after each addition: sums of exactly representable values (small integers)
// match a GPU exactly, anything else only within a tolerance.
void mma_m16n8k16(MmaInput type, const uint32_t* a, const uint32_t* b, const float* c, float* d) {
  const char* op = type == MmaInput::kBF16 ? "mma.m16n8k16.f32.bf16.bf16.f32" : "mma.m16n8k16.f32.f16.f16.f32";
  require_full_warp(op);
  const uint64_t mine[3] = {a[0] | uint64_t{a[1]} << 32, a[2] | uint64_t{a[3]} << 32, b[0] | uint64_t{b[1]} << 32};
  const uint64_t* slots = exchange(mine, 3, 0xffffffffu, op, true);
  if (self().lane == 0) log_mma();
  float A[16][16], B[16][8];
  for (int lane = 0; lane < kWarp; ++lane) {
    const int group = lane >> 2, in_group = lane % 4;
    const uint64_t* s = slots + lane * kSlotWords;
    const uint32_t ar[4] = {static_cast<uint32_t>(s[0]), static_cast<uint32_t>(s[0] >> 32),
                            static_cast<uint32_t>(s[1]), static_cast<uint32_t>(s[1] >> 32)};
    const uint32_t br[2] = {static_cast<uint32_t>(s[2]), static_cast<uint32_t>(s[2] >> 32)};
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (4 <= i && i < 6)) ? group : group + 8;
      const int col = in_group * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = element(type, ar[i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) {
      const int row = in_group * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][group] = element(type, br[i / 2], i % 2);
    }
  }
  const int group = self().lane >> 2, in_group = self().lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? group : group + 8, col = in_group * 2 + (i & 1);
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    d[i] = acc;
  }
}

namespace {

/// The warp-wide instruction the calling thread's execution of `site` belongs to: (launch, block, warp, site,
/// n-th execution of the site by this thread), counted in `executions`. Call with the log's mutex held.
std::tuple<uint64_t, uint64_t, int, int, uint32_t> warp_instruction(
    std::map<std::tuple<uint64_t, uint64_t, int64_t, int>, uint32_t>& executions, int site) {
  const Fiber& f = self();
  const uint64_t block = (uint64_t{active->bid.z} * active->grid.y + active->bid.y) * active->grid.x + active->bid.x;
  const int64_t thread = &f - active->fibers.data();
  const uint32_t n = executions[{launch_number, block, thread, site}]++;
  return {launch_number, block, f.warp, site, n};
}

}  // namespace

void log_global_load(int site, const void* address, unsigned bytes) {
  AccessLog& log = access_log();
  if (!log.open || active == nullptr) return;
  std::lock_guard<std::mutex> lock(log.mutex);
  log.loads[warp_instruction(log.executions, site)].emplace_back(reinterpret_cast<uintptr_t>(address), bytes);
}

void log_shared_load(int site, const void* address, unsigned bytes) {
  AccessLog& log = access_log();
  if (!log.open || active == nullptr) return;
  std::lock_guard<std::mutex> lock(log.mutex);
  log.shared[warp_instruction(log.shared_executions, site)].emplace_back(self().lane,
                                                                         reinterpret_cast<uintptr_t>(address), bytes);
}

void start_access_log() {
  AccessLog& log = access_log();
  std::lock_guard<std::mutex> lock(log.mutex);
  log.loads.clear();
  log.executions.clear();
  log.launches = 0;
  log.mma = log.ldmatrix = log.ldmatrix_extra_wavefronts = 0;
  log.shared.clear();
  log.shared_executions.clear();
  log.open = true;
}

AccessSummary stop_access_log() {
  AccessLog& log = access_log();
  std::lock_guard<std::mutex> lock(log.mutex);
  log.open = false;
  AccessSummary s;
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;  // [begin, end) of every load
  for (const auto& [key, lanes] : log.loads) {
    int64_t bytes = 0;
    std::set<uintptr_t> sectors;
    for (const auto& [address, n] : lanes) {
      bytes += n;
      for (uintptr_t sector = address / 32; sector <= (address + n - 1) / 32; ++sector) sectors.insert(sector);
      ranges.emplace_back(address, address + n);
    }
    s.warp_loads += 1;
    s.bytes += bytes;
    s.sector_bytes += 32 * static_cast<int64_t>(sectors.size());
    s.min_warp_bytes = s.warp_loads == 1 ? bytes : std::min(s.min_warp_bytes, bytes);
  }
  // bytes read again: sweep the ranges in address order, counting what lies below the furthest end so far
  std::sort(ranges.begin(), ranges.end());
  uintptr_t reach = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin < reach) s.bytes_read_again += static_cast<int64_t>(std::min(end, reach) - begin);
    reach = std::max(reach, end);
  }
  // shared loads: a warp's request is served in phases of 128 bytes (32 lanes of up to 4 bytes, 16 of 8, 8 of
  // 16); in a phase, a bank holding n distinct words takes n wavefronts (lanes reading one word share it)
  for (const auto& [key, lanes] : log.shared) {
    unsigned bytes = 0;
    for (const auto& [lane, address, n] : lanes) bytes = std::max(bytes, n);
    const int phase_lanes = bytes > 8 ? 8 : bytes > 4 ? 16 : 32;
    std::map<int, std::array<std::set<uintptr_t>, 32>> phases;
    for (const auto& [lane, address, n] : lanes) {
      auto& banks = phases[lane / phase_lanes];
      for (uintptr_t w = address / 4; w <= (address + n - 1) / 4; ++w) banks[w % 32].insert(w);
    }
    for (const auto& [phase, banks] : phases) {
      size_t wavefronts = 1;
      for (const auto& bank : banks) wavefronts = std::max(wavefronts, bank.size());
      s.shared_extra_wavefronts += static_cast<int64_t>(wavefronts) - 1;
    }
    s.shared_loads += 1;
  }
  log.shared.clear();
  log.shared_executions.clear();
  s.mma = log.mma;
  s.ldmatrix = log.ldmatrix;
  s.ldmatrix_extra_wavefronts = log.ldmatrix_extra_wavefronts;
  log.loads.clear();
  log.executions.clear();
  return s;
}

bool poison_per_block(void* array, size_t bytes) {
  shared_arrays().emplace_back(array, bytes);
  std::memset(array, 0xff, bytes);
  return true;
}

cudaError_t take_last_error() {
  const cudaError_t e = pending_error;
  pending_error = cudaSuccess;
  return e;
}

const std::string& last_error_message() { return pending_message; }

}  // namespace kvcache::emu
