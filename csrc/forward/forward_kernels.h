// The lean forward's per-instruction-set kernels (float_gemm.h: the float products; llama_math.h: the float math of a
// Llama layer), compiled once per build (forward_kernels_baseline.cpp, forward_kernels_avx2.cpp,
// forward_kernels_avx512.cpp) inside the namespace diversed::cpu::DIVERSED_CPU_CAPABILITY; forward_dispatch.h declares
// them. Float32 only, so there is nothing to instantiate: the headers define the entry points directly.
#ifndef DIVERSED_CPU_CAPABILITY
#error "define DIVERSED_CPU_CAPABILITY and DIVERSED_CPU_VECTOR_FLOATS before including forward_kernels.h"
#endif

#include "float_gemm.h"
#include "llama_math.h"
