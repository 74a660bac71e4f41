// Kernel launches are written KVC_LAUNCH(grid, block, stream, kernel)(args...) and shared arrays
// KVC_SHARED(type, name, [dims]): plain CUDA under nvcc, and csrc/cuda_emulation's CPU emulator when
// the kernels are built as C++ for the emulation tests (no GPU where this library is developed).
#pragma once

#if defined(__CUDACC__)
#define KVC_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<(grid), (block), 0, (stream)>>>
#define KVC_SHARED(type, name, dims) __shared__ type name dims
#else
#include "cuda_emulation/emulator.h"
#endif
