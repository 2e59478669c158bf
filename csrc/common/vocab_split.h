// One request's vocabulary split over many GPU blocks (the "split" CUDA kernels): the chunk layout, the merge of
// per-chunk softmax partials into a row's normaliser, and the search for the chunk that holds a sampling threshold.
//
// A row is cut into chunks of whole granules; each block of a split kernel reduces one chunk to a partial (a softmax
// max and sum, a mass, an argmax), and one block per request then combines a row's partials in chunk order and, to
// sample, reads again only the chunk that holds the threshold. Torch-free and __host__ __device__, so the CPU build
// runs these very functions (the CPU-only op vocab_split_probe) and the CPU tests check the decomposition against the
// reference: partial masses, the chunk chosen, the sample inside it, the merged normaliser.
#pragma once

#include <cmath>
#include <cstdint>

#include "verify_math.h"

namespace diversed {

// Chunks are whole multiples of this many elements: one tile of the CUDA kernels (256 threads x 16 elements), so every
// block reads whole 16-byte vectors and the chunk boundaries keep each row's alignment.
constexpr int64_t kSplitGranule = 4096;
// At most this many chunks per row, which bounds the per-request scratch (and the combining block's work).
constexpr int64_t kSplitMaxChunks = 128;

// The chunks of one row of `vocab` elements: chunk c covers [begin(c), end(c)); the last may be short, none is empty.
struct VocabSplit {
  int64_t num_chunks, chunk_size, vocab;

  DX_HD int64_t begin(int64_t chunk) const { return chunk * chunk_size < vocab ? chunk * chunk_size : vocab; }
  DX_HD int64_t end(int64_t chunk) const {
    const int64_t stop = (chunk + 1) * chunk_size;
    return stop < vocab ? stop : vocab;
  }
};

DX_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Enough chunks per row that `rows` rows give about `target_blocks` blocks (a few per multiprocessor), each at least
// one granule and at most kSplitMaxChunks per row. A request with many rows to reduce (or a large batch) gets few
// chunks: its blocks already fill the device.
DX_HD VocabSplit split_vocab(int64_t rows, int64_t vocab, int64_t target_blocks) {
  const int64_t safe_vocab = vocab > 1 ? vocab : 1;
  const int64_t safe_rows = rows > 1 ? rows : 1;
  int64_t chunks = ceil_div(target_blocks > 1 ? target_blocks : 1, safe_rows);
  const int64_t most = ceil_div(safe_vocab, kSplitGranule);
  if (chunks > most) chunks = most;
  if (chunks > kSplitMaxChunks) chunks = kSplitMaxChunks;
  const int64_t chunk_size = ceil_div(ceil_div(safe_vocab, chunks), kSplitGranule) * kSplitGranule;
  return VocabSplit{ceil_div(safe_vocab, chunk_size), chunk_size, safe_vocab};
}

// ------------------------------------------------------------------------------------------------ softmax partials
// A chunk's share of a softmax normaliser: the max of its scaled logits and the sum of exp(s - max) over the chunk.
// A chunk without a finite logit has max -inf and sum 0.
struct SoftmaxPartial {
  float max;
  double sum;
};

// A chunk's sum re-expressed against the row max (>= the chunk's max); 0 for a chunk without a finite logit, whose
// exp(-inf - -inf) would be NaN.
DX_HD double rescaled_partial_sum(SoftmaxPartial partial, float row_max) {
  return partial.max > -INFINITY ? rescale_exp_sum(partial.sum, partial.max, row_max) : 0.0;
}

// The row's normaliser from its max and its total; a row without a finite logit has no mass.
DX_HD SoftmaxStats finish_softmax(float row_max, double total) {
  if (!(row_max > -INFINITY)) return SoftmaxStats{-INFINITY, 0.0f};
  return SoftmaxStats{row_max, static_cast<float>(1.0 / total)};
}

// The normaliser of a row from all its chunks' partials, in chunk order (a GPU block adds the same terms in a tree).
DX_HD SoftmaxStats merge_softmax_partials(const SoftmaxPartial* partials, int64_t num_chunks) {
  float row_max = -INFINITY;
  for (int64_t c = 0; c < num_chunks; ++c) row_max = partials[c].max > row_max ? partials[c].max : row_max;
  double total = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) total += rescaled_partial_sum(partials[c], row_max);
  return finish_softmax(row_max, total);
}

// ------------------------------------------------------------------------------------------------ sampling
// The total of a row's chunk masses, added in chunk order: the scale of the sampling threshold u * total.
DX_HD double total_mass(const double* chunk_masses, int64_t num_chunks) {
  double total = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) total += chunk_masses[c];
  return total;
}

// The chunk that holds `threshold`, and the mass of the chunks before it (the threshold inside the chunk is then
// threshold - mass_before).
struct ChunkChoice {
  int64_t chunk;  // -1: no chunk has mass
  double mass_before;
};

// The first chunk whose running total (in chunk order, as total_mass adds) exceeds `threshold`. Only chunks with
// positive mass can be chosen; when rounding puts the threshold at or past the total, the last chunk with mass is.
DX_HD ChunkChoice choose_chunk(const double* chunk_masses, int64_t num_chunks, double threshold) {
  double running = 0.0;
  ChunkChoice last{-1, 0.0};
  for (int64_t c = 0; c < num_chunks; ++c) {
    const double mass = chunk_masses[c];
    if (!(mass > 0.0)) continue;
    if (running + mass > threshold) return ChunkChoice{c, running};
    last = ChunkChoice{c, running};
    running += mass;
  }
  return last;
}

// Inside the chosen chunk: the first element whose running mass exceeds `threshold` (already relative to the chunk),
// else (rounding) the chunk's last element with positive mass; -1 when the chunk has none. `mass(v)` gives element
// v's sampled mass. The GPU evaluates the same rule with a block-wide scan.
template <typename Mass>
DX_HD int64_t sample_in_chunk(const Mass& mass, int64_t begin, int64_t end, double threshold) {
  double running = 0.0;
  int64_t last_positive = -1;
  for (int64_t v = begin; v < end; ++v) {
    const float m = mass(v);
    if (!(m > 0.0f)) continue;
    running += static_cast<double>(m);
    last_positive = v;
    if (running > threshold) return v;
  }
  return last_positive;
}

}  // namespace diversed
