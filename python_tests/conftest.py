"""Shared fixtures: random draft/target problems, and output poisoning for every native call."""

import os

# Every native call fills its outputs with garbage before computing, so an element a kernel forgets to write shows up
# as a mismatch against the reference.
os.environ.setdefault("DIVERSED_POISON_OUTPUTS", "1")

import pytest
import torch

CUDA_SKIP_REASON = "CUDA tests need a GPU, and none is visible on this machine"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)


def random_distributions(shape, generator, sharpness=2.0, dtype=torch.float32):
    """Softmax of scaled Gaussian logits: a mix of peaked and flat rows."""
    logits = torch.randn(*shape, generator=generator) * sharpness
    return logits.softmax(-1).to(dtype)


def random_problem(batch, num_positions, vocab, *, seed=0, dtype=torch.float32, sharpness=2.0):
    """(draft_tokens, draft_probs, target_probs) with drafts sampled from the draft distributions."""
    generator = torch.Generator().manual_seed(seed)
    draft_probs = random_distributions((batch, num_positions, vocab), generator, sharpness, dtype)
    target_probs = random_distributions((batch, num_positions + 1, vocab), generator, sharpness, dtype)
    if num_positions > 0:
        flat = draft_probs.float().reshape(-1, vocab)
        draft_tokens = torch.multinomial(flat, 1, generator=generator).reshape(batch, num_positions)
    else:
        draft_tokens = torch.zeros(batch, 0, dtype=torch.int64)
    return draft_tokens, draft_probs, target_probs
