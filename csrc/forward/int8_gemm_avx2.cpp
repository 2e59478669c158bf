// The int8 product tiles of int8_gemm.h for CPUs with AVX2 but without AVX-512 VNNI, the only code built for AVX2
// here; the binding checks the CPU at run time before calling it.
//
// The weights stay in the VNNI layout (16 output features x 4 reduction terms per 64 bytes). Each 16-byte quarter
// (4 features x 4 terms) is sign-extended to 16-bit and multiplied by the row's 4 inputs, zero-extended and repeated,
// with vpmaddwd: every int32 lane then holds one feature's sum over 2 terms, and two neighbouring lanes make up its
// 4-term sum. Every product and partial sum is exact in int32, so these tiles agree with gemm_tiles_portable bit for
// bit (the epilogue is the same store_tile). vpmaddubsw would halve the instructions, but its pairs of u8 x s8 products
// saturate in int16 over uint8's upper half, which the inputs use; exactness is worth more than instructions in a
// pass that waits on memory.
//
// Every outside header is included BEFORE the target pragma, so inline functions of the standard library keep their
// default-target definitions.
#include "int8_gemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace diversed {
namespace cpu {
namespace int8 {
namespace {

constexpr int kQuarters = 4;           // 16-byte quarters of a 64-byte block: 4 output features each
constexpr int kFeaturesPerQuarter = 4;
constexpr int kAvx2RowBlock = 2;       // rows per pass over a tile: 8 accumulators, within the 16 vector registers

// The 4 inputs of group g of a row, zero-extended to 16 bits and repeated over the 4 features of a quarter.
inline __m256i group_inputs(const uint8_t* x, int64_t g) {
  int32_t four;
  std::memcpy(&four, x + g * kGroup, sizeof(four));
  return _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(_mm_cvtsi32_si128(four)));
}

// Rows [row, row + R) of one tile: each quarter of the tile's weights is sign-extended once per R rows.
template <int R>
void tile_rows(const GemmProblem& p, int64_t tile, int64_t row) {
  const int64_t stride = p.groups * kGroup;
  const int8_t* weights = p.packed + tile * p.groups * kTileBytes;
  const uint8_t* x = p.xq + row * stride;
  __m256i sums[R][kQuarters];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < kQuarters; ++q) sums[r][q] = _mm256_setzero_si256();
  }
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i inputs[R];
    for (int r = 0; r < R; ++r) inputs[r] = group_inputs(x + r * stride, g);
    const int8_t* block = weights + g * kTileBytes;
    for (int q = 0; q < kQuarters; ++q) {
      const __m256i quarter =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + q * 16)));
      for (int r = 0; r < R; ++r) sums[r][q] = _mm256_add_epi32(sums[r][q], _mm256_madd_epi16(quarter, inputs[r]));
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) int32_t pairs[kQuarters][8];
    for (int q = 0; q < kQuarters; ++q) _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[q]), sums[r][q]);
    int32_t feature_sums[kTileRows];
    for (int q = 0; q < kQuarters; ++q) {
      for (int f = 0; f < kFeaturesPerQuarter; ++f) {
        feature_sums[q * kFeaturesPerQuarter + f] = pairs[q][2 * f] + pairs[q][2 * f + 1];
      }
    }
    store_tile(p, row + r, tile, feature_sums);
  }
}

// The minimum and maximum of 8 lanes.
inline float reduce_min(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

}  // namespace

void gemm_tiles_avx2(const GemmProblem& p, int64_t tile_begin, int64_t tile_end) {
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    int64_t row = 0;
    for (; row + kAvx2RowBlock <= p.M; row += kAvx2RowBlock) tile_rows<kAvx2RowBlock>(p, tile, row);
    if (row < p.M) tile_rows<1>(p, tile, row);
  }
}

// find_min_max 8 lanes at a time: min/max_ps return their second operand when either is NaN, so NaNs are skipped as
// in the scalar version; a tensor of NaNs only gives (0, 0) as there.
void find_min_max_avx2(const float* x, int64_t count, float* min_out, float* max_out) {
  __m256 lo = _mm256_set1_ps(INFINITY), hi = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    lo = _mm256_min_ps(v, lo);
    hi = _mm256_max_ps(v, hi);
  }
  float low = reduce_min(lo), high = reduce_max(hi);
  for (; i < count; ++i) {
    if (std::isnan(x[i])) continue;
    low = std::min(low, x[i]);
    high = std::max(high, x[i]);
  }
  if (low > high) low = high = 0.f;  // nothing but NaNs
  *min_out = low;
  *max_out = high;
}

// quantize_rows 8 lanes at a time: the same fused multiply-add, clamped to [0, 255] before the conversion (max_ps
// turns NaN into 0) and rounded to nearest even by the conversion, which equals rounding first.
void quantize_rows_avx2(const float* x, int64_t M, int64_t K, int64_t stride, ActivationParams params, uint8_t* xq) {
  const float inverse = 1.0f / params.scale;
  const __m256 inverse_v = _mm256_set1_ps(inverse), zero_point_v = _mm256_set1_ps(float(params.zero_point));
  const __m256 low = _mm256_setzero_ps(), high = _mm256_set1_ps(255.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    uint8_t* out = xq + m * stride;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), inverse_v, zero_point_v);
      v = _mm256_min_ps(_mm256_max_ps(v, low), high);
      const __m256i words = _mm256_cvtps_epi32(v);
      // In range already, so the saturating packs only narrow: 8 int32 -> 8 uint16 -> 8 bytes, in order.
      const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packus_epi16(halves, halves));
    }
    quantize_rows(row + k, 1, K - k, K - k, params, out + k);
    std::memset(out + K, 0, static_cast<size_t>(stride - K));
  }
}


}  // namespace int8
}  // namespace cpu
}  // namespace diversed

#pragma GCC pop_options

#endif
