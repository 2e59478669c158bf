// CUDA kernels of DIVERSED verification, token statistics and the materialised mixture.
//
// Free of torch and Python: raw pointers in, a stream to launch on (the bindings live in verify_cuda.cu and
// stats_cuda.cu). The per-element arithmetic is csrc/common/verify_math.h, shared with the CPU kernels (cpu/cpu_kernels.h),
// whose algorithm these kernels mirror:
//   * one thread block per distribution row (per request for verify): a whole batch is one launch;
//   * a row is read in tiles of kThreads x kItemsPerThread elements, each thread owning kItemsPerThread consecutive
//     elements, loaded with 16-byte vector loads where the row allows it (rows start at row * V elements, so a row is
//     aligned only when V is a multiple of the vector width: misaligned rows get a short scalar head, see TileLayout);
//   * block reductions and the inverse-CDF prefix sum are CUB collectives; mass is accumulated in float64;
//   * nothing is read or written outside [0, V) of a row, whatever the token ids, num_draft or values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cmath>
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

template <typename T>
__device__ __forceinline__ float load_element(const T* row, int64_t v) {
  using Bits = typename Element<T>::Bits;
  return Element<T>::decode(__ldg(reinterpret_cast<const Bits*>(row) + v));
}

// Where the tiles of a row (or of two rows read in lockstep) start. Vector loads need 16-byte alignment; a row whose
// start is off by `head` elements from it begins its first tile at `head - width` (those leading lanes lie before the
// row and are skipped), so every later vector is aligned. Two rows with different misalignments are read scalar.
struct TileLayout {
  int64_t base;     // element index of the first tile, in (-width, 0]
  bool vectorised;  // 16-byte loads wherever a whole vector lies inside the row
};

template <typename T>
__device__ __forceinline__ TileLayout tile_layout(const T* first, const T* second) {
  const uintptr_t misalignment = reinterpret_cast<uintptr_t>(first) % 16;
  const bool same = second == nullptr || reinterpret_cast<uintptr_t>(second) % 16 == misalignment;
  if (!same || misalignment % sizeof(T) != 0) return TileLayout{0, false};
  const int64_t head = static_cast<int64_t>(((16 - misalignment) % 16) / sizeof(T));
  return TileLayout{head > 0 ? head - kVectorWidth<T> : 0, true};
}

// Elements [first, first + kItemsPerThread) of a row as float32; entries outside [0, vocab) read as 0 and are never
// loaded (callers skip them with in_row).
template <typename T>
__device__ __forceinline__ void load_items(const T* row, int64_t first, int64_t vocab, bool vectorised,
                                           float (&x)[kItemsPerThread]) {
  using Bits = typename Element<T>::Bits;
  constexpr int kWidth = kVectorWidth<T>;
#pragma unroll
  for (int j = 0; j < kItemsPerThread / kWidth; ++j) {
    const int64_t start = first + j * kWidth;
    if (vectorised && start >= 0 && start + kWidth <= vocab) {
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
        x[j * kWidth + k] = in_row(v, vocab) ? load_element(row, v) : 0.0f;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ row policies
// As on the CPU: a row of probabilities (mass = the sanitised value) or of logits with its softmax normaliser
// (mass = the softmax probability, recomputed on the fly). `mass` maps a loaded element to its mass.
template <typename T>
struct ProbRow {
  const T* values;
  __device__ __forceinline__ float mass(float x) const { return sanitize_mass(x); }
};

template <typename T>
struct LogitRow {
  const T* values;
  float inverse_temperature;
  SoftmaxStats stats;
  __device__ __forceinline__ float mass(float x) const { return softmax_mass(x, inverse_temperature, stats); }
};

template <typename Row>
__device__ __forceinline__ float mass_at(const Row& row, int64_t v) {
  return row.mass(load_element(row.values, v));
}

// Masses of this thread's elements of a tile; 0 outside the row.
template <typename Row>
__device__ __forceinline__ void load_masses(const Row& row, int64_t first, int64_t vocab, bool vectorised,
                                            float (&mass)[kItemsPerThread]) {
  load_items(row.values, first, vocab, vectorised, mass);
#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) mass[k] = in_row(first + k, vocab) ? row.mass(mass[k]) : 0.0f;
}

// The mass sampled by the final step: max(0, p - q) with a draft row, p alone without.
template <typename Row>
__device__ __forceinline__ void load_sample_masses(const Row& target, const Row* draft, int64_t first, int64_t vocab,
                                                   bool vectorised, float (&mass)[kItemsPerThread]) {
  load_masses(target, first, vocab, vectorised, mass);
  if (draft != nullptr) {
    float q[kItemsPerThread];
    load_masses(*draft, first, vocab, vectorised, q);
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) mass[k] = residual_mass(mass[k], q[k]);
  }
}

// The first element this thread owns in the tile starting at `tile`.
__device__ __forceinline__ int64_t thread_first(int64_t tile) {
  return tile + static_cast<int64_t>(threadIdx.x) * kItemsPerThread;
}

// ------------------------------------------------------------------------------------------------ block collectives
struct ArgMax {
  float value;
  int64_t index;
};
struct ArgMaxOp {  // larger value, ties to the lower id (better_candidate): a total order, so associative
  __device__ __forceinline__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return better_candidate(b.value, b.index, a.value, a.index) ? b : a;
  }
};
struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(const V& a, const V& b) const { return a + b; }
};
struct MaxOp {  // operands are never NaN: threads skip NaN before reducing
  template <typename V>
  __device__ __forceinline__ V operator()(const V& a, const V& b) const { return a > b ? a : b; }
};
struct MinOp {
  template <typename V>
  __device__ __forceinline__ V operator()(const V& a, const V& b) const { return a < b ? a : b; }
};

template <typename V>
using BlockReduce = cub::BlockReduce<V, kThreads>;
using BlockScan = cub::BlockScan<double, kThreads>;

// Shared memory of one block: CUB scratch and the slot that broadcasts a reduction's result to every thread.
struct BlockStorage {
  union {
    typename BlockReduce<double>::TempStorage sum;
    typename BlockReduce<float>::TempStorage max;
    typename BlockReduce<int64_t>::TempStorage index;
    typename BlockReduce<ArgMax>::TempStorage argmax;
    typename BlockScan::TempStorage scan;
  } temp;
  union {
    double sum;
    float max;
    int64_t index;
    ArgMax argmax;
  } result;
};

// Reduction whose result every thread receives. Must be reached by all threads of the block.
template <typename V, typename Op>
__device__ __forceinline__ V block_all_reduce(V value, Op op, typename BlockReduce<V>::TempStorage& temp, V& slot) {
  const V reduced = BlockReduce<V>(temp).Reduce(value, op);
  if (threadIdx.x == 0) slot = reduced;
  __syncthreads();
  const V result = slot;
  __syncthreads();  // temp and slot may be reused
  return result;
}

__device__ __forceinline__ double block_sum(double value, BlockStorage& s) {
  return block_all_reduce(value, SumOp{}, s.temp.sum, s.result.sum);
}
__device__ __forceinline__ int64_t block_min(int64_t value, BlockStorage& s) {
  return block_all_reduce(value, MinOp{}, s.temp.index, s.result.index);
}
__device__ __forceinline__ int64_t block_max(int64_t value, BlockStorage& s) {
  return block_all_reduce(value, MaxOp{}, s.temp.index, s.result.index);
}

// ------------------------------------------------------------------------------------------------ row operations
// Each is called by every thread of the block and returns the same value in every thread.

// Softmax normaliser of logits scaled by inverse_temperature, reading the row once (online softmax): each thread keeps
// its running max and its sum of exp(s - running max), rescaled when a tile raises the max; the block then rescales
// every thread's sum to the row max and adds them. Float partials per tile, float64 across tiles. NaN is skipped by the
// max; a row without a finite logit has no mass.
template <typename T>
__device__ SoftmaxStats block_softmax_stats(const T* row, int64_t vocab, float inverse_temperature, BlockStorage& s) {
  const TileLayout layout = tile_layout<T>(row, nullptr);
  float thread_max = -INFINITY;
  double thread_sum = 0.0;
  for (int64_t tile = layout.base; tile < vocab; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float scaled[kItemsPerThread];
    load_items(row, first, vocab, layout.vectorised, scaled);
    float tile_max = thread_max;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      scaled[k] *= inverse_temperature;
      if (in_row(first + k, vocab) && scaled[k] > tile_max) tile_max = scaled[k];
    }
    if (!(tile_max > -INFINITY)) continue;  // nothing finite seen by this thread yet
    if (tile_max > thread_max) thread_sum = rescale_exp_sum(thread_sum, thread_max, tile_max);
    thread_max = tile_max;
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k)
      if (in_row(first + k, vocab)) partial += exp_nonpositive(scaled[k] - thread_max);
    thread_sum += static_cast<double>(partial);
  }
  const float row_max = block_all_reduce(thread_max, MaxOp{}, s.temp.max, s.result.max);
  if (!(row_max > -INFINITY)) return SoftmaxStats{-INFINITY, 0.0f};
  const double total = block_sum(rescale_exp_sum(thread_sum, thread_max, row_max), s);
  return SoftmaxStats{row_max, static_cast<float>(1.0 / total)};
}

// argmax of nu = w p + (1 - w) q (or of p without a draft row); ties to the lowest id. Always in [0, vocab).
template <typename Row>
__device__ int64_t block_argmax_mixture(const Row& target, const Row* draft, float weight, int64_t vocab,
                                        BlockStorage& s) {
  const TileLayout layout = tile_layout(target.values, draft != nullptr ? draft->values : nullptr);
  ArgMax best{-1.0f, vocab};  // loses to every element: masses are >= 0
  for (int64_t tile = layout.base; tile < vocab; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float p[kItemsPerThread], q[kItemsPerThread];
    load_masses(target, first, vocab, layout.vectorised, p);
    if (draft != nullptr) load_masses(*draft, first, vocab, layout.vectorised, q);
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      const int64_t v = first + k;
      const float nu = draft != nullptr ? mix_mass(weight, p[k], q[k]) : p[k];
      if (in_row(v, vocab) && better_candidate(nu, v, best.value, best.index)) best = ArgMax{nu, v};
    }
  }
  const int64_t index = block_all_reduce(best, ArgMaxOp{}, s.temp.argmax, s.result.argmax).index;
  return index < vocab ? index : 0;  // unreachable guard: vocab >= 1, so some element always wins
}

// Sum of the sampled mass (residual with a draft row, p without), in float64.
template <typename Row>
__device__ double block_sample_total(const Row& target, const Row* draft, int64_t vocab, BlockStorage& s) {
  const TileLayout layout = tile_layout(target.values, draft != nullptr ? draft->values : nullptr);
  double thread_sum = 0.0;
  for (int64_t tile = layout.base; tile < vocab; tile += kTileElements) {
    float mass[kItemsPerThread];
    load_sample_masses(target, draft, thread_first(tile), vocab, layout.vectorised, mass);
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) thread_sum += static_cast<double>(mass[k]);
  }
  return block_sum(thread_sum, s);
}

// Inverse CDF: the first id whose running sum of sampled mass exceeds `threshold` (= u * total, total > 0), tile by
// tile with a block-wide exclusive scan in float64. Only ids with positive mass can be chosen, and when rounding puts
// the threshold past the scanned sum (the scan and the total add in different orders), the last id with positive mass
// is returned: the result always has positive mass, as the SPEC's boundary guard requires.
template <typename Row>
__device__ int64_t block_inverse_cdf(const Row& target, const Row* draft, int64_t vocab, double threshold,
                                     BlockStorage& s) {
  const TileLayout layout = tile_layout(target.values, draft != nullptr ? draft->values : nullptr);
  constexpr int64_t kNone = INT64_MAX;
  double carry = 0.0;              // mass of all earlier tiles
  int64_t last_positive = -1;      // this thread's last element with positive mass
  for (int64_t tile = layout.base; tile < vocab; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float mass[kItemsPerThread];
    load_sample_masses(target, draft, first, vocab, layout.vectorised, mass);
    double local = 0.0;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) local += static_cast<double>(mass[k]);
    double before, tile_total;
    BlockScan(s.temp.scan).ExclusiveSum(local, before, tile_total);
    __syncthreads();  // the scan's storage is reused below
    double running = carry + before;
    int64_t found = kNone;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      if (mass[k] > 0.0f) {  // 0 outside the row
        running += static_cast<double>(mass[k]);
        last_positive = first + k;
        if (found == kNone && running > threshold) found = first + k;
      }
    }
    found = block_min(found, s);
    if (found != kNone) return found;
    carry += tile_total;
  }
  const int64_t fallback = block_max(last_positive, s);
  return fallback >= 0 ? fallback : 0;  // no mass at all cannot happen with total > 0; 0 keeps the id in range
}

// ------------------------------------------------------------------------------------------------ verify
// The request-level inputs and outputs are a VerifyProblem (csrc/common/verify_math.h), shared with the CPU kernels; its
// greedy flags are read by ProbRows, while LogitRows derives them from the temperatures.

// Rows of draft probabilities [B, K, V] and target probabilities [B, K+1, V]; greedy rows flagged per request.
template <typename T>
struct ProbRows {
  using Row = ProbRow<T>;
  const T* draft;
  const T* target;

  __device__ bool greedy(const VerifyProblem& p, int64_t row) const { return p.greedy[row]; }
  __device__ void prepare(const VerifyProblem&, int64_t, int64_t, BlockStorage&) const {}
  __device__ Row draft_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    return Row{draft + (row * p.num_positions + position) * p.vocab};
  }
  __device__ Row target_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    return Row{target + (row * (p.num_positions + 1) + position) * p.vocab};
  }
};

// Rows of logits with their softmax normalisers, which `prepare` computes into per-call scratch (see
// logits_scratch_size) for every row the request reads: draft positions < num_draft, target positions <= num_draft.
// Temperature <= 0 or NaN marks a greedy row, decided on the untempered softmax.
template <typename T>
struct LogitRows {
  using Row = LogitRow<T>;
  const T* draft;
  const T* target;
  const float* temperature;    // [B]
  SoftmaxStats* draft_stats;   // [B, K] scratch
  SoftmaxStats* target_stats;  // [B, K+1] scratch

  __device__ bool greedy(const VerifyProblem&, int64_t row) const { return !(temperature[row] > 0.0f); }
  __device__ float inverse_temperature(int64_t row) const { return inverse_temperature_of(temperature[row]); }

  __device__ void prepare(const VerifyProblem& p, int64_t row, int64_t drafted, BlockStorage& s) const {
    const float inverse_t = inverse_temperature(row);
    for (int64_t i = 0; i <= drafted; ++i) {
      const int64_t index = row * (p.num_positions + 1) + i;
      const SoftmaxStats stats = block_softmax_stats(target + index * p.vocab, p.vocab, inverse_t, s);
      if (threadIdx.x == 0) target_stats[index] = stats;
    }
    for (int64_t i = 0; i < drafted; ++i) {
      const int64_t index = row * p.num_positions + i;
      const SoftmaxStats stats = block_softmax_stats(draft + index * p.vocab, p.vocab, inverse_t, s);
      if (threadIdx.x == 0) draft_stats[index] = stats;
    }
    __syncthreads();  // the block reads the normalisers back from global memory
  }
  __device__ Row draft_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    const int64_t index = row * p.num_positions + position;
    return Row{draft + index * p.vocab, inverse_temperature(row), draft_stats[index]};
  }
  __device__ Row target_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    const int64_t index = row * (p.num_positions + 1) + position;
    return Row{target + index * p.vocab, inverse_temperature(row), target_stats[index]};
  }
};

// SoftmaxStats entries the logits path needs as scratch: [B, K] draft and [B, K+1] target normalisers.
inline int64_t logits_scratch_size(int64_t batch, int64_t num_positions) {
  return batch * (2 * num_positions + 1);
}

// One block per request: accept tests, outputs, then the greedy argmax or the residual/bonus sample.
template <typename Rows>
__global__ void __launch_bounds__(kThreads) verify_kernel(const VerifyProblem params, const Rows rows) {
  __shared__ BlockStorage storage;
  using Row = typename Rows::Row;
  const int64_t b = blockIdx.x;
  const int64_t K = params.num_positions, V = params.vocab;
  const int64_t drafted = params.drafted(b);
  const bool greedy = rows.greedy(params, b);
  rows.prepare(params, b, drafted, storage);

  // 1. Accept tests at drafted positions; m = the first rejection (drafted when all pass).
  int64_t m = drafted;
  int64_t greedy_choice = 0;  // argmax nu_m of a greedy row rejected at m
  if (greedy) {
    for (int64_t i = 0; i < drafted; ++i) {
      const Row target = rows.target_row(params, b, i);
      const Row draft = rows.draft_row(params, b, i);
      const int64_t best = block_argmax_mixture(target, &draft, params.weight_at(b, i), V, storage);
      const bool accepted = params.draft_tokens[b * K + i] == best;  // best lies in [0, V): ids outside are rejected
      if (threadIdx.x == 0) params.out_accept_prob[b * K + i] = accepted ? 1.0f : 0.0f;
      if (!accepted && m == drafted) {
        m = i;
        greedy_choice = best;
      }
    }
  } else {
    int64_t first_rejection = drafted;
    for (int64_t i = threadIdx.x; i < drafted; i += kThreads) {
      const int64_t token = params.draft_tokens[b * K + i];
      float probability = 0.0f;
      bool accepted = false;
      if (in_row(token, V)) {
        const Row target = rows.target_row(params, b, i);
        const Row draft = rows.draft_row(params, b, i);
        const float q = mass_at(draft, token);
        const float nu = mix_mass(params.weight_at(b, i), mass_at(target, token), q);
        probability = accept_probability(nu, q);
        accepted = accept_draft(params.uniform(b, i), q, nu);
      }
      params.out_accept_prob[b * K + i] = probability;
      if (!accepted && i < first_rejection) first_rejection = i;
    }
    m = block_min(first_rejection, storage);
  }

  // 2. Every output but the final token: accept_prob past num_draft, accepted drafts, -1 padding.
  for (int64_t i = drafted + threadIdx.x; i < K; i += kThreads) params.out_accept_prob[b * K + i] = 0.0f;
  int64_t* row_tokens = params.out_tokens + b * (K + 1);
  for (int64_t i = threadIdx.x; i <= K; i += kThreads)
    if (i != m) row_tokens[i] = i < m ? params.draft_tokens[b * K + i] : -1;
  if (threadIdx.x == 0) params.out_num_accepted[b] = static_cast<int32_t>(m);

  // 3. The final token at position m.
  const bool rejected = m < drafted;
  int64_t choice;
  if (greedy) {
    if (rejected) {
      choice = greedy_choice;
    } else {
      const Row bonus = rows.target_row(params, b, drafted);
      choice = block_argmax_mixture(bonus, static_cast<const Row*>(nullptr), 1.0f, V, storage);
    }
  } else {
    // Residual max(0, p_m - q_m) only when rejected with w_m > 0; otherwise (or when it has no mass) p_m itself.
    const bool use_residual = rejected && params.weight_at(b, m) > 0.0f;
    const Row target = rows.target_row(params, b, m);
    Row draft_storage = target;
    if (use_residual) draft_storage = rows.draft_row(params, b, m);
    const Row* draft = use_residual ? &draft_storage : nullptr;
    double total = block_sample_total(target, draft, V, storage);
    if (!(total > 0.0) && draft != nullptr) {
      draft = nullptr;
      total = block_sample_total(target, draft, V, storage);
    }
    choice = 0;  // a target row without mass has no valid sample; 0 keeps the id in range
    if (total > 0.0) choice = block_inverse_cdf(target, draft, V, params.uniform(b, K) * total, storage);
  }
  if (threadIdx.x == 0) row_tokens[m] = choice;
}

// Launchers; params.greedy must be set for probabilities. `scratch` holds logits_scratch_size(B, K) entries.
template <typename T>
void launch_verify_probs(const VerifyProblem& params, const T* draft, const T* target, cudaStream_t stream) {
  if (params.batch == 0) return;
  const ProbRows<T> rows{draft, target};
  verify_kernel<<<static_cast<unsigned>(params.batch), kThreads, 0, stream>>>(params, rows);
}

template <typename T>
void launch_verify_logits(const VerifyProblem& params, const T* draft, const T* target, const float* temperature,
                          SoftmaxStats* scratch, cudaStream_t stream) {
  if (params.batch == 0) return;
  const LogitRows<T> rows{draft, target, temperature, scratch, scratch + params.batch * params.num_positions};
  verify_kernel<<<static_cast<unsigned>(params.batch), kThreads, 0, stream>>>(params, rows);
}

// ------------------------------------------------------------------------------------------------ token_stats, mix
// One block per (row, position) pair of distributions.
template <typename T>
struct PairParams {
  const T* draft;             // [B, T, V]
  const T* target;            // [B, Tt, V], Tt >= T (mix ignores positions past T)
  int64_t batch, positions, target_positions, vocab;
  const float* temperature;   // [B]; only read with from_logits
  bool from_logits;

  __device__ const T* draft_values(int64_t index) const { return draft + index * vocab; }
  __device__ const T* target_values(int64_t index) const {
    return target + ((index / positions) * target_positions + index % positions) * vocab;
  }
};

// Calls f(target_row, draft_row) with probability rows, or with logit rows and their normalisers (computed here by
// the whole block), so one body serves both inputs.
template <typename T, typename F>
__device__ __forceinline__ void with_rows(const PairParams<T>& p, int64_t index, BlockStorage& s, F f) {
  const T* target = p.target_values(index);
  const T* draft = p.draft_values(index);
  if (p.from_logits) {
    const float inverse_t = inverse_temperature_of(p.temperature[index / p.positions]);
    const LogitRow<T> target_row{target, inverse_t, block_softmax_stats(target, p.vocab, inverse_t, s)};
    const LogitRow<T> draft_row{draft, inverse_t, block_softmax_stats(draft, p.vocab, inverse_t, s)};
    f(target_row, draft_row);
  } else {
    f(ProbRow<T>{target}, ProbRow<T>{draft});
  }
}

// Calls f(first, p, q) with this thread's masses of two rows read in lockstep, tile by tile (0 outside the row).
template <typename Row, typename F>
__device__ __forceinline__ void for_each_pair_tile(const Row& target, const Row& draft, int64_t vocab, F f) {
  const TileLayout layout = tile_layout(target.values, draft.values);
  for (int64_t tile = layout.base; tile < vocab; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float p[kItemsPerThread], q[kItemsPerThread];
    load_masses(target, first, vocab, layout.vectorised, p);
    load_masses(draft, first, vocab, layout.vectorised, q);
    f(first, p, q);
  }
}

struct TokenStatsOut {
  const int64_t* tokens;  // [B, T]
  float *target_prob, *draft_prob, *total_variation, *target_logprob, *draft_logprob;  // [B, T] each
};

// log p(y) from logits: s_y - max + log(1 / sum) in float64, exact where the mass underflows; NaN gives -inf.
template <typename T>
__device__ __forceinline__ float log_mass_at(const LogitRow<T>& row, int64_t token) {
  const float scaled = load_element(row.values, token) * row.inverse_temperature;
  const double value =
      static_cast<double>(scaled) - row.stats.max + log(static_cast<double>(row.stats.inverse_sum));
  return value == value ? static_cast<float>(value) : -INFINITY;
}
template <typename T>
__device__ __forceinline__ float log_mass_at(const ProbRow<T>& row, int64_t token) {
  return static_cast<float>(log(static_cast<double>(mass_at(row, token))));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) token_stats_kernel(const PairParams<T> params, const TokenStatsOut out) {
  __shared__ BlockStorage storage;
  const int64_t index = blockIdx.x;
  const int64_t vocab = params.vocab;
  with_rows(params, index, storage, [&](const auto& target, const auto& draft) {
    double thread_sum = 0.0;
    for_each_pair_tile(target, draft, vocab, [&](int64_t, const float(&p)[kItemsPerThread],
                                                 const float(&q)[kItemsPerThread]) {
#pragma unroll
      for (int k = 0; k < kItemsPerThread; ++k) thread_sum += static_cast<double>(fabsf(p[k] - q[k]));
    });
    const double sum = block_sum(thread_sum, storage);
    if (threadIdx.x == 0) {
      const int64_t token = out.tokens[index];
      const bool valid = in_row(token, vocab);
      out.total_variation[index] = static_cast<float>(0.5 * sum);
      out.target_prob[index] = valid ? mass_at(target, token) : 0.0f;
      out.draft_prob[index] = valid ? mass_at(draft, token) : 0.0f;
      out.target_logprob[index] = valid ? log_mass_at(target, token) : -INFINITY;
      out.draft_logprob[index] = valid ? log_mass_at(draft, token) : -INFINITY;
    }
  });
}

// nu = w p + (1 - w) q as float32 [B, K, V]; float4 stores where the output row is aligned.
template <typename T>
__global__ void __launch_bounds__(kThreads) mix_kernel(const PairParams<T> params, const float* weight, float* mixture) {
  __shared__ BlockStorage storage;
  const int64_t index = blockIdx.x;
  const int64_t vocab = params.vocab;
  const float w = sanitize_weight(weight[index]);
  float* out = mixture + index * vocab;
  with_rows(params, index, storage, [&](const auto& target, const auto& draft) {
    for_each_pair_tile(target, draft, vocab, [&](int64_t first, const float(&p)[kItemsPerThread],
                                                 const float(&q)[kItemsPerThread]) {
      float nu[kItemsPerThread];
#pragma unroll
      for (int k = 0; k < kItemsPerThread; ++k) nu[k] = mix_mass(w, p[k], q[k]);
#pragma unroll
      for (int j = 0; j < kItemsPerThread; j += 4) {
        const int64_t start = first + j;
        if (start >= 0 && start + 4 <= vocab && reinterpret_cast<uintptr_t>(out + start) % 16 == 0) {
          *reinterpret_cast<float4*>(out + start) = make_float4(nu[j], nu[j + 1], nu[j + 2], nu[j + 3]);
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k)
            if (in_row(start + k, vocab)) out[start + k] = nu[j + k];
        }
      }
    });
  });
}

template <typename T>
void launch_token_stats(const PairParams<T>& params, const TokenStatsOut& out, cudaStream_t stream) {
  const int64_t rows = params.batch * params.positions;
  if (rows == 0) return;
  token_stats_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(params, out);
}

template <typename T>
void launch_mix(const PairParams<T>& params, const float* weight, float* mixture, cudaStream_t stream) {
  const int64_t rows = params.batch * params.positions;
  if (rows == 0) return;
  mix_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(params, weight, mixture);
}

}  // namespace gpu
}  // namespace diversed
