// The verify and stats kernels compiled for AVX2 (8 floats per vector instead of 4), chosen at run time by
// cpu_dispatch.h. Every outside header (kernel_prelude.h gathers them) is included before the build opens; only the
// kernels, which live in their own namespace, are defined inside it (../cpu_base/begin_avx2.h).
#if defined(__x86_64__) && defined(__GNUC__)
#include "kernel_prelude.h"
#include "../cpu_base/begin_avx2.h"
#include "cpu_kernels.h"
#include "../cpu_base/end_target.h"
#endif
