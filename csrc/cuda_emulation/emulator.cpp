// The fiber scheduler behind emulator.h.
#include "cuda_emulation/emulator.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
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
constexpr int kWarp = 32;

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
  std::unique_ptr<char[]> stack;
  uint3 tid;
  int warp = 0, lane = 0;
  Wait wait = Wait::kNone;
  unsigned mask = 0;  // of the warp barrier it waits at
};

struct Grid {
  dim3 grid, block;
  uint3 bid;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  Context scheduler;
  int current = -1;
  std::string error;
  // Warp shuffles: double-buffered slots (a lane reads buffer g % 2 after the barrier of shuffle g;
  // the next shuffle writes the other buffer, so no lane can overwrite a value still to be read).
  std::vector<uint64_t> slots[2];
  std::vector<int> generation;   // per warp: shuffles completed
  bool reverse = false;          // ThreadOrder::kReverse
};

thread_local Grid* active = nullptr;

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

/// Back to the scheduler until the barrier this fiber waits at opens.
void yield_until_released() { switch_context(self().ctx, active->scheduler); }

/// A fiber's first frame: the thread's body, then back to the scheduler for good.
void entry() {
  (*active->body)();
  Fiber& f = self();
  f.wait = Wait::kDone;
  switch_context(f.ctx, active->scheduler);
  __builtin_trap();  // a finished fiber is never resumed
}

void start_fiber(Fiber& f, Context& scheduler) {
#if defined(__x86_64__)
  // The frame kvc_emu_switch pops: six registers, then the return address (entry); entry then starts
  // with rsp = 8 (mod 16), as after a call.
  auto* top = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(f.stack.get()) + kStackBytes) & ~uintptr_t{15});
  void** sp = top - 8;
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[6] = reinterpret_cast<void*>(&entry);
  sp[7] = nullptr;
  f.ctx.sp = sp;
  (void)scheduler;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack.get();
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
    for (int i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
      const Fiber& f = L.fibers[i];
      if (f.wait == Wait::kDone && (mask >> f.lane & 1u)) {
        std::ostringstream s;
        s << "warp " << w << ": a shuffle or __syncwarp names lane " << f.lane << ", which has exited";
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
    s << " thread " << f.tid.x << (f.wait == Wait::kBlock ? " at __syncthreads;" : " at a warp barrier;");
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
    bool ran = false;
    for (int k = 0; k < n && L.error.empty(); ++k) {
      const int i = L.reverse ? n - 1 - k : k;
      if (L.fibers[i].wait != Wait::kNone) continue;
      L.current = i;
      switch_context(L.scheduler, L.fibers[i].ctx);
      ran = true;
    }
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
  L.slots[0].assign(threads, 0);
  L.slots[1].assign(threads, 0);
  L.generation.assign(warps, 0);
  for (uint64_t i = 0; i < threads; ++i) {
    Fiber& f = L.fibers[i];
    f.stack.reset(new char[kStackBytes]);
    f.tid = {static_cast<unsigned>(i % block.x), static_cast<unsigned>(i / block.x % block.y),
             static_cast<unsigned>(i / (uint64_t{block.x} * block.y))};
    f.warp = static_cast<int>(i / kWarp);
    f.lane = static_cast<int>(i % kWarp);
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

void sync_warp(unsigned mask) {
  if (mask != 0xffffffffu) fail("only full-warp masks (0xffffffff) are emulated");
  Fiber& f = self();
  f.wait = Wait::kWarp;
  f.mask = mask;
  yield_until_released();
}

uint64_t shuffle(unsigned mask, uint64_t value, int src_lane) {
  Fiber& f = self();
  const int g = active->generation[f.warp];
  const int base = f.warp * kWarp;
  active->slots[g % 2][base + f.lane] = value;
  sync_warp(mask);
  if (src_lane < 0 || src_lane >= kWarp || base + src_lane >= static_cast<int>(active->fibers.size())) return value;
  return active->slots[g % 2][base + src_lane];
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
