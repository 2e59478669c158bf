// The kernels' view of one op call: raw pointers and sizes, no torch. Both backends' kernels take these structs, and
// op_outputs.h builds them from the checked tensors, so the layouts below are stated once (they are the schemas' in
// csrc/ops.cpp).
#pragma once

#include <cstdint>

#include "fly_math.h"
#include "verify_math.h"

namespace diversed {

// The tensor row that slot `slot` (= request * width + position) reads: the slot itself for a [B, width, V] tensor,
// or rows[slot] of a row tensor [count, V] read through an index (target_rows / draft_rows). An index outside
// [0, count) is clamped into it: only check_inputs=False lets one through, and the clamp keeps every read inside the
// tensor without a branch the kernels would have to carry through every policy (count >= 1 is checked by the
// bindings whenever a row may be read).
DX_HD int64_t indexed_row(const int64_t* rows, int64_t count, int64_t slot) {
  if (rows == nullptr) return slot;
  const int64_t index = rows[slot];
  return index < 0 ? 0 : (index >= count ? count - 1 : index);
}

// verify_probs / verify_logits: the request-level inputs, the randomness and the outputs. The distributions themselves
// (probabilities or logits, of whatever element type) are passed to the kernels beside it.
struct VerifyProblem {
  int64_t batch, num_positions, vocab;  // B, K, V
  const int64_t* draft_tokens;          // [B, K]
  const float* weight;                  // [B, K], or nullptr: weight_value everywhere
  float weight_value;
  const int64_t* num_draft;             // [B], or nullptr: every row drafts K
  const bool* greedy;                   // [B] or nullptr (no greedy row); the logits path derives it from temperatures
  const float* temperature;             // logits only: [B], or nullptr: temperature_value for every row
  float temperature_value;
  // Logits only: the target rows' own temperature (the caller divided the target logits already); without it
  // (has_target_temperature false) the target rows use `temperature` too. Greedy rows still come from `temperature`.
  bool has_target_temperature;
  const float* target_temperature;      // [B], or nullptr: target_temperature_value for every row
  float target_temperature_value;
  // Rows read in place (indexed_row): target_rows [B, K+1] into a target of target_row_count rows, draft_rows [B, K]
  // into a draft of draft_row_count rows; nullptr: the target is [B, K+1, V] (the draft [B, K, V]).
  const int64_t* target_rows;
  int64_t target_row_count;
  const int64_t* draft_rows;
  int64_t draft_row_count;
  const double* uniforms;               // [B, K+1] or nullptr (then Philox)
  const int64_t* seeds;                 // seeds[row * seed_stride], or nullptr: seed_value for every row
  int64_t seed_stride;                  // 1 for a [B] tensor, 0 for one seed drawn on the device
  int64_t seed_value;
  int64_t offset;
  bool per_row_seed;
  // CUDA calls without seeds or uniforms draw their seed from torch's CUDA generator (seed_from_generator): its seed
  // and offset are read from device memory where a CUDA graph is being captured (the pointers), else passed as values.
  bool from_generator;
  const int64_t* generator_seed;    // or nullptr: generator_seed_value
  const int64_t* generator_offset;  // or nullptr: 0; generator_offset_value is added either way
  uint64_t generator_seed_value, generator_offset_value;
  FlySettings fly;            // deferred verification (fly_math.h); window 0 everywhere: off
  int64_t* out_tokens;        // [B, K+1]
  int32_t* out_num_accepted;  // [B]
  float* out_accept_prob;     // [B, K]

  // u_position of a row: explicit uniforms (clamped into [0, 1)) or Philox keyed by the row's seed.
  DX_HD double uniform(int64_t row, int64_t position) const {
    if (uniforms) return sanitize_uniform(uniforms[row * (num_positions + 1) + position]);
    return philox_uniform(seed_of(row), offset, per_row_seed ? 0 : row, position);
  }
  DX_HD int64_t seed_of(int64_t row) const {
    if (seeds) return seeds[row * seed_stride];
    return from_generator ? generator_call_seed() : seed_value;
  }
  DX_HD int64_t generator_call_seed() const {
    const uint64_t seed = generator_seed ? static_cast<uint64_t>(*generator_seed) : generator_seed_value;
    const uint64_t base = generator_offset ? static_cast<uint64_t>(*generator_offset) : 0u;
    return seed_from_generator(seed, base + generator_offset_value);
  }
  // num_draft clamped to [0, K] (garbage is only reachable with check_inputs=False).
  DX_HD int64_t drafted(int64_t row) const {
    if (!num_draft) return num_positions;
    const int64_t n = num_draft[row];
    return n < 0 ? 0 : (n > num_positions ? num_positions : n);
  }
  DX_HD bool greedy_at(int64_t row) const { return greedy != nullptr && greedy[row]; }
  DX_HD float temperature_at(int64_t row) const { return temperature ? temperature[row] : temperature_value; }
  DX_HD float target_temperature_at(int64_t row) const {
    if (!has_target_temperature) return temperature_at(row);
    return target_temperature ? target_temperature[row] : target_temperature_value;
  }
  // The tensor rows of a request's positions (indexed_row): target position i <= K, draft position i < K.
  DX_HD int64_t target_row(int64_t row, int64_t position) const {
    return indexed_row(target_rows, target_row_count, row * (num_positions + 1) + position);
  }
  DX_HD int64_t draft_row(int64_t row, int64_t position) const {
    return indexed_row(draft_rows, draft_row_count, row * num_positions + position);
  }
  DX_HD float weight_at(int64_t row, int64_t position) const {
    return sanitize_weight(weight ? weight[row * num_positions + position] : weight_value);
  }
  // The weight a drafted position verifies with (verify_weight): weight_at, or 1 where the target forbids the drafted
  // token, whose target mass is p (0 for an id outside [0, V)).
  DX_HD float verify_weight_at(int64_t row, int64_t position, float p) const {
    return verify_weight(weight_at(row, position), p);
  }
};

// token_stats / mix: pairs of distributions, draft [B, T, V] and target [B, Tt, V] with Tt >= T (mix ignores the
// target's positions past T). One task per (row, position) index in [0, B * T).
template <typename T>
struct PairProblem {
  const T* draft;
  const T* target;
  int64_t batch, positions, target_positions, vocab;
  const float* temperature;  // [B]; only read with from_logits
  bool from_logits;

  DX_HD int64_t rows() const { return batch * positions; }
  DX_HD int64_t row_of(int64_t index) const { return index / positions; }
  DX_HD const T* draft_values(int64_t index) const { return draft + index * vocab; }
  DX_HD const T* target_values(int64_t index) const {
    return target + (row_of(index) * target_positions + index % positions) * vocab;
  }
  DX_HD float inverse_temperature(int64_t index) const { return inverse_temperature_of(temperature[row_of(index)]); }
};

// mixture_divergence: the most weights G of its table (the CPU kernel keeps a float64 sum per weight on the stack).
constexpr int64_t kMaxGridPoints = 1025;

// distribution_features: pairs of logit rows, one per slot (= request * positions + position) of [B, T]; each row is
// the slot's own in a [B, T, V] tensor, or read in place through an index (indexed_row). The draft rows are taken at
// `temperature`, the target rows at `target_temperature` when given (a server's rows already divided by theirs).
struct FeaturesProblem {
  int64_t batch, positions, vocab;  // B, T, V
  const float* temperature;         // [B]
  const float* target_temperature;  // [B], or nullptr: the target rows use `temperature` too
  const int64_t* target_rows;       // [B, T] into target_row_count rows, or nullptr: the target is [B, T, V]
  int64_t target_row_count;
  const int64_t* draft_rows;        // [B, T] into draft_row_count rows, or nullptr: the draft is [B, T, V]
  int64_t draft_row_count;

  DX_HD int64_t slots() const { return batch * positions; }
  DX_HD int64_t target_row(int64_t slot) const { return indexed_row(target_rows, target_row_count, slot); }
  DX_HD int64_t draft_row(int64_t slot) const { return indexed_row(draft_rows, draft_row_count, slot); }
  DX_HD float draft_inverse_temperature(int64_t slot) const {
    return inverse_temperature_of(temperature[slot / positions]);
  }
  DX_HD float target_inverse_temperature(int64_t slot) const {
    const float* rows_temperature = target_temperature ? target_temperature : temperature;
    return inverse_temperature_of(rows_temperature[slot / positions]);
  }
};

// token_stats: the tokens y and the five outputs, each [B, T].
struct TokenStatsOut {
  const int64_t* tokens;
  float *target_prob, *draft_prob, *total_variation, *target_logprob, *draft_logprob;
};

}  // namespace diversed
