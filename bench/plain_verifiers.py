"""Careful plain-PyTorch verifiers, the baselines a user would write instead of the fused ops: gather p(x) and q(x),
accept tests on the gathered values, then the residual of the one row per request that needs it. They assume valid
inputs, every row fully drafted and weight > 0; bench_verify.py checks each equal to the reference on identical
uniforms before it times it.
"""

from __future__ import annotations

import torch

from diversed_ext.ops.reference import inverse_cdf_sample


def _plain_accept(p_tokens, q_tokens, weight, uniforms):
    """Accept tests on gathered float32 values: (num_accepted [B], accept_prob [B, K])."""
    nu = weight * p_tokens + (1 - weight) * q_tokens
    accepted = uniforms[:, :-1] * q_tokens.double() < nu.double()
    accept_prob = torch.where(q_tokens > 0, (nu / q_tokens).clamp(max=1.0), (nu > 0).float())
    return accepted.int().cumprod(1).sum(1), accept_prob


def _plain_finish(draft_tokens, num_accepted, accept_prob, p_row, q_row, uniforms):
    """Final token from the one row per request: residual max(0, p - q) after a rejection, else the bonus p."""
    num_positions = draft_tokens.shape[1]
    rejected = (num_accepted < num_positions).unsqueeze(1)
    residual = torch.where(rejected, (p_row - q_row).clamp_min(0.0), p_row)
    empty = residual.sum(-1, keepdim=True) <= 0  # no residual mass: sample p itself
    final = inverse_cdf_sample(torch.where(empty, p_row, residual), uniforms[:, -1])
    positions = torch.arange(num_positions + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)
    tokens = torch.where(positions < num_accepted.unsqueeze(1), padded, -1)
    tokens = torch.where(positions == num_accepted.unsqueeze(1), final.unsqueeze(1), tokens)
    return tokens, num_accepted.int(), accept_prob


def _one_hot_rows(draft_tokens, num_accepted, vocab):
    """q at each request's final position when the drafter gave tokens only: one-hot at its drafted id, [B, V]."""
    num_positions = draft_tokens.shape[1]
    drafted = draft_tokens.gather(1, num_accepted.clamp(max=num_positions - 1).unsqueeze(1))
    return torch.zeros(draft_tokens.shape[0], vocab, device=draft_tokens.device).scatter_(1, drafted, 1.0)


def plain_verify(tokens, draft, target, uniforms, weight):
    """From probabilities [B, K, V] and [B, K+1, V]; draft None: the drafter gave tokens only (q one-hot at x)."""
    num_positions = tokens.shape[1]
    index = tokens.unsqueeze(-1)
    p_tokens = target[:, :num_positions].gather(2, index).squeeze(-1).float()
    q_tokens = torch.ones_like(p_tokens) if draft is None else draft.gather(2, index).squeeze(-1).float()
    num_accepted, accept_prob = _plain_accept(p_tokens, q_tokens, weight, uniforms)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    p_row = target[rows, num_accepted].float()
    if draft is None:
        q_row = _one_hot_rows(tokens, num_accepted, target.shape[-1])
    else:
        q_row = draft[rows, num_accepted.clamp(max=num_positions - 1)].float()
    return _plain_finish(tokens, num_accepted, accept_prob, p_row, q_row, uniforms)


def _token_probs(logits, tokens):
    """softmax(logits)[x] per position, from a logsumexp per row and the gathered logits."""
    return (logits.gather(2, tokens.unsqueeze(-1)).squeeze(-1).float() - torch.logsumexp(logits.float(), -1)).exp()


def plain_verify_logits(tokens, draft, target, uniforms, weight):
    """The same from logits: a logsumexp per row, gathered logits, and a softmax of the rows that need one."""
    num_positions = tokens.shape[1]
    p_tokens = _token_probs(target[:, :num_positions], tokens)
    q_tokens = torch.ones_like(p_tokens) if draft is None else _token_probs(draft, tokens)
    num_accepted, accept_prob = _plain_accept(p_tokens, q_tokens, weight, uniforms)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    p_row = target[rows, num_accepted].float().softmax(-1)
    if draft is None:
        q_row = _one_hot_rows(tokens, num_accepted, target.shape[-1])
    else:
        q_row = draft[rows, num_accepted.clamp(max=num_positions - 1)].float().softmax(-1)
    return _plain_finish(tokens, num_accepted, accept_prob, p_row, q_row, uniforms)
