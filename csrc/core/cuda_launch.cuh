// Kernel launches are written KVC_LAUNCH(grid, block, stream, kernel)(args...): the triple-chevron
// launch under nvcc, and csrc/cuda_emulation's CPU emulator when the kernels are built as C++ for
// the emulation tests (no GPU where this library is developed).
#pragma once

#if defined(__CUDACC__)
#define KVC_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<(grid), (block), 0, (stream)>>>
#else
#include "cuda_emulation/emulator.h"
#endif
