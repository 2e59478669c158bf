// The CPU kernels for the compiler's default instruction set (runs on every x86-64 or other CPU).
#define DIVERSED_CPU_CAPABILITY baseline
#include "cpu_kernels.h"
