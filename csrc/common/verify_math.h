// Per-element math of DIVERSED verification, shared by the CPU and CUDA kernels.
//
// Every function here is __host__ __device__ and free of torch, so the CPU build (and therefore the CPU test suite)
// exercises exactly the arithmetic the GPU runs. The arithmetic model is fixed so that the native kernels and the
// pure-PyTorch reference agree bit for bit on identical uniforms:
//   * probabilities and weights are loaded as float32 and sanitised (NaN, negative or infinite mass counts as zero,
//     and in the verify ops target mass below kMinTargetMass, outside the target's support: see below);
//   * nu = (w * p) + ((1 - w) * q) in float32 without fused multiply-add (the build passes -ffp-contract=off and
//     --fmad=false, so only the explicit fused_multiply_add calls of exp_math.h fuse);
//   * the accept test u * q < nu is evaluated in float64, where it is exact;
//   * residual mass max(0, p - q) is formed in float32 and accumulated in float64.
#pragma once

#include <cmath>
#include <cstdint>
#include <cfloat>
#include <type_traits>

#include "exp_math.h"  // DX_HD, fused_multiply_add, exp_nonpositive

namespace diversed {

// ---------------------------------------------------------------------------------------------------------------
// The target's support. A hard constraint of a server (bad words, allowed token ids, a -inf or -100 logit bias, EOS
// suppressed by min_tokens) reaches the verifier only as a target probability of (nearly) zero, while the mixture
// nu = w p + (1 - w) q still gives such a draft (1 - w) q(x). So the verify ops restrict everything to the target's
// support: a drafted token outside it verifies with w = 1 (never accepted; the correction comes from
// norm(max(0, p - q)), verify_weight), greedy rows take the argmax of nu over the support only (greedy_value), FLy
// never defers such a draft (fly_math.h), and the correction and bonus samples never draw outside it.
//
// A target mass below kMinTargetMass = 2^-64 (log p < -44.36) counts as zero. -inf logits give exactly 0, but a soft
// ban does not: a logit bias of -100 leaves p(x) ~ exp((g - 100) / T) when x led the other tokens by g nats at
// temperature T, above FLT_MIN (log -87.3) once g > 12.7 at T = 1, or for any g >= 0 at T >= 1.15. 2^-64 catches it
// for g < 55 at T = 1 and g < 11 at T = 2. It costs nothing measurable: the masses it drops add up to less than
// V * 2^-64 < 2^-40 for any vocabulary below 2^24 tokens, 2^16 times below float32's resolution of a probability
// (2^-24), so at w = 1 the output is still the target distribution as float32 states it. The Python reference uses
// the same constant (diversed_ext/ops/reference.py: MIN_TARGET_MASS).
constexpr float kMinTargetMass = 0x1p-64f;

// Whether the target forbids a token of mass p (p as loaded, sanitised or not): the one test of the support rule.
DX_HD bool target_forbids(float p) { return !(p >= kMinTargetMass); }  // NaN is forbidden too

// Probability mass that is NaN, negative or infinite counts as zero (only reachable with check_inputs=False), and so
// does mass below `floor`: 0 for draft rows and the stats ops, kMinTargetMass for the verify ops' target rows (mass
// outside the target's support). Written as two selects (no short-circuit branch) so loops over the vocabulary
// vectorise. A template so that the CPU kernels apply the very same rule to a whole vector of lanes (F a GCC vector of
// floats); F{} is zero either way.
template <typename F>
DX_HD F sanitize_mass(F x, float floor = 0.0f) {
  F counted = x >= floor ? x : F{};  // NaN compares false
  return counted <= FLT_MAX ? counted : F{};
}

// The weight on the target; NaN falls back to 1 (plain speculative decoding, the conservative choice).
DX_HD float sanitize_weight(float w) {
  if (!(w == w)) return 1.0f;
  return w < 0.0f ? 0.0f : (w > 1.0f ? 1.0f : w);
}

// nu(x) = w p(x) + (1 - w) q(x): written as two products and a sum so the rounding matches torch's elementwise ops.
DX_HD float mix_mass(float w, float p, float q) {
  float target_part = w * p;
  float draft_part = (1.0f - w) * q;
  return target_part + draft_part;
}

// The weight a drafted position verifies with: its own w, or 1 where the target forbids the drafted token (p its
// sanitised target mass). nu(x) is then p(x) = 0, so the draft is never accepted (accept probability 0), and the
// correction comes from norm(max(0, p - q)) whatever w was. An id outside [0, V) (only reachable with
// check_inputs=False) passes p = 0: a draft the target forbids, which is what a server means by it (vLLM, scheduling
// asynchronously, marks -1 a draft that its request's grammar rejects), so the position follows the law the
// forbidden token itself would have given it.
DX_HD float verify_weight(float w, float p) { return target_forbids(p) ? 1.0f : w; }

// Accept the drafted token iff u * q(x) < nu(x); exact in double because u, q and nu are float32 values.
DX_HD bool accept_draft(double u, float q, float nu) { return u * static_cast<double>(q) < static_cast<double>(nu); }

// min(1, nu / q): the probability that the accept test passes. A token the draft could not have sampled (q = 0)
// passes whenever nu > 0.
DX_HD float accept_probability(float nu, float q) {
  if (q > 0.0f) {
    float ratio = nu / q;
    return ratio < 1.0f ? ratio : 1.0f;
  }
  return nu > 0.0f ? 1.0f : 0.0f;
}

// Residual mass max(0, p - q) at the first rejection; w cancels after normalisation for every w > 0. A float or a
// vector of lanes, like sanitize_mass.
template <typename F>
DX_HD F residual_mass(F p, F q) {
  F r = p - q;
  return r > 0.0f ? r : F{};
}

// A drafter that gives tokens only: q is one-hot at the drafted id, so q(x) = 1 and nu(x) = w p(x) + 1 - w, and the
// residual max(0, p - q) is p off x and 0 at x. An id outside [0, V) has no row (q = 0 everywhere) and is rejected,
// as it is with draft distributions. Returns the id that carries q's mass, or -1 for none.
DX_HD int64_t one_hot_draft_token(int64_t token, int64_t vocab) { return token >= 0 && token < vocab ? token : -1; }
DX_HD float one_hot_mass(int64_t v, int64_t hot_token) { return v == hot_token ? 1.0f : 0.0f; }

// What a greedy row maximises at a token: nu = w p + (1 - w) q (pass w = 1, q = 0 for p alone) over the target's
// support; -inf off it, below every candidate (the argmax starts from -1), so a greedy row never picks a forbidden
// token while the target allows one.
DX_HD float greedy_value(float w, float p, float q) { return target_forbids(p) ? -INFINITY : mix_mass(w, p, q); }

// Greedy comparison: strictly larger wins, so ties keep the lowest token id.
DX_HD bool better_candidate(float value, int64_t index, float best_value, int64_t best_index) {
  return value > best_value || (value == best_value && index < best_index);
}

// ---------------------------------------------------------------------------------------------------------------
// Counter-based random numbers: Philox4x32-10 (Salmon et al., SC'11), keyed by the seed, counted by
// (position, row key, offset). The Python reference implements the same function with int64 tensor arithmetic.
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

DX_HD void mul_hi_lo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
}

// Returns the first 32-bit word of Philox4x32-10 for the given counter and key.
DX_HD uint32_t philox_first_word(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kPhiloxM0, c0, &hi0, &lo0);
    mul_hi_lo(kPhiloxM1, c2, &hi1, &lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return c0;
}

// A uniform in [0, 1) with 24 random bits: exactly representable in float32 and float64.
DX_HD double philox_uniform(int64_t seed, int64_t offset, int64_t row_key, int64_t position) {
  uint64_t s = static_cast<uint64_t>(seed);
  uint64_t o = static_cast<uint64_t>(offset);
  uint32_t word = philox_first_word(static_cast<uint32_t>(position), static_cast<uint32_t>(row_key),
                                    static_cast<uint32_t>(o), static_cast<uint32_t>(o >> 32),
                                    static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  return static_cast<double>(word >> 8) * (1.0 / 16777216.0);
}

// The seed of one seedless call drawn from a generator's Philox state (seed, offset), as torch's CUDA generator hands
// it out: 64 bits of Philox4x32-10 keyed by the generator's seed (xor kGeneratorDrawKey, so no word of torch's own
// streams doubles as a seed) at the counter (offset, kGeneratorDrawLane), so every call (every offset) gets an
// independent seed, and torch.manual_seed repeats them. Computed on the device, so drawing
// needs no kernel of its own and a CUDA graph replays fresh draws (the state is read from device memory there).
constexpr uint32_t kGeneratorDrawLane = 0x5EEDu;
constexpr uint64_t kGeneratorDrawKey = 0xD1B54A32D192ED03ull;
DX_HD int64_t seed_from_generator(uint64_t generator_seed, uint64_t generator_offset) {
  generator_seed ^= kGeneratorDrawKey;
  const uint32_t k0 = static_cast<uint32_t>(generator_seed), k1 = static_cast<uint32_t>(generator_seed >> 32);
  const uint32_t c0 = static_cast<uint32_t>(generator_offset), c1 = static_cast<uint32_t>(generator_offset >> 32);
  const uint64_t low = philox_first_word(c0, c1, kGeneratorDrawLane, 0u, k0, k1);
  const uint64_t high = philox_first_word(c0, c1, kGeneratorDrawLane, 1u, k0, k1);
  return static_cast<int64_t>((high << 32) | low);
}

// Uniforms outside [0, 1) (only reachable with check_inputs=False) are clamped into it; NaN becomes 0.
DX_HD double sanitize_uniform(double u) {
  if (!(u >= 0.0)) return 0.0;
  return u < 1.0 ? u : 0.99999999999999989;  // largest double below 1
}

// ---------------------------------------------------------------------------------------------------------------
// Softmax from logits without materialising probabilities.

// Normaliser of one softmax row of scaled logits s_v = logit_v * inverse_temperature: its max and 1 / sum exp(s - max).
struct SoftmaxStats {
  float max;
  float inverse_sum;
};

// Online softmax: a sum of exp(s - old_max) re-expressed against new_max >= old_max. A sum begun before any finite
// logit is 0 and old_max = -inf, and exp(-inf) = 0 keeps it 0.
DX_HD double rescale_exp_sum(double sum, float old_max, float new_max) {
  return sum * exp(static_cast<double>(old_max) - static_cast<double>(new_max));
}

// Probability of one entry given the row's normaliser; sanitised, so a row without finite logits has no mass.
// `floor` as in sanitize_mass.
template <typename F>
DX_HD F softmax_mass(F logit, float inverse_temperature, SoftmaxStats stats, float floor = 0.0f) {
  return sanitize_mass(exp_nonpositive(logit * inverse_temperature - stats.max) * stats.inverse_sum, floor);
}

// Temperature 0 marks a greedy row; its distributions are the untempered softmax (temperature 1). So does any
// temperature below kMinTemperature (and NaN): dividing logits by it would overflow to inf and every row would collapse
// to id 0, while its limit is the greedy decision anyway. The Python layer uses the same threshold (MIN_TEMPERATURE).
constexpr float kMinTemperature = 1e-6f;
DX_HD bool is_greedy_temperature(float temperature) { return !(temperature >= kMinTemperature); }
DX_HD float inverse_temperature_of(float temperature) {
  return is_greedy_temperature(temperature) ? 1.0f : 1.0f / temperature;
}

}  // namespace diversed
