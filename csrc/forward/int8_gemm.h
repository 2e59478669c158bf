// Torch-free int8 x int8 products for the int8 draft: the arithmetic of torch's dynamically quantised linear layer
// (quantize_dynamic, fbgemm) over uint8's whole range, with the weights packed once, multiplied with AVX-512 VNNI,
// with AVX2 where the CPU lacks VNNI, or with portable loops.
//
// What fbgemm computes with reduce_range off, and so what these kernels compute, for an int8 weight W [N, K]
// (symmetric, zero point 0, one scale per output feature, so that several layers' weights can share one call) and
// float input X [M, K]:
//   1. one (scale, zero point) for the whole of X, from its min and max over every row, over uint8's [0, 255].
//      torch's layer halves that range (reduce_range) because fbgemm's AVX2 path sums pairs of u8 x s8 products in
//      int16, which would saturate; every build here sums in int32 exactly (vpdpbusd, vpmaddwd on widened inputs,
//      portable loops), so the whole range costs nothing and halves the input's rounding step. Here X may also
//      be split into groups of consecutive rows, each quantised on its own as if it were the layer's whole input:
//      a batch of sequences stacked into one call then gets, row for row, what each sequence alone would get;
//   2. xq = clamp(nearbyint(x * (1 / scale) + zero_point), 0, 255), the multiply-add fused as fbgemm's AVX2 quantiser
//      does it;
//   3. acc[m, n] = sum_k xq[m, k] * W[n, k] in int32, minus zero_point * sum_k W[n, k] (exact: each term is at most
//      255 * 128 in size, so no sum of up to kMaxInFeatures of them can overflow; the bindings refuse longer rows);
//   4. out[m, n] = fma(float(acc), x_scale * w_scale[n], bias[n]) in float, rounded as fbgemm's AVX2 epilogue rounds.
// The int32 sums are therefore identical to the layer's, and on this CPU so are the outputs, bit for bit (checked
// against the layer on random problems; fbgemm's other code paths may round step 4 differently).
//
// Packed layout: output features in tiles of 16, the reduction in groups of 4: packed[tile][k4][16][4], zero padded
// past N and K. One 64-byte load then feeds one vpdpbusd (16 lanes, each a 4-term u8 x s8 dot product).
#pragma once

#include <cstdlib>
#include <cstring>

#include "../cpu_base/kernel_base.h"

namespace diversed {
namespace cpu {
namespace int8 {

constexpr int64_t kTileRows = 16;  // output features per tile: one 512-bit register of int32 sums
constexpr int64_t kGroup = 4;      // reduction terms per vpdpbusd lane
constexpr int64_t kTileBytes = kTileRows * kGroup;
constexpr int kMaxRowBlock = 4;    // input rows multiplied per pass over a tile's weights

// The longest reduction whose int32 sums cannot overflow: every term xq * w lies within 255 * 128 of zero.
constexpr int64_t kMaxInFeatures = INT32_MAX / (255 * 128);

inline int64_t tile_count(int64_t out_features) { return (out_features + kTileRows - 1) / kTileRows; }
inline int64_t group_count(int64_t in_features) { return (in_features + kGroup - 1) / kGroup; }
inline int64_t packed_size(int64_t out_features, int64_t in_features) {
  return tile_count(out_features) * group_count(in_features) * kTileBytes;
}

// weight [N, K] row-major -> packed (packed_size(N, K) bytes) and col_sums[n] = sum_k weight[n, k].
inline void pack_weight(const int8_t* weight, int64_t N, int64_t K, int8_t* packed, int32_t* col_sums) {
  const int64_t groups = group_count(K);
  std::memset(packed, 0, static_cast<size_t>(packed_size(N, K)));
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* row = weight + n * K;
    int8_t* tile = packed + (n / kTileRows) * groups * kTileBytes + (n % kTileRows) * kGroup;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      tile[(k / kGroup) * kTileBytes + k % kGroup] = row[k];
      sum += row[k];
    }
    col_sums[n] = sum;
  }
}

struct ActivationParams {
  float scale;
  int32_t zero_point;
};

// torch's ChooseQuantizationParams (ATen/native/quantized/cpu/QuantUtils.h) for qmin 0, qmax 255, no reduce_range,
// no preserve_sparsity, no power-of-two scale: the parameters fbgemm's dynamic linear layer picks for its input when
// called with reduce_range=False.
inline ActivationParams choose_activation_params(float min, float max) {
  constexpr int32_t qmin = 0, qmax = 255;
  constexpr float kSmallScale = 6.1e-5f;
  min = std::min(min, 0.f);
  max = std::max(max, 0.f);
  double scale = (static_cast<double>(max) - min) / (qmax - qmin);
  if (static_cast<float>(scale) == 0.0f || std::isinf(1.0f / static_cast<float>(scale))) scale = 0.1;
  if (scale < kSmallScale) {
    const float original = static_cast<float>(scale);
    scale = kSmallScale;
    if (min == 0.0f) {
      max = kSmallScale * (qmax - qmin);
    } else if (max == 0.0f) {
      min = -kSmallScale * (qmax - qmin);
    } else {
      const float amplifier = kSmallScale / original;
      min *= amplifier;
      max *= amplifier;
    }
  }
  const double from_min = qmin - min / scale, from_max = qmax - max / scale;
  const double error_min = std::abs(qmin) - std::abs(min / scale);
  const double error_max = std::abs(qmax) - std::abs(max / scale);
  const double initial = error_min < error_max ? from_min : from_max;
  int32_t zero_point;
  if (std::isnan(initial) || initial < qmin) {  // NaN from an infinite input: any value is garbage, but a defined one
    zero_point = qmin;
  } else if (initial > qmax) {
    zero_point = qmax;
  } else {
    zero_point = static_cast<int32_t>(std::nearbyint(initial));
  }
  return {static_cast<float>(scale), zero_point};
}

// Min and max over `count` floats; NaNs are skipped (a NaN input gives NaN outputs through the float epilogue's
// neighbours anyway, and here it must not reach a float-to-int conversion).
inline void find_min_max(const float* x, int64_t count, float* min_out, float* max_out) {
  float lo = 0.f, hi = 0.f;
  bool first = true;
  for (int64_t i = 0; i < count; ++i) {
    const float v = x[i];
    if (std::isnan(v)) continue;
    if (first) {
      lo = hi = v;
      first = false;
    } else {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  *min_out = lo;
  *max_out = hi;
}

// Row m of x [M, K] -> xq [M, stride] (stride >= K; the padding is set to 0 and meets zero weights).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t stride, ActivationParams params,
                          uint8_t* xq) {
  const float inverse = 1.0f / params.scale;
  const float zero_point = static_cast<float>(params.zero_point);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    uint8_t* out = xq + m * stride;
    for (int64_t k = 0; k < K; ++k) {
      const float value = std::nearbyint(std::fma(row[k], inverse, zero_point));
      // Written so that NaN lands on 0: a float-to-int conversion of NaN or out-of-range values is undefined.
      out[k] = value > 0.f ? static_cast<uint8_t>(std::min(value, 255.f)) : 0;
    }
    std::memset(out + K, 0, static_cast<size_t>(stride - K));
  }
}

// One product: out [M, N] = dequantised (xq [M, groups * 4] . W^T) + bias.
struct GemmProblem {
  const uint8_t* xq;
  const int8_t* packed;
  const int32_t* col_sums;  // [N]
  const float* w_scale;     // [N]
  const float* bias;        // [N] or nullptr
  float* out;               // [M, N]
  int64_t M, N, groups;
  const ActivationParams* x;  // [M]: each row's input quantisation
};

// The float epilogue for one row and one tile, from its 16 int32 sums (step 4 above).
inline void store_tile(const GemmProblem& p, int64_t row, int64_t tile, const int32_t* sums) {
  const int64_t first = tile * kTileRows, count = std::min(kTileRows, p.N - first);
  float* out = p.out + row * p.N + first;
  for (int64_t j = 0; j < count; ++j) {
    const int32_t corrected = sums[j] - p.x[row].zero_point * p.col_sums[first + j];
    const float multiplier = p.x[row].scale * p.w_scale[first + j];
    const float value = static_cast<float>(corrected);
    out[j] = p.bias != nullptr ? std::fma(value, multiplier, p.bias[first + j]) : value * multiplier;
  }
}

// Portable tiles [tile_begin, tile_end) for every row: the reference the vector builds match bit for bit.
inline void gemm_tiles_portable(const GemmProblem& p, int64_t tile_begin, int64_t tile_end) {
  const int64_t stride = p.groups * kGroup;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int8_t* weights = p.packed + tile * p.groups * kTileBytes;
    for (int64_t row = 0; row < p.M; ++row) {
      const uint8_t* x = p.xq + row * stride;
      int32_t sums[kTileRows] = {0};
      for (int64_t g = 0; g < p.groups; ++g) {
        const int8_t* block = weights + g * kTileBytes;
        for (int64_t j = 0; j < kTileRows; ++j) {
          for (int64_t t = 0; t < kGroup; ++t) sums[j] += int32_t(x[g * kGroup + t]) * int32_t(block[j * kGroup + t]);
        }
      }
      store_tile(p, row, tile, sums);
    }
  }
}

// Which tiles and quantisation loops run: the same bytes and int32 sums whichever it is (the tests compare them).
enum class Isa { kPortable, kAvx2, kVnni };

// The AVX-512 VNNI tiles (int8_gemm_vnni.cpp) and the AVX2 ones (int8_gemm_avx2.cpp), the only code compiled for
// those instruction sets, built on x86-64 only. Call them only for the Isa the binding picked from what the CPU runs;
// elsewhere every Isa runs the portable loops.
#if defined(__x86_64__) && defined(__GNUC__)
#define DIVERSED_INT8_X86_BUILDS 1
void gemm_tiles_vnni(const GemmProblem& p, int64_t tile_begin, int64_t tile_end);
void gemm_tiles_avx2(const GemmProblem& p, int64_t tile_begin, int64_t tile_end);
void find_min_max_avx2(const float* x, int64_t count, float* min_out, float* max_out);
void quantize_rows_avx2(const float* x, int64_t M, int64_t K, int64_t stride, ActivationParams params, uint8_t* xq);
#endif

inline void find_min_max(const float* x, int64_t count, Isa isa, float* min_out, float* max_out) {
  switch (isa) {
#ifdef DIVERSED_INT8_X86_BUILDS
    case Isa::kVnni:  // quantising is a small part of a product: the AVX2 loops serve both
    case Isa::kAvx2: find_min_max_avx2(x, count, min_out, max_out); break;
#endif
    default: find_min_max(x, count, min_out, max_out); break;
  }
}

inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t stride, ActivationParams params, Isa isa,
                          uint8_t* xq) {
  switch (isa) {
#ifdef DIVERSED_INT8_X86_BUILDS
    case Isa::kVnni:
    case Isa::kAvx2: quantize_rows_avx2(x, M, K, stride, params, xq); break;
#endif
    default: quantize_rows(x, M, K, stride, params, xq); break;
  }
}

// Quantises x [M, K] into xq [M, groups * 4] as fbgemm does (steps 1 and 2 above), one (scale, zero point) per
// group of consecutive rows (group_rows[g] rows each, summing to M), written for each row into row_params [M]. The
// vector builds' loops give the same bytes as the scalar ones.
inline void quantize_input(const float* x, int64_t M, int64_t K, int64_t stride, const int64_t* group_rows,
                           int64_t group_count, Isa isa, uint8_t* xq, ActivationParams* row_params) {
  int64_t row = 0;
  for (int64_t g = 0; g < group_count && row < M; ++g) {
    const int64_t rows = std::min(group_rows[g], M - row);
    const float* group = x + row * K;
    float min = 0.f, max = 0.f;
    find_min_max(group, rows * K, isa, &min, &max);
    const ActivationParams params = choose_activation_params(min, max);
    quantize_rows(group, rows, K, stride, params, isa, xq + row * stride);
    for (int64_t r = 0; r < rows; ++r) row_params[row + r] = params;
    row += rows;
  }
}

// The whole product, its tiles spread over threads; a task of fewer than kMinTaskElements weight bytes x rows is not
// worth a fork.
inline void gemm(const GemmProblem& p, Isa isa, const ParallelFor& parallel_for) {
  const int64_t grain = grain_for(p.groups * kTileBytes * p.M);
  parallel_for(0, tile_count(p.N), grain, [&](int64_t begin, int64_t end) {
    switch (isa) {
#ifdef DIVERSED_INT8_X86_BUILDS
      case Isa::kVnni: gemm_tiles_vnni(p, begin, end); break;
      case Isa::kAvx2: gemm_tiles_avx2(p, begin, end); break;
#endif
      default: gemm_tiles_portable(p, begin, end); break;
    }
  });
}

}  // namespace int8
}  // namespace cpu
}  // namespace diversed
