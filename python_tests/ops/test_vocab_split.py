"""The split CUDA kernels' decomposition, checked on the CPU against the reference.

The split kernels cut each row into chunks (csrc/common/vocab_split.h): per-chunk masses or softmax partials, the
total in chunk order, the chunk that holds u * total, and the sample inside that chunk alone. The CPU-only op
``diversed_probes::vocab_split_probe`` (a library only the tests load) runs those very __host__ __device__ functions, so these tests need no GPU. The GPU
kernels evaluate the same rules with block-wide sums and scans (float64 sums in another order), which
test_cuda_vs_cpu.py compares against the CPU kernels where a GPU is present. The seed a seedless CUDA call draws
(``diversed_probes::generator_seeds``) is checked against the Python rule here too.
"""

import math
import subprocess
import sys

import pytest
import torch
from scipy import stats as scipy_stats

from diversed_ext.ops import _philox
from helpers import probe_ops

PROBES = probe_ops()

GRANULE = 4096  # kSplitGranule
MAX_CHUNKS = 128  # kSplitMaxChunks


def probe(values, uniforms, target_blocks=512, from_logits=False, temperature=1.0):
    masses, chunks, tokens, stats = PROBES.vocab_split_probe(values, uniforms, target_blocks, from_logits,
                                                                         temperature)
    return masses, chunks, tokens, stats


def chunk_size_of(masses, row_masses):
    """The chunk size whose contiguous sums of row_masses give `masses` (a multiple of the granule)."""
    vocab = row_masses.shape[0]
    for size in range(GRANULE, max(vocab, GRANULE) + GRANULE, GRANULE):
        if math.ceil(vocab / size) != masses.shape[0]:
            continue
        sums = torch.stack([row_masses[c * size:(c + 1) * size].sum() for c in range(masses.shape[0])])
        if torch.allclose(sums, masses, rtol=1e-12, atol=0):
            return size
    raise AssertionError("no chunk size of whole granules gives these chunk masses")


def reference_sample(row_masses, uniform):
    """Inverse CDF in float64 over the whole row: the first id whose running mass exceeds u * total."""
    cumulative = row_masses.cumsum(0)
    threshold = uniform * float(cumulative[-1])
    return int(torch.searchsorted(cumulative, torch.tensor([threshold], dtype=torch.float64), right=True)), cumulative


def assert_sample_agrees(row_masses, uniform, chunk, token, boundary_tol=1e-12):
    expected, cumulative = reference_sample(row_masses, uniform)
    assert row_masses[token] > 0, "a sample must have positive mass"
    if token != expected:  # only where the threshold sits on a CDF boundary (sums in another order)
        threshold = uniform * float(cumulative[-1])
        assert abs(float(cumulative[min(token, expected)]) - threshold) <= boundary_tol * float(cumulative[-1])


@pytest.mark.parametrize("vocab", [1, 7, GRANULE, GRANULE + 1, 3 * GRANULE - 5, 40000, 600000])
@pytest.mark.parametrize("rows,target_blocks", [(1, 528), (4, 528), (64, 528), (3, 1)])
def test_chunk_layout_and_masses(vocab, rows, target_blocks):
    generator = torch.Generator().manual_seed(vocab + rows)
    values = torch.rand(rows, vocab, generator=generator)
    masses, chunks, tokens, _ = probe(values, torch.rand(rows, dtype=torch.float64, generator=generator),
                                      target_blocks)
    num_chunks = masses.shape[1]
    assert 1 <= num_chunks <= min(MAX_CHUNKS, math.ceil(vocab / GRANULE))
    assert num_chunks <= max(1, math.ceil(target_blocks / rows))  # no more blocks than the device wants
    size = chunk_size_of(masses[0], values[0].double())
    assert (num_chunks - 1) * size < vocab <= num_chunks * size  # no empty chunk
    for row in range(rows):
        sums = torch.stack([values[row, c * size:(c + 1) * size].double().sum() for c in range(num_chunks)])
        torch.testing.assert_close(masses[row], sums, rtol=1e-12, atol=0)
        assert chunks[row] == int(tokens[row]) // size  # the token lies in the chosen chunk


def test_more_blocks_or_fewer_rows_give_more_chunks():
    values = torch.rand(8, 600000)
    uniforms = torch.rand(8, dtype=torch.float64)
    counts = [probe(values[:rows], uniforms[:rows], blocks)[0].shape[1] for rows, blocks in
              ((8, 64), (8, 528), (1, 528), (1, 100000))]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    assert counts[-1] <= MAX_CHUNKS < math.ceil(600000 / GRANULE)  # capped


@pytest.mark.parametrize("vocab", [5, 9000, 40001])
def test_samples_match_the_reference_on_identical_uniforms(vocab):
    generator = torch.Generator().manual_seed(vocab)
    rows = 200
    values = torch.rand(rows, vocab, generator=generator) ** 8  # uneven masses
    values[::3, : vocab // 2] = 0.0  # whole chunks without mass
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    uniforms[0], uniforms[1] = 0.0, 1.0 - 2.0**-53
    masses, chunks, tokens, _ = probe(values, uniforms, target_blocks=rows * 8)
    for row in range(rows):
        assert masses[row, chunks[row]] > 0, "only a chunk with mass can be chosen"
        assert_sample_agrees(values[row].double(), float(uniforms[row]), int(chunks[row]), int(tokens[row]))
    assert tokens[0] == int(torch.nonzero(values[0]).min())  # u = 0: the first id with mass
    assert tokens[1] == int(torch.nonzero(values[1]).max())  # u just under 1: the last id with mass


def test_edges_without_mass_and_with_bad_values():
    vocab = 3 * GRANULE + 17
    values = torch.zeros(5, vocab)
    values[1, -1] = 0.25  # all mass in the last element of the last chunk
    values[2, GRANULE] = 1.0  # one id, first element of the second chunk
    values[3] = float("nan")
    values[3, 5] = -1.0
    values[3, 2 * GRANULE + 1] = float("inf")
    values[3, 7] = 0.5  # the only valid mass among NaN, negative and infinite entries
    values[4, :] = 1.0  # a flat row, u beyond 1 clamped below it
    uniforms = torch.tensor([0.5, 0.5, 0.999, 0.3, 7.0], dtype=torch.float64)
    masses, chunks, tokens, _ = probe(values, uniforms, target_blocks=40)
    assert (chunks[0], tokens[0]) == (-1, -1)  # no mass: nothing to sample
    assert tokens[1] == vocab - 1 and chunks[1] == masses.shape[1] - 1
    assert tokens[2] == GRANULE
    assert tokens[3] == 7 and torch.all(masses[3] >= 0)
    assert tokens[4] == vocab - 1


def test_single_element_rows():
    masses, chunks, tokens, _ = probe(torch.tensor([[0.3], [0.0]]), torch.tensor([0.9, 0.9], dtype=torch.float64))
    assert tokens.tolist() == [0, -1] and chunks.tolist() == [0, -1] and masses.shape == (2, 1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_merged_softmax_partials_match_the_reference(temperature):
    generator = torch.Generator().manual_seed(3)
    vocab = 5 * GRANULE + 123
    logits = torch.randn(6, vocab, generator=generator) * 4
    logits[1, : 3 * GRANULE] = float("-inf")  # whole chunks without a finite logit
    logits[2, 17] = 60.0  # the max far from the other chunks' maxes
    logits[3] = float("-inf")  # no finite logit at all: no mass
    uniforms = torch.rand(6, dtype=torch.float64, generator=generator)
    masses, chunks, tokens, stats = probe(logits, uniforms, target_blocks=64, from_logits=True,
                                          temperature=temperature)
    scaled = logits.double() * (1.0 / temperature if temperature > 0 else 1.0)
    for row in (0, 1, 2, 4, 5):
        row_max = scaled[row].max()
        assert stats[row, 0] == pytest.approx(float(row_max), rel=1e-6)
        inverse_sum = 1.0 / torch.exp(scaled[row] - row_max).sum()
        assert stats[row, 1] == pytest.approx(float(inverse_sum), rel=1e-5)
        probabilities = torch.softmax(scaled[row], 0)
        torch.testing.assert_close(masses[row].sum(), probabilities.sum(), rtol=1e-5, atol=0)
        assert_sample_agrees(probabilities, float(uniforms[row]), int(chunks[row]), int(tokens[row]),
                             boundary_tol=1e-5)
    assert stats[3, 0] == float("-inf") and stats[3, 1] == 0.0 and tokens[3] == -1


def test_split_samples_follow_the_softmax_law():
    # One row, many uniforms: the tokens the decomposition draws pass a chi-square against the softmax, and a
    # distribution one logit away is rejected by the same samples.
    vocab, samples = 3 * GRANULE, 20000
    logits = torch.full((vocab,), float("-inf"))
    support = torch.tensor([3, 900, GRANULE - 1, GRANULE, GRANULE + 5, 2 * GRANULE + 1, vocab - 1])
    logits[support] = torch.tensor([0.0, 1.0, -0.5, 2.0, 0.3, -1.0, 1.5])
    uniforms = torch.rand(samples, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    _, _, tokens, _ = probe(logits.expand(samples, vocab).contiguous(), uniforms, target_blocks=samples * 3,
                            from_logits=True)
    observed = torch.stack([(tokens == token).sum() for token in support]).double()
    assert int(observed.sum()) == samples
    expected = torch.softmax(logits[support].double(), 0) * samples
    assert scipy_stats.chisquare(observed, expected).pvalue > 1e-3
    wrong = logits[support].double().clone()
    wrong[0] += 0.3
    assert scipy_stats.chisquare(observed, torch.softmax(wrong, 0) * samples).pvalue < 1e-6


def test_generator_seeds_match_the_python_rule():
    states = [(0, 0), (67280421310721, 4), (2**63 - 1, 2**40 + 8), (-5, 12), (123, 2**63 - 4)]
    seeds = torch.tensor([seed for seed, _ in states], dtype=torch.int64)
    offsets = torch.tensor([offset for _, offset in states], dtype=torch.int64)
    native = PROBES.generator_seeds(seeds, offsets).tolist()
    assert native == [_philox.seed_from_generator(seed, offset) for seed, offset in states]
    assert len(set(native)) == len(native)
    # successive calls (offsets 4 apart) draw unrelated seeds
    successive = PROBES.generator_seeds(torch.full((3,), 42), torch.tensor([0, 4, 8])).tolist()
    assert len(set(successive)) == 3


def test_python_philox_word_is_the_kernels():
    # Philox on Python ints (as seed_from_generator runs it) gives the words of the kernels' uniforms.
    seeds = torch.tensor([7, -3, 2**62 + 5], dtype=torch.int64)
    uniforms = torch.ops.diversed.philox_uniforms(seeds, torch.tensor([0, 9, 2**33 + 1]), 3, False)
    for row, (seed, offset) in enumerate(zip(seeds.tolist(), (0, 9, 2**33 + 1))):
        seed %= 2**64
        for position in range(3):
            word = _philox.philox_first_word(position, row, offset & 0xFFFFFFFF, offset >> 32, seed & 0xFFFFFFFF,
                                             seed >> 32)
            assert float(uniforms[row, position]) == (word >> 8) / 2**24


PROBE_NAMES = ("vocab_split_probe", "generator_seeds")  # csrc/probes/split_probes.cpp


def test_the_package_never_loads_the_probes():
    # This module loaded the probes (PROBES): so they are here, and absent from the package's own namespace only
    # because they are not in it. A fresh interpreter that imports the package alone must lack them.
    for name in PROBE_NAMES:
        assert hasattr(PROBES, name) and not hasattr(torch.ops.diversed, name), name
    code = ("import torch, diversed_ext; "
            f"assert not any(hasattr(torch.ops.diversed_probes, name) for name in {PROBE_NAMES!r}), 'loaded'; "
            "assert not any('_probes' in path for path in torch.ops.loaded_libraries), 'listed'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
