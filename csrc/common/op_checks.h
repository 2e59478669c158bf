// Argument checks of the `diversed` ops, shared by every backend's bindings (csrc/cpu, csrc/cuda). They are the last
// line of defence: the Python layer (diversed_ext/ops/_inputs.py) has already produced these exact layouts. Structural
// checks only, so they never read tensor values (no device sync). Device placement is the CUDA binding's own check.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>

#include "fly_math.h"       // kFlyMaxTopK
#include "problems.h"       // kMaxGridPoints
#include "tensor_checks.h"  // check_layout, check_float_vector

namespace diversed {

// Operator names as error messages give them.
constexpr const char* kVerifyProbsOp = "diversed::verify_probs";
constexpr const char* kVerifyLogitsOp = "diversed::verify_logits";
constexpr const char* kTokenStatsOp = "diversed::token_stats";
constexpr const char* kMixOp = "diversed::mix";
constexpr const char* kMixtureDivergenceOp = "diversed::mixture_divergence";
constexpr const char* kDistributionFeaturesOp = "diversed::distribution_features";
constexpr const char* kGateStatisticsOp = "diversed::gate_statistics";

inline void check_int64_vector(const at::Tensor& tensor, int64_t size, const char* op, const char* what) {
  check_layout(tensor, at::kLong, {size}, op, what);
}

// A draft/target pair of 3-D distributions [B, *, V] (probabilities or logits).
inline void check_pair(const at::Tensor& draft, const at::Tensor& target, const char* op) {
  TORCH_CHECK(draft.dim() == 3 && target.dim() == 3, op, ": draft and target must be 3-D");
  TORCH_CHECK(draft.scalar_type() == target.scalar_type(), op, ": draft and target dtypes differ");
  TORCH_CHECK(draft.is_contiguous() && target.is_contiguous(), op, ": draft and target must be contiguous");
  TORCH_CHECK(draft.size(2) > 0 && draft.size(2) == target.size(2), op, ": vocabulary sizes differ or are zero");
  TORCH_CHECK(draft.size(0) == target.size(0), op, ": batch sizes differ");
}

// verify_probs / verify_logits: draft [B, K, V], target [B, K+1, V] (dtypes: is_verify_dtype), draft_tokens (int64
// [B, K]), and when given:
// weight (float32 [B, K]), num_draft and seeds (int64 [B]), uniforms (float64 [B, K+1]), and the per-row flags: greedy
// (bool [B]) from probabilities, temperature (float32 [B]) from logits. An absent one takes its scalar default.
// Rows read in place: with target_rows (int64 [B, K+1]) the target is a row tensor [R, V], and B and K come from
// draft_tokens; with draft_rows (int64 [B, K]) the draft is [Rd, V]. The indices' values are not read here.
enum class VerifyInput { kProbs, kLogits };

inline const char* verify_op(VerifyInput input) {
  return input == VerifyInput::kProbs ? kVerifyProbsOp : kVerifyLogitsOp;
}

// The optional tensor arguments of the verify ops, in schema order (target_temperature: logits only).
struct VerifyOptionals {
  const c10::optional<at::Tensor>& weight;
  const c10::optional<at::Tensor>& num_draft;
  const c10::optional<at::Tensor>& greedy_or_temperature;
  const c10::optional<at::Tensor>& uniforms;
  const c10::optional<at::Tensor>& seeds;
  const c10::optional<at::Tensor>& target_rows;
  const c10::optional<at::Tensor>& draft_rows;
  const c10::optional<at::Tensor>& target_temperature;
};

// The target temperature of a verify_probs call, which has none.
inline const c10::optional<at::Tensor> kNoTargetTemperature;

// B, K and V of a verify call, as the checks found them.
struct VerifyShape {
  int64_t batch, num_positions, vocab;
};

// A distribution tensor of a verify call: [B, positions, V], or [R, V] read through an index tensor `rows` (int64
// [B, positions]) that must find a row whenever one may be read (R >= 1 unless B * positions is 0).
inline void check_verify_values(const at::Tensor& values, const c10::optional<at::Tensor>& rows, int64_t batch,
                                int64_t positions, int64_t vocab, const char* op, const char* what,
                                const char* rows_name) {
  TORCH_CHECK(values.is_contiguous(), op, ": ", what, " must be contiguous");
  TORCH_CHECK(values.size(-1) == vocab, op, ": ", what, " has vocabulary size ", values.size(-1), ", expected ", vocab);
  if (rows.has_value()) {
    TORCH_CHECK(values.dim() == 2, op, ": with ", rows_name, ", ", what, " must be 2-D [R, V], got ", values.sizes());
    check_layout(*rows, at::kLong, {batch, positions}, op, rows_name);
    TORCH_CHECK(batch * positions == 0 || values.size(0) > 0, op, ": ", what, " has no rows for ", rows_name);
  } else {
    TORCH_CHECK(values.dim() == 3 && values.size(0) == batch && values.size(1) == positions, op, ": ", what,
                " must be [", batch, ", ", positions, ", V], got ", values.sizes());
  }
}

// The dtypes of verify's distributions: float32, bfloat16 and float16, which a draft and a target may mix (each read
// as it lies), and float64 (only with a float64 partner; the kernels read it as float32).
inline bool is_verify_dtype(at::ScalarType type, bool allow_double) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || (allow_double && type == at::kDouble);
}

// verify's draft tensor is optional (absent: the drafter gave tokens only, and draft_rows must be absent too); B and
// K come from the target [B, K+1, V], or from draft_tokens when the target is read through target_rows.
inline VerifyShape check_verify_args(VerifyInput input, const at::Tensor& draft_tokens,
                                     const c10::optional<at::Tensor>& draft, const at::Tensor& target,
                                     const VerifyOptionals& optional) {
  const char* op = verify_op(input);
  const bool target_indexed = optional.target_rows.has_value();
  TORCH_CHECK(target.dim() == (target_indexed ? 2 : 3), op, ": target must be ",
              target_indexed ? "[R, V] with target_rows" : "[B, K+1, V]", ", got ", target.sizes());
  TORCH_CHECK(target_indexed || target.size(1) >= 1, op, ": target must be [B, K+1, V] with K >= 0");
  TORCH_CHECK(!target_indexed || draft_tokens.dim() == 2, op, ": draft_tokens must be [B, K]");
  const int64_t B = target_indexed ? draft_tokens.size(0) : target.size(0);
  const int64_t K = target_indexed ? draft_tokens.size(1) : target.size(1) - 1;
  const int64_t V = target.size(-1);
  TORCH_CHECK(V > 0, op, ": the vocabulary size is zero");
  check_verify_values(target, optional.target_rows, B, K + 1, V, op, "target", "target_rows");
  const at::ScalarType target_type = target.scalar_type();
  TORCH_CHECK(is_verify_dtype(target_type, true), op, ": target must be float32, bfloat16, float16 or float64, got ",
              target_type);
  if (draft.has_value()) {
    const at::ScalarType draft_type = draft->scalar_type();
    const bool mixable = is_verify_dtype(draft_type, false) && is_verify_dtype(target_type, false);
    TORCH_CHECK(draft_type == target_type || mixable, op, ": draft (", draft_type, ") and target (", target_type,
                ") dtypes: a draft of another dtype than the target's must be float32, bfloat16 or float16, and so "
                "must the target");
    check_verify_values(*draft, optional.draft_rows, B, K, V, op, "draft", "draft_rows");
  } else {
    TORCH_CHECK(!optional.draft_rows.has_value(), op, ": draft_rows given without a draft tensor");
  }
  check_layout(draft_tokens, at::kLong, {B, K}, op, "draft_tokens");
  if (optional.weight.has_value()) check_layout(*optional.weight, at::kFloat, {B, K}, op, "weight");
  if (optional.num_draft.has_value()) check_int64_vector(*optional.num_draft, B, op, "num_draft");
  if (optional.seeds.has_value()) check_int64_vector(*optional.seeds, B, op, "seeds");
  const auto& uniforms = optional.uniforms;
  if (uniforms.has_value()) check_layout(*uniforms, at::kDouble, {B, K + 1}, op, "uniforms");
  const bool logits = input == VerifyInput::kLogits;
  if (optional.target_temperature.has_value()) {
    TORCH_CHECK(logits, op, ": target_temperature belongs to the logits path");
    check_float_vector(*optional.target_temperature, B, op, "target_temperature");
  }
  if (optional.greedy_or_temperature.has_value()) {
    const at::Tensor& flags = *optional.greedy_or_temperature;
    if (logits) check_float_vector(flags, B, op, "temperature");
    else check_layout(flags, at::kBool, {B}, op, "greedy");
  }
  return VerifyShape{B, K, V};
}

// FLy's arguments of the verify ops (fly_math.h): fly_window int64 [B] or fly_window_value, fly_threshold float32
// [B] or fly_threshold_value, and fly_top_k (>= 1; at most kFlyMaxTopK, which the kernels keep).
struct FlyArgs {
  const c10::optional<at::Tensor>& window;
  const c10::optional<at::Tensor>& threshold;
  int64_t window_value;
  double threshold_value;
  int64_t top_k;
};

inline void check_fly_args(const FlyArgs& fly, int64_t batch, const char* op) {
  if (fly.window.has_value()) check_int64_vector(*fly.window, batch, op, "fly_window");
  if (fly.threshold.has_value()) check_float_vector(*fly.threshold, batch, op, "fly_threshold");
  TORCH_CHECK(fly.top_k >= 1 && fly.top_k <= kFlyMaxTopK, op, ": fly_top_k must lie in [1, ", kFlyMaxTopK,
              "], got ", fly.top_k);
}

// token_stats: draft and target [B, T, V], tokens int64 [B, T], temperature float32 [B].
inline void check_token_stats_args(const at::Tensor& draft, const at::Tensor& target,
                                   const at::Tensor& tokens, const at::Tensor& temperature) {
  constexpr const char* op = kTokenStatsOp;
  check_pair(draft, target, op);
  const int64_t B = draft.size(0), T = draft.size(1);
  TORCH_CHECK(target.size(1) == T, op, ": draft and target must both be [B, T, V]");
  check_layout(tokens, at::kLong, {B, T}, op, "tokens");
  check_float_vector(temperature, B, op, "temperature");
}

// mix: draft [B, K, V], target [B, K or more, V], weight float32 [B, K], temperature float32 [B].
inline void check_mix_args(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                           const at::Tensor& temperature) {
  constexpr const char* op = kMixOp;
  check_pair(draft, target, op);
  const int64_t B = draft.size(0), K = draft.size(1);
  TORCH_CHECK(target.size(1) >= K, op, ": target must have at least K positions");
  check_layout(weight, at::kFloat, {B, K}, op, "weight");
  check_float_vector(temperature, B, op, "temperature");
}

// mixture_divergence: draft and target logits [B, T, V], temperature float32 [B], grid_points in [2, kMaxGridPoints],
// a finite log_floor.
inline void check_mixture_divergence_args(const at::Tensor& draft, const at::Tensor& target,
                                          const at::Tensor& temperature, int64_t grid_points, double log_floor) {
  constexpr const char* op = kMixtureDivergenceOp;
  check_pair(draft, target, op);
  TORCH_CHECK(target.size(1) == draft.size(1), op, ": draft and target must both be [B, T, V]");
  check_float_vector(temperature, draft.size(0), op, "temperature");
  TORCH_CHECK(grid_points >= 2 && grid_points <= kMaxGridPoints, op, ": grid_points must lie in [2, ", kMaxGridPoints,
              "], got ", grid_points);
  TORCH_CHECK(std::isfinite(log_floor), op, ": log_floor must be finite, got ", log_floor);
}

// distribution_features: draft and target logits [B, T, V], or [R, V] rows read through target_rows / draft_rows (int64
// [B, T]; B and T from a 3-D tensor, else from target_rows), of verify's dtypes (is_verify_dtype: each float32,
// bfloat16 or float16, or both float64); temperature and target_temperature float32 [B]. Returns (B, T, V).
struct FeaturesShape {
  int64_t batch, positions, vocab;
};

// The checks of a pair of logit rows that distribution_features and gate_statistics read, for `op`.
inline FeaturesShape check_logit_rows(const char* op, const at::Tensor& draft, const at::Tensor& target,
                                      const at::Tensor& temperature, const c10::optional<at::Tensor>& target_rows,
                                      const c10::optional<at::Tensor>& draft_rows,
                                      const c10::optional<at::Tensor>& target_temperature) {
  TORCH_CHECK(draft.dim() >= 2 && target.dim() >= 2, op, ": draft and target must be [B, T, V] or [R, V]");
  const bool target_indexed = target_rows.has_value(), draft_indexed = draft_rows.has_value();
  const at::Tensor& shaped = !draft_indexed ? draft : (!target_indexed ? target : *target_rows);
  TORCH_CHECK(shaped.dim() == (draft_indexed && target_indexed ? 2 : 3), op, ": draft and target must be [B, T, V] "
              "or, read through target_rows / draft_rows, [R, V] with those indices [B, T]");
  const int64_t B = shaped.size(0), T = shaped.size(1), V = target.size(-1);
  TORCH_CHECK(V > 0, op, ": the vocabulary size is zero");  // the draft's must match (check_verify_values)
  check_verify_values(target, target_rows, B, T, V, op, "target", "target_rows");
  check_verify_values(draft, draft_rows, B, T, V, op, "draft", "draft_rows");
  const at::ScalarType draft_type = draft.scalar_type(), target_type = target.scalar_type();
  const bool mixable = is_verify_dtype(draft_type, false) && is_verify_dtype(target_type, false);
  TORCH_CHECK(mixable || (draft_type == target_type && is_verify_dtype(target_type, true)), op,
              ": draft and target must each be float32, bfloat16 or float16, or both float64, got ", draft_type,
              " and ", target_type);
  check_float_vector(temperature, B, op, "temperature");
  if (target_temperature.has_value()) check_float_vector(*target_temperature, B, op, "target_temperature");
  return FeaturesShape{B, T, V};
}

inline FeaturesShape check_distribution_features_args(const at::Tensor& draft, const at::Tensor& target,
                                                      const at::Tensor& temperature,
                                                      const c10::optional<at::Tensor>& target_rows,
                                                      const c10::optional<at::Tensor>& draft_rows,
                                                      const c10::optional<at::Tensor>& target_temperature) {
  return check_logit_rows(kDistributionFeaturesOp, draft, target, temperature, target_rows, draft_rows,
                          target_temperature);
}

// gate_statistics: draft_tokens int64 [B, T] beside distribution_features' rows; without a draft (tokens only) the
// target alone, and no draft_rows.
inline FeaturesShape check_gate_statistics_args(const at::Tensor& draft_tokens, const c10::optional<at::Tensor>& draft,
                                                const at::Tensor& target, const at::Tensor& temperature,
                                                const c10::optional<at::Tensor>& target_rows,
                                                const c10::optional<at::Tensor>& draft_rows,
                                                const c10::optional<at::Tensor>& target_temperature) {
  constexpr const char* op = kGateStatisticsOp;
  TORCH_CHECK(draft.has_value() || !draft_rows.has_value(), op, ": draft_rows needs a draft");
  const FeaturesShape shape = check_logit_rows(op, draft.has_value() ? *draft : target, target, temperature,
                                               target_rows, draft.has_value() ? draft_rows : target_rows,
                                               target_temperature);
  check_layout(draft_tokens, at::kLong, {shape.batch, shape.positions}, op, "draft_tokens");
  return shape;
}

}  // namespace diversed
