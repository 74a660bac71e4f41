// mla_kernels.cu built as C++ against the emulator (emulator.h stands in for the CUDA headers).
#include "mla/mla_kernels.cu"
