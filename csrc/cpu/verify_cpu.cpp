// Fused DIVERSED verification on the CPU.
//
// Three phases, none of which allocates a [B, K, V] temporary:
//   1. per row (parallel over rows): accept tests on gathered values; greedy rows scan nu for its argmax;
//   2. per (row, vocabulary chunk) (parallel, so a single request still uses every core): residual or bonus mass;
//   3. per row: inverse-CDF sample inside the one chunk that holds the threshold.
// Extra memory is O(B) plus a bounded number of chunk sums per row.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <vector>

#include "../verify_math.h"

namespace diversed {
namespace {

constexpr int64_t kChunkElements = 8192;  // vocabulary elements summed by one task in phase 2
constexpr int64_t kMaxChunks = 32;        // bounds the per-row scratch whatever V is
constexpr int kLanes = 8;                 // independent float64 accumulators, so the sum loop vectorises
constexpr int64_t kScanBlock = 256;       // phase 3 skips whole blocks of this size before scanning element-wise

template <typename scalar_t>
inline float load_mass(const scalar_t* row, int64_t index) {
  return sanitize_mass(static_cast<float>(row[index]));
}

// What phase 1 decides for one row.
struct RowPlan {
  int64_t first_rejection;  // m: number of accepted drafts
  int64_t sample_position;  // target row to sample from
  bool use_residual;        // sample max(0, p - q) at sample_position instead of p
  bool needs_scan;          // sampled (not greedy) final token
};

template <typename scalar_t>
int64_t argmax_mixture(const scalar_t* target_row, const scalar_t* draft_row, float weight, int64_t vocab) {
  float best_value = -1.0f;
  int64_t best_index = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    float p = load_mass(target_row, v);
    float nu = draft_row ? mix_mass(weight, p, load_mass(draft_row, v)) : p;
    if (better_candidate(nu, v, best_value, best_index)) {
      best_value = nu;
      best_index = v;
    }
  }
  return best_index;
}

template <typename scalar_t>
double chunk_mass(const scalar_t* target_row, const scalar_t* draft_row, int64_t begin, int64_t end) {
  double lanes[kLanes] = {0.0};
  int64_t v = begin;
  if (draft_row) {
    for (; v + kLanes <= end; v += kLanes)
      for (int l = 0; l < kLanes; ++l)
        lanes[l] += static_cast<double>(residual_mass(load_mass(target_row, v + l), load_mass(draft_row, v + l)));
    for (; v < end; ++v) lanes[0] += static_cast<double>(residual_mass(load_mass(target_row, v), load_mass(draft_row, v)));
  } else {
    for (; v + kLanes <= end; v += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(load_mass(target_row, v + l));
    for (; v < end; ++v) lanes[0] += static_cast<double>(load_mass(target_row, v));
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// Inverse CDF inside [begin, end) starting from `prefix`: the first index whose running sum exceeds `threshold`.
// Blocks of kScanBlock are skipped with a vectorised sum; only the block holding the threshold is scanned one
// element at a time. Falls back to the last index with positive mass, so the result always has positive mass when
// the range has any (the block sums and the element-wise running sum may round differently).
template <typename scalar_t>
int64_t scan_chunk(const scalar_t* target_row, const scalar_t* draft_row, int64_t begin, int64_t end, double prefix,
                   double threshold) {
  double running = prefix;
  int64_t last_positive = -1;
  int64_t last_nonempty_block = -1;
  for (int64_t block = begin; block < end; block += kScanBlock) {
    const int64_t block_end = std::min(end, block + kScanBlock);
    const double block_total = chunk_mass(target_row, draft_row, block, block_end);
    if (!(block_total > 0.0)) continue;
    last_nonempty_block = block;
    if (running + block_total <= threshold) {
      running += block_total;
      continue;
    }
    for (int64_t v = block; v < block_end; ++v) {
      const float p = load_mass(target_row, v);
      const float mass = draft_row ? residual_mass(p, load_mass(draft_row, v)) : p;
      if (mass > 0.0f) {
        running += static_cast<double>(mass);
        last_positive = v;
        if (running > threshold) return v;
      }
    }
  }
  if (last_positive < 0 && last_nonempty_block >= 0) {
    const int64_t block_end = std::min(end, last_nonempty_block + kScanBlock);
    for (int64_t v = last_nonempty_block; v < block_end; ++v) {
      const float p = load_mass(target_row, v);
      if ((draft_row ? residual_mass(p, load_mass(draft_row, v)) : p) > 0.0f) last_positive = v;
    }
  }
  return last_positive;
}

template <typename scalar_t>
void verify_probs_kernel(const at::Tensor& draft_tokens, const at::Tensor& draft_probs, const at::Tensor& target_probs,
                         const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& greedy,
                         const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset,
                         bool per_row_seed, at::Tensor& tokens, at::Tensor& num_accepted, at::Tensor& accept_prob) {
  const int64_t batch = draft_probs.size(0);
  const int64_t num_positions = draft_probs.size(1);
  const int64_t vocab = draft_probs.size(2);

  const int64_t* token_ptr = draft_tokens.data_ptr<int64_t>();
  const scalar_t* draft_ptr = draft_probs.data_ptr<scalar_t>();
  const scalar_t* target_ptr = target_probs.data_ptr<scalar_t>();
  const float* weight_ptr = weight.data_ptr<float>();
  const int64_t* num_draft_ptr = num_draft.data_ptr<int64_t>();
  const bool* greedy_ptr = greedy.data_ptr<bool>();
  const double* uniform_ptr = uniforms.has_value() ? uniforms->data_ptr<double>() : nullptr;
  const int64_t* seed_ptr = seeds.data_ptr<int64_t>();
  int64_t* out_tokens = tokens.data_ptr<int64_t>();
  int32_t* out_accepted = num_accepted.data_ptr<int32_t>();
  float* out_accept_prob = accept_prob.data_ptr<float>();

  auto uniform_at = [&](int64_t row, int64_t position) -> double {
    if (uniform_ptr) return sanitize_uniform(uniform_ptr[row * (num_positions + 1) + position]);
    return philox_uniform(seed_ptr[row], offset, per_row_seed ? 0 : row, position);
  };
  auto target_row_ptr = [&](int64_t row, int64_t position) {
    return target_ptr + (row * (num_positions + 1) + position) * vocab;
  };
  auto draft_row_ptr = [&](int64_t row, int64_t position) { return draft_ptr + (row * num_positions + position) * vocab; };

  std::vector<RowPlan> plans(batch);

  // Phase 1: accept tests. Greedy rows need a scan of nu per position, so give them small grains.
  at::parallel_for(0, batch, 1, [&](int64_t row_begin, int64_t row_end) {
    for (int64_t row = row_begin; row < row_end; ++row) {
      const int64_t drafted = std::min(std::max<int64_t>(num_draft_ptr[row], 0), num_positions);
      const bool is_greedy = greedy_ptr[row];
      int64_t first_rejection = drafted;
      int64_t rejected_argmax = 0;
      for (int64_t i = 0; i < drafted; ++i) {
        const int64_t token = token_ptr[row * num_positions + i];
        const bool valid = token >= 0 && token < vocab;
        const float w = sanitize_weight(weight_ptr[row * num_positions + i]);
        const scalar_t* target_row = target_row_ptr(row, i);
        const scalar_t* draft_row = draft_row_ptr(row, i);
        bool accepted = false;
        float probability = 0.0f;
        if (is_greedy) {
          const int64_t best = argmax_mixture(target_row, draft_row, w, vocab);
          accepted = valid && token == best;
          probability = accepted ? 1.0f : 0.0f;
          if (!accepted && first_rejection == drafted) rejected_argmax = best;
        } else if (valid) {
          const float q = load_mass(draft_row, token);
          const float nu = mix_mass(w, load_mass(target_row, token), q);
          probability = accept_probability(nu, q);
          accepted = accept_draft(uniform_at(row, i), q, nu);
        }
        out_accept_prob[row * num_positions + i] = probability;
        if (!accepted && first_rejection == drafted) first_rejection = i;
      }
      for (int64_t i = drafted; i < num_positions; ++i) out_accept_prob[row * num_positions + i] = 0.0f;

      int64_t* row_tokens = out_tokens + row * (num_positions + 1);
      for (int64_t i = 0; i < first_rejection; ++i) row_tokens[i] = token_ptr[row * num_positions + i];
      for (int64_t i = first_rejection; i <= num_positions; ++i) row_tokens[i] = -1;
      out_accepted[row] = static_cast<int32_t>(first_rejection);

      RowPlan plan;
      plan.first_rejection = first_rejection;
      plan.sample_position = first_rejection;
      plan.use_residual = first_rejection < drafted &&
                          sanitize_weight(weight_ptr[row * num_positions + first_rejection]) > 0.0f;
      plan.needs_scan = !is_greedy;
      if (is_greedy) {
        row_tokens[first_rejection] = first_rejection < drafted
                                          ? rejected_argmax
                                          : argmax_mixture(target_row_ptr(row, drafted), (const scalar_t*)nullptr,
                                                           1.0f, vocab);
      }
      plans[row] = plan;
    }
  });

  // Phase 2: mass per (row, chunk) for every sampled row.
  const int64_t num_chunks = std::min(kMaxChunks, std::max<int64_t>(1, (vocab + kChunkElements - 1) / kChunkElements));
  const int64_t chunk_size = (vocab + num_chunks - 1) / num_chunks;
  std::vector<double> chunk_sums(batch * num_chunks, 0.0);
  at::parallel_for(0, batch * num_chunks, 1, [&](int64_t task_begin, int64_t task_end) {
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t row = task / num_chunks;
      const RowPlan& plan = plans[row];
      if (!plan.needs_scan) continue;
      const int64_t begin = (task % num_chunks) * chunk_size;
      const int64_t end = std::min(vocab, begin + chunk_size);
      if (begin >= end) continue;
      const scalar_t* draft_row = plan.use_residual ? draft_row_ptr(row, plan.sample_position) : nullptr;
      chunk_sums[task] = chunk_mass(target_row_ptr(row, plan.sample_position), draft_row, begin, end);
    }
  });

  // Phase 3: locate the chunk holding u * total and scan only that chunk.
  at::parallel_for(0, batch, 1, [&](int64_t row_begin, int64_t row_end) {
    for (int64_t row = row_begin; row < row_end; ++row) {
      const RowPlan& plan = plans[row];
      if (!plan.needs_scan) continue;
      double* sums = chunk_sums.data() + row * num_chunks;
      const scalar_t* target_row = target_row_ptr(row, plan.sample_position);
      const scalar_t* draft_row = plan.use_residual ? draft_row_ptr(row, plan.sample_position) : nullptr;
      double total = 0.0;
      for (int64_t c = 0; c < num_chunks; ++c) total += sums[c];
      if (!(total > 0.0) && draft_row) {
        // Zero residual: the target already puts no more mass anywhere than the draft, so sample p itself.
        draft_row = nullptr;
        total = 0.0;
        for (int64_t c = 0; c < num_chunks; ++c) {
          const int64_t begin = c * chunk_size;
          sums[c] = begin < vocab ? chunk_mass(target_row, draft_row, begin, std::min(vocab, begin + chunk_size)) : 0.0;
          total += sums[c];
        }
      }
      int64_t chosen = 0;  // an all-zero target row has no valid sample; token 0 keeps the id in range
      if (total > 0.0) {
        const double threshold = uniform_at(row, num_positions) * total;
        double prefix = 0.0;
        int64_t last_nonempty = -1;
        chosen = -1;
        for (int64_t c = 0; c < num_chunks && chosen < 0; ++c) {
          if (!(sums[c] > 0.0)) continue;
          last_nonempty = c;
          const int64_t begin = c * chunk_size;
          if (prefix + sums[c] > threshold)
            chosen = scan_chunk(target_row, draft_row, begin, std::min(vocab, begin + chunk_size), prefix, threshold);
          prefix += sums[c];
        }
        if (chosen < 0) {  // rounding put the threshold past the last chunk: take its last positive entry
          const int64_t begin = last_nonempty * chunk_size;
          chosen = scan_chunk(target_row, draft_row, begin, std::min(vocab, begin + chunk_size), 0.0, 1e308);
        }
      }
      out_tokens[row * (num_positions + 1) + plan.first_rejection] = chosen;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_probs_cpu(
    const at::Tensor& draft_tokens, const at::Tensor& draft_probs, const at::Tensor& target_probs,
    const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& greedy,
    const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset, bool per_row_seed) {
  // Last line of defence: the Python layer has already produced these exact layouts.
  TORCH_CHECK(draft_probs.dim() == 3 && target_probs.dim() == 3, "diversed::verify_probs: probabilities must be 3-D");
  const int64_t batch = draft_probs.size(0), num_positions = draft_probs.size(1), vocab = draft_probs.size(2);
  TORCH_CHECK(vocab > 0, "diversed::verify_probs: vocabulary size must be positive");
  TORCH_CHECK(target_probs.size(0) == batch && target_probs.size(1) == num_positions + 1 && target_probs.size(2) == vocab,
              "diversed::verify_probs: target_probs must be [B, K+1, V]");
  TORCH_CHECK(draft_probs.scalar_type() == target_probs.scalar_type(), "diversed::verify_probs: dtype mismatch");
  TORCH_CHECK(draft_probs.is_contiguous() && target_probs.is_contiguous(), "diversed::verify_probs: non-contiguous");
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong && draft_tokens.is_contiguous() &&
                  draft_tokens.numel() == batch * num_positions,
              "diversed::verify_probs: draft_tokens must be contiguous int64 [B, K]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == batch * num_positions,
              "diversed::verify_probs: weight must be contiguous float32 [B, K]");
  TORCH_CHECK(num_draft.scalar_type() == at::kLong && num_draft.is_contiguous() && num_draft.numel() == batch,
              "diversed::verify_probs: num_draft must be contiguous int64 [B]");
  TORCH_CHECK(greedy.scalar_type() == at::kBool && greedy.is_contiguous() && greedy.numel() == batch,
              "diversed::verify_probs: greedy must be contiguous bool [B]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.is_contiguous() && seeds.numel() == batch,
              "diversed::verify_probs: seeds must be contiguous int64 [B]");
  if (uniforms.has_value())
    TORCH_CHECK(uniforms->scalar_type() == at::kDouble && uniforms->is_contiguous() &&
                    uniforms->numel() == batch * (num_positions + 1),
                "diversed::verify_probs: uniforms must be contiguous float64 [B, K+1]");

  auto tokens = at::empty({batch, num_positions + 1}, draft_tokens.options().dtype(at::kLong));
  auto num_accepted = at::empty({batch}, draft_tokens.options().dtype(at::kInt));
  auto accept_prob = at::empty({batch, num_positions}, draft_tokens.options().dtype(at::kFloat));
  if (batch == 0) return {tokens, num_accepted, accept_prob};
  // Test hook: fill the outputs with garbage first, so a test notices any element the kernel forgets to write.
  if (std::getenv("DIVERSED_POISON_OUTPUTS") != nullptr) {
    tokens.fill_(0x5A5A5A5A);
    num_accepted.fill_(-777);
    accept_prob.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_probs.scalar_type(), "verify_probs_cpu", [&] {
    verify_probs_kernel<scalar_t>(draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms, seeds,
                                  offset, per_row_seed, tokens, num_accepted, accept_prob);
  });
  return {tokens, num_accepted, accept_prob};
}

}  // namespace

TORCH_LIBRARY_IMPL(diversed, CPU, m) { m.impl("verify_probs", &verify_probs_cpu); }

}  // namespace diversed
