"""FLy against a literal Python port of vLLM 0.33's (helpers/fly.py): at w = 1 our ops keep the same drafts, on every
device.

vLLM accepts a draft when p / q >= u, ours when u q < nu (nu = p at w = 1): on the same uniforms the two differ only
where p = u q exactly, which random uniforms never hit; the entropies differ by float rounding (ours in float64 from
the kernels' softmax, vLLM's in float32), which random thresholds do not straddle either.
"""

import pytest
import torch

import diversed_ext as dx
from diversed_ext.ops._fly import fly_entropy
from helpers import (vllm_accepted_lengths, vllm_apply_fly_greedy, vllm_apply_fly_random,
                         vllm_compute_fly_entropy)
from helpers import on_device, random_logits


def vllm_fly_lengths(tokens, draft_logits, target_logits, num_draft, greedy, uniforms, window, threshold, top_k):
    """vLLM V1's accepted lengths with FLy: flatten the drafted positions, compute the entropy, run both FLy kernels,
    then the rejection kernels' accept rules."""
    rows = [(b, i) for b in range(tokens.shape[0]) for i in range(int(num_draft[b]))]
    b_idx = torch.tensor([b for b, _ in rows], dtype=torch.int64)
    i_idx = torch.tensor([i for _, i in rows], dtype=torch.int64)
    cu_num_draft_tokens = num_draft.cumsum(0)
    flat_logits = target_logits[b_idx, i_idx].float()
    target_probs = flat_logits.softmax(-1, dtype=torch.float32)
    draft_probs = None if draft_logits is None else draft_logits[b_idx, i_idx].float().softmax(-1)
    entropy = vllm_compute_fly_entropy(target_probs, top_k)
    target_argmax = flat_logits.argmax(-1)
    uniform_probs = uniforms[b_idx, i_idx].clone()
    draft_ids = tokens[b_idx, i_idx]
    vocab = target_logits.shape[-1]
    vllm_apply_fly_greedy(cu_num_draft_tokens, draft_ids, target_argmax, flat_logits, entropy, greedy, vocab,
                          threshold, window)
    vllm_apply_fly_random(cu_num_draft_tokens, draft_ids, draft_probs, target_probs, uniform_probs, entropy, greedy,
                          vocab, threshold, window)
    return vllm_accepted_lengths(cu_num_draft_tokens, draft_ids, draft_probs, target_probs, target_argmax,
                                 uniform_probs, greedy)


@pytest.mark.parametrize("tokens_only", [False, True])
@pytest.mark.parametrize("window,threshold,top_k", [(1, 0.5, 3), (2, 0.3, 3), (3, 0.3, 5), (1, 0.0, 1)])
def test_fly_keeps_the_drafts_vllm_keeps_at_w1(tokens_only, window, threshold, top_k, device):
    batch, num_positions, vocab = 64, 6, 32
    tokens, draft_logits, target_logits = random_logits(batch, num_positions, vocab, seed=window * 10 + top_k,
                                                        scale=1.5)
    target_logits[:, :num_positions] = draft_logits + 0.3 * target_logits[:, :num_positions]  # most drafts pass
    generator = torch.Generator().manual_seed(window + top_k)
    num_draft = torch.randint(0, num_positions + 1, (batch,), generator=generator)
    greedy = torch.rand(batch, generator=generator) < 0.33
    if tokens_only:  # a tokens-only drafter's greedy drafts: often the target's argmax, as in serving
        argmax = target_logits[:, :num_positions].argmax(-1)
        tokens = torch.where(torch.rand(batch, num_positions, generator=generator) < 0.85, argmax, tokens)
    uniforms = torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64)
    temperature = torch.where(greedy, 0.0, 1.0)
    draft = None if tokens_only else draft_logits
    kwargs = dict(temperature=temperature, num_draft=num_draft, uniforms=uniforms)
    ours = on_device(device, dx.verify_logits, tokens, draft, target_logits, 1.0, fly_window=window,
                     fly_threshold=threshold, fly_top_k=top_k, **kwargs)
    plain = on_device(device, dx.verify_logits, tokens, draft, target_logits, 1.0, **kwargs)
    expected = vllm_fly_lengths(tokens, draft, target_logits, num_draft, greedy, uniforms, window, threshold, top_k)
    assert torch.equal(ours.num_accepted, expected)
    # Kept drafts, then on greedy rows the target's argmax at the first position kept by neither rule (or the bonus).
    for b in range(batch):
        m = int(expected[b])
        assert torch.equal(ours.tokens[b, :m], tokens[b, :m])
        if greedy[b]:
            assert int(ours.tokens[b, m]) == int(target_logits[b, m].argmax())
    assert bool((ours.num_accepted > plain.num_accepted).any()), "the case must exercise deferral"
    assert bool((ours.num_accepted >= plain.num_accepted).all())


@pytest.mark.parametrize("top_k", [1, 3, 7, 40])
def test_fly_entropy_is_vllms_compute_fly_entropy(top_k):
    _, _, target_logits = random_logits(8, 3, 32, seed=top_k)
    logits = target_logits.reshape(-1, 32)
    probs = logits.softmax(-1)
    ours = fly_entropy(probs, top_k)
    assert torch.allclose(ours.float(), vllm_compute_fly_entropy(probs, top_k), atol=1e-6)
    assert torch.allclose(ours.float(), vllm_compute_fly_entropy(logits, top_k, from_logits=True), atol=1e-5)
