// Opens the AVX2 build of a floor's kernels (8 floats per vector): what follows, up to end_target.h, is compiled for
// AVX2 and FMA into the namespace diversed::cpu::avx2. A kernels_*.cpp file includes its floor's prelude first, then
// this header, its kernel headers, and end_target.h; kernel_base.h says why the order matters. FMA instructions serve
// the explicit fused multiply-adds only; -ffp-contract=off keeps the compiler from fusing anything else, so the
// arithmetic is the baseline's, bit for bit. No include guard: a file opens one build.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define DIVERSED_CPU_CAPABILITY avx2
#define DIVERSED_CPU_VECTOR_FLOATS 8
