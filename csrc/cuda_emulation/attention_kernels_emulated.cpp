// attention_kernels.cu built as C++ against the emulator (emulator.h stands in for the CUDA headers).
#include "attention/attention_kernels.cu"
