// FLy (entropy-gated deferred verification, as vLLM ships it) on top of the DIVERSED accept test, shared by the CPU
// and CUDA verify kernels. At a drafted position i of a request with n drafts, a draft that the exact test rejects is
// accepted anyway ("deferred") when
//   * the draft could have come from both models: its id lies in [0, V), the target allows it (p_i(x_i) > 0, by the
//     support rule of verify_math.h: target_forbids), and q_i(x_i) > 0 for a sampled row (a greedy row asks the
//     target's p_i(x_i) only, as vLLM's greedy rule asks a finite target logit);
//   * i + W < n and the next W drafts all pass the exact test (with their own uniforms, or as argmax for greedy rows);
//   * the target's entropy over its top-k probabilities at i, -sum_{top k} p log p (unnormalised), is >= tau.
// Then the usual prefix rule: the request keeps its drafts up to the first position neither accepted nor deferred.
// The exact test is the row's own (u q < nu, or x == argmax nu), so FLy composes with every weight; with w = 1 it is
// vLLM's rule. A window of 0 switches FLy off for the row, and the walk below is then the plain prefix rule.
#pragma once

#include <cmath>
#include <cstdint>

#include "exp_math.h"     // DX_HD
#include "verify_math.h"  // target_forbids

namespace diversed {

// The largest top-k the kernels keep: each CUDA thread holds its own top-k list in registers or local memory, so the
// bound is fixed at compile time. The Python layer and the bindings (check_fly_args) refuse a larger fly_top_k.
constexpr int kFlyMaxTopK = 32;

// The settings of a call: per request tensors, or one value for every request.
struct FlySettings {
  const int64_t* window = nullptr;  // [B], or nullptr: window_value
  int64_t window_value = 0;
  const float* threshold = nullptr;  // [B], or nullptr: threshold_value
  float threshold_value = 0.3f;
  int top_k = 3;  // in [1, kFlyMaxTopK]

  // The window, 0 (off) where outside [0, K - 1] (only unchecked calls pass such): a window of K or more never fits
  // after a rejection, so it defers nothing, as off; clamping it to K - 1 would defer where the caller's window could
  // not (vLLM's V1 step is as wide as its longest draft, narrower than a request's window when all drafts are short).
  DX_HD int64_t window_at(int64_t row, int64_t num_positions) const {
    const int64_t w = window ? window[row] : window_value;
    return w < 0 || w >= num_positions ? 0 : w;
  }
  DX_HD float threshold_at(int64_t row) const { return threshold ? threshold[row] : threshold_value; }
  // Whether any request of the call may defer, decided without reading device memory (the CUDA binding's choice of
  // kernels may not sync): a window tensor may hold positive values.
  bool may_defer() const { return window != nullptr || window_value > 0; }
};

// Whether a rejected draft may be deferred, before its window and entropy are looked at.
DX_HD bool fly_deferrable(bool greedy, bool valid, float p, float q) {
  return valid && !target_forbids(p) && (greedy || q > 0.0f);
}

// The k largest of the masses offered, sorted in decreasing order. A NaN is never kept; ties at the k-th value keep
// the first offered, which leaves the multiset of values (and so the entropy) independent of the offering order.
struct FlyTopK {
  float values[kFlyMaxTopK];
  int count;
  int k;

  DX_HD explicit FlyTopK(int top_k) : count(0), k(top_k) {}
  DX_HD float floor() const { return count < k ? -INFINITY : values[k - 1]; }
  DX_HD void offer(float mass) {
    if (!(mass > floor())) return;
    int j = count < k ? count++ : k - 1;
    for (; j > 0 && values[j - 1] < mass; --j) values[j] = values[j - 1];
    values[j] = mass;
  }
};

// The summand of FLy's entropy, p log p in float64 (0 for p <= 0), added in decreasing order of p: the references
// (diversed_ext/ops/_fly.py) add them in that order too.
DX_HD double fly_entropy_term(float p) {
  const double x = static_cast<double>(p);
  return p > 0.0f ? x * log(x) : 0.0;
}

DX_HD double fly_entropy(const FlyTopK& top) {
  double sum = 0.0;
  for (int j = 0; j < top.count; ++j) sum += fly_entropy_term(top.values[j]);
  return -sum;
}

// tau compared in float64; a NaN threshold (unchecked calls only) never defers.
DX_HD bool fly_entropy_passes(double entropy, float threshold) { return entropy >= static_cast<double>(threshold); }

// The prefix rule with FLy, fed one position at a time in order (the exact test's result and fly_deferrable's), so a
// kernel needs no per-position storage and computes an entropy only where a window has confirmed a rejection. With
// window 0 it is the plain rule: the first failed test ends the accepted prefix.
struct FlyWalk {
  int64_t drafted, window;
  int64_t length = -1;   // the accepted length once decided
  int64_t pending = -1;  // a rejected position waiting for its window

  DX_HD FlyWalk(int64_t drafted_positions, int64_t fly_window) : drafted(drafted_positions), window(fly_window) {}
  DX_HD bool decided() const { return length >= 0; }
  DX_HD int64_t accepted_length() const { return length >= 0 ? length : drafted; }

  // Position i's exact test. Returns the position whose entropy decides the walk now (its window has just passed):
  // the caller computes it and calls settle; -1 when nothing is asked.
  DX_HD int64_t feed(int64_t i, bool passed, bool deferrable) {
    if (length >= 0) return -1;
    if (pending < 0) {
      if (passed) return -1;
      if (deferrable && window > 0 && i + window < drafted) pending = i;
      else length = i;
      return -1;
    }
    if (!passed) {
      length = pending;  // the window failed: the pending rejection stands
      return -1;
    }
    return i - pending == window ? pending : -1;
  }
  DX_HD void settle(bool entropy_passes) {
    if (!entropy_passes) length = pending;
    pending = -1;
  }
};

}  // namespace diversed
