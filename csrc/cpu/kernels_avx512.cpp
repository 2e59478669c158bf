// The CPU kernels compiled for AVX-512 (16 floats per vector, mask registers for the selects of the sanitising and
// residual loops), chosen at run time by cpu_dispatch.h where the CPU has AVX-512F/BW/VL/DQ.
//
// As in kernels_avx2.cpp: every outside header is included BEFORE the target pragma, so standard-library inline
// functions keep their default-target definitions. FMA instructions serve the explicit fused multiply-adds only
// (exp_nonpositive, float_gemm.h); -ffp-contract=off keeps the compiler from fusing anything else, so the arithmetic
// is the baseline's, bit for bit.
#if defined(__x86_64__) && defined(__GNUC__)
// exp_nonpositive (verify_math.h, included before the pragma) is instantiated for this build's vectors from the plain
// functions of llama_math.h, where gcc warns that an out-of-line copy returning such a vector would have another ABI.
// It is always inlined into the kernels (no copy exists), so no call crosses that ABI.
#pragma GCC diagnostic ignored "-Wpsabi"
#include "kernel_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define DIVERSED_CPU_CAPABILITY avx512
#define DIVERSED_CPU_VECTOR_FLOATS 16
#include "cpu_kernels.h"
#pragma GCC pop_options
#endif
