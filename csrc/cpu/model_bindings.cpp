// CPU bindings of the lean forward's ops: argument checks, output and scratch allocation, then the torch-free kernels
// of float_gemm.h (a float product over packed weights), int8_gemm.h (an int8 product) and int8_llama.h (every layer of
// an int8 Llama). Whatever the arguments, nothing is read
// or written out of bounds: every size the kernels use is checked against the tensors here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../common/op_checks.h"
#include "../common/poison.h"
#include "model_bindings.h"
#include "int8_gemm.h"
#include "int8_llama.h"
#include "cpu_dispatch.h"
#include "parallel_binding.h"

namespace diversed {
namespace cpu {

constexpr const char* kInt8PackOp = "diversed::int8_pack";
constexpr const char* kInt8LinearOp = "diversed::int8_linear";

// weight int8 [N, K] -> (packed int8 [int8::packed_size(N, K)], col_sums int32 [N]): the layout int8_linear reads.
std::tuple<at::Tensor, at::Tensor> int8_pack_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, kInt8PackOp,
              ": weight must be a 2-D int8 tensor");
  const at::Tensor contiguous = weight.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor packed = at::empty({int8::packed_size(N, K)}, weight.options());
  at::Tensor col_sums = at::empty({N}, weight.options().dtype(at::kInt));
  poison_outputs(col_sums);  // packed is zeroed by pack_weight itself (its padding must be zero)
  int8::pack_weight(contiguous.data_ptr<int8_t>(), N, K, packed.data_ptr<int8_t>(), col_sums.data_ptr<int32_t>());
  return {packed, col_sums};
}

// input float32 [..., K] -> [..., N], N = w_scale's length: fbgemm's dynamic int8 linear layer over packed weights.
at::Tensor int8_linear_cpu(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& col_sums,
                           const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                           at::OptionalIntArrayRef row_groups) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() >= 1 && input.size(-1) > 0, kInt8LinearOp,
              ": input must be float32 with a non-empty last dimension");
  const int64_t K = input.size(-1), N = w_scale.numel();
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 1 && w_scale.is_contiguous(), kInt8LinearOp,
              ": w_scale must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(col_sums.scalar_type() == at::kInt && col_sums.is_contiguous() && col_sums.numel() == N, kInt8LinearOp,
              ": col_sums must be contiguous int32 with ", N, " elements (one per output feature)");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 1 &&
                  packed.numel() == int8::packed_size(N, K),
              kInt8LinearOp, ": packed must be the int8_pack of an [", N, ", ", K, "] weight (",
              int8::packed_size(N, K), " int8 elements)");
  if (bias.has_value()) check_float_vector(*bias, N, kInt8LinearOp, "bias");
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = N;
  at::Tensor out = at::empty(shape, input.options());
  const int64_t M = input.numel() / K;
  // Rows quantised together: the whole input by default, else consecutive groups of the given sizes.
  std::vector<int64_t> group_rows{M};
  if (row_groups.has_value()) {
    group_rows.assign(row_groups->begin(), row_groups->end());
    int64_t total = 0;
    for (const int64_t rows : group_rows) {
      TORCH_CHECK(rows >= 1, kInt8LinearOp, ": row_groups must hold sizes >= 1, got ", rows);
      total += rows;
    }
    TORCH_CHECK(total == M, kInt8LinearOp, ": row_groups must add up to the input's ", M, " rows, got ", total);
  }
  if (M == 0 || N == 0) return out;
  poison_outputs(out);
  const at::Tensor x = input.contiguous();
  const int64_t groups = int8::group_count(K);
  const bool vnni = int8::use_vnni();
  at::Tensor xq = at::empty({M, groups * int8::kGroup}, input.options().dtype(at::kByte));
  std::vector<int8::ActivationParams> row_params(static_cast<size_t>(M));
  int8::quantize_input(x.data_ptr<float>(), M, K, groups * int8::kGroup, group_rows.data(),
                       static_cast<int64_t>(group_rows.size()), vnni, xq.data_ptr<uint8_t>(), row_params.data());
  const int8::GemmProblem problem{xq.data_ptr<uint8_t>(), packed.data_ptr<int8_t>(), col_sums.data_ptr<int32_t>(),
                                  w_scale.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                  out.data_ptr<float>(), M, N, groups, row_params.data()};
  int8::gemm(problem, vnni, kParallelFor);
  return out;
}

constexpr const char* kFloatPackOp = "diversed::float_pack";
constexpr const char* kFloatLinearOp = "diversed::float_linear";

// weight float32 [N, K] -> packed float32 [float_tile_count(N), K, kFloatTile]: the layout float_linear reads.
at::Tensor float_pack_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.size(1) >= 1,
              kFloatPackOp, ": weight must be a 2-D CPU float32 tensor with at least one input feature");
  const at::Tensor contiguous = weight.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor packed = at::empty({float_tile_count(N), K, kFloatTile}, weight.options());
  float_pack_weight(contiguous.data_ptr<float>(), N, K, packed.data_ptr<float>());
  return packed;
}

// input float32 [..., K] -> [..., out_features]: input times the packed weight, plus bias.
at::Tensor float_linear_cpu(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat && input.dim() >= 1 && input.size(-1) > 0,
              kFloatLinearOp, ": input must be a CPU float32 tensor with a non-empty last dimension");
  const int64_t K = input.size(-1), N = out_features;
  TORCH_CHECK(N >= 0 && packed.device().is_cpu() && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.dim() == 3 && packed.size(0) == float_tile_count(N) && packed.size(1) == K &&
                  packed.size(2) == kFloatTile,
              kFloatLinearOp, ": packed must be the float_pack of an [", N, ", ", K, "] weight, shape [",
              float_tile_count(N), ", ", K, ", ", kFloatTile, "], got ", packed.sizes());
  if (bias.has_value()) check_float_vector(*bias, N, kFloatLinearOp, "bias");
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = N;
  at::Tensor out = at::empty(shape, input.options());
  const int64_t M = input.numel() / K;
  if (M == 0 || N == 0) return out;
  poison_outputs(out);
  const at::Tensor x = input.contiguous();
  const FloatGemmProblem problem{x.data_ptr<float>(), packed.data_ptr<float>(),
                                 bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N, K};
  DIVERSED_CPU_CALL(float_gemm, problem, kParallelFor);
  return out;
}

namespace {

constexpr const char* kInt8LlamaOp = "diversed::int8_llama_layers";
constexpr int kProducts = 4;  // qkv, o, gate_up, down, in this order in every list
constexpr const char* kProductNames[kProducts] = {"qkv", "o", "gate_up", "down"};

// A stacked [layers, size] tensor of the given dtype, contiguous, on the CPU.
void check_stacked(const at::Tensor& tensor, at::ScalarType dtype, int64_t layers, int64_t size, const char* what,
                   int product) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.scalar_type() == dtype && tensor.is_contiguous() &&
                  tensor.dim() == 2 && tensor.size(0) == layers && tensor.size(1) == size,
              kInt8LlamaOp, ": ", what, "[", product, "] (", kProductNames[product], ") must be a contiguous CPU ",
              c10::toString(dtype), " tensor of shape [", layers, ", ", size, "], got ", tensor.sizes(), " ",
              tensor.scalar_type());
}

Int8LayerStack checked_stack(at::TensorList packed, at::TensorList col_sums, at::TensorList w_scales,
                             const c10::List<c10::optional<at::Tensor>>& biases, int product, int64_t layers,
                             int64_t out_features, int64_t in_features) {
  TORCH_CHECK(out_features >= 1 && in_features >= 1, kInt8LlamaOp, ": ", kProductNames[product],
              " must have at least one input and one output feature");
  check_stacked(packed[product], at::kChar, layers, int8::packed_size(out_features, in_features), "packed", product);
  check_stacked(col_sums[product], at::kInt, layers, out_features, "col_sums", product);
  check_stacked(w_scales[product], at::kFloat, layers, out_features, "w_scales", product);
  const c10::optional<at::Tensor> bias = biases.get(product);
  if (bias.has_value()) check_stacked(*bias, at::kFloat, layers, out_features, "biases", product);
  return {packed[product].data_ptr<int8_t>(), col_sums[product].data_ptr<int32_t>(),
          w_scales[product].data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr, out_features,
          in_features};
}

void check_cache(const at::Tensor& cache, const at::Tensor& first, int64_t layers, const char* what, size_t row) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kFloat && cache.is_contiguous() &&
                  cache.dim() == 4 && cache.size(0) == layers && cache.size(1) == first.size(1) &&
                  cache.size(3) == first.size(3),
              kInt8LlamaOp, ": ", what, "[", row, "] must be a contiguous CPU float32 cache [", layers, ", ",
              first.size(1), ", capacity, ", first.size(3), "] like keys[0], got ", cache.sizes(), " ",
              cache.scalar_type());
}

// The rows of the pass, each checked against its cache: offsets follow from the counts.
std::vector<LlamaRow> checked_rows(at::TensorList keys, at::TensorList values, at::IntArrayRef cache_lengths,
                                   at::IntArrayRef row_counts, int64_t layers, int64_t tokens) {
  TORCH_CHECK(!row_counts.empty() && keys.size() == row_counts.size() && values.size() == row_counts.size() &&
                  cache_lengths.size() == row_counts.size(),
              kInt8LlamaOp, ": keys, values, cache_lengths and row_counts must have one entry per row (at least one), "
              "got ", keys.size(), ", ", values.size(), ", ", cache_lengths.size(), " and ", row_counts.size());
  std::vector<LlamaRow> rows;
  int64_t offset = 0;
  for (size_t r = 0; r < row_counts.size(); ++r) {
    check_cache(keys[r], keys[0], layers, "keys", r);
    check_cache(values[r], keys[0], layers, "values", r);
    const int64_t capacity = keys[r].size(2);
    TORCH_CHECK(values[r].size(2) == capacity, kInt8LlamaOp, ": values[", r, "] must have the shape of keys[", r, "]");
    TORCH_CHECK(row_counts[r] >= 1 && cache_lengths[r] >= 0 && cache_lengths[r] <= capacity - row_counts[r],
                kInt8LlamaOp, ": row ", r, " appends ", row_counts[r], " token(s) after ", cache_lengths[r],
                " cached position(s); it needs at least one token and room for them in its cache of ", capacity);
    rows.push_back({offset, row_counts[r], cache_lengths[r], capacity, keys[r].data_ptr<float>(),
                    values[r].data_ptr<float>()});
    offset += row_counts[r];
  }
  TORCH_CHECK(offset == tokens, kInt8LlamaOp, ": row_counts must add up to the ", tokens, " rows of states, got ",
              offset);
  return rows;
}

at::Tensor scratch(int64_t rows, int64_t columns, const at::Tensor& like) {
  return at::empty({rows, columns}, like.options());
}

}  // namespace

// states float32 [M, hidden] (the embedded new tokens of every row, row after row) -> the residual stream after every
// layer, [M, hidden]; each row's new keys and values are written to its cache (see int8_llama.h).
at::Tensor int8_llama_layers_cpu(const at::Tensor& states, const at::Tensor& norms, at::TensorList packed,
                                 at::TensorList col_sums, at::TensorList w_scales,
                                 const c10::List<c10::optional<at::Tensor>>& biases, const at::Tensor& cos,
                                 const at::Tensor& sin, at::TensorList keys, at::TensorList values,
                                 at::IntArrayRef cache_lengths, at::IntArrayRef row_counts, int64_t num_heads,
                                 double eps, double attention_scale) {
  TORCH_CHECK(states.device().is_cpu() && states.scalar_type() == at::kFloat && states.dim() == 2 &&
                  states.size(0) >= 1 && states.size(1) >= 1,
              kInt8LlamaOp, ": states must be a CPU float32 [tokens, hidden] tensor with at least one token");
  const int64_t M = states.size(0), H = states.size(1);
  TORCH_CHECK(norms.device().is_cpu() && norms.scalar_type() == at::kFloat && norms.is_contiguous() &&
                  norms.dim() == 3 && norms.size(0) == 2 && norms.size(1) >= 1 && norms.size(2) == H,
              kInt8LlamaOp, ": norms must be a contiguous CPU float32 [2, layers, hidden] tensor (input and "
              "post-attention RMSNorm weights) with the hidden size of states (", H, "), got ", norms.sizes());
  const int64_t layers = norms.size(1);
  TORCH_CHECK(packed.size() == kProducts && col_sums.size() == kProducts && w_scales.size() == kProducts &&
                  biases.size() == kProducts,
              kInt8LlamaOp, ": packed, col_sums, w_scales and biases must each hold 4 entries (qkv, o, gate_up, down)");
  const std::vector<LlamaRow> rows = checked_rows(keys, values, cache_lengths, row_counts, layers, M);
  const int64_t kv_heads = keys[0].size(1), head_dim = keys[0].size(3);
  TORCH_CHECK(kv_heads >= 1 && head_dim >= 2 && head_dim % 2 == 0 && num_heads >= 1 && num_heads % kv_heads == 0,
              kInt8LlamaOp, ": num_heads (", num_heads, ") must be a positive multiple of the caches' ", kv_heads,
              " key/value heads, and head_dim (", head_dim, ") even");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == at::kFloat && table->is_contiguous() &&
                    table->dim() == 2 && table->size(0) == M && table->size(1) == head_dim,
                kInt8LlamaOp, ": cos and sin must be contiguous CPU float32 [", M, ", ", head_dim, "] tensors");
  }
  TORCH_CHECK(col_sums[2].dim() == 2 && col_sums[2].size(1) % 2 == 0, kInt8LlamaOp,
              ": gate_up must stack the gate and up projections (an even number of output features)");
  const int64_t intermediate = col_sums[2].size(1) / 2, qkv_features = (num_heads + 2 * kv_heads) * head_dim;
  Int8LlamaPass pass{};
  pass.qkv = checked_stack(packed, col_sums, w_scales, biases, 0, layers, qkv_features, H);
  pass.o = checked_stack(packed, col_sums, w_scales, biases, 1, layers, H, num_heads * head_dim);
  pass.gate_up = checked_stack(packed, col_sums, w_scales, biases, 2, layers, 2 * intermediate, H);
  pass.down = checked_stack(packed, col_sums, w_scales, biases, 3, layers, H, intermediate);

  at::Tensor out = states.contiguous().clone();
  at::Tensor normed = scratch(M, H, states), qkv = scratch(M, qkv_features, states);
  at::Tensor attended = scratch(M, num_heads * head_dim, states), product = scratch(M, H, states);
  at::Tensor gate_up = scratch(M, 2 * intermediate, states), activated = scratch(M, intermediate, states);
  const int64_t widest = std::max({H, num_heads * head_dim, intermediate});
  const at::Tensor quantized =
      at::empty({M, int8::group_count(widest) * int8::kGroup}, states.options().dtype(at::kByte));
  poison_outputs(normed, qkv, attended, product, gate_up, activated);  // a scratch element read before written shows
  std::vector<int8::ActivationParams> row_params(static_cast<size_t>(M));
  const std::vector<int64_t> counts(row_counts.begin(), row_counts.end());

  pass.states = out.data_ptr<float>();
  pass.tokens = M;
  pass.hidden = H;
  pass.layers = layers;
  pass.heads = num_heads;
  pass.kv_heads = kv_heads;
  pass.head_dim = head_dim;
  pass.intermediate = intermediate;
  pass.input_norm = norms.data_ptr<float>();
  pass.post_norm = pass.input_norm + layers * H;
  pass.eps = static_cast<float>(eps);
  pass.attention_scale = static_cast<float>(attention_scale);
  pass.cos = cos.data_ptr<float>();
  pass.sin = sin.data_ptr<float>();
  pass.rows = rows.data();
  pass.row_counts = counts.data();
  pass.row_count = static_cast<int64_t>(rows.size());
  pass.normed = normed.data_ptr<float>();
  pass.qkv_out = qkv.data_ptr<float>();
  pass.attended = attended.data_ptr<float>();
  pass.gate_up_out = gate_up.data_ptr<float>();
  pass.activated = activated.data_ptr<float>();
  pass.product = product.data_ptr<float>();
  pass.quantized = quantized.data_ptr<uint8_t>();
  pass.row_params = row_params.data();
  run_int8_llama(pass, kParallelFor);
  return out;
}

}  // namespace cpu
}  // namespace diversed
