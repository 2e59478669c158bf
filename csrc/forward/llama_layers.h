// Every decoder layer of a Llama in one native call: the lean forward pass without an op dispatch, a temporary or a
// Python line between its products. Torch-free; the binding (model_bindings.cpp) checks the tensors and hands their
// pointers over.
//
// Per layer, for the stacked new tokens of every row (forward_problems.h):
//   x = x + o(attention(rotate(qkv(rms_norm(x)))))          the new keys and values written to each row's cache first
//   x = x + down(silu(gate(rms_norm(x))) * up(rms_norm(x)))
// The products are the model's: int8 (int8_gemm.h: each row's input quantised on its own, the same int32 sums as
// torch's dynamically quantised layer) or float32 over packed weights (float_gemm.h: each output summed in the same
// order whatever the row count). Either way a row's result never depends on its neighbours. The float math between
// products is llama_math.h's, compiled per instruction set.
#pragma once

#include <cstring>
#include <vector>

#include "forward_dispatch.h"
#include "int8_gemm.h"

namespace diversed {
namespace cpu {

// A layer's products, in the order the model's per-layer weight lists give them.
enum LlamaProduct { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kProductsPerLayer = 4 };

struct LlamaPass {
  float* states;  // [M, hidden], in and out: the residual stream of the stacked new tokens
  int64_t tokens, hidden, layers, heads, kv_heads, head_dim, intermediate;
  std::vector<const float*> input_norms, post_norms;  // [hidden] per layer
  float eps, attention_scale;
  const float* cos;  // [M, head_dim]: each token's rotary tables
  const float* sin;
  const LlamaRow* rows;
  int64_t row_count;
  // Scratch, allocated by the binding.
  float* normed;       // [M, hidden]
  float* qkv_out;      // [M, (heads + 2 kv_heads) head_dim]
  float* attended;     // [M, heads head_dim]
  float* gate_up_out;  // [M, 2 intermediate]
  float* activated;    // [M, intermediate]
  float* product;      // [M, hidden]: o's and down's outputs before they join the residual
};

// int8 products: layer l's product p is parts[l * kProductsPerLayer + p]; every token's input quantised on its own.
struct Int8Part {
  const int8_t* packed;
  const int32_t* col_sums;
  const float* w_scale;
  const float* bias;  // or nullptr
  int64_t out_features, in_features;
};
struct Int8Products {
  std::vector<Int8Part> parts;
  const int64_t* row_counts;  // [row_count]: the quantisation groups (one token each)
  int64_t row_count, tokens;
  uint8_t* quantized;                  // [M, the widest input rounded up to 4]
  int8::ActivationParams* row_params;  // [M]
  int8::Isa isa;
  const ParallelFor* parallel_for;

  void operator()(int product, int64_t layer, const float* input, float* output) const {
    const Int8Part& part = parts[layer * kProductsPerLayer + product];
    const int64_t groups = int8::group_count(part.in_features);
    int8::quantize_input(input, tokens, part.in_features, groups * int8::kGroup, row_counts, row_count, isa,
                         quantized, row_params);
    const int8::GemmProblem problem{quantized, part.packed, part.col_sums, part.w_scale, part.bias,    output,
                                    tokens,    part.out_features, groups, row_params};
    int8::gemm(problem, isa, *parallel_for);
  }
};

// float32 products over weights packed by float_pack_weight.
struct FloatPart {
  const float* packed;
  const float* bias;  // or nullptr
  int64_t out_features, in_features;
};
struct FloatProducts {
  std::vector<FloatPart> parts;
  int64_t tokens;
  const ParallelFor* parallel_for;

  void operator()(int product, int64_t layer, const float* input, float* output) const {
    const FloatPart& part = parts[layer * kProductsPerLayer + product];
    const FloatGemmProblem problem{input, part.packed, part.bias, output, tokens, part.out_features, part.in_features};
    DIVERSED_CPU_CALL(float_gemm, problem, *parallel_for);
  }
};

namespace llama_layers_detail {

// The layer's new keys (into their tiles) and values (after the rotation) into each row's cache, after its `start`
// cached positions.
inline void store_keys_values(const LlamaPass& pass, int64_t layer) {
  const int64_t head_dim = pass.head_dim, qkv_stride = (pass.heads + 2 * pass.kv_heads) * head_dim;
  for (int64_t r = 0; r < pass.row_count; ++r) {
    const LlamaRow& row = pass.rows[r];
    for (int64_t t = 0; t < row.count; ++t) {
      const float* token = pass.qkv_out + (row.offset + t) * qkv_stride;
      const int64_t position = row.start + t;
      for (int64_t h = 0; h < pass.kv_heads; ++h) {
        const int64_t plane = (layer * pass.kv_heads + h) * row.capacity * head_dim;
        const float* key = token + (pass.heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) row.keys[plane + key_offset(position, d, head_dim)] = key[d];
        std::memcpy(row.values + plane + position * head_dim, token + (pass.heads + pass.kv_heads + h) * head_dim,
                    static_cast<size_t>(head_dim) * sizeof(float));
      }
    }
  }
}

inline void add_into(float* states, const float* addend, int64_t count) {
  for (int64_t i = 0; i < count; ++i) states[i] += addend[i];
}

}  // namespace llama_layers_detail

// products(p, layer, input [M, K], output [M, N]) runs layer's product p (Int8Products or FloatProducts).
template <typename Products>
void run_llama_layers(const LlamaPass& pass, const Products& products, const ParallelFor& parallel_for) {
  using namespace llama_layers_detail;
  const int64_t M = pass.tokens, H = pass.hidden;
  const int64_t rotated_heads = pass.heads + pass.kv_heads;
  const int64_t qkv_stride = (rotated_heads + pass.kv_heads) * pass.head_dim;
  for (int64_t layer = 0; layer < pass.layers; ++layer) {
    DIVERSED_CPU_CALL(llama_rms_norm, pass.states, pass.input_norms[layer], pass.eps, M, H, pass.normed);
    products(kQkv, layer, pass.normed, pass.qkv_out);
    DIVERSED_CPU_CALL(llama_rotate, pass.qkv_out, pass.cos, pass.sin, M, qkv_stride, rotated_heads, pass.head_dim);
    store_keys_values(pass, layer);
    const LlamaAttention attention{pass.qkv_out, pass.attended, pass.rows, pass.row_count, M, layer,
                                   pass.heads,   pass.kv_heads, pass.head_dim, pass.attention_scale};
    DIVERSED_CPU_CALL(llama_attention, attention, parallel_for);
    products(kO, layer, pass.attended, pass.product);
    add_into(pass.states, pass.product, M * H);
    DIVERSED_CPU_CALL(llama_rms_norm, pass.states, pass.post_norms[layer], pass.eps, M, H, pass.normed);
    products(kGateUp, layer, pass.normed, pass.gate_up_out);
    DIVERSED_CPU_CALL(llama_silu_mul, pass.gate_up_out, M, pass.intermediate, pass.activated);
    products(kDown, layer, pass.activated, pass.product);
    add_into(pass.states, pass.product, M * H);
  }
}

}  // namespace cpu
}  // namespace diversed
