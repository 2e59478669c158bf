// Reading distribution rows in the CUDA kernels: element decoding, 16-byte vector loads over tiles, and the row
// policies that turn loaded elements into probability mass. Free of torch, like every header of the CUDA kernels.
//
// A thread block works on a span of a row (the whole row, or one chunk of it in the split kernels), reading it in
// tiles of kThreads x kItemsPerThread elements, each thread owning kItemsPerThread consecutive elements, loaded with
// 16-byte vector loads where the row allows it (rows start at row * V elements, so a row is aligned only when V is a
// multiple of the vector width: misaligned rows are read scalar, see TileLayout). Nothing is read outside the span,
// which lies inside [0, V) of the row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/verify_math.h"

namespace diversed {
namespace gpu {

constexpr int kThreads = 256;        // one block per row
constexpr int kItemsPerThread = 16;  // consecutive elements per thread and tile: 4 x float4 or 2 x 8 16-bit values
constexpr int64_t kTileElements = static_cast<int64_t>(kThreads) * kItemsPerThread;

// ------------------------------------------------------------------------------------------------ element loads
// Elements are decoded from their bits to float32 (exact for the three API types; bfloat16 is the top half of a
// float32, as on the CPU).
template <typename T>
struct Element;
template <>
struct Element<float> {
  using Bits = uint32_t;
  static __device__ __forceinline__ float decode(uint32_t bits) { return __uint_as_float(bits); }
};
template <>
struct Element<double> {  // reachable through the dispatch macros; read as float32 like the CPU kernels
  using Bits = unsigned long long;
  static __device__ __forceinline__ float decode(unsigned long long bits) {
    return static_cast<float>(__longlong_as_double(static_cast<long long>(bits)));
  }
};
template <>
struct Element<__nv_bfloat16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float decode(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
};
template <>
struct Element<__half> {
  using Bits = uint16_t;
  static __device__ __forceinline__ float decode(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
};

template <typename T>
constexpr int kVectorWidth = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load

__device__ __forceinline__ bool in_row(int64_t v, int64_t vocab) { return v >= 0 && v < vocab; }

// The elements [begin, end) of a row that one block reads, with 0 <= begin <= end <= V.
struct Span {
  int64_t begin, end;
  __device__ __forceinline__ bool contains(int64_t v) const { return v >= begin && v < end; }
};

template <typename T>
__device__ __forceinline__ float load_element(const T* row, int64_t v) {
  using Bits = typename Element<T>::Bits;
  return Element<T>::decode(__ldg(reinterpret_cast<const Bits*>(row) + v));
}

// How the tiles of a row (or of two rows read in lockstep) are loaded. Tiles always start at the span's start, so the
// elements a thread owns, and with them the order in which sums and maxima are taken, are the same whatever the
// row's alignment and element type: a row read in place, a padded copy of it and its float32 widening give the same
// bits. A row whose start is 16-byte aligned is read with 16-byte loads, any other row scalar (the second row, of its
// own element type, is decided alone). A span's start is a multiple of every vector width and 16 elements
// (vocab_split.h), and a thread's elements begin at multiples of kItemsPerThread, so one test at the row's start
// decides for every vector.
struct TileLayout {
  bool vectorised;         // the first row: 16-byte loads wherever a whole vector lies inside the span
  bool second_vectorised;  // the second row: the same
};

__device__ __forceinline__ bool aligned16(const void* address) {
  return reinterpret_cast<uintptr_t>(address) % 16 == 0;
}

template <typename T, typename Second = T>
__device__ __forceinline__ TileLayout tile_layout(const T* first, const Second* second) {
  return TileLayout{aligned16(first), second != nullptr && aligned16(second)};
}

// Elements [first, first + kItemsPerThread) of a row as float32; entries outside the span read as 0 and are never
// loaded (callers skip them with span.contains).
template <typename T>
__device__ __forceinline__ void load_items(const T* row, int64_t first, Span span, bool vectorised,
                                           float (&x)[kItemsPerThread]) {
  using Bits = typename Element<T>::Bits;
  constexpr int kWidth = kVectorWidth<T>;
#pragma unroll
  for (int j = 0; j < kItemsPerThread / kWidth; ++j) {
    const int64_t start = first + j * kWidth;
    if (vectorised && start >= span.begin && start + kWidth <= span.end) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + start));
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        if constexpr (sizeof(Bits) == 8) {
          if (w % 2 == 0)
            x[j * kWidth + w / 2] = Element<T>::decode(static_cast<Bits>(words[w]) |
                                                       (static_cast<Bits>(words[w + 1]) << 32));
        } else if constexpr (sizeof(Bits) == 4) {
          x[j * kWidth + w] = Element<T>::decode(words[w]);
        } else {
          x[j * kWidth + 2 * w] = Element<T>::decode(static_cast<uint16_t>(words[w] & 0xFFFFu));
          x[j * kWidth + 2 * w + 1] = Element<T>::decode(static_cast<uint16_t>(words[w] >> 16));
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < kWidth; ++k) {
        const int64_t v = start + k;
        x[j * kWidth + k] = span.contains(v) ? load_element(row, v) : 0.0f;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ row policies
// As on the CPU: a row of probabilities (mass = the sanitised value) or of logits with its softmax normaliser
// (mass = the softmax probability, recomputed on the fly). `mass` maps a loaded element to its mass. OneHotRow, the
// draft row of a tokens-only drafter, loads nothing (see below).
// Both count mass below their floor as zero (sanitize_mass): kMinTargetMass for the verify kernels' target rows (the
// target's support, verify_math.h), 0 for every other row.
template <typename T>
struct ProbRow {
  const T* values;
  float floor = 0.0f;
  __device__ __forceinline__ float mass(float x) const { return sanitize_mass(x, floor); }
};

template <typename T>
struct LogitRow {
  const T* values;
  float inverse_temperature;
  SoftmaxStats stats;
  float floor = 0.0f;
  __device__ __forceinline__ float mass(float x) const { return softmax_mass(x, inverse_temperature, stats, floor); }
};

// The draft row of a drafter that gives tokens only: one-hot at `token` (one_hot_draft_token: -1 for an id outside
// [0, V), a row without mass), read from nowhere.
struct OneHotRow {
  int64_t token;
};

template <typename Row>
__device__ __forceinline__ float mass_at(const Row& row, int64_t v) {
  return row.mass(load_element(row.values, v));
}
__device__ __forceinline__ float mass_at(const OneHotRow& row, int64_t v) { return one_hot_mass(v, row.token); }

// The memory an optional second row reads, which tile_layout aligns with the first: none for a one-hot row.
template <typename Row>
__device__ __forceinline__ auto row_memory(const Row* row) -> decltype(row->values) {
  return row != nullptr ? row->values : nullptr;
}
__device__ __forceinline__ const float* row_memory(const OneHotRow*) { return nullptr; }

// Masses of this thread's elements of a tile; 0 outside the span.
template <typename Row>
__device__ __forceinline__ void load_masses(const Row& row, int64_t first, Span span, bool vectorised,
                                            float (&mass)[kItemsPerThread]) {
  load_items(row.values, first, span, vectorised, mass);
#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) mass[k] = span.contains(first + k) ? row.mass(mass[k]) : 0.0f;
}

__device__ __forceinline__ void load_masses(const OneHotRow& row, int64_t first, Span span, bool,
                                            float (&mass)[kItemsPerThread]) {
#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k)
    mass[k] = span.contains(first + k) ? one_hot_mass(first + k, row.token) : 0.0f;  // 0 outside, as loads
}

// The mass sampled by the final step: max(0, p - q) with a draft row, p alone without (`layout` from tile_layout of
// the two rows).
template <typename Row, typename Draft>
__device__ __forceinline__ void load_sample_masses(const Row& target, const Draft* draft, int64_t first, Span span,
                                                   const TileLayout& layout, float (&mass)[kItemsPerThread]) {
  load_masses(target, first, span, layout.vectorised, mass);
  if (draft != nullptr) {
    float q[kItemsPerThread];
    load_masses(*draft, first, span, layout.second_vectorised, q);
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) mass[k] = residual_mass(mass[k], q[k]);
  }
}

// The first element this thread owns in the tile starting at `tile`.
__device__ __forceinline__ int64_t thread_first(int64_t tile) {
  return tile + static_cast<int64_t>(threadIdx.x) * kItemsPerThread;
}

}  // namespace gpu
}  // namespace diversed
