// The float math of a Llama layer between its int8 or float products (llama_layers.h runs the layers): RMSNorm, the
// rotary embedding, causal attention over each row's own cache, and SiLU(gate) * up. Compiled once per instruction set
// through forward_kernels.h (forward_kernels_*.cpp); every sum goes through the same kLanes logical lanes and fixed
// trees in every build, so the builds agree bit for bit.
//
// The results equal torch's modules up to float rounding: sums are formed in another order (RMSNorm's in float64),
// and exp is exp_nonpositive (relative error about 1e-7) where torch uses its own vectorised exp.
#pragma once

#include "../cpu_base/kernel_base.h"
#include "../cpu_base/lanes.h"
#include "forward_problems.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

static_assert(kLanes == kKeyTile, "a tile of keys is one FloatLanes wide");

inline void store_lanes(float* out, const FloatLanes& lanes) {
  for (int i = 0; i < kParts; ++i) __builtin_memcpy(out + i * kVectorFloats, &lanes.part[i], sizeof lanes.part[i]);
}

// Part by part rather than through zip_lanes: a capture-less lambda's function-pointer thunk would be emitted for the
// default target with a vector return.
inline FloatLanes add(const FloatLanes& a, const FloatLanes& b) {
  FloatLanes sum;
  for (int i = 0; i < kParts; ++i) sum.part[i] = a.part[i] + b.part[i];
  return sum;
}

inline FloatLanes multiply(const FloatLanes& a, const FloatLanes& b) {
  FloatLanes product;
  for (int i = 0; i < kParts; ++i) product.part[i] = a.part[i] * b.part[i];
  return product;
}

// x * sigmoid(x) given e = exp(-|x|) (an exp that cannot overflow): sigmoid(x) = 1 / (1 + e) for x > 0, else
// e / (1 + e). F is a float or a vector of floats; NaN stays NaN. The caller takes the exp, so that exp_nonpositive is
// called straight from this build's own functions and inlined there.
template <typename F>
inline F negative_magnitude(F x) {
  return x > 0.0f ? -x : x;
}
template <typename F>
inline F silu_given_exp(F x, F e) {
  const F one_plus = e + 1.0f;
  const F sigmoid = x > 0.0f ? 1.0f / one_plus : e / one_plus;
  return x * sigmoid;
}

// out[r] = (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) * weight, row by row (LlamaRMSNorm; the squares summed in float64).
void llama_rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t width, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * width;
    DoubleLanes sums = {};
    int64_t v = 0;
    for (; v + kLanes <= width; v += kLanes) {
      const FloatLanes values = load_lanes(row, v);
      accumulate(sums, multiply(values, values));
    }
    double total = reduce_lanes(sums);
    for (; v < width; ++v) total += static_cast<double>(row[v] * row[v]);
    const float variance = static_cast<float>(total / static_cast<double>(width));
    const float inverse_rms = 1.0f / std::sqrt(variance + eps);
    float* normed = out + r * width;
    for (v = 0; v < width; ++v) normed[v] = (row[v] * inverse_rms) * weight[v];
  }
}

// Llama's rotary embedding, in place, on the first `heads` heads of every token's row of `qkv` (queries, then keys):
// x * cos + rotate_half(x) * sin with rotate_half(x) = (-x_high, x_low); cos and sin are [tokens, head_dim].
void llama_rotate(float* qkv, const float* cos, const float* sin, int64_t tokens, int64_t row_stride, int64_t heads,
                  int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * head_dim;
    const float* s = sin + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = qkv + t * row_stride + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float low = x[i], high = x[i + half];
        x[i] = low * c[i] + (-high) * s[i];
        x[i + half] = high * c[i + half] + low * s[i + half];
      }
    }
  }
}

namespace llama_detail {

// One query head of one token against the `visible` first positions of its row's cache (its key/value head's keys,
// in tiles of kKeyTile positions, and values [visible, head_dim]): softmax(q . k * scale) . v into out [head_dim].
// `scores` has room for `visible` rounded up to kKeyTile floats. Each score sums its head_dim products in order.
inline void attend_one(const float* query, const float* keys, const float* values, int64_t visible, int64_t head_dim,
                       float scale, float* scores, float* out) {
  for (int64_t tile = 0; tile * kKeyTile < visible; ++tile) {
    const float* tile_keys = keys + tile * head_dim * kKeyTile;
    FloatLanes sums = multiply(splat_lanes(query[0]), load_lanes(tile_keys, 0));
    for (int64_t d = 1; d < head_dim; ++d)
      sums = add(sums, multiply(splat_lanes(query[d]), load_lanes(tile_keys + d * kKeyTile, 0)));
    store_lanes(scores + tile * kKeyTile, multiply(sums, splat_lanes(scale)));
  }
  float max_score = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) max_score = scores[j] > max_score ? scores[j] : max_score;  // NaN never wins
  FloatLanes sums = splat_lanes(0.0f);
  int64_t j = 0;
  for (; j + kLanes <= visible; j += kLanes) {
    const FloatLanes weights =
        map_lanes(load_lanes(scores, j), [&](FloatVector s) { return exp_nonpositive(s - max_score); });
    store_lanes(scores + j, weights);
    sums = add(sums, weights);
  }
  float total = reduce_lanes(sums);
  for (; j < visible; ++j) {
    scores[j] = exp_nonpositive(scores[j] - max_score);
    total += scores[j];
  }
  const float inverse_total = 1.0f / total;
  // Each output chunk is summed over positions in order, in registers.
  int64_t d = 0;
  for (; d + kLanes <= head_dim; d += kLanes) {
    FloatLanes sum = splat_lanes(0.0f);
    for (int64_t p = 0; p < visible; ++p)
      sum = add(sum, multiply(splat_lanes(scores[p]), load_lanes(values + p * head_dim, d)));
    store_lanes(out + d, multiply(sum, splat_lanes(inverse_total)));
  }
  for (; d < head_dim; ++d) {
    float sum = 0.0f;
    for (int64_t p = 0; p < visible; ++p) sum += scores[p] * values[p * head_dim + d];
    out[d] = sum * inverse_total;
  }
}

}  // namespace llama_detail

// Causal attention of every new token over its own row's cache, one task per (token, query head); query head h reads
// key/value head h / (heads / kv_heads) (grouped-query attention).
void llama_attention(const LlamaAttention& p, const ParallelFor& parallel_for) {
  const int64_t qkv_stride = (p.heads + 2 * p.kv_heads) * p.head_dim;
  const int64_t group = p.heads / p.kv_heads;
  int64_t longest = 1;
  for (int64_t r = 0; r < p.row_count; ++r) longest = std::max(longest, p.rows[r].start + p.rows[r].count);
  const int64_t grain = grain_for(2 * longest * p.head_dim);
  const int64_t score_room = (longest + kKeyTile - 1) / kKeyTile * kKeyTile;  // whole tiles of scores
  parallel_for(0, p.tokens * p.heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(score_room));
    int64_t r = 0;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t token = task / p.heads, head = task % p.heads;
      while (token >= p.rows[r].offset + p.rows[r].count) ++r;  // tasks come in token order
      const LlamaRow& row = p.rows[r];
      const int64_t visible = row.start + (token - row.offset) + 1;
      const int64_t cache_offset = ((p.layer * p.kv_heads + head / group) * row.capacity) * p.head_dim;
      llama_detail::attend_one(p.qkv + token * qkv_stride + head * p.head_dim, row.keys + cache_offset,
                               row.values + cache_offset, visible, p.head_dim, p.scale, scores.data(),
                               p.out + (token * p.heads + head) * p.head_dim);
    }
  });
}

// out [tokens, width] = silu(gate) * up, gate_up [tokens, 2 * width] holding gate then up for every token.
void llama_silu_mul(const float* gate_up, int64_t tokens, int64_t width, float* out) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* gate = gate_up + t * 2 * width;
    const float* up = gate + width;
    float* row = out + t * width;
    int64_t v = 0;
    for (; v + kLanes <= width; v += kLanes) {
      const FloatLanes activated = map_lanes(load_lanes(gate, v), [&](FloatVector x) {
        return silu_given_exp(x, exp_nonpositive(negative_magnitude(x)));
      });
      store_lanes(row + v, multiply(activated, load_lanes(up, v)));
    }
    for (; v < width; ++v)
      row[v] = silu_given_exp(gate[v], exp_nonpositive(negative_magnitude(gate[v]))) * up[v];
  }
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
