// The lean forward's kernels compiled for AVX2 (8 floats per vector), chosen at run time by forward_dispatch.h. Every
// outside header is included before the build opens (../cpu_base/begin_avx2.h); the FMA instructions serve
// float_gemm.h's products and exp_nonpositive.
#if defined(__x86_64__) && defined(__GNUC__)
#include "../cpu_base/kernel_base.h"
#include "forward_problems.h"
#include "../cpu_base/begin_avx2.h"
#include "forward_kernels.h"
#include "../cpu_base/end_target.h"
#endif
