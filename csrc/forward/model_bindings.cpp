// CPU bindings of the lean forward's ops: argument checks, output and scratch allocation, then the torch-free kernels
// of float_gemm.h (a float product over packed weights), int8_gemm.h (an int8 product) and llama_layers.h (every layer
// of a Llama, with int8 or float products). Whatever the arguments, nothing is read or written out of bounds: every
// size the kernels use is checked against the tensors here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "../common/poison.h"
#include "../common/tensor_checks.h"
#include "../cpu_base/torch_parallel_for.h"
#include "forward_dispatch.h"
#include "int8_gemm.h"
#include "llama_layers.h"
#include "model_bindings.h"

namespace diversed {
namespace cpu {

constexpr const char* kInt8PackOp = "diversed::int8_pack";
constexpr const char* kInt8LinearOp = "diversed::int8_linear";

namespace {

// Every int8 op refuses a product longer than the int32 sums allow, naming what reads the `in_features` inputs.
void check_int8_in_features(int64_t in_features, const char* op, const std::string& what) {
  TORCH_CHECK(in_features <= int8::kMaxInFeatures, op, ": ", what, " may have at most ", int8::kMaxInFeatures,
              " input features (the int32 sums' bound), got ", in_features);
}

}  // namespace

// weight int8 [N, K] -> (packed int8 [int8::packed_size(N, K)], col_sums int32 [N]): the layout int8_linear reads.
std::tuple<at::Tensor, at::Tensor> int8_pack_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, kInt8PackOp,
              ": weight must be a 2-D int8 tensor");
  const at::Tensor contiguous = weight.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1);
  check_int8_in_features(K, kInt8PackOp, "weight");
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
  check_int8_in_features(K, kInt8LinearOp, "input");
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
  const int8::Isa isa = int8_isa();
  at::Tensor xq = at::empty({M, groups * int8::kGroup}, input.options().dtype(at::kByte));
  std::vector<int8::ActivationParams> row_params(static_cast<size_t>(M));
  int8::quantize_input(x.data_ptr<float>(), M, K, groups * int8::kGroup, group_rows.data(),
                       static_cast<int64_t>(group_rows.size()), isa, xq.data_ptr<uint8_t>(), row_params.data());
  const int8::GemmProblem problem{xq.data_ptr<uint8_t>(), packed.data_ptr<int8_t>(), col_sums.data_ptr<int32_t>(),
                                  w_scale.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                  out.data_ptr<float>(), M, N, groups, row_params.data()};
  int8::gemm(problem, isa, kParallelFor);
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
constexpr const char* kFloatLlamaOp = "diversed::float_llama_layers";
constexpr const char* kProductNames[kProductsPerLayer] = {"qkv", "o", "gate_up", "down"};

// A per-layer tensor list entry: a contiguous CPU tensor of the given dtype and shape.
void check_part(const at::Tensor& tensor, at::ScalarType dtype, at::IntArrayRef shape, const char* op,
                const char* what, size_t index) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.scalar_type() == dtype && tensor.is_contiguous() &&
                  tensor.sizes() == shape,
              op, ": ", what, "[", index, "] (layer ", index / kProductsPerLayer, ", ",
              kProductNames[index % kProductsPerLayer], ") must be a contiguous CPU ", c10::toString(dtype),
              " tensor of shape ", shape, ", got ", tensor.sizes(), " ", tensor.scalar_type());
}

void check_cache(const at::Tensor& cache, const at::Tensor& first, int64_t layers, const char* op, const char* what,
                 size_t row) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kFloat && cache.is_contiguous() &&
                  cache.dim() == 4 && cache.size(0) == layers && cache.size(1) == first.size(1) &&
                  cache.size(3) == first.size(3),
              op, ": ", what, "[", row, "] must be a contiguous CPU float32 cache [", layers, ", ", first.size(1),
              ", capacity, ", first.size(3), "] like keys[0], got ", cache.sizes(), " ", cache.scalar_type());
}

// The rows of the pass, each checked against its cache: offsets follow from the counts.
std::vector<LlamaRow> checked_rows(at::TensorList keys, at::TensorList values, at::IntArrayRef cache_lengths,
                                   at::IntArrayRef row_counts, int64_t layers, int64_t tokens, const char* op) {
  TORCH_CHECK(!row_counts.empty() && keys.size() == row_counts.size() && values.size() == row_counts.size() &&
                  cache_lengths.size() == row_counts.size(),
              op, ": keys, values, cache_lengths and row_counts must have one entry per row (at least one), got ",
              keys.size(), ", ", values.size(), ", ", cache_lengths.size(), " and ", row_counts.size());
  std::vector<LlamaRow> rows;
  int64_t offset = 0;
  for (size_t r = 0; r < row_counts.size(); ++r) {
    check_cache(keys[r], keys[0], layers, op, "keys", r);
    check_cache(values[r], keys[0], layers, op, "values", r);
    const int64_t capacity = keys[r].size(2);
    TORCH_CHECK(values[r].size(2) == capacity, op, ": values[", r, "] must have the shape of keys[", r, "]");
    TORCH_CHECK(capacity % kKeyTile == 0, op, ": keys[", r, "] must hold a multiple of ", kKeyTile,
                " positions (keys are stored in tiles of that many), got ", capacity);
    TORCH_CHECK(row_counts[r] >= 1 && cache_lengths[r] >= 0 && cache_lengths[r] <= capacity - row_counts[r], op,
                ": row ", r, " appends ", row_counts[r], " token(s) after ", cache_lengths[r],
                " cached position(s); it needs at least one token and room for them in its cache of ", capacity);
    rows.push_back({offset, row_counts[r], cache_lengths[r], capacity, keys[r].data_ptr<float>(),
                    values[r].data_ptr<float>()});
    offset += row_counts[r];
  }
  TORCH_CHECK(offset == tokens, op, ": row_counts must add up to the ", tokens, " rows of states, got ", offset);
  return rows;
}

at::Tensor scratch(int64_t rows, int64_t columns, const at::Tensor& like) {
  return at::empty({rows, columns}, like.options());
}

// Everything both ops share: the checked shapes, the rows, the output (the residual stream, a copy of states) and the
// scratch between products. The products' own tensors are the caller's to check against in_features/out_features.
struct LlamaCall {
  LlamaPass pass;
  std::vector<LlamaRow> rows;
  at::Tensor out, normed, qkv, attended, gate_up, activated, product;

  // Product p's (out_features, in_features).
  std::pair<int64_t, int64_t> product_shape(int product) const {
    switch (product) {
      case kQkv: return {(pass.heads + 2 * pass.kv_heads) * pass.head_dim, pass.hidden};
      case kO: return {pass.hidden, pass.heads * pass.head_dim};
      case kGateUp: return {2 * pass.intermediate, pass.hidden};
      default: return {pass.hidden, pass.intermediate};
    }
  }
};

LlamaCall start_llama_call(const at::Tensor& states, at::TensorList norms, size_t product_count,
                           const at::Tensor& cos, const at::Tensor& sin, at::TensorList keys, at::TensorList values,
                           at::IntArrayRef cache_lengths, at::IntArrayRef row_counts, int64_t num_heads,
                           int64_t intermediate, double eps, double attention_scale, const char* op) {
  TORCH_CHECK(states.device().is_cpu() && states.scalar_type() == at::kFloat && states.dim() == 2 &&
                  states.size(0) >= 1 && states.size(1) >= 1,
              op, ": states must be a CPU float32 [tokens, hidden] tensor with at least one token");
  LlamaCall call;
  LlamaPass& pass = call.pass;
  pass.tokens = states.size(0);
  pass.hidden = states.size(1);
  TORCH_CHECK(!norms.empty() && norms.size() % 2 == 0 && product_count == kProductsPerLayer * norms.size() / 2, op,
              ": norms must hold 2 weights per layer (input and post-attention RMSNorm) and the product lists 4 per "
              "layer (qkv, o, gate_up, down), got ", norms.size(), " and ", product_count);
  pass.layers = static_cast<int64_t>(norms.size() / 2);
  call.rows = checked_rows(keys, values, cache_lengths, row_counts, pass.layers, pass.tokens, op);
  pass.kv_heads = keys[0].size(1);
  pass.head_dim = keys[0].size(3);
  pass.heads = num_heads;
  pass.intermediate = intermediate;
  TORCH_CHECK(pass.kv_heads >= 1 && pass.head_dim >= 2 && pass.head_dim % 2 == 0 && num_heads >= 1 &&
                  num_heads % pass.kv_heads == 0 && intermediate >= 1,
              op, ": num_heads (", num_heads, ") must be a positive multiple of the caches' ", pass.kv_heads,
              " key/value heads, head_dim (", pass.head_dim, ") even, and the MLP at least one feature wide");
  for (size_t index = 0; index < norms.size(); ++index) {
    TORCH_CHECK(norms[index].device().is_cpu() && norms[index].scalar_type() == at::kFloat &&
                    norms[index].is_contiguous() && norms[index].dim() == 1 && norms[index].size(0) == pass.hidden,
                op, ": norms[", index, "] must be a contiguous CPU float32 vector with the hidden size of states (",
                pass.hidden, "), got ", norms[index].sizes());
    (index % 2 == 0 ? pass.input_norms : pass.post_norms).push_back(norms[index].data_ptr<float>());
  }
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == at::kFloat && table->is_contiguous() &&
                    table->dim() == 2 && table->size(0) == pass.tokens && table->size(1) == pass.head_dim,
                op, ": cos and sin must be contiguous CPU float32 [", pass.tokens, ", ", pass.head_dim, "] tensors");
  }
  const int64_t M = pass.tokens;
  call.out = states.contiguous().clone();
  call.normed = scratch(M, pass.hidden, states);
  call.qkv = scratch(M, call.product_shape(kQkv).first, states);
  call.attended = scratch(M, num_heads * pass.head_dim, states);
  call.gate_up = scratch(M, 2 * intermediate, states);
  call.activated = scratch(M, intermediate, states);
  call.product = scratch(M, pass.hidden, states);
  // A scratch element read before it is written shows as NaN in the output under the test hook.
  poison_outputs(call.normed, call.qkv, call.attended, call.gate_up, call.activated, call.product);
  pass.states = call.out.data_ptr<float>();
  pass.eps = static_cast<float>(eps);
  pass.attention_scale = static_cast<float>(attention_scale);
  pass.cos = cos.data_ptr<float>();
  pass.sin = sin.data_ptr<float>();
  pass.rows = call.rows.data();
  pass.row_count = static_cast<int64_t>(call.rows.size());
  pass.normed = call.normed.data_ptr<float>();
  pass.qkv_out = call.qkv.data_ptr<float>();
  pass.attended = call.attended.data_ptr<float>();
  pass.gate_up_out = call.gate_up.data_ptr<float>();
  pass.activated = call.activated.data_ptr<float>();
  pass.product = call.product.data_ptr<float>();
  return call;
}

const float* optional_bias(const c10::List<c10::optional<at::Tensor>>& biases, size_t index, int64_t out_features,
                           const char* op) {
  const c10::optional<at::Tensor> bias = biases.get(index);
  if (!bias.has_value()) return nullptr;
  check_part(*bias, at::kFloat, {out_features}, op, "biases", index);
  return bias->data_ptr<float>();
}

}  // namespace

// states float32 [M, hidden] (the embedded new tokens of every row, row after row) -> the residual stream after every
// layer, [M, hidden]; each row's new keys and values are written to its cache (see llama_layers.h).
at::Tensor int8_llama_layers_cpu(const at::Tensor& states, at::TensorList norms, at::TensorList packed,
                                 at::TensorList col_sums, at::TensorList w_scales,
                                 const c10::List<c10::optional<at::Tensor>>& biases, const at::Tensor& cos,
                                 const at::Tensor& sin, at::TensorList keys, at::TensorList values,
                                 at::IntArrayRef cache_lengths, at::IntArrayRef row_counts, int64_t num_heads,
                                 double eps, double attention_scale) {
  const char* op = kInt8LlamaOp;
  TORCH_CHECK(packed.size() >= kProductsPerLayer && col_sums.size() == packed.size() &&
                  w_scales.size() == packed.size() && biases.size() == packed.size(),
              op, ": packed, col_sums, w_scales and biases must each hold 4 entries per layer (qkv, o, gate_up, down)");
  TORCH_CHECK(col_sums[kGateUp].dim() == 1 && col_sums[kGateUp].size(0) % 2 == 0, op,
              ": gate_up must stack the gate and up projections (an even number of output features)");
  LlamaCall call = start_llama_call(states, norms, packed.size(), cos, sin, keys, values, cache_lengths, row_counts,
                                    num_heads, col_sums[kGateUp].size(0) / 2, eps, attention_scale, op);
  Int8Products products;
  for (size_t index = 0; index < packed.size(); ++index) {
    const auto [N, K] = call.product_shape(static_cast<int>(index % kProductsPerLayer));
    check_int8_in_features(K, op, "product " + std::to_string(index));
    check_part(packed[index], at::kChar, {int8::packed_size(N, K)}, op, "packed", index);
    check_part(col_sums[index], at::kInt, {N}, op, "col_sums", index);
    check_part(w_scales[index], at::kFloat, {N}, op, "w_scales", index);
    products.parts.push_back({packed[index].data_ptr<int8_t>(), col_sums[index].data_ptr<int32_t>(),
                              w_scales[index].data_ptr<float>(), optional_bias(biases, index, N, op), N, K});
  }
  const LlamaPass& pass = call.pass;
  const int64_t widest = std::max({pass.hidden, pass.heads * pass.head_dim, pass.intermediate});
  const at::Tensor quantized =
      at::empty({pass.tokens, int8::group_count(widest) * int8::kGroup}, states.options().dtype(at::kByte));
  std::vector<int8::ActivationParams> row_params(static_cast<size_t>(pass.tokens));
  // Every token's input quantised on its own (a group of one row each), as Int8Linear does: one scale over a pass
  // would let an outlier token coarsen the others, and a token's result depend on what it was fed with.
  const std::vector<int64_t> counts(static_cast<size_t>(pass.tokens), 1);
  products.row_counts = counts.data();
  products.row_count = static_cast<int64_t>(counts.size());
  products.tokens = pass.tokens;
  products.quantized = quantized.data_ptr<uint8_t>();
  products.row_params = row_params.data();
  products.isa = int8_isa();
  products.parallel_for = &kParallelFor;
  run_llama_layers(pass, products, kParallelFor);
  return call.out;
}

// The same for a float32 Llama whose products are packed by float_pack.
at::Tensor float_llama_layers_cpu(const at::Tensor& states, at::TensorList norms, at::TensorList packed,
                                  const c10::List<c10::optional<at::Tensor>>& biases, const at::Tensor& cos,
                                  const at::Tensor& sin, at::TensorList keys, at::TensorList values,
                                  at::IntArrayRef cache_lengths, at::IntArrayRef row_counts, int64_t num_heads,
                                  double eps, double attention_scale) {
  const char* op = kFloatLlamaOp;
  TORCH_CHECK(packed.size() >= kProductsPerLayer && biases.size() == packed.size(), op,
              ": packed and biases must each hold 4 entries per layer (qkv, o, gate_up, down)");
  TORCH_CHECK(packed[kDown].dim() == 3, op, ": packed[3] (down) must be a float_pack of the down projection");
  LlamaCall call = start_llama_call(states, norms, packed.size(), cos, sin, keys, values, cache_lengths, row_counts,
                                    num_heads, packed[kDown].size(1), eps, attention_scale, op);
  FloatProducts products;
  for (size_t index = 0; index < packed.size(); ++index) {
    const auto [N, K] = call.product_shape(static_cast<int>(index % kProductsPerLayer));
    check_part(packed[index], at::kFloat, {float_tile_count(N), K, kFloatTile}, op, "packed", index);
    products.parts.push_back({packed[index].data_ptr<float>(), optional_bias(biases, index, N, op), N, K});
  }
  products.tokens = call.pass.tokens;
  products.parallel_for = &kParallelFor;
  run_llama_layers(call.pass, products, kParallelFor);
  return call.out;
}

}  // namespace cpu
}  // namespace diversed
