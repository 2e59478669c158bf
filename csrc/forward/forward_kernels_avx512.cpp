// The lean forward's kernels compiled for AVX-512 (16 floats per vector), chosen at run time by forward_dispatch.h
// where the CPU has AVX-512F/BW/VL/DQ. As in forward_kernels_avx2.cpp, every outside header is included before the
// build opens (../cpu_base/begin_avx512.h).
#if defined(__x86_64__) && defined(__GNUC__)
#include "../cpu_base/kernel_base.h"
#include "forward_problems.h"
#include "../cpu_base/begin_avx512.h"
#include "forward_kernels.h"
#include "../cpu_base/end_target.h"
#endif
