// CPU-only probes of what the split CUDA kernels compute, for the tests: the same __host__ __device__ functions
// (csrc/common/vocab_split.h and the seed draw of verify_math.h) run here on the CPU, so the CPU suite checks the
// decomposition against the reference without a GPU. Their own library (diversed_ext/_probes*.so, namespace
// diversed_probes), which only the tests load (torch.ops.load_library): the package never does.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../common/vocab_split.h"

namespace diversed {
namespace cpu {
namespace {

constexpr const char* kSplitProbeOp = "diversed_probes::vocab_split_probe";

// A chunk's online-softmax partial, taken in index order: the GPU takes the same max and adds the same exps in a tree.
SoftmaxPartial chunk_softmax_partial(const float* logits, int64_t begin, int64_t end, float inverse_temperature) {
  float chunk_max = -INFINITY;
  for (int64_t v = begin; v < end; ++v) {
    const float scaled = logits[v] * inverse_temperature;
    if (scaled > chunk_max) chunk_max = scaled;
  }
  if (!(chunk_max > -INFINITY)) return SoftmaxPartial{-INFINITY, 0.0};
  double sum = 0.0;
  for (int64_t v = begin; v < end; ++v) sum += exp_nonpositive(logits[v] * inverse_temperature - chunk_max);
  return SoftmaxPartial{chunk_max, sum};
}

// One row through the split kernels' steps: (logits: the chunks' softmax partials merged into the normaliser), the
// chunk masses, the chunk holding u * total, and the sample inside it. Writes the row's outputs.
void probe_row(const float* values, int64_t vocab, bool from_logits, float inverse_temperature, double uniform,
               const VocabSplit& split, double* chunk_masses, int64_t* chunk, int64_t* token, float* stats) {
  SoftmaxStats normaliser{0.0f, 0.0f};
  if (from_logits) {
    std::vector<SoftmaxPartial> partials(split.num_chunks);
    for (int64_t c = 0; c < split.num_chunks; ++c)
      partials[c] = chunk_softmax_partial(values, split.begin(c), split.end(c), inverse_temperature);
    normaliser = merge_softmax_partials(partials.data(), split.num_chunks);
  }
  const auto mass = [&](int64_t v) {
    return from_logits ? softmax_mass(values[v], inverse_temperature, normaliser) : sanitize_mass(values[v]);
  };
  for (int64_t c = 0; c < split.num_chunks; ++c) {
    double sum = 0.0;
    for (int64_t v = split.begin(c); v < split.end(c); ++v) sum += static_cast<double>(mass(v));
    chunk_masses[c] = sum;
  }
  const double total = total_mass(chunk_masses, split.num_chunks);
  const double threshold = sanitize_uniform(uniform) * total;
  const ChunkChoice choice = total > 0.0 ? choose_chunk(chunk_masses, split.num_chunks, threshold) : ChunkChoice{-1, 0};
  *chunk = choice.chunk;
  *token = choice.chunk < 0 ? -1
                            : sample_in_chunk(mass, split.begin(choice.chunk), split.end(choice.chunk),
                                              threshold - choice.mass_before);
  stats[0] = normaliser.max;
  stats[1] = normaliser.inverse_sum;
}

// values float32 [N, V] (probabilities, or logits with from_logits), uniforms float64 [N]; the rows are cut as a
// split kernel cuts N rows aiming at target_blocks blocks. Returns the chunk masses float64 [N, chunks], the chosen
// chunk and token int64 [N] (-1: no mass), and the normaliser float32 [N, 2] (max, 1 / sum; zeros for probabilities).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> vocab_split_probe_cpu(const at::Tensor& values,
                                                                                const at::Tensor& uniforms,
                                                                                int64_t target_blocks, bool from_logits,
                                                                                double temperature) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.dim() == 2 && values.size(1) >= 1, kSplitProbeOp,
              ": values must be float32 [N, V] with V >= 1, got ", values.scalar_type(), " ", values.sizes());
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.dim() == 1 && uniforms.size(0) == values.size(0),
              kSplitProbeOp, ": uniforms must be float64 [N] = [", values.size(0), "], got ", uniforms.sizes());
  TORCH_CHECK(target_blocks >= 1, kSplitProbeOp, ": target_blocks must be >= 1, got ", target_blocks);
  const at::Tensor rows = values.contiguous(), draws = uniforms.contiguous();
  const int64_t N = rows.size(0), V = rows.size(1);
  const VocabSplit split = split_vocab(N, V, target_blocks);
  const auto options = rows.options();
  at::Tensor masses = at::empty({N, split.num_chunks}, options.dtype(at::kDouble));
  at::Tensor chunks = at::empty({N}, options.dtype(at::kLong));
  at::Tensor tokens = at::empty({N}, options.dtype(at::kLong));
  at::Tensor stats = at::empty({N, 2}, options);
  const float inverse_temperature = inverse_temperature_of(static_cast<float>(temperature));
  for (int64_t row = 0; row < N; ++row) {
    probe_row(rows.data_ptr<float>() + row * V, V, from_logits, inverse_temperature, draws.data_ptr<double>()[row],
              split, masses.data_ptr<double>() + row * split.num_chunks, chunks.data_ptr<int64_t>() + row,
              tokens.data_ptr<int64_t>() + row, stats.data_ptr<float>() + 2 * row);
  }
  return {masses, chunks, tokens, stats};
}

// seeds, offsets int64 [N] -> int64 [N]: the seed a seedless CUDA call draws from a generator state (seed, offset).
at::Tensor generator_seeds_cpu(const at::Tensor& seeds, const at::Tensor& offsets) {
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 1 && offsets.scalar_type() == at::kLong &&
                  offsets.sizes() == seeds.sizes(),
              "diversed_probes::generator_seeds: seeds and offsets must be int64 [N] of one shape");
  const at::Tensor seed_values = seeds.contiguous(), offset_values = offsets.contiguous();
  at::Tensor out = at::empty_like(seed_values);
  for (int64_t i = 0; i < seeds.size(0); ++i)
    out.data_ptr<int64_t>()[i] = seed_from_generator(static_cast<uint64_t>(seed_values.data_ptr<int64_t>()[i]),
                                                     static_cast<uint64_t>(offset_values.data_ptr<int64_t>()[i]));
  return out;
}

}  // namespace
}  // namespace cpu

// Rows float32 [N, V] through the split CUDA kernels' steps (chunk masses float64 [N, chunks], chosen chunk and token
// int64 [N], softmax normaliser float32 [N, 2]), and the seeds int64 [N] that seedless CUDA calls draw from generator
// states (seeds, offsets int64 [N]).
TORCH_LIBRARY(diversed_probes, m) {
  m.def("vocab_split_probe(Tensor values, Tensor uniforms, int target_blocks, bool from_logits, float temperature) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("generator_seeds(Tensor seeds, Tensor offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(diversed_probes, CPU, m) {
  m.impl("vocab_split_probe", &cpu::vocab_split_probe_cpu);
  m.impl("generator_seeds", &cpu::generator_seeds_cpu);
}

}  // namespace diversed
