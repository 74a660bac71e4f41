// Emulation stand-in for the CUDA runtime header (csrc/cuda_emulation/emulator.h).
#pragma once
#include "cuda_emulation/emulator.h"
