// Run-time choice between the CPU kernel builds (cpu_kernels.h compiled per instruction set).
//
// DIVERSED_CPU_CAPABILITY=baseline|avx2 forces one (the tests compare both); otherwise AVX2 is used where the CPU has
// it. The builds give bitwise-identical results, so the choice only changes speed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace diversed {
namespace cpu {

#define DIVERSED_DECLARE_CPU_LAUNCHERS(capability)                                                                   \
  namespace capability {                                                                                             \
  void verify_probs(const at::Tensor& draft_tokens, const at::Tensor& draft_probs, const at::Tensor& target_probs,  \
                    const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& greedy,                \
                    const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset,             \
                    bool per_row_seed, at::Tensor& tokens, at::Tensor& num_accepted, at::Tensor& accept_prob);      \
  void verify_logits(const at::Tensor& draft_tokens, const at::Tensor& draft_logits,                                \
                     const at::Tensor& target_logits, const at::Tensor& weight, const at::Tensor& num_draft,        \
                     const at::Tensor& temperature, const c10::optional<at::Tensor>& uniforms,                      \
                     const at::Tensor& seeds, int64_t offset, bool per_row_seed, at::Tensor& tokens,                \
                     at::Tensor& num_accepted, at::Tensor& accept_prob);                                            \
  void token_stats(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens,                     \
                   const at::Tensor& temperature, bool from_logits, at::Tensor& target_prob, at::Tensor& draft_prob, \
                   at::Tensor& total_variation, at::Tensor& target_logprob, at::Tensor& draft_logprob);             \
  void mix(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,                             \
           const at::Tensor& temperature, bool from_logits, at::Tensor& mixture);                                   \
  }

DIVERSED_DECLARE_CPU_LAUNCHERS(baseline)
#if defined(__x86_64__) && defined(__GNUC__)
#define DIVERSED_HAS_AVX2_BUILD 1
DIVERSED_DECLARE_CPU_LAUNCHERS(avx2)
#endif

inline bool use_avx2() {
#ifdef DIVERSED_HAS_AVX2_BUILD
  const char* forced = std::getenv("DIVERSED_CPU_CAPABILITY");
  if (forced != nullptr && std::strcmp(forced, "baseline") == 0) return false;
  static const bool supported = __builtin_cpu_supports("avx2");
  return supported;
#else
  return false;
#endif
}

#ifdef DIVERSED_HAS_AVX2_BUILD
#define DIVERSED_CPU_CALL(launcher, ...) \
  (::diversed::cpu::use_avx2() ? ::diversed::cpu::avx2::launcher(__VA_ARGS__) : ::diversed::cpu::baseline::launcher(__VA_ARGS__))
#else
#define DIVERSED_CPU_CALL(launcher, ...) ::diversed::cpu::baseline::launcher(__VA_ARGS__)
#endif

}  // namespace cpu
}  // namespace diversed
