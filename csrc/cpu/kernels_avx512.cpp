// The verify and stats kernels compiled for AVX-512 (mask registers for the selects of the sanitising and residual
// loops), chosen at run time by cpu_dispatch.h where the CPU has AVX-512F/BW/VL/DQ. As in kernels_avx2.cpp, every
// outside header is included before the build opens (../cpu_base/begin_avx512.h).
#if defined(__x86_64__) && defined(__GNUC__)
#include "kernel_prelude.h"
#include "../cpu_base/begin_avx512.h"
#include "cpu_kernels.h"
#include "../cpu_base/end_target.h"
#endif
