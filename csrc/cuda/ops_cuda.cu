// CUDA bindings of the six `diversed` ops: argument and device checks, output allocation, the kernel launches.
// Nothing here reads device memory, so a call never syncs with the host (CUDA graphs can capture it). The kernels are
// torch-free headers: verify_kernels.cuh and split_kernels.cuh (verify_probs, verify_logits: two families, picked by
// diversed_ext.set_cuda_kernels, common/kernel_family.h; compiled in translation units of their own, see
// verify_instances.cuh) and stats_kernels.cuh (token_stats, mix, distribution_features, gate_statistics).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <tuple>

#include "../common/kernel_family.h"
#include "../common/op_checks.h"
#include "../common/op_outputs.h"
#include "stats_kernels.cuh"
#include "verify_instances.cuh"

namespace diversed {
namespace gpu {

// The verify launchers are compiled in their own translation units (verify_instances.cuh).
#define DX_DECLARE_LAUNCHERS(TD, TT)                                                                            \
  DX_BLOCK_PROBS_INSTANCE(extern, TD, TT) DX_BLOCK_LOGITS_INSTANCE(extern, TD, TT)                            \
  DX_SPLIT_PROBS_INSTANCE(extern, TD, TT) DX_SPLIT_LOGITS_INSTANCE(extern, TD, TT)
DX_VERIFY_TYPE_PAIRS(DX_DECLARE_LAUNCHERS)
#undef DX_DECLARE_LAUNCHERS

namespace {

// The kernels are written over CUDA's 16-bit types.
template <typename scalar_t>
using CudaElement = kernel_element_t<__half, __nv_bfloat16, scalar_t>;

void check_same_device(const char* op, const at::Device& device, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device() == device, op, ": every tensor must be on the same device (", device, "), got one on ",
              tensor.device());
}

// The first tensor decides the device, which must be a CUDA device; the rest must share it.
template <typename... Tensors>
void check_cuda_device(const char* op, const at::Tensor& first, const Tensors&... rest) {
  TORCH_CHECK(first.is_cuda(), op, ": CUDA kernel called with tensors on ", first.device());
  (check_same_device(op, first.device(), rest), ...);
}

// One thread block per row: the grid's x dimension bounds the number of rows of one launch.
void check_grid_rows(const char* op, int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), op, ": too many rows for one launch (", rows, ")");
}

// ------------------------------------------------------------------------------------------------ verify helpers
// The split kernels decide each request's accepted length in every block of the request from gathered values alone,
// before any block has read a whole row; FLy's entropy needs the whole target row at a rejected position, which
// only the block kernels (one block per request) read. Refused rather than run with other kernels than the ones
// diversed_ext.set_cuda_kernels asked for (the default, "auto", runs such a call with the block kernels).
void check_split_without_fly(const char* op, const VerifyProblem& problem) {
  TORCH_CHECK(!problem.fly.may_defer(), op, ": FLy (fly_window) is not supported by the split CUDA kernels; use "
              "diversed_ext.set_cuda_kernels('auto') (the default) or 'block'");
}

// The verify kernels a call runs: the process-wide family of common/kernel_family.h (diversed_ext.set_cuda_kernels:
// "block", one block per request; "split", each request's vocabulary over many blocks, faster at every shape
// measured on an H100; or "auto", the default: split, and block for a call that asks for FLy, which only the block
// kernels run). A call asking the split family for FLy is refused (check_split_without_fly).
bool use_split_kernels(const char* op, const VerifyProblem& problem) {
  const int family = cuda_kernel_family.load(std::memory_order_relaxed);
  if (family == kSplitKernels) check_split_without_fly(op, problem);
  return family == kSplitKernels || (family == kAutoKernels && !problem.fly.may_defer());
}

// A seedless call draws its seed inside the kernel from torch's CUDA generator (seed_from_generator), which hands each
// call its own offset: no launch of its own, and under graph capture the state is read from device memory, so every
// replay draws afresh. Torch's Philox offsets move in steps of 4.
constexpr uint64_t kGeneratorIncrement = 4;
void attach_cuda_generator(VerifyProblem& problem) {
  auto* generator = at::cuda::detail::getDefaultCUDAGenerator().get<at::CUDAGeneratorImpl>();
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    state = generator->philox_cuda_state(kGeneratorIncrement);
  }
  if (state.captured_) {
    problem.generator_seed = state.seed_.ptr;
    problem.generator_offset = state.offset_.ptr;
    problem.generator_offset_value = state.offset_intragraph_;
  } else {
    problem.generator_seed_value = state.seed_.val;
    problem.generator_offset_value = state.offset_.val;
  }
}

// start_verify for the CUDA kernels (a seedless call's seed is left to the kernel, from the generator state), and
// whether the split kernels run the call. The family is chosen, and a call it refuses refused, before the generator's
// offset moves: a refused call leaves the generator as it was, so the next seedless call draws what it would have.
struct CudaVerifyCall {
  VerifyCall call;
  bool split = false;
};
CudaVerifyCall start_cuda_verify(const char* op, VerifyInput input, const VerifyShape& shape,
                                 const at::Tensor& draft_tokens, const c10::optional<at::Tensor>& draft,
                                 const at::Tensor& target, const VerifyOptionals& optional,
                                 const VerifyScalars& scalars, const FlyArgs& fly) {
  CudaVerifyCall started{
      start_verify(input, shape, draft_tokens, draft, target, optional, scalars, fly, SeedSource::kKernelGenerator)};
  started.split = !started.call.empty() && use_split_kernels(op, started.call.problem);
  if (started.call.problem.from_generator) attach_cuda_generator(started.call.problem);
  return started;
}

// The split kernels aim for this many blocks per multiprocessor of the device (queried once per device).
constexpr int64_t kSplitBlocksPerMultiprocessor = 4;
constexpr int kMaxCachedDevices = 64;
int multiprocessor_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}
int64_t split_target_blocks(c10::DeviceIndex device) {
  static std::atomic<int> multiprocessors[kMaxCachedDevices];
  const int index = device < 0 ? static_cast<int>(c10::cuda::current_device()) : static_cast<int>(device);
  if (index >= kMaxCachedDevices) return multiprocessor_count(index) * kSplitBlocksPerMultiprocessor;
  int count = multiprocessors[index].load(std::memory_order_relaxed);
  if (count == 0) {
    count = multiprocessor_count(index);
    multiprocessors[index].store(count, std::memory_order_relaxed);
  }
  return count * kSplitBlocksPerMultiprocessor;
}

// The split kernels' cut of a call and their scratch, counters zeroed on the stream (a memset, which graphs capture).
struct SplitLaunch {
  SplitPlan plan;
  at::Tensor memory;
  SplitScratch scratch;
};
SplitLaunch prepare_split(const char* op, const VerifyProblem& problem, const at::Tensor& like, bool logits,
                          cudaStream_t stream) {
  const SplitPlan plan = split_plan(problem.batch, problem.num_positions, problem.vocab, logits,
                                    split_target_blocks(like.device().index()));
  check_grid_rows(op, problem.batch * plan.verify.num_chunks);
  if (logits) check_grid_rows(op, problem.batch * (2 * problem.num_positions + 1) * plan.rows.num_chunks);
  const SplitScratchLayout size = lay_out_split_scratch(plan, nullptr);
  at::Tensor memory = at::empty({size.bytes}, like.options().dtype(at::kByte));
  C10_CUDA_CHECK(cudaMemsetAsync(memory.data_ptr(), 0, size.counter_bytes, stream));
  return SplitLaunch{plan, memory, lay_out_split_scratch(plan, memory.data_ptr()).scratch};
}

using VerifyTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using OptionalTensor = c10::optional<at::Tensor>;

// Every tensor argument on one CUDA device (the draft's may be absent); one block per request must fit in the grid.
// FLy's settings checked too (check_fly_args).
void check_verify_devices(const char* op, const at::Tensor& draft_tokens, const OptionalTensor& draft,
                          const at::Tensor& target, const VerifyOptionals& optional, const FlyArgs& fly,
                          const VerifyShape& shape) {
  check_fly_args(fly, shape.batch, op);
  check_cuda_device(op, target, draft_tokens);
  for (const auto* tensor : {&draft, &optional.weight, &optional.num_draft, &optional.greedy_or_temperature,
                             &optional.uniforms, &optional.seeds, &optional.target_rows, &optional.draft_rows,
                             &optional.target_temperature, &fly.window, &fly.threshold})
    if (tensor->has_value()) check_same_device(op, target.device(), **tensor);
  check_grid_rows(op, shape.batch);
}

VerifyTuple verify_probs_cuda(const at::Tensor& draft_tokens, const OptionalTensor& draft_probs,
                              const at::Tensor& target_probs, const OptionalTensor& weight,
                              const OptionalTensor& num_draft, const OptionalTensor& greedy,
                              const OptionalTensor& uniforms, const OptionalTensor& seeds, int64_t offset,
                              bool per_row_seed, double weight_value, c10::optional<int64_t> seed,
                              const OptionalTensor& target_rows, const OptionalTensor& draft_rows,
                              const OptionalTensor& fly_window, const OptionalTensor& fly_threshold,
                              int64_t fly_window_value, double fly_threshold_value, int64_t fly_top_k) {
  const VerifyOptionals optional{weight, num_draft, greedy, uniforms, seeds, target_rows, draft_rows,
                                 kNoTargetTemperature};
  const FlyArgs fly{fly_window, fly_threshold, fly_window_value, fly_threshold_value, fly_top_k};
  const VerifyShape shape = check_verify_args(VerifyInput::kProbs, draft_tokens, draft_probs, target_probs, optional);
  check_verify_devices(kVerifyProbsOp, draft_tokens, draft_probs, target_probs, optional, fly, shape);
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const CudaVerifyCall started =
      start_cuda_verify(kVerifyProbsOp, VerifyInput::kProbs, shape, draft_tokens, draft_probs, target_probs, optional,
                        VerifyScalars{weight_value, 1.0, seed, offset, per_row_seed}, fly);
  const VerifyCall& call = started.call;
  const bool split = started.split;
  if (call.empty()) return call.result();
  const VerifyProblem& problem = call.problem;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const SplitLaunch launch =
      split ? prepare_split(kVerifyProbsOp, problem, target_probs, false, stream) : SplitLaunch{};
  dispatch_verify_types(kVerifyProbsOp, draft_probs, target_probs, [&](auto draft_tag, auto target_tag) {
    using DraftScalar = typename decltype(draft_tag)::type;
    using TargetScalar = typename decltype(target_tag)::type;
    const auto* draft = kernel_data<CudaElement<DraftScalar>, DraftScalar>(draft_probs);
    const auto* target = kernel_data<CudaElement<TargetScalar>, TargetScalar>(target_probs);
    if (split) launch_split_verify_probs(problem, draft, target, launch.plan, launch.scratch, stream);
    else launch_verify_probs(problem, draft, target, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.result();
}

VerifyTuple verify_logits_cuda(const at::Tensor& draft_tokens, const OptionalTensor& draft_logits,
                               const at::Tensor& target_logits, const OptionalTensor& weight,
                               const OptionalTensor& num_draft, const OptionalTensor& temperature,
                               const OptionalTensor& uniforms, const OptionalTensor& seeds, int64_t offset,
                               bool per_row_seed, double weight_value, double temperature_value,
                               c10::optional<int64_t> seed, const OptionalTensor& target_rows,
                               const OptionalTensor& draft_rows, const OptionalTensor& target_temperature,
                               c10::optional<double> target_temperature_value, const OptionalTensor& fly_window,
                               const OptionalTensor& fly_threshold, int64_t fly_window_value,
                               double fly_threshold_value, int64_t fly_top_k) {
  const VerifyOptionals optional{weight, num_draft, temperature, uniforms, seeds, target_rows, draft_rows,
                                 target_temperature};
  const FlyArgs fly{fly_window, fly_threshold, fly_window_value, fly_threshold_value, fly_top_k};
  const VerifyShape shape =
      check_verify_args(VerifyInput::kLogits, draft_tokens, draft_logits, target_logits, optional);
  check_verify_devices(kVerifyLogitsOp, draft_tokens, draft_logits, target_logits, optional, fly, shape);
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const CudaVerifyCall started = start_cuda_verify(
      kVerifyLogitsOp, VerifyInput::kLogits, shape, draft_tokens, draft_logits, target_logits, optional,
      VerifyScalars{weight_value, temperature_value, seed, offset, per_row_seed, target_temperature_value}, fly);
  const VerifyCall& call = started.call;
  const bool split = started.split;
  if (call.empty()) return call.result();
  const VerifyProblem& problem = call.problem;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const SplitLaunch launch =
      split ? prepare_split(kVerifyLogitsOp, problem, target_logits, true, stream) : SplitLaunch{};
  // The block kernels' scratch: the softmax normalisers of the rows each request reads, written and read back by its
  // own block.
  static_assert(sizeof(SoftmaxStats) == 2 * sizeof(float), "SoftmaxStats is stored as two floats");
  const at::Tensor block_scratch =
      split ? at::Tensor()
            : at::empty({2 * logits_scratch_size(problem.batch, problem.num_positions)},
                        target_logits.options().dtype(at::kFloat));
  dispatch_verify_types(kVerifyLogitsOp, draft_logits, target_logits, [&](auto draft_tag, auto target_tag) {
    using DraftScalar = typename decltype(draft_tag)::type;
    using TargetScalar = typename decltype(target_tag)::type;
    const auto* draft = kernel_data<CudaElement<DraftScalar>, DraftScalar>(draft_logits);
    const auto* target = kernel_data<CudaElement<TargetScalar>, TargetScalar>(target_logits);
    if (split) {
      launch_split_verify_logits(problem, draft, target, launch.plan, launch.scratch, stream);
    } else {
      launch_verify_logits(problem, draft, target, reinterpret_cast<SoftmaxStats*>(block_scratch.data_ptr<float>()),
                           stream);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.result();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_cuda(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& temperature,
    bool from_logits) {
  check_token_stats_args(draft, target, tokens, temperature);
  check_cuda_device(kTokenStatsOp, draft, target, tokens, temperature);
  check_grid_rows(kTokenStatsOp, draft.size(0) * draft.size(1));
  const c10::cuda::CUDAGuard guard(draft.device());
  const TokenStatsCall call = start_token_stats(draft, tokens);
  if (call.empty()) return call.result();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "token_stats_cuda", [&] {
    launch_token_stats(pair_problem<CudaElement<scalar_t>, scalar_t>(draft, target, temperature, from_logits),
                       call.out, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.result();
}

// nu = w p + (1 - w) q materialised as float32 [B, K, V]; target may carry extra positions (K+1), which are ignored.
at::Tensor mix_cuda(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                    const at::Tensor& temperature, bool from_logits) {
  check_mix_args(draft, target, weight, temperature);
  check_cuda_device(kMixOp, draft, target, weight, temperature);
  check_grid_rows(kMixOp, draft.size(0) * draft.size(1));
  const c10::cuda::CUDAGuard guard(draft.device());
  at::Tensor mixture = allocate_mixture(draft);
  if (mixture.numel() == 0) return mixture;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "mix_cuda", [&] {
    launch_mix(pair_problem<CudaElement<scalar_t>, scalar_t>(draft, target, temperature, from_logits),
               weight.data_ptr<float>(), mixture.data_ptr<float>(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return mixture;
}

// Pairs of logit rows ([B, T, V], or [R, V] read through an index) -> float32 [B, T, 5]: entropies, largest
// probabilities and TV (features_math.h).
at::Tensor distribution_features_cuda(const at::Tensor& draft, const at::Tensor& target,
                                      const at::Tensor& temperature, const OptionalTensor& target_rows,
                                      const OptionalTensor& draft_rows, const OptionalTensor& target_temperature) {
  const FeaturesShape shape =
      check_distribution_features_args(draft, target, temperature, target_rows, draft_rows, target_temperature);
  check_cuda_device(kDistributionFeaturesOp, target, draft, temperature);
  for (const auto* tensor : {&target_rows, &draft_rows, &target_temperature})
    if (tensor->has_value()) check_same_device(kDistributionFeaturesOp, target.device(), **tensor);
  check_grid_rows(kDistributionFeaturesOp, shape.batch * shape.positions);
  const c10::cuda::CUDAGuard guard(target.device());
  at::Tensor features = allocate_features(shape, target);
  if (features.numel() == 0) return features;
  const FeaturesProblem problem =
      features_problem(shape, draft, target, temperature, target_rows, draft_rows, target_temperature);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_verify_types(kDistributionFeaturesOp, draft, target, [&](auto draft_tag, auto target_tag) {
    using DraftScalar = typename decltype(draft_tag)::type;
    using TargetScalar = typename decltype(target_tag)::type;
    launch_distribution_features(problem, kernel_data<CudaElement<DraftScalar>, DraftScalar>(draft),
                                 kernel_data<CudaElement<TargetScalar>, TargetScalar>(target),
                                 features.data_ptr<float>(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return features;
}

// Drafted tokens [B, T] and their target logit rows beside draft logits or probabilities (no draft: tokens only) ->
// (log p(x), E_r[log p]), float32 [B, T] each: what the log-probability gate compares (gate_math.h).
std::tuple<at::Tensor, at::Tensor> gate_statistics_cuda(const at::Tensor& draft_tokens, const OptionalTensor& draft,
                                                        const at::Tensor& target, const at::Tensor& temperature,
                                                        const OptionalTensor& target_rows,
                                                        const OptionalTensor& draft_rows,
                                                        const OptionalTensor& target_temperature, bool draft_probs) {
  const FeaturesShape shape = check_gate_statistics_args(draft_tokens, draft, target, temperature, target_rows,
                                                         draft_rows, target_temperature);
  check_cuda_device(kGateStatisticsOp, target, draft_tokens, temperature);
  for (const auto* tensor : {&draft, &target_rows, &draft_rows, &target_temperature})
    if (tensor->has_value()) check_same_device(kGateStatisticsOp, target.device(), **tensor);
  check_grid_rows(kGateStatisticsOp, shape.batch * shape.positions);
  const c10::cuda::CUDAGuard guard(target.device());
  auto [drafted, rejected] = allocate_gate_statistics(shape, target);
  if (drafted.numel() == 0) return {drafted, rejected};
  const FeaturesProblem problem = features_problem(shape, draft.has_value() ? *draft : target, target, temperature,
                                                   target_rows, draft_rows, target_temperature);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_verify_types(kGateStatisticsOp, draft, target, [&](auto draft_tag, auto target_tag) {
    using DraftScalar = typename decltype(draft_tag)::type;
    using TargetScalar = typename decltype(target_tag)::type;
    launch_gate_statistics(problem, draft_tokens.data_ptr<int64_t>(),
                           kernel_data<CudaElement<DraftScalar>, DraftScalar>(draft), draft_probs,
                           kernel_data<CudaElement<TargetScalar>, TargetScalar>(target), drafted.data_ptr<float>(),
                           rejected.data_ptr<float>(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {drafted, rejected};
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(diversed, CUDA, m) {
  m.impl("verify_probs", &gpu::verify_probs_cuda);
  m.impl("verify_logits", &gpu::verify_logits_cuda);
  m.impl("token_stats", &gpu::token_stats_cuda);
  m.impl("mix", &gpu::mix_cuda);
  m.impl("distribution_features", &gpu::distribution_features_cuda);
  m.impl("gate_statistics", &gpu::gate_statistics_cuda);
}

}  // namespace diversed
