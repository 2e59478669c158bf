// Every decoder layer of an int8 Llama in one native call: the int8 draft's forward pass without an op dispatch, a
// temporary or a Python line between its products. Torch-free; the binding (ops_cpu.cpp) checks the tensors and hands
// their pointers over.
//
// Per layer, for the stacked new tokens of every row (forward_problems.h):
//   x = x + o(attention(rotate(qkv(rms_norm(x)))))          the new keys and values written to each row's cache first
//   x = x + down(silu(gate(rms_norm(x))) * up(rms_norm(x)))
// Every product is int8_gemm.h's: the input quantised per row group (a row's tokens together, as the row alone would
// be), the same int32 sums as torch's dynamically quantised layer, so a row's result never depends on its neighbours.
// The float math between products is llama_math.h's, compiled per instruction set.
#pragma once

#include <cstring>

#include "cpu_dispatch.h"
#include "int8_gemm.h"

namespace diversed {
namespace cpu {

// One product of every layer, stacked: layer l's packed weight at packed + l * packed_size(N, K), its per-feature
// column sums, scales and bias (or nullptr) at l * N.
struct Int8LayerStack {
  const int8_t* packed;
  const int32_t* col_sums;
  const float* w_scale;
  const float* bias;
  int64_t out_features, in_features;  // N, K
};

struct Int8LlamaPass {
  float* states;  // [M, hidden], in and out: the residual stream of the stacked new tokens
  int64_t tokens, hidden, layers, heads, kv_heads, head_dim, intermediate;
  const float* input_norm;  // [layers, hidden]
  const float* post_norm;   // [layers, hidden]
  float eps, attention_scale;
  Int8LayerStack qkv, o, gate_up, down;
  const float* cos;  // [M, head_dim]: each token's rotary tables
  const float* sin;
  const LlamaRow* rows;
  const int64_t* row_counts;  // [row_count]: the rows' token counts, the int8 inputs' quantisation groups
  int64_t row_count;
  // Scratch, allocated by the binding.
  float* normed;     // [M, hidden]
  float* qkv_out;    // [M, (heads + 2 kv_heads) head_dim]
  float* attended;   // [M, heads head_dim]
  float* gate_up_out;  // [M, 2 intermediate]
  float* activated;  // [M, intermediate]
  float* product;    // [M, hidden]: o's and down's outputs before they join the residual
  uint8_t* quantized;  // [M, the widest product input rounded up to 4]
  int8::ActivationParams* row_params;  // [M]
};

namespace int8_llama_detail {

inline void int8_product(const Int8LlamaPass& pass, const Int8LayerStack& stack, int64_t layer, const float* input,
                         float* output, bool vnni, const ParallelFor& parallel_for) {
  const int64_t N = stack.out_features, K = stack.in_features, groups = int8::group_count(K);
  int8::quantize_input(input, pass.tokens, K, groups * int8::kGroup, pass.row_counts, pass.row_count, vnni,
                       pass.quantized, pass.row_params);
  const int8::GemmProblem problem{pass.quantized,
                                  stack.packed + layer * int8::packed_size(N, K),
                                  stack.col_sums + layer * N,
                                  stack.w_scale + layer * N,
                                  stack.bias != nullptr ? stack.bias + layer * N : nullptr,
                                  output,
                                  pass.tokens,
                                  N,
                                  groups,
                                  pass.row_params};
  int8::gemm(problem, vnni, parallel_for);
}

// The layer's new keys and values (after the rotation) into each row's cache, after its `start` cached positions.
inline void store_keys_values(const Int8LlamaPass& pass, int64_t layer) {
  const int64_t qkv_stride = (pass.heads + 2 * pass.kv_heads) * pass.head_dim;
  const size_t head_bytes = static_cast<size_t>(pass.head_dim) * sizeof(float);
  for (int64_t r = 0; r < pass.row_count; ++r) {
    const LlamaRow& row = pass.rows[r];
    for (int64_t t = 0; t < row.count; ++t) {
      const float* token = pass.qkv_out + (row.offset + t) * qkv_stride;
      for (int64_t h = 0; h < pass.kv_heads; ++h) {
        const int64_t slot = ((layer * pass.kv_heads + h) * row.capacity + row.start + t) * pass.head_dim;
        std::memcpy(row.keys + slot, token + (pass.heads + h) * pass.head_dim, head_bytes);
        std::memcpy(row.values + slot, token + (pass.heads + pass.kv_heads + h) * pass.head_dim, head_bytes);
      }
    }
  }
}

inline void add_into(float* states, const float* addend, int64_t count) {
  for (int64_t i = 0; i < count; ++i) states[i] += addend[i];
}

}  // namespace int8_llama_detail

inline void run_int8_llama(const Int8LlamaPass& pass, const ParallelFor& parallel_for) {
  using namespace int8_llama_detail;
  const bool vnni = int8::use_vnni();
  const int64_t M = pass.tokens, H = pass.hidden;
  const int64_t rotated_heads = pass.heads + pass.kv_heads;
  const int64_t qkv_stride = (rotated_heads + pass.kv_heads) * pass.head_dim;
  for (int64_t layer = 0; layer < pass.layers; ++layer) {
    DIVERSED_CPU_CALL(llama_rms_norm, pass.states, pass.input_norm + layer * H, pass.eps, M, H, pass.normed);
    int8_product(pass, pass.qkv, layer, pass.normed, pass.qkv_out, vnni, parallel_for);
    DIVERSED_CPU_CALL(llama_rotate, pass.qkv_out, pass.cos, pass.sin, M, qkv_stride, rotated_heads, pass.head_dim);
    store_keys_values(pass, layer);
    const LlamaAttention attention{pass.qkv_out, pass.attended, pass.rows, pass.row_count, M, layer,
                                   pass.heads,   pass.kv_heads, pass.head_dim, pass.attention_scale};
    DIVERSED_CPU_CALL(llama_attention, attention, parallel_for);
    int8_product(pass, pass.o, layer, pass.attended, pass.product, vnni, parallel_for);
    add_into(pass.states, pass.product, M * H);
    DIVERSED_CPU_CALL(llama_rms_norm, pass.states, pass.post_norm + layer * H, pass.eps, M, H, pass.normed);
    int8_product(pass, pass.gate_up, layer, pass.normed, pass.gate_up_out, vnni, parallel_for);
    DIVERSED_CPU_CALL(llama_silu_mul, pass.gate_up_out, M, pass.intermediate, pass.activated);
    int8_product(pass, pass.down, layer, pass.activated, pass.product, vnni, parallel_for);
    add_into(pass.states, pass.product, M * H);
  }
}

}  // namespace cpu
}  // namespace diversed
