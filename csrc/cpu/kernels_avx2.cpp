// The CPU kernels compiled for AVX2 (8 floats per vector instead of 4), chosen at run time by cpu_dispatch.h.
//
// Every outside header (kernel_prelude.h gathers them) is included BEFORE the target pragma: inline functions of the
// standard library must keep their default-target definitions, or the linker could hand AVX2 code to a CPU without
// it. Only the kernels, which live in their own namespace, are defined after it. FMA instructions are enabled for the
// explicit fused multiply-adds (exp_nonpositive in verify_math.h, the float products of float_gemm.h);
// -ffp-contract=off keeps the compiler from fusing anything else, so the arithmetic is the baseline's, bit for bit.
#if defined(__x86_64__) && defined(__GNUC__)
// exp_nonpositive (verify_math.h, included before the pragma) is instantiated for this build's vectors from the plain
// functions of llama_math.h, where gcc warns that an out-of-line copy returning such a vector would have another ABI.
// It is always inlined into the kernels (no copy exists), so no call crosses that ABI.
#pragma GCC diagnostic ignored "-Wpsabi"
#include "kernel_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define DIVERSED_CPU_CAPABILITY avx2
#define DIVERSED_CPU_VECTOR_FLOATS 8
#include "cpu_kernels.h"
#pragma GCC pop_options
#endif
