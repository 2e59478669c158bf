// CPU bindings of the `diversed` ops: argument checks, output allocation, one kernel call per op. The kernels are
// torch-free (verify_kernels.h, stats_kernels.h), compiled per instruction set and picked at run time
// (cpu_dispatch.h); this file hands them raw pointers and at::parallel_for.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../common/op_checks.h"
#include "../common/op_outputs.h"
#include "cpu_dispatch.h"
#include "int8_gemm.h"

namespace diversed {
namespace cpu {
namespace {

// The kernels are written over torch-free bit wrappers of the 16-bit types.
template <typename scalar_t>
using CpuElement = kernel_element_t<HalfBits, BFloat16Bits, scalar_t>;

// The kernels pick their grain (kernel_prelude.h); a range within one grain runs inline.
void run_parallel_for(int64_t begin, int64_t end, int64_t grain, ParallelFor::Thunk thunk, const void* body) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { thunk(body, b, e); });
}
int thread_count() { return at::get_num_threads(); }
constexpr ParallelFor kParallelFor{&run_parallel_for, &thread_count};

using VerifyTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

using OptionalTensor = c10::optional<at::Tensor>;

VerifyTuple verify_probs_cpu(const at::Tensor& draft_tokens, const at::Tensor& draft_probs,
                             const at::Tensor& target_probs, const OptionalTensor& weight,
                             const OptionalTensor& num_draft, const OptionalTensor& greedy,
                             const OptionalTensor& uniforms, const OptionalTensor& seeds, int64_t offset,
                             bool per_row_seed, double weight_value, c10::optional<int64_t> seed) {
  const VerifyOptionals optional{weight, num_draft, greedy, uniforms, seeds};
  check_verify_args(VerifyInput::kProbs, draft_tokens, draft_probs, target_probs, optional);
  const VerifyCall call = start_verify(VerifyInput::kProbs, draft_tokens, draft_probs, optional,
                                       VerifyScalars{weight_value, 1.0, seed, offset, per_row_seed});
  if (call.empty()) return call.result();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_probs.scalar_type(), "verify_probs_cpu", [&] {
    using T = CpuElement<scalar_t>;
    DIVERSED_CPU_CALL(verify_probs<T>, call.problem, kernel_data<T, scalar_t>(draft_probs),
                      kernel_data<T, scalar_t>(target_probs), kParallelFor);
  });
  return call.result();
}

VerifyTuple verify_logits_cpu(const at::Tensor& draft_tokens, const at::Tensor& draft_logits,
                              const at::Tensor& target_logits, const OptionalTensor& weight,
                              const OptionalTensor& num_draft, const OptionalTensor& temperature,
                              const OptionalTensor& uniforms, const OptionalTensor& seeds, int64_t offset,
                              bool per_row_seed, double weight_value, double temperature_value,
                              c10::optional<int64_t> seed) {
  const VerifyOptionals optional{weight, num_draft, temperature, uniforms, seeds};
  check_verify_args(VerifyInput::kLogits, draft_tokens, draft_logits, target_logits, optional);
  const VerifyCall call = start_verify(VerifyInput::kLogits, draft_tokens, draft_logits, optional,
                                       VerifyScalars{weight_value, temperature_value, seed, offset, per_row_seed});
  if (call.empty()) return call.result();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_logits.scalar_type(), "verify_logits_cpu", [&] {
    using T = CpuElement<scalar_t>;
    DIVERSED_CPU_CALL(verify_logits<T>, call.problem, kernel_data<T, scalar_t>(draft_logits),
                      kernel_data<T, scalar_t>(target_logits), kParallelFor);
  });
  return call.result();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_cpu(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& temperature,
    bool from_logits) {
  check_token_stats_args(draft, target, tokens, temperature);
  const TokenStatsCall call = start_token_stats(draft, tokens);
  if (call.empty()) return call.result();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "token_stats_cpu", [&] {
    using T = CpuElement<scalar_t>;
    DIVERSED_CPU_CALL(token_stats<T>, pair_problem<T, scalar_t>(draft, target, temperature, from_logits), call.out,
                      kParallelFor);
  });
  return call.result();
}

// nu = w p + (1 - w) q materialised as float32 [B, K, V]; target may carry extra positions (K+1), which are ignored.
at::Tensor mix_cpu(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                   const at::Tensor& temperature, bool from_logits) {
  check_mix_args(draft, target, weight, temperature);
  at::Tensor mixture = allocate_mixture(draft);
  if (mixture.numel() == 0) return mixture;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "mix_cpu", [&] {
    using T = CpuElement<scalar_t>;
    DIVERSED_CPU_CALL(mix<T>, pair_problem<T, scalar_t>(draft, target, temperature, from_logits),
                      weight.data_ptr<float>(), mixture.data_ptr<float>(), kParallelFor);
  });
  return mixture;
}

constexpr const char* kInt8PackOp = "diversed::int8_pack";
constexpr const char* kInt8LinearOp = "diversed::int8_linear";

// weight int8 [N, K] -> (packed int8 [int8::packed_size(N, K)], col_sums int32 [N]): the layout int8_linear reads.
std::tuple<at::Tensor, at::Tensor> int8_pack_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, kInt8PackOp, ": weight must be a 2-D int8 tensor");
  const at::Tensor contiguous = weight.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor packed = at::empty({int8::packed_size(N, K)}, weight.options());
  at::Tensor col_sums = at::empty({N}, weight.options().dtype(at::kInt));
  poison_outputs(col_sums);  // packed is zeroed by pack_weight itself (its padding must be zero)
  int8::pack_weight(contiguous.data_ptr<int8_t>(), N, K, packed.data_ptr<int8_t>(), col_sums.data_ptr<int32_t>());
  return {packed, col_sums};
}

// input float32 [..., K] -> [..., N], N = w_scale's length: fbgemm's dynamic int8 linear layer over packed weights.
at::Tensor int8_linear_cpu(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& col_sums,
                           const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                           at::OptionalIntArrayRef row_groups) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() >= 1 && input.size(-1) > 0, kInt8LinearOp,
              ": input must be float32 with a non-empty last dimension");
  const int64_t K = input.size(-1), N = w_scale.numel();
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 1 && w_scale.is_contiguous(), kInt8LinearOp,
              ": w_scale must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(col_sums.scalar_type() == at::kInt && col_sums.is_contiguous() && col_sums.numel() == N, kInt8LinearOp,
              ": col_sums must be contiguous int32 with ", N, " elements (one per output feature)");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 1 &&
                  packed.numel() == int8::packed_size(N, K),
              kInt8LinearOp, ": packed must be the int8_pack of an [", N, ", ", K, "] weight (",
              int8::packed_size(N, K), " int8 elements)");
  if (bias.has_value()) check_float_vector(*bias, N, kInt8LinearOp, "bias");
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = N;
  at::Tensor out = at::empty(shape, input.options());
  const int64_t M = input.numel() / K;
  // Rows quantised together: the whole input by default, else consecutive groups of the given sizes.
  std::vector<int64_t> group_rows{M};
  if (row_groups.has_value()) {
    group_rows.assign(row_groups->begin(), row_groups->end());
    int64_t total = 0;
    for (const int64_t rows : group_rows) {
      TORCH_CHECK(rows >= 1, kInt8LinearOp, ": row_groups must hold sizes >= 1, got ", rows);
      total += rows;
    }
    TORCH_CHECK(total == M, kInt8LinearOp, ": row_groups must add up to the input's ", M, " rows, got ", total);
  }
  if (M == 0 || N == 0) return out;
  poison_outputs(out);
  const at::Tensor x = input.contiguous();
  const int64_t groups = int8::group_count(K);
  const bool vnni = int8::use_vnni();
  at::Tensor xq = at::empty({M, groups * int8::kGroup}, input.options().dtype(at::kByte));
  std::vector<int8::ActivationParams> row_params(static_cast<size_t>(M));
  int8::quantize_input(x.data_ptr<float>(), M, K, groups * int8::kGroup, group_rows.data(),
                       static_cast<int64_t>(group_rows.size()), vnni, xq.data_ptr<uint8_t>(), row_params.data());
  const int8::GemmProblem problem{xq.data_ptr<uint8_t>(), packed.data_ptr<int8_t>(), col_sums.data_ptr<int32_t>(),
                                  w_scale.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                  out.data_ptr<float>(), M, N, groups, row_params.data()};
  int8::gemm(problem, vnni, kParallelFor);
  return out;
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(diversed, CPU, m) {
  m.impl("verify_probs", &cpu::verify_probs_cpu);
  m.impl("verify_logits", &cpu::verify_logits_cpu);
  m.impl("token_stats", &cpu::token_stats_cpu);
  m.impl("mix", &cpu::mix_cpu);
  m.impl("int8_pack", &cpu::int8_pack_cpu);
  m.impl("int8_linear", &cpu::int8_linear_cpu);
}

}  // namespace diversed
