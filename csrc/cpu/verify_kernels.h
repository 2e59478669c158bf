// Fused DIVERSED verification on the CPU, from probabilities or from logits: torch-free kernels over a VerifyProblem
// (csrc/common/problems.h), compiled once per instruction set (see cpu_kernels.h).
//
// Three phases per request, whichever the input, in one parallel region (see VerifyLayout):
//   1. accept tests on gathered values; greedy rows scan nu for its argmax;
//   2. residual or bonus mass per block of kBlock elements, kept (split over threads by vocabulary chunks when there
//      are fewer requests than threads);
//   3. inverse-CDF sample: the block sums find the one block that holds the threshold, which alone is read again.
// No [B, K, V] temporary; extra memory is O(B) plus V / kBlock block sums per row in flight. Logits are never turned
// into probabilities: each row the request reads gets its softmax normaliser (max and 1 / sum exp) in a first pass,
// and every later pass recomputes softmax(v) on the fly.
#pragma once

#include "check_kernels.h"
#include "kernel_prelude.h"
#include "row_ops.h"
#include "verify_rows.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

constexpr int64_t kChunkElements = 8192;  // vocabulary elements per parallel task of phase 2
constexpr int64_t kMaxChunks = 32;        // bounds the tasks per row whatever V is

// What the accept phase decides for one row.
struct RowPlan {
  int64_t num_accepted;   // m, also the position of the final token
  bool use_residual;      // sample max(0, p_m - q_m) rather than p_m
  bool needs_sample;      // sampled row (greedy rows are finished in the accept phase)
};

// FLy's entropy of one target row (fly_math.h) in one pass: the masses come kLanes at a time and each is offered to
// the top-k list, where one below the list's floor (nearly every one) costs a compare.
template <typename Row>
double fly_row_entropy(const Row& target, int64_t vocab, int top_k) {
  FlyTopK top(top_k);
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const FloatLanes masses = target.mass_lanes(v);
    float lane[kLanes];
    __builtin_memcpy(lane, &masses, sizeof lane);
    for (int j = 0; j < kLanes; ++j) top.offer(lane[j]);
  }
  for (; v < vocab; ++v) top.offer(target.mass(v));
  return fly_entropy(top);
}

// The mass of a row at a drafted id, 0 for an id outside [0, V).
template <typename Row>
float valid_token_mass(const Row& row, int64_t token, int64_t vocab) {
  return token >= 0 && token < vocab ? row.mass(token) : 0.0f;
}

// Accept tests of one row; greedy rows also get their final token here. `Rows` provides draft(row, i) and
// target(row, i) returning Row policies. The tests run at every drafted position (accept_prob reports each), and
// a FlyWalk turns them into the accepted length: the first failure, or with FLy a later one (a position's entropy is
// computed only once its window has passed). A draft the target forbids verifies with w = 1 (verify_weight): never
// accepted, never deferred, and its correction is the residual's.
template <typename Rows>
RowPlan accept_row(const VerifyProblem& problem, const Rows& rows, int64_t row) {
  const int64_t K = problem.num_positions;
  const int64_t drafted = problem.drafted(row);
  const bool is_greedy = problem.greedy_at(row);
  FlyWalk walk(drafted, problem.fly.window_at(row, K));
  int64_t rejected_argmax = 0;
  for (int64_t i = 0; i < drafted; ++i) {
    const int64_t token = problem.draft_tokens[row * K + i];
    const bool valid = token >= 0 && token < problem.vocab;
    const auto target = rows.target(row, i);
    const auto draft = rows.draft(row, i);
    bool accepted = false;
    float probability = 0.0f;
    const float p = valid ? target.mass(token) : 0.0f;
    const float q = valid ? draft.mass(token) : 0.0f;
    int64_t best = 0;
    if (is_greedy) {
      // The argmax over the support is never a forbidden token, unless the target has no support at all.
      best = argmax_mixture(target, &draft, problem.weight_at(row, i), problem.vocab);
      accepted = valid && token == best && !target_forbids(p);
      probability = accepted ? 1.0f : 0.0f;
    } else if (valid) {
      const float nu = mix_mass(verify_weight(problem.weight_at(row, i), p), p, q);
      probability = accept_probability(nu, q);
      accepted = accept_draft(problem.uniform(row, i), q, nu);
    }
    problem.out_accept_prob[row * K + i] = probability;
    // A failure while no rejection is pending is this position's (pending or final); one inside a window ends the
    // walk at the pending position, whose argmax is already kept.
    if (!accepted && !walk.decided() && walk.pending < 0) rejected_argmax = best;
    const int64_t asked = walk.feed(i, accepted, fly_deferrable(is_greedy, valid, p, q));
    if (asked >= 0)
      walk.settle(fly_entropy_passes(fly_row_entropy(rows.target(row, asked), problem.vocab, problem.fly.top_k),
                                     problem.fly.threshold_at(row)));
  }
  const int64_t num_accepted = walk.accepted_length();
  for (int64_t i = drafted; i < K; ++i) problem.out_accept_prob[row * K + i] = 0.0f;

  int64_t* row_tokens = problem.out_tokens + row * (K + 1);
  for (int64_t i = 0; i < num_accepted; ++i) row_tokens[i] = problem.draft_tokens[row * K + i];
  for (int64_t i = num_accepted; i <= K; ++i) row_tokens[i] = -1;
  problem.out_num_accepted[row] = static_cast<int32_t>(num_accepted);

  const bool rejected = num_accepted < drafted;
  // The weight at the rejection decides between the residual and p: 1 where the target forbids the draft.
  const float final_weight =
      rejected ? problem.verify_weight_at(row, num_accepted,
                                          valid_token_mass(rows.target(row, num_accepted),
                                                           problem.draft_tokens[row * K + num_accepted], problem.vocab))
               : 1.0f;
  if (is_greedy) {
    const auto bonus_row = rows.target(row, drafted);
    row_tokens[num_accepted] =
        rejected ? rejected_argmax : argmax_mixture(bonus_row, static_cast<decltype(&bonus_row)>(nullptr), 1.0f,
                                                    problem.vocab);
  }
  return RowPlan{num_accepted, rejected && final_weight > 0.0f, !is_greedy};
}

// The draft row at the first rejection, built only when its residual is sampled (with K = 0 there is no draft row,
// and the logits policy would otherwise read a normaliser that does not exist).
template <typename Rows>
auto residual_draft_row(const Rows& rows, const RowPlan& plan, int64_t row)
    -> std::optional<decltype(rows.draft(row, 0))> {
  if (!plan.use_residual) return std::nullopt;
  return rows.draft(row, plan.num_accepted);
}

// Vocabulary chunks of the chunks layout: at most kMaxChunks per row, each a whole number of kBlock blocks (so the
// block sums, and therefore the sample, do not depend on the layout); the last may be short.
struct ChunkLayout {
  int64_t num_chunks, chunk_size, vocab;

  explicit ChunkLayout(int64_t V)
      : num_chunks(std::min(kMaxChunks, std::max<int64_t>(1, (V + kChunkElements - 1) / kChunkElements))),
        chunk_size(((V + num_chunks - 1) / num_chunks + kBlock - 1) / kBlock * kBlock),
        vocab(V) {}
  int64_t begin(int64_t c) const { return std::min(vocab, c * chunk_size); }
  int64_t end(int64_t c) const { return std::min(vocab, c * chunk_size + chunk_size); }
};

// How a call spreads over threads. By rows: ONE parallel region over the requests, each task taking its requests
// from the accept tests to the final sample; rows are grouped so that a task reads at least kMinTaskElements, so a
// small call never forks. By chunks (fewer requests than threads, and rows long enough to share): the residual sums
// are split per (request, vocabulary chunk), so one request still uses every core; the accept tests and the sample,
// which read a few values and one chunk, run on the calling thread.
enum class VerifyLayout { kRows, kChunks };

inline VerifyLayout verify_layout(int64_t batch, int64_t vocab, const ParallelFor& parallel_for) {
  return batch < parallel_for.threads() && vocab >= 2 * kMinTaskElements ? VerifyLayout::kChunks
                                                                         : VerifyLayout::kRows;
}

// The final token of a sampled row from its block sums (blocks_of(V) of them, filled by block_masses): the total is
// their sum in order, and the inverse CDF reads only the block that holds the threshold.
template <typename Rows>
void sample_row(const VerifyProblem& problem, const Rows& rows, const RowPlan& plan, int64_t row,
                double* block_sums) {
  const int64_t V = problem.vocab, num_blocks = blocks_of(V);
  const auto target_row = rows.target(row, plan.num_accepted);
  const auto draft_row = residual_draft_row(rows, plan, row);
  with_mass_rows(target_row, draft_row ? &*draft_row : nullptr, [&](const auto& target, const auto* draft) {
    double total = 0.0;
    for (int64_t b = 0; b < num_blocks; ++b) total += block_sums[b];
    if (!(total > 0.0) && draft) {
      // Zero residual: the target puts no more mass anywhere than the draft does, so sample p itself.
      draft = nullptr;
      block_masses(target, draft, 0, V, block_sums);
      total = 0.0;
      for (int64_t b = 0; b < num_blocks; ++b) total += block_sums[b];
    }
    int64_t chosen = 0;  // a target row without mass has no valid sample; 0 keeps the id in range
    if (total > 0.0)
      chosen = inverse_cdf(target, draft, block_sums, V, problem.uniform(row, problem.num_positions) * total);
    problem.out_tokens[row * (problem.num_positions + 1) + plan.num_accepted] = chosen;
  });
}

// Residual (or bonus) mass of the blocks of one vocabulary range of a sampled row, into the row's block sums.
template <typename Rows>
void range_block_masses(const Rows& rows, const RowPlan& plan, int64_t row, int64_t begin, int64_t end,
                        double* block_sums) {
  const auto target = rows.target(row, plan.num_accepted);
  const auto draft = residual_draft_row(rows, plan, row);
  with_mass_rows(target, draft ? &*draft : nullptr, [&](const auto& mass_target, const auto* mass_draft) {
    block_masses(mass_target, mass_draft, begin, end, block_sums + begin / kBlock);
  });
}

// Fused verification in the given layout. In the rows layout, prepare_row(row) runs first in each request's task and
// prepare_bonus(row) before a sampled row draws its bonus token (all drafts accepted); with chunks, the caller prepares
// every row beforehand.
template <typename Rows, typename Prepare, typename PrepareBonus>
void run_verify(const VerifyProblem& problem, const Rows& rows, const ParallelFor& parallel_for, VerifyLayout layout,
                const Prepare& prepare_row, const PrepareBonus& prepare_bonus) {
  const int64_t B = problem.batch, V = problem.vocab, num_blocks = blocks_of(V);
  if (layout == VerifyLayout::kRows) {
    parallel_for(0, B, grain_for(2 * V), [&](int64_t begin, int64_t end) {
      std::vector<double> block_sums(num_blocks);
      for (int64_t row = begin; row < end; ++row) {
        prepare_row(row);
        const RowPlan plan = accept_row(problem, rows, row);
        if (!plan.needs_sample) continue;
        if (plan.num_accepted == problem.drafted(row)) prepare_bonus(row);
        range_block_masses(rows, plan, row, 0, V, block_sums.data());
        sample_row(problem, rows, plan, row, block_sums.data());
      }
    });
    return;
  }
  const ChunkLayout chunks(V);
  const int64_t num_chunks = chunks.num_chunks;
  std::vector<RowPlan> plans(B);
  for (int64_t row = 0; row < B; ++row) plans[row] = accept_row(problem, rows, row);
  std::vector<double> block_sums(B * num_blocks, 0.0);
  parallel_for(0, B * num_chunks, grain_for(chunks.chunk_size * 2), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / num_chunks, c = task % num_chunks;
      if (plans[row].needs_sample)
        range_block_masses(rows, plans[row], row, chunks.begin(c), chunks.end(c), block_sums.data() + row * num_blocks);
    }
  });
  for (int64_t row = 0; row < B; ++row)
    if (plans[row].needs_sample) sample_row(problem, rows, plans[row], row, block_sums.data() + row * num_blocks);
}

// ------------------------------------------------------------------------------------------ entry points
// Called by the binding (ops_cpu.cpp, through cpu_dispatch.h) after the checks and the allocation of the outputs.

// The rows as the passes see them: as they are, or with one-hot draft rows when the draft tensor is absent. Only a
// call whose draft and target share an element type may lack a draft (the binding dispatches a tokens-only call on
// the target's type alone), so the mixed-type instantiations carry no tokens-only passes.
template <typename TD, typename TT, typename Rows, typename Body>
void with_draft_rows(const VerifyProblem& problem, const Rows& rows, bool has_draft, const Body& body) {
  if constexpr (std::is_same_v<TD, TT>) {
    if (!has_draft) {
      body(TokenDraftRows<Rows>{rows, problem.draft_tokens, problem.num_positions, problem.vocab});
      return;
    }
  }
  body(rows);
}

// verify_probs: draft probabilities [B, K, V] of element type TD (or nullptr: tokens only, with TD = TT), target
// probabilities [B, K+1, V] of type TT; either may be a row tensor [R, V] that the problem's target_rows / draft_rows
// index. problem.greedy is set.
template <typename TD, typename TT>
void verify_probs(const VerifyProblem& problem, const TD* draft_probs, const TT* target_probs,
                  const ParallelFor& parallel_for) {
  const ProbRows<TD, TT> prob_rows{draft_probs, target_probs, &problem};
  with_draft_rows<TD, TT>(problem, prob_rows, draft_probs != nullptr, [&](const auto& rows) {
    run_verify(problem, rows, parallel_for, verify_layout(problem.batch, problem.vocab, parallel_for),
               [](int64_t) {}, [](int64_t) {});
  });
}

// verify_logits: draft logits [B, K, V] of type TD (or nullptr: tokens only, with TD = TT), target logits
// [B, K+1, V] of type TT (either may be a row tensor, as in verify_probs), temperatures from the problem. Each row the
// request reads gets its softmax normaliser first (inside the request's own task when the layout is by rows, where a
// sampled row's bonus normaliser waits until the bonus is drawn); the greedy flags come from the temperatures.
template <typename TD, typename TT>
void verify_logits(const VerifyProblem& problem, const TD* draft_logits, const TT* target_logits,
                   const ParallelFor& parallel_for) {
  const TemperaturePlan temperatures = plan_temperatures(problem);
  SoftmaxStatsPlan<TD, TT> stats(problem, draft_logits, target_logits, temperatures.inverse.data(),
                                 temperatures.target_inverse.data());
  const VerifyLayout layout = verify_layout(problem.batch, problem.vocab, parallel_for);
  if (layout == VerifyLayout::kChunks) stats.compute_all(parallel_for);
  const LogitRows<TD, TT> logit_rows{draft_logits, target_logits, &problem, temperatures.inverse.data(),
                                temperatures.target_inverse.data(), stats.draft_stats.data(),
                                stats.target_stats.data(), stats.draft_vouched.data(), stats.target_vouched.data()};
  VerifyProblem with_greedy = problem;
  with_greedy.greedy = temperatures.greedy.get();
  with_draft_rows<TD, TT>(problem, logit_rows, draft_logits != nullptr, [&](const auto& rows) {
    run_verify(
        with_greedy, rows, parallel_for, layout,
        [&](int64_t row) { stats.compute_row(row, with_greedy.greedy_at(row)); },
        [&](int64_t row) { stats.compute_bonus(row); });
  });
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
