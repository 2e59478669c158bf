// The int8 product tiles of int8_gemm.h with AVX-512 VNNI (vpdpbusd: 16 lanes of 4-term u8 x s8 dot products added to
// int32), the only code built for that instruction set; the binding checks the CPU at run time before calling it.
//
// As in int8_gemm_avx2.cpp, every outside header is included BEFORE the target pragma, so inline functions of the
// standard library keep their default-target definitions. The int32 sums are exact, so these tiles agree with
// gemm_tiles_portable bit for bit (the epilogue is the same store_tile).
#include "int8_gemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni,avx512bw,avx512vl")

namespace diversed {
namespace cpu {
namespace int8 {
namespace {

// Rows [row, row + R) of one tile: the tile's weights are read once per R rows; two accumulators per row over
// alternate groups keep two vpdpbusd chains in flight (its latency is several cycles).
template <int R>
void tile_rows(const GemmProblem& p, int64_t tile, int64_t row) {
  const int64_t stride = p.groups * kGroup;
  const int8_t* weights = p.packed + tile * p.groups * kTileBytes;
  const uint8_t* x = p.xq + row * stride;
  __m512i even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_si512();
  int64_t g = 0;
  for (; g + 2 <= p.groups; g += 2) {
    const __m512i w0 = _mm512_loadu_si512(weights + g * kTileBytes);
    const __m512i w1 = _mm512_loadu_si512(weights + (g + 1) * kTileBytes);
    for (int r = 0; r < R; ++r) {
      int32_t a0, a1;
      std::memcpy(&a0, x + r * stride + g * kGroup, sizeof(a0));
      std::memcpy(&a1, x + r * stride + (g + 1) * kGroup, sizeof(a1));
      even[r] = _mm512_dpbusd_epi32(even[r], _mm512_set1_epi32(a0), w0);
      odd[r] = _mm512_dpbusd_epi32(odd[r], _mm512_set1_epi32(a1), w1);
    }
  }
  if (g < p.groups) {
    const __m512i w0 = _mm512_loadu_si512(weights + g * kTileBytes);
    for (int r = 0; r < R; ++r) {
      int32_t a0;
      std::memcpy(&a0, x + r * stride + g * kGroup, sizeof(a0));
      even[r] = _mm512_dpbusd_epi32(even[r], _mm512_set1_epi32(a0), w0);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) int32_t sums[kTileRows];
    _mm512_store_si512(sums, _mm512_add_epi32(even[r], odd[r]));
    store_tile(p, row + r, tile, sums);
  }
}

}  // namespace

void gemm_tiles_vnni(const GemmProblem& p, int64_t tile_begin, int64_t tile_end) {
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    int64_t row = 0;
    for (; row + kMaxRowBlock <= p.M; row += kMaxRowBlock) tile_rows<kMaxRowBlock>(p, tile, row);
    switch (p.M - row) {
      case 3: tile_rows<3>(p, tile, row); break;
      case 2: tile_rows<2>(p, tile, row); break;
      case 1: tile_rows<1>(p, tile, row); break;
      default: break;
    }
  }
}

}  // namespace int8
}  // namespace cpu
}  // namespace diversed

#pragma GCC pop_options

#endif
