// The lean forward passes' kernels' view of their inputs: raw pointers and sizes, no torch. float_gemm.h multiplies by
// float weights packed once; llama_layers.h runs a Llama's layers, with llama_math.h's float math between its int8 or
// float products; model_bindings.cpp builds these from checked tensors.
//
// A Llama pass carries several sequences ("rows") at once: their new tokens are stacked, row after row, into [M, ...]
// buffers, and each row has its own key/value cache [layers, kv_heads, capacity, head_dim] (float32), of which the
// first `start` positions are filled; the pass writes the row's `count` new positions after them and every token
// attends to its own row's cache only, causally.
#pragma once

#include <cstdint>

namespace diversed {
namespace cpu {

// out [M, N] = x [M, K] . W^T (+ bias), W [N, K] packed as float_pack_weight lays it out: output features in tiles
// of kFloatTile, each tile [K][kFloatTile], zero past N. Every output is summed over k in order (a product, then an
// add; no fused multiply-add), whatever M: a row's result never depends on the other rows.
constexpr int64_t kFloatTile = 16;
struct FloatGemmProblem {
  const float* x;       // [M, K]
  const float* packed;  // [ceil(N / kFloatTile), K, kFloatTile]
  const float* bias;    // [N] or nullptr
  float* out;           // [M, N]
  int64_t M, N, K;
};

inline int64_t float_tile_count(int64_t out_features) { return (out_features + kFloatTile - 1) / kFloatTile; }

// W [N, K] row-major -> packed [float_tile_count(N), K, kFloatTile].
inline void float_pack_weight(const float* weight, int64_t N, int64_t K, float* packed) {
  for (int64_t tile = 0; tile < float_tile_count(N); ++tile) {
    float* block = packed + tile * K * kFloatTile;
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t j = 0; j < kFloatTile; ++j) {
        const int64_t n = tile * kFloatTile + j;
        block[k * kFloatTile + j] = n < N ? weight[n * K + k] : 0.0f;
      }
    }
  }
}

// Keys are stored in tiles of kKeyTile positions: in each (layer, kv head) plane of capacity x head_dim floats, tile t
// holds positions [t * kKeyTile, (t + 1) * kKeyTile) as [head_dim][kKeyTile], so the scores of a tile's positions are
// one broadcast-multiply-add loop over head_dim with no sum across lanes. The capacity is a multiple of kKeyTile, and
// a tile's offset does not depend on it. Values stay [capacity][head_dim].
constexpr int64_t kKeyTile = 16;
inline int64_t key_offset(int64_t position, int64_t d, int64_t head_dim) {
  return ((position / kKeyTile) * head_dim + d) * kKeyTile + position % kKeyTile;
}

struct LlamaRow {
  int64_t offset;    // first of the row's tokens in the stacked buffers
  int64_t count;     // new tokens of the row (>= 1)
  int64_t start;     // cached positions before them (start + count <= capacity)
  int64_t capacity;  // positions the row's cache holds, a multiple of kKeyTile
  float* keys;       // the row's cache, [layers, kv_heads, capacity, head_dim], keys in tiles (above)
  float* values;
};

// Attention of one layer: queries and keys in `qkv` are already rotated, and the new keys and values already written
// to the caches. One task per (row, token, query head).
struct LlamaAttention {
  const float* qkv;  // [M, (heads + 2 * kv_heads) * head_dim]: queries, keys, values of every new token
  float* out;        // [M, heads * head_dim]
  const LlamaRow* rows;
  int64_t row_count, tokens;  // rows, and M = the rows' counts added up
  int64_t layer, heads, kv_heads, head_dim;
  float scale;  // the factor on q . k before the softmax
};

}  // namespace cpu
}  // namespace diversed
