// CPU bindings of the lean forward's ops (model_bindings.cpp), registered with their schemas in ops_forward.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace diversed {
namespace cpu {

at::Tensor float_pack_cpu(const at::Tensor& weight);

at::Tensor float_linear_cpu(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features);

std::tuple<at::Tensor, at::Tensor> int8_pack_cpu(const at::Tensor& weight);

at::Tensor int8_linear_cpu(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& col_sums,
                           const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                           at::OptionalIntArrayRef row_groups);

at::Tensor int8_llama_layers_cpu(const at::Tensor& states, at::TensorList norms, at::TensorList packed,
                                 at::TensorList col_sums, at::TensorList w_scales,
                                 const c10::List<c10::optional<at::Tensor>>& biases, const at::Tensor& cos,
                                 const at::Tensor& sin, at::TensorList keys, at::TensorList values,
                                 at::IntArrayRef cache_lengths, at::IntArrayRef row_counts, int64_t num_heads,
                                 double eps, double attention_scale);

at::Tensor float_llama_layers_cpu(const at::Tensor& states, at::TensorList norms, at::TensorList packed,
                                  const c10::List<c10::optional<at::Tensor>>& biases, const at::Tensor& cos,
                                  const at::Tensor& sin, at::TensorList keys, at::TensorList values,
                                  at::IntArrayRef cache_lengths, at::IntArrayRef row_counts, int64_t num_heads,
                                  double eps, double attention_scale);

}  // namespace cpu
}  // namespace diversed
