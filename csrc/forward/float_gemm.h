// Float products over weights packed once (forward_problems.h): the lean Llama forward's skinny products, a few rows
// times a large weight. Vectorised across the kFloatTile output features of a tile, so no sum is split over lanes:
// each output is the in-order sum over k of fused multiply-adds (one rounding each: exactly rounded on every CPU,
// std::fma where the build has no FMA instruction), the same in every build and for every row count. The weights stream
// from memory once per call; a tile (16 x K floats) stays in the L1/L2 caches while groups of up to kRowBlock rows
// run over it. Compiled per instruction set through forward_kernels.h.
#pragma once

#include "../cpu_base/kernel_base.h"
#include "../cpu_base/lanes.h"
#include "forward_problems.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

static_assert(kLanes == kFloatTile, "a packed tile is one FloatLanes wide");

namespace float_gemm_detail {

// a * b + c with one rounding, lane by lane. Not verify_math.h's generic fused_multiply_add: gcc does not turn that
// one's lane loop into vector FMAs inside these tile loops (the products ran 3-8x slower with it).
inline FloatVector fused_multiply_add(FloatVector a, FloatVector b, FloatVector c) {
#if DIVERSED_CPU_VECTOR_FLOATS == 16
  return reinterpret_cast<FloatVector>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                       reinterpret_cast<__m512>(c)));
#elif DIVERSED_CPU_VECTOR_FLOATS == 8
  return reinterpret_cast<FloatVector>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                       reinterpret_cast<__m256>(c)));
#else
  FloatVector result;
  for (int l = 0; l < kVectorFloats; ++l) result[l] = std::fma(a[l], b[l], c[l]);
  return result;
#endif
}

// Rows accumulated at once: 8 accumulators, the tile's vector and a broadcast fit in registers.
constexpr int kRowBlock = 8;

template <int R>
inline void tile_rows(const FloatGemmProblem& p, int64_t tile, int64_t row) {
  const float* weights = p.packed + tile * p.K * kFloatTile;
  FloatLanes sums[R];
  for (int r = 0; r < R; ++r) sums[r] = splat_lanes(0.0f);
  for (int64_t k = 0; k < p.K; ++k) {
    FloatLanes w;
    for (int i = 0; i < kParts; ++i)
      __builtin_memcpy(&w.part[i], weights + k * kFloatTile + i * kVectorFloats, sizeof w.part[i]);
    for (int r = 0; r < R; ++r) {
      const FloatVector x = broadcast(p.x[(row + r) * p.K + k]);
      for (int i = 0; i < kParts; ++i) sums[r].part[i] = fused_multiply_add(w.part[i], x, sums[r].part[i]);
    }
  }
  const int64_t first = tile * kFloatTile, count = std::min<int64_t>(kFloatTile, p.N - first);
  for (int r = 0; r < R; ++r) {
    float lane[kFloatTile];
    __builtin_memcpy(lane, &sums[r], sizeof lane);
    float* out = p.out + (row + r) * p.N + first;
    for (int64_t j = 0; j < count; ++j) out[j] = p.bias != nullptr ? lane[j] + p.bias[first + j] : lane[j];
  }
}

}  // namespace float_gemm_detail

void float_gemm(const FloatGemmProblem& p, const ParallelFor& parallel_for) {
  using namespace float_gemm_detail;
  const int64_t grain = grain_for(p.K * kFloatTile * std::max<int64_t>(1, p.M / 4));
  parallel_for(0, float_tile_count(p.N), grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      int64_t row = 0;
      for (; row + kRowBlock <= p.M; row += kRowBlock) tile_rows<kRowBlock>(p, tile, row);
      switch (p.M - row) {
        case 7: tile_rows<7>(p, tile, row); break;
        case 6: tile_rows<6>(p, tile, row); break;
        case 5: tile_rows<5>(p, tile, row); break;
        case 4: tile_rows<4>(p, tile, row); break;
        case 3: tile_rows<3>(p, tile, row); break;
        case 2: tile_rows<2>(p, tile, row); break;
        case 1: tile_rows<1>(p, tile, row); break;
        default: break;
      }
    }
  });
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
