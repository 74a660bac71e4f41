// cache_kernels.cu built as C++ against the emulator (emulator.h stands in for the CUDA headers).
#include "cache/cache_kernels.cu"
