// Output allocation shared by every backend's op wrappers: the shapes and dtypes of the schemas in ops.cpp, on the
// device of the inputs, poisoned under the test hook (poison.h) so that an element a kernel forgets shows up.
// Empty outputs are returned unpoisoned: the kernels are not launched for them.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <tuple>

#include "poison.h"

namespace diversed {

// verify_probs / verify_logits: tokens int64 [B, K+1], num_accepted int32 [B], accept_prob float32 [B, K].
struct VerifyOutputs {
  at::Tensor tokens, num_accepted, accept_prob;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> as_tuple() const { return {tokens, num_accepted, accept_prob}; }
};

inline VerifyOutputs allocate_verify_outputs(const at::Tensor& draft_tokens, int64_t batch, int64_t num_positions) {
  const auto options = draft_tokens.options();
  VerifyOutputs out{at::empty({batch, num_positions + 1}, options.dtype(at::kLong)),
                    at::empty({batch}, options.dtype(at::kInt)),
                    at::empty({batch, num_positions}, options.dtype(at::kFloat))};
  if (batch > 0) poison_outputs(out.tokens, out.num_accepted, out.accept_prob);
  return out;
}

// token_stats: p(y), q(y), TV(p, q), log p(y), log q(y), each float32 [B, T].
struct TokenStatsOutputs {
  at::Tensor target_prob, draft_prob, total_variation, target_logprob, draft_logprob;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> as_tuple() const {
    return {target_prob, draft_prob, total_variation, target_logprob, draft_logprob};
  }
};

inline TokenStatsOutputs allocate_token_stats_outputs(const at::Tensor& draft, int64_t batch, int64_t length) {
  const auto options = draft.options().dtype(at::kFloat);
  TokenStatsOutputs out{at::empty({batch, length}, options), at::empty({batch, length}, options),
                        at::empty({batch, length}, options), at::empty({batch, length}, options),
                        at::empty({batch, length}, options)};
  if (batch * length > 0)
    poison_outputs(out.target_prob, out.draft_prob, out.total_variation, out.target_logprob, out.draft_logprob);
  return out;
}

// mix: nu float32 [B, K, V].
inline at::Tensor allocate_mixture(const at::Tensor& draft) {
  at::Tensor mixture = at::empty(draft.sizes(), draft.options().dtype(at::kFloat));
  if (mixture.numel() > 0) poison_outputs(mixture);
  return mixture;
}

}  // namespace diversed
