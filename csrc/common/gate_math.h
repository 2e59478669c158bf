// Per-element and per-row math of gate_statistics, shared by the CPU and CUDA kernels: what the log-probability gate
// (diversed_ext/decoding/gate.py) compares for a drafted token x of a pair of softmax rows p (target) and q (draft, or
// one-hot at x when the verifier sees the drafted tokens alone).
//
// A rejection resamples from the residual r = norm((p - q)+). With p_v = exp(s_v - m) / sum (features_math.h's
// shifted logits s_v - m and normaliser), log p_v = (s_v - m) + log(1 / sum), so the residual's expected
// log-probability
//     E_r[log p] = sum_v (p_v - q_v)+ (s_v - m) / sum_v (p_v - q_v)+ + log(1 / sum)
// needs no logarithm per element: one pass summing the residual's mass and its mass times the shifted logits. Where q
// is one-hot at x the residual is p off x ((p_x - 1)+ = 0), so x's element is left out rather than subtracted: the
// sums stay sums of terms of one sign, exact where p_x is close to 1.
#pragma once

#include <cmath>
#include <cstdint>

#include "features_math.h"  // SoftmaxStats, entropy_term, shifted_mass; residual_mass (verify_math.h)

namespace diversed {

// What the residual pass sums over a row, in float64.
struct ResidualSums {
  double mass, weighted;  // sum (p - q)+ and sum (p - q)+ (s - m)
};

// Adds one element to the residual's sums: its target logit scaled and shifted by the target row's max, and the draft's
// mass q there (1 at x and 0 elsewhere for a one-hot draft). The CUDA kernel's per-thread step (the CPU kernel sums
// its scratch rows' masses lane by lane, csrc/cpu/gate_kernels.h).
DX_HD void add_residual_element(ResidualSums& sums, float p_shifted, SoftmaxStats target, float q) {
  const float residual = residual_mass(shifted_mass(p_shifted, target), q);
  sums.mass += residual;
  sums.weighted += entropy_term(residual, p_shifted);
}

// log p(x) of a drafted token from its scaled logit s_x (its logit times the row's inverse temperature): s_x - m +
// log(1 / sum) in float64, exact where the mass underflows; -inf for a NaN logit, a row without mass or an id outside
// the vocabulary (`valid` false).
DX_HD float drafted_logprob(bool valid, float scaled_logit, SoftmaxStats target) {
  if (!valid) return -INFINITY;
  const double value = static_cast<double>(scaled_logit) - target.max + log(static_cast<double>(target.inverse_sum));
  return value == value ? static_cast<float>(value) : -INFINITY;
}

// E_r[log p], the log-probability a rejection's resampled token has in expectation; +inf where the residual has no
// mass (p = q: nothing is rejected there, so the gate has nothing to keep).
DX_HD float rejected_logprob(ResidualSums sums, SoftmaxStats target) {
  if (!(sums.mass > 0.0)) return INFINITY;
  return static_cast<float>(sums.weighted / sums.mass + log(static_cast<double>(target.inverse_sum)));
}

}  // namespace diversed
