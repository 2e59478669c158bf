// The lean forward's kernels for the compiler's default instruction set (runs on every x86-64 or other CPU).
#define DIVERSED_CPU_CAPABILITY baseline
#define DIVERSED_CPU_VECTOR_FLOATS 4  // SSE2 on x86-64, NEON elsewhere
#include "forward_kernels.h"
