// Opens the AVX-512 build of a floor's kernels (16 floats per vector, mask registers for selects): what follows, up to
// end_target.h, is compiled for AVX-512F/BW/VL/DQ and FMA into the namespace diversed::cpu::avx512, as begin_avx2.h
// describes for AVX2. No include guard: a file opens one build.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define DIVERSED_CPU_CAPABILITY avx512
#define DIVERSED_CPU_VECTOR_FLOATS 16
