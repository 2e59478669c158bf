"""The EAGLE-3 head unrolled at every position of known sequences at once: EAGLE-3's training-time test.

At every anchor position ``i`` the head is unrolled ``steps`` times: step 0 reads the fused target features of
position ``i`` and the token ``i + 1``; step ``j`` reads step ``j - 1``'s pre-norm output and the token ``i + j + 1``
(the sequence's own token), sits at rotary position ``i + j``, and attends to the target-fed entries at positions
``0 .. i`` plus its own anchor's steps ``1 .. j``. That is the cache the head sees when it drafts ``j + 1`` tokens
ahead after a verified prefix ending at ``i + 1``, so step ``j`` at anchor ``i`` gives, up to rounding, the very
logits and state with which a drafting head predicts token ``i + j + 2``. The drafter's training
(:mod:`.drafter_training`) learns from it; teacher forcing (:mod:`.teacher_forcing`) reads the states an ensemble head
sees while decoding from it.

A batch is a dict (:func:`.drafter_training.collate` builds one): ``tokens`` [B, W + extra] (``extra`` >= steps - 1
padding positions), ``aux`` [B, W - 1, A] (the target's aux hidden states at positions 0 .. W - 2) and
``first_label`` (the first position any label needs: anchors start one before it).
"""

from __future__ import annotations

import math

import torch

from ..models.eagle3 import Eagle3Head


def _attend(q, keys0, values0, causal, diagonal):
    """Attention of step-j queries [B, h, n, d] over the target-fed keys [B, h, S, d] (``causal`` [n, S] bool) and
    the same anchor's earlier draft steps ``diagonal``: list of (k, v) [B, h, n, d]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = [torch.matmul(q, keys0.transpose(-1, -2)).mul(scale).masked_fill(~causal, float("-inf"))]
    scores += [(q * k).sum(-1, keepdim=True).mul(scale) for k, _ in diagonal]
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = torch.matmul(weights[..., :keys0.shape[2]], values0)
    for index, (_, v) in enumerate(diagonal):
        out = out + weights[..., keys0.shape[2] + index:keys0.shape[2] + index + 1] * v
    return out


def unrolled_logits(head: Eagle3Head, batch: dict, steps: int) -> tuple:
    """(logits per step, each [B, n, Vd] for the anchors ``start .. W - 2``, start): the training-time test."""
    logits, _, start = unrolled_steps(head, batch, steps)
    return logits, start


def unrolled_steps(head: Eagle3Head, batch: dict, steps: int) -> tuple:
    """(logits per step [B, n, Vd], pre-norm output states per step [B, n, H], start) for the anchors
    ``start .. W - 2``: :func:`unrolled_logits` with the states the head feeds forward, which a drafting head hands
    to an ensemble head as its hidden state."""
    c = head.config
    tokens, aux = batch["tokens"], batch["aux"]
    anchors = aux.shape[1]                                   # positions 0 .. W - 2
    start = max(0, min(batch["first_label"] - 1, anchors - 1))  # the first anchor any label needs
    group = c.num_attention_heads // c.num_key_value_heads
    fused = head.fuse(aux)
    positions = torch.arange(anchors, device=aux.device)
    q0, k0, v0 = head.project(tokens[:, 1:anchors + 1], fused, positions)
    keys0, values0 = k0.repeat_interleave(group, 1), v0.repeat_interleave(group, 1)
    causal = positions.unsqueeze(0) <= positions[start:].unsqueeze(1)      # [n, S]
    features, query, diagonal, outputs, states = fused[:, start:], q0[:, :, start:], [], [], []
    n = anchors - start
    for j in range(steps):
        if j > 0:
            query, k, v = head.project(tokens[:, start + j + 1:start + j + 1 + n], features,
                                       torch.arange(start + j, start + j + n, device=aux.device))
            diagonal.append((k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
        logits, features = head.finish(_attend(query, keys0, values0, causal, diagonal), features)
        outputs.append(logits)
        states.append(features)
    return outputs, states, start
