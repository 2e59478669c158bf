// The lean forward's ops: their schemas, a fragment of the `diversed` library whose verify and stats ops are defined in
// ../ops.cpp, and their CPU kernels (model_bindings.cpp). CPU only, and only in a build with the forward
// (DIVERSED_FORWARD=1, the default; setup.py); the fake (meta) kernels are registered from Python.
#include <torch/library.h>

#include "model_bindings.h"

TORCH_LIBRARY_FRAGMENT(diversed, m) {
  // float32 weight [N, K] packed once, then input float32 [..., K] times it (float_gemm.h): each output summed over k
  // in order, whatever the number of rows; bias float32 [N].
  m.def("float_pack(Tensor weight) -> Tensor");
  m.def("float_linear(Tensor input, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  // int8 weight [N, K] packed once, then input float32 [..., K] times it as torch's dynamic int8 linear layer computes
  // it (int8_gemm.h); w_scale float32 [N], bias float32 [N]; row_groups: sizes of consecutive row groups quantised
  // separately (default: all rows together, as the layer does).
  m.def("int8_pack(Tensor weight) -> (Tensor, Tensor)");
  m.def("int8_linear(Tensor input, Tensor packed, Tensor col_sums, Tensor w_scale, Tensor? bias, "
        "int[]? row_groups=None) -> Tensor");
  // Every decoder layer of a Llama (llama_layers.h) over the embedded new tokens of several sequences stacked in
  // states [M, hidden]. Per layer l: norms[2l], norms[2l + 1] (input and post-attention RMSNorm
  // weights), and products 4l..4l+3 (qkv, o, gate_up, down) in the lists: int8 (int8_pack's packed, col_sums,
  // w_scales) or float32 (float_pack's packed); biases optional. cos, sin [M, head_dim]; keys/values: each
  // sequence's cache [layers, kv_heads, capacity, head_dim], written after its cache_lengths[r] positions with its
  // row_counts[r] new tokens; int8 products quantise every token's input on its own. Returns the residual stream
  // after the last layer.
  m.def("int8_llama_layers(Tensor states, Tensor[] norms, Tensor[] packed, Tensor[] col_sums, Tensor[] w_scales, "
        "Tensor?[] biases, Tensor cos, Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, int[] cache_lengths, "
        "int[] row_counts, int num_heads, float eps, float attention_scale) -> Tensor");
  m.def("float_llama_layers(Tensor states, Tensor[] norms, Tensor[] packed, Tensor?[] biases, Tensor cos, "
        "Tensor sin, Tensor(a!)[] keys, Tensor(b!)[] values, int[] cache_lengths, int[] row_counts, int num_heads, "
        "float eps, float attention_scale) -> Tensor");
}

namespace diversed {

TORCH_LIBRARY_IMPL(diversed, CPU, m) {
  m.impl("float_pack", &cpu::float_pack_cpu);
  m.impl("float_linear", &cpu::float_linear_cpu);
  m.impl("int8_pack", &cpu::int8_pack_cpu);
  m.impl("int8_linear", &cpu::int8_linear_cpu);
  m.impl("int8_llama_layers", &cpu::int8_llama_layers_cpu);
  m.impl("float_llama_layers", &cpu::float_llama_layers_cpu);
}

}  // namespace diversed
