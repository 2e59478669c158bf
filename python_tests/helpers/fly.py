"""Builders of the FLy tests (test_fly*.py): random calls with FLy settings, and a literal Python port of vLLM 0.33's
FLy (vllm/v1/spec_decode/fly.py: compute_fly_entropy and the two acceptance kernels, and the V1 rejection kernels'
accept rules they feed), the oracle our rule is compared with at w = 1."""

import torch

from .ops import random_logits, random_problem


def fly_settings(batch, num_positions, generator, *, threshold_high=1.2):
    """Per-request windows in [0, K - 1] and thresholds in [0, threshold_high) (the top-3 entropies of the random
    rows lie around 0.3 to 1, so a threshold there defers some rejections and not others)."""
    window = torch.randint(0, max(min(num_positions, 3), 1), (batch,), generator=generator)
    threshold = torch.rand(batch, generator=generator) * threshold_high
    return dict(fly_window=window, fly_threshold=threshold)


def fly_probs_case(batch=32, num_positions=5, vocab=48, *, seed=0, dtype=torch.float32, sharpness=1.5):
    """A mixed verify call with FLy: random probabilities, uniforms, ragged rows, a third of the rows greedy, and
    per-request FLy settings. The target leans towards the draft, so that most drafts pass and windows can pass.
    Returns (tokens, draft, target, kwargs)."""
    tokens, draft, target = random_problem(batch, num_positions, vocab, seed=seed, dtype=torch.float32,
                                           sharpness=sharpness)
    target[:, :num_positions] = 0.85 * draft + 0.15 * target[:, :num_positions]
    draft, target = draft.to(dtype), target.to(dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    kwargs = dict(uniforms=torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64),
                  num_draft=torch.randint(0, num_positions + 1, (batch,), generator=generator),
                  greedy=torch.rand(batch, generator=generator) < 0.33,
                  **fly_settings(batch, num_positions, generator))
    return tokens, draft, target, kwargs


def fly_logits_case(batch=32, num_positions=5, vocab=48, *, seed=0, dtype=torch.float32, scale=1.5):
    """As fly_probs_case from logits, with temperatures (a third greedy) in place of greedy flags."""
    tokens, draft, target = random_logits(batch, num_positions, vocab, seed=seed, scale=scale)
    generator = torch.Generator().manual_seed(seed + 1)
    target[:, :num_positions] = draft + 0.3 * target[:, :num_positions]  # close to the draft, as in fly_probs_case
    draft, target = draft.to(dtype), target.to(dtype)
    temperature = torch.rand(batch, generator=generator) * 1.5 + 0.5
    temperature[torch.rand(batch, generator=generator) < 0.33] = 0.0
    kwargs = dict(uniforms=torch.rand(batch, num_positions + 1, generator=generator, dtype=torch.float64),
                  num_draft=torch.randint(0, num_positions + 1, (batch,), generator=generator),
                  temperature=temperature, **fly_settings(batch, num_positions, generator))
    return tokens, draft, target, kwargs


# ------------------------------------------------------------------------------------------------ vLLM, literally
# Triton programs become loops over requests; tl.load with a mask becomes the masked value; the flattened layout
# (cu_num_draft_tokens, one row per drafted token) is vLLM's.

def vllm_compute_fly_entropy(values, entropy_top_k, *, from_logits=False):
    top_k = min(entropy_top_k, values.shape[-1])
    values = values.to(torch.float32)
    top_values = torch.topk(values, k=top_k, dim=-1).values
    if from_logits:
        top_log_probs = top_values - values.logsumexp(dim=-1, keepdim=True)
        top_probs = top_log_probs.exp()
    else:
        top_probs = top_values
        top_log_probs = top_probs.log()
    entropy_terms = torch.where(top_probs > 0, top_probs * top_log_probs, torch.zeros_like(top_probs))
    return -entropy_terms.sum(dim=-1)


def _starts(cu_num_draft_tokens, req_idx):
    start_idx = 0 if req_idx == 0 else int(cu_num_draft_tokens[req_idx - 1])
    return start_idx, int(cu_num_draft_tokens[req_idx]) - start_idx


def vllm_apply_fly_greedy(cu_num_draft_tokens, draft_token_ids, target_argmax, target_logits, fly_entropy, is_greedy,
                          vocab_size, fly_entropy_threshold, window):
    for req_idx in range(len(cu_num_draft_tokens)):
        if not bool(is_greedy[req_idx]):
            continue
        start_idx, num_draft_tokens = _starts(cu_num_draft_tokens, req_idx)
        for pos in range(num_draft_tokens):
            token_idx = start_idx + pos
            draft_token_id = int(draft_token_ids[token_idx])
            target_token_id = int(target_argmax[token_idx])
            can_defer = (draft_token_id != target_token_id and 0 <= draft_token_id < vocab_size
                         and pos + window < num_draft_tokens
                         and float(fly_entropy[token_idx]) >= fly_entropy_threshold)
            draft_logit = float(target_logits[token_idx, draft_token_id]) if can_defer else float("-inf")
            can_defer = can_defer and draft_logit > float("-inf")
            for offset in range(1, window + 1):
                future_idx = token_idx + offset
                in_bounds = pos + offset < num_draft_tokens
                future_draft_id = int(draft_token_ids[future_idx]) if in_bounds else -1
                future_target_id = int(target_argmax[future_idx]) if in_bounds else -2
                can_defer = can_defer and future_draft_id == future_target_id
            if can_defer:
                target_argmax[token_idx] = draft_token_id


def vllm_apply_fly_random(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, uniform_probs, fly_entropy,
                          is_greedy, vocab_size, fly_entropy_threshold, window):
    no_draft_probs = draft_probs is None
    for req_idx in range(len(cu_num_draft_tokens)):
        if bool(is_greedy[req_idx]):
            continue
        start_idx, num_draft_tokens = _starts(cu_num_draft_tokens, req_idx)

        def accepted_natively(idx, token):
            valid = 0 <= token < vocab_size
            draft_prob = 1.0 if no_draft_probs else (float(draft_probs[idx, token]) if valid else 0.0)
            target_prob = float(target_probs[idx, token]) if valid else 0.0
            return valid, draft_prob, target_prob

        for pos in range(num_draft_tokens):
            token_idx = start_idx + pos
            draft_token_id = int(draft_token_ids[token_idx])
            valid_draft, draft_prob, target_prob = accepted_natively(token_idx, draft_token_id)
            uniform_prob = float(uniform_probs[token_idx])
            native_accepted = valid_draft and draft_prob > 0 and target_prob / draft_prob >= uniform_prob
            can_defer = (not native_accepted and valid_draft and draft_prob > 0 and target_prob > 0
                         and pos + window < num_draft_tokens
                         and float(fly_entropy[token_idx]) >= fly_entropy_threshold)
            for offset in range(1, window + 1):
                future_idx = token_idx + offset
                in_bounds = pos + offset < num_draft_tokens
                future_draft_id = int(draft_token_ids[future_idx]) if in_bounds else -1
                future_valid, future_draft_prob, future_target_prob = accepted_natively(future_idx, future_draft_id)
                future_valid = in_bounds and future_valid
                future_uniform_prob = float(uniform_probs[future_idx]) if in_bounds else 1.0
                future_accepted = (future_valid and future_draft_prob > 0
                                   and future_target_prob / future_draft_prob >= future_uniform_prob)
                can_defer = can_defer and future_accepted
            if can_defer:
                uniform_probs[token_idx] = 0.0


def vllm_accepted_lengths(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, target_argmax,
                          uniform_probs, is_greedy):
    """How many drafts V1's rejection kernels keep per request (rejection_greedy_sample_kernel and
    rejection_random_sample_kernel's accept rules), after the FLy kernels rewrote their inputs."""
    lengths = []
    for req_idx in range(len(cu_num_draft_tokens)):
        start_idx, num_draft_tokens = _starts(cu_num_draft_tokens, req_idx)
        length = 0
        for pos in range(num_draft_tokens):
            idx = start_idx + pos
            token = int(draft_token_ids[idx])
            if bool(is_greedy[req_idx]):
                accepted = token == int(target_argmax[idx])
            elif token < 0:
                accepted = False
            else:
                draft_prob = 1.0 if draft_probs is None else float(draft_probs[idx, token])
                accepted = draft_prob > 0 and float(target_probs[idx, token]) / draft_prob >= float(uniform_probs[idx])
            if not accepted:
                break
            length += 1
        lengths.append(length)
    return torch.tensor(lengths, dtype=torch.int32)
