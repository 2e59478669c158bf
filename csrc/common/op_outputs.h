// Output allocation shared by every backend's op bindings, and the torch-free problem structs (problems.h) built over
// the checked inputs and the fresh outputs. Outputs have the shapes and dtypes of the schemas in csrc/ops.cpp, live on
// the device of the inputs, and are poisoned under the test hook (poison.h) so that an element a kernel forgets shows
// up. Empty outputs are returned unpoisoned: the kernels are not called for them.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>

#include <cstdint>
#include <tuple>
#include <type_traits>

#include "features_math.h"
#include "op_checks.h"
#include "poison.h"
#include "problems.h"

namespace diversed {

// ------------------------------------------------------------------------------------------------ element types
// torch's 16-bit types have the same bits as each backend's own (CUDA's __half and __nv_bfloat16, the CPU kernels'
// bit wrappers), so a binding hands its kernels the tensor's data reinterpreted as the backend's type.
template <typename Half, typename BFloat16, typename scalar_t>
using kernel_element_t =
    std::conditional_t<std::is_same_v<scalar_t, at::Half>, Half,
                       std::conditional_t<std::is_same_v<scalar_t, at::BFloat16>, BFloat16, scalar_t>>;

template <typename T, typename scalar_t>
const T* kernel_data(const at::Tensor& tensor) {
  static_assert(sizeof(T) == sizeof(scalar_t), "a kernel element type must have the bits of torch's");
  return reinterpret_cast<const T*>(tensor.data_ptr<scalar_t>());
}
// An optional tensor's data, or nullptr when it is absent (verify's draft tensor, for tokens-only drafts).
template <typename T, typename scalar_t>
const T* kernel_data(const c10::optional<at::Tensor>& tensor) {
  return tensor.has_value() ? kernel_data<T, scalar_t>(*tensor) : nullptr;
}

// The element types of a verify call's distributions: fn(ScalarTag<draft's scalar_t>{}, ScalarTag<target's>{}),
// once. A draft of the target's type, or none (tokens only), dispatches on the target's type alone (float32, float64,
// bfloat16, float16); a draft of another type (the model's bfloat16 beside a server's float32 target rows, say) on the
// pair, each of float32, bfloat16 and float16 (check_verify_args refuses the rest). So the kernels read each tensor as
// it lies, and only the mixed pairs a call can reach are compiled, without tokens-only variants.
template <typename T>
struct ScalarTag {
  using type = T;
};

// kMixableOnly is a template argument, not a flag, so that a mixed call compiles no float64 kernels at all.
template <bool kMixableOnly, typename Fn>
void with_floating_type(at::ScalarType type, const char* op, Fn&& fn) {
  switch (type) {
    case at::kFloat: fn(ScalarTag<float>{}); return;
    case at::kBFloat16: fn(ScalarTag<at::BFloat16>{}); return;
    case at::kHalf: fn(ScalarTag<at::Half>{}); return;
    case at::kDouble:
      if constexpr (!kMixableOnly) {
        fn(ScalarTag<double>{});
        return;
      }
      break;
    default: break;
  }
  TORCH_CHECK(false, op, ": unsupported distribution dtype ", type);  // check_verify_args refused it already
}

template <typename Fn>
void dispatch_verify_types(const char* op, const c10::optional<at::Tensor>& draft, const at::Tensor& target,
                           Fn&& fn) {
  const at::ScalarType target_type = target.scalar_type();
  if (!draft.has_value() || draft->scalar_type() == target_type) {
    with_floating_type<false>(target_type, op, [&](auto tag) { fn(tag, tag); });
    return;
  }
  with_floating_type<true>(draft->scalar_type(), op, [&](auto draft_tag) {
    with_floating_type<true>(target_type, op, [&](auto target_tag) {
      using Draft = typename decltype(draft_tag)::type;
      using Target = typename decltype(target_tag)::type;
      if constexpr (!std::is_same_v<Draft, Target>) fn(draft_tag, target_tag);
    });
  });
}

// ------------------------------------------------------------------------------------------------ verify
// verify_probs / verify_logits: tokens int64 [B, K+1], num_accepted int32 [B], accept_prob float32 [B, K], and the
// VerifyProblem that points at them.
struct VerifyCall {
  at::Tensor tokens, num_accepted, accept_prob;
  at::Tensor drawn_seed;  // [1] on the device, when neither uniforms nor a seed were given
  VerifyProblem problem;

  bool empty() const { return problem.batch == 0; }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> result() const { return {tokens, num_accepted, accept_prob}; }
};

// The scalar arguments of the verify ops: the values of absent weight / temperature tensors, an int seed, the
// generator's counter, and the target rows' own temperature when it is one value.
struct VerifyScalars {
  double weight_value;
  double temperature_value;
  c10::optional<int64_t> seed;
  int64_t offset;
  bool per_row_seed;
  c10::optional<double> target_temperature_value = c10::nullopt;  // logits only
};

// Where a call without seeds or uniforms gets its seed: drawn with at::randint before the kernel (the CPU), or drawn by
// the kernel itself from the generator state the binding attaches (CUDA: no launch of its own, and graph-safe).
enum class SeedSource { kRandint, kKernelGenerator };

// The largest seed torch.randint(0, 2**63 - 1) can give: the Python layer draws seeds the same way (ops/_inputs.py).
constexpr int64_t kSeedDrawBound = INT64_MAX;

// `shape` is what check_verify_args returned (check_fly_args passed `fly`); `draft` and `target` are the distribution
// tensors (row counts of the row tensors read through target_rows / draft_rows).
inline VerifyCall start_verify(VerifyInput input, const VerifyShape& shape, const at::Tensor& draft_tokens,
                               const c10::optional<at::Tensor>& draft, const at::Tensor& target,
                               const VerifyOptionals& optional, const VerifyScalars& scalars, const FlyArgs& fly,
                               SeedSource seed_source = SeedSource::kRandint) {
  const int64_t B = shape.batch, K = shape.num_positions, V = shape.vocab;
  const auto options = draft_tokens.options();
  VerifyCall call{at::empty({B, K + 1}, options.dtype(at::kLong)), at::empty({B}, options.dtype(at::kInt)),
                  at::empty({B, K}, options.dtype(at::kFloat)), at::Tensor(), VerifyProblem{}};
  if (B == 0) return call;
  poison_outputs(call.tokens, call.num_accepted, call.accept_prob);
  VerifyProblem& problem = call.problem;
  problem.batch = B;
  problem.num_positions = K;
  problem.vocab = V;
  problem.draft_tokens = draft_tokens.data_ptr<int64_t>();
  problem.weight = optional.weight.has_value() ? optional.weight->data_ptr<float>() : nullptr;
  problem.weight_value = static_cast<float>(scalars.weight_value);
  problem.num_draft = optional.num_draft.has_value() ? optional.num_draft->data_ptr<int64_t>() : nullptr;
  const auto& flags = optional.greedy_or_temperature;
  const bool probs = input == VerifyInput::kProbs;
  problem.greedy = probs && flags.has_value() ? flags->data_ptr<bool>() : nullptr;
  problem.temperature = !probs && flags.has_value() ? flags->data_ptr<float>() : nullptr;
  problem.temperature_value = static_cast<float>(scalars.temperature_value);
  const auto& target_temperature = optional.target_temperature;
  problem.has_target_temperature = target_temperature.has_value() || scalars.target_temperature_value.has_value();
  problem.target_temperature = target_temperature.has_value() ? target_temperature->data_ptr<float>() : nullptr;
  problem.target_temperature_value = static_cast<float>(scalars.target_temperature_value.value_or(1.0));
  if (optional.target_rows.has_value()) {
    problem.target_rows = optional.target_rows->data_ptr<int64_t>();
    problem.target_row_count = target.size(0);
  }
  if (optional.draft_rows.has_value() && draft.has_value()) {
    problem.draft_rows = optional.draft_rows->data_ptr<int64_t>();
    problem.draft_row_count = draft->size(0);
  }
  problem.uniforms = optional.uniforms.has_value() ? optional.uniforms->data_ptr<double>() : nullptr;
  problem.seeds = nullptr;
  problem.seed_stride = 0;
  problem.seed_value = scalars.seed.value_or(0);
  if (optional.seeds.has_value()) {
    problem.seeds = optional.seeds->data_ptr<int64_t>();
    problem.seed_stride = 1;
  } else if (!scalars.seed.has_value() && problem.uniforms == nullptr && seed_source == SeedSource::kKernelGenerator) {
    problem.from_generator = true;
  } else if (!scalars.seed.has_value() && problem.uniforms == nullptr) {
    // Drawn on the device from its default generator, so torch.manual_seed repeats runs.
    call.drawn_seed = at::randint(0, kSeedDrawBound, {1}, options.dtype(at::kLong));
    problem.seeds = call.drawn_seed.data_ptr<int64_t>();
  }
  problem.fly.window = fly.window.has_value() ? fly.window->data_ptr<int64_t>() : nullptr;
  problem.fly.window_value = fly.window_value;
  problem.fly.threshold = fly.threshold.has_value() ? fly.threshold->data_ptr<float>() : nullptr;
  problem.fly.threshold_value = static_cast<float>(fly.threshold_value);
  problem.fly.top_k = static_cast<int>(fly.top_k);
  problem.offset = scalars.offset;
  problem.per_row_seed = scalars.per_row_seed;
  problem.out_tokens = call.tokens.data_ptr<int64_t>();
  problem.out_num_accepted = call.num_accepted.data_ptr<int32_t>();
  problem.out_accept_prob = call.accept_prob.data_ptr<float>();
  return call;
}

// ------------------------------------------------------------------------------------------------ token_stats, mix
// The draft/target pair of token_stats and mix as the kernels' element type T.
template <typename T, typename scalar_t>
PairProblem<T> pair_problem(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& temperature,
                            bool from_logits) {
  return {kernel_data<T, scalar_t>(draft), kernel_data<T, scalar_t>(target), draft.size(0), draft.size(1),
          target.size(1), draft.size(2), temperature.data_ptr<float>(), from_logits};
}

// token_stats: p(y), q(y), TV(p, q), log p(y), log q(y), each float32 [B, T], and the TokenStatsOut over them.
struct TokenStatsCall {
  at::Tensor target_prob, draft_prob, total_variation, target_logprob, draft_logprob;
  TokenStatsOut out;

  bool empty() const { return target_prob.numel() == 0; }
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> result() const {
    return {target_prob, draft_prob, total_variation, target_logprob, draft_logprob};
  }
};

inline TokenStatsCall start_token_stats(const at::Tensor& draft, const at::Tensor& tokens) {
  const int64_t B = draft.size(0), T = draft.size(1);
  const auto options = draft.options().dtype(at::kFloat);
  TokenStatsCall call{at::empty({B, T}, options), at::empty({B, T}, options), at::empty({B, T}, options),
                      at::empty({B, T}, options), at::empty({B, T}, options), TokenStatsOut{}};
  if (B * T > 0)
    poison_outputs(call.target_prob, call.draft_prob, call.total_variation, call.target_logprob, call.draft_logprob);
  call.out = TokenStatsOut{tokens.data_ptr<int64_t>(), call.target_prob.data_ptr<float>(),
                           call.draft_prob.data_ptr<float>(), call.total_variation.data_ptr<float>(),
                           call.target_logprob.data_ptr<float>(), call.draft_logprob.data_ptr<float>()};
  return call;
}

// distribution_features: float32 [B, T, 5] (features_math.h), and the FeaturesProblem that reads the rows.
inline at::Tensor allocate_features(const FeaturesShape& shape, const at::Tensor& like) {
  at::Tensor features =
      at::empty({shape.batch, shape.positions, kNumDistributionFeatures}, like.options().dtype(at::kFloat));
  if (features.numel() > 0) poison_outputs(features);
  return features;
}

inline FeaturesProblem features_problem(const FeaturesShape& shape, const at::Tensor& draft, const at::Tensor& target,
                                        const at::Tensor& temperature,
                                        const c10::optional<at::Tensor>& target_rows,
                                        const c10::optional<at::Tensor>& draft_rows,
                                        const c10::optional<at::Tensor>& target_temperature) {
  return FeaturesProblem{shape.batch,
                         shape.positions,
                         shape.vocab,
                         temperature.data_ptr<float>(),
                         target_temperature.has_value() ? target_temperature->data_ptr<float>() : nullptr,
                         target_rows.has_value() ? target_rows->data_ptr<int64_t>() : nullptr,
                         target.size(0),
                         draft_rows.has_value() ? draft_rows->data_ptr<int64_t>() : nullptr,
                         draft.size(0)};
}

// gate_statistics: log p(x) and E_r[log p], float32 [B, T] each (gate_math.h).
inline std::tuple<at::Tensor, at::Tensor> allocate_gate_statistics(const FeaturesShape& shape,
                                                                   const at::Tensor& like) {
  const auto options = like.options().dtype(at::kFloat);
  at::Tensor drafted = at::empty({shape.batch, shape.positions}, options);
  at::Tensor rejected = at::empty({shape.batch, shape.positions}, options);
  if (drafted.numel() > 0) poison_outputs(drafted, rejected);
  return {drafted, rejected};
}

// mix: nu float32 [B, K, V].
inline at::Tensor allocate_mixture(const at::Tensor& draft) {
  at::Tensor mixture = at::empty(draft.sizes(), draft.options().dtype(at::kFloat));
  if (mixture.numel() > 0) poison_outputs(mixture);
  return mixture;
}

// mixture_divergence: KL(nu_w || p) float32 [B, T, G].
inline at::Tensor allocate_divergence_table(const at::Tensor& draft, int64_t grid_points) {
  at::Tensor table = at::empty({draft.size(0), draft.size(1), grid_points}, draft.options().dtype(at::kFloat));
  if (table.numel() > 0) poison_outputs(table);
  return table;
}

}  // namespace diversed
