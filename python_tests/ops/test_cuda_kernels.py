"""CUDA-only behaviour of the verify kernels: choosing the family (diversed_ext.set_cuda_kernels), seedless calls that draw
their seed inside the kernel from torch's CUDA generator, and CUDA graphs. Skipped where no GPU is visible; how the
split family cuts rows is checked on the CPU by test_vocab_split.py, and its results against the CPU kernels by
test_cuda_vs_cpu.py."""

import re

import pytest
import torch

import diversed_ext as dx
from diversed_ext.ops import _philox
from helpers import random_problem, requires_cuda

CUDA = "cuda"


def cuda_problem(batch, num_positions, vocab, seed=0):
    return tuple(t.to(CUDA) for t in random_problem(batch, num_positions, vocab, seed=seed))


def test_the_kernel_family_is_auto_by_default_and_set_by_name():
    assert dx.cuda_kernels() == "auto"
    try:
        for family in ("split", "block"):
            dx.set_cuda_kernels(family)
            assert dx.cuda_kernels() == family
    finally:
        dx.set_cuda_kernels("auto")
    with pytest.raises(ValueError, match="CUDA kernel family must be one of block, split, auto, got 'warp'"):
        dx.set_cuda_kernels("warp")
    assert dx.cuda_kernels() == "auto"


def verify_kernel_names(call) -> set:
    """The names of the verify kernels that ``call()`` launched, as CUDA's profiler saw them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        call()
        torch.cuda.synchronize()
    return {found.group(0) for event in profile.events() if (found := re.search(r"\w*verify_kernel", event.name))}


@requires_cuda
@pytest.mark.parametrize("from_logits", [False, True])
def test_auto_runs_the_split_kernels_and_the_block_kernels_for_fly(from_logits):
    """"auto" launches the split kernels for a call without FLy and the block kernels for one that may defer, with
    the bits of the family it ran."""
    tokens, draft, target = cuda_problem(16, 4, 40000, seed=8)
    if from_logits:
        draft, target = draft.log(), target.log()
    verify = dx.verify_logits if from_logits else dx.verify

    def run(family, **fly):
        dx.set_cuda_kernels(family)
        try:
            return verify(tokens, draft, target, 0.6, seed=4, check_inputs=False, **fly)
        finally:
            dx.set_cuda_kernels("auto")

    for fly, family, kernels in (({}, "split", {"split_verify_kernel"}),
                                 (dict(fly_window=1, fly_threshold=0.5), "block", {"verify_kernel"})):
        assert verify_kernel_names(lambda: run("auto", **fly)) == kernels
        auto, expected = run("auto", **fly), run(family, **fly)
        for name in ("tokens", "num_accepted", "accept_prob"):
            assert torch.equal(getattr(auto, name), getattr(expected, name)), (fly, name)


@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
def test_seedless_calls_draw_from_the_cuda_generator():
    tokens, draft, target = cuda_problem(64, 4, 1000, seed=3)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.manual_seed(9)
    start = generator.get_offset()
    first = dx.verify(tokens, draft, target, 0.3, check_inputs=False)
    second = dx.verify(tokens, draft, target, 0.3, check_inputs=False)
    assert generator.get_offset() == start + 2 * _philox.GENERATOR_INCREMENT
    assert not torch.equal(first.tokens, second.tokens)  # a fresh seed per call
    torch.manual_seed(9)
    again = dx.verify(tokens, draft, target, 0.3, check_inputs=False)
    assert torch.equal(first.tokens, again.tokens)  # torch.manual_seed repeats them
    # The reference draws the same seed from the generator, so it makes the same accept decisions.
    reference = dx.verify_reference(tokens, draft, target, 0.3, check_inputs=False)
    assert torch.equal(reference.num_accepted, second.num_accepted)
    assert torch.equal(reference.accept_prob, second.accept_prob)
    assert (reference.tokens == second.tokens).all(1).sum() >= 62  # final tokens differ only on CDF boundaries


@requires_cuda
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("from_logits", [False, True])
def test_graph_replays_match_eager_and_draw_fresh_seeds(from_logits):
    tokens, draft, target = cuda_problem(32, 4, 5000, seed=5)
    if from_logits:
        draft, target = draft.log(), target.log()
    verify = dx.verify_logits if from_logits else dx.verify
    seeds = torch.arange(32, device=CUDA)

    def calls():
        return (verify(tokens, draft, target, 0.5, seed=seeds, check_inputs=False),
                verify(tokens, draft, target, 0.5, check_inputs=False))

    eager, _ = calls()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as torch asks
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seeded, seedless = calls()
    draws = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(seeded.tokens, eager.tokens) and torch.equal(seeded.accept_prob, eager.accept_prob)
        draws.append(seedless.tokens.clone())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
