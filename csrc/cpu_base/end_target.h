// Closes the build that begin_avx2.h or begin_avx512.h opened: back to the compiler's default instruction set.
#pragma GCC pop_options
