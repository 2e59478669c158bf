"""Public verification API: one fused native call per batch of draft blocks.

Algorithm (DIVERSED, probability mixture). For row b with drafts x_1..x_n (n = num_draft[b]) sampled from q_i, target
distributions p_1..p_{n+1} and weights w_i on the target:

    nu_i = w_i * p_i + (1 - w_i) * q_i
    accept x_i  iff  u_i * q_i(x_i) < nu_i(x_i)                 (probability min(1, nu_i(x_i) / q_i(x_i)))
    first rejection at m: emit y ~ norm(max(0, p_m - q_m))      (= norm(max(0, nu_m - q_m)) for w_m > 0)
    all n accepted:       emit the bonus y ~ p_{n+1}
    greedy rows:          accept while x_i == argmax nu_i, emit argmax nu_m or argmax p_{n+1}; ties go to the lowest id

Every emitted token at a drafted position follows nu; with w = 1 the output follows the target exactly.
"""

from __future__ import annotations

import torch

from . import _ops  # noqa: F401  (registers the native ops and their fake kernels)
from ._inputs import prepare_verify
from .types import VerifyResult


def verify(draft_tokens, draft_probs, target_probs, weight, *, num_draft=None, greedy=None, uniforms=None, seed=None,
           offset=0, check_inputs=True) -> VerifyResult:
    """Verify a batch of draft blocks against the DIVERSED mixture, in one fused native call.

    Args:
        draft_tokens: int32/int64 [B, K], the drafted ids. Entries at positions >= num_draft[b] are ignored.
        draft_probs: [B, K, V] draft distributions q (float32, bfloat16 or float16).
        target_probs: [B, K+1, V] target distributions p, same dtype and device; row K (or num_draft[b]) gives the bonus.
        weight: weight w on the target: a float, a [B] tensor (per request) or a [B, K] tensor (per token, e.g. from
            :class:`diversed_ext.head.EnsembleHead`). 1 is standard speculative decoding, 0 accepts every draft.
        num_draft: optional int [B] in [0, K]: ragged rows; row b verifies positions < num_draft[b].
        greedy: optional bool [B] (or one bool): rows decided by argmax instead of sampling.
        uniforms: optional [B, K+1] in [0, 1): u_0..u_{K-1} for the accept tests, u_K for the final sample. Makes the
            call reproducible and comparable across implementations.
        seed: int, or int64 [B] for per-request seeds (a row then depends only on its own inputs and seed). Without
            uniforms or seed, a seed is drawn from torch's default generator (so ``torch.manual_seed`` repeats runs).
        offset: counter of the generator; pass the decoding step so successive calls draw fresh numbers.
        check_inputs: validate values (token ids, probabilities, weights, uniforms, num_draft), which syncs with the
            device. False skips those checks (CUDA-graph friendly); the kernels then treat out-of-range ids as
            rejected and NaN/negative/infinite mass as zero, and never access memory out of bounds.

    Returns:
        :class:`VerifyResult` with ``tokens`` [B, K+1] int64, ``num_accepted`` [B] int32, ``accept_prob`` [B, K] float32.

    Raises:
        TypeError / ValueError naming the offending argument.
    """
    args = prepare_verify(draft_tokens, draft_probs, target_probs, weight, num_draft=num_draft, greedy=greedy,
                          uniforms=uniforms, seed=seed, offset=offset, check_inputs=check_inputs,
                          draft_name="draft_probs", target_name="target_probs", kind="probabilities")
    tokens, num_accepted, accept_prob = torch.ops.diversed.verify_probs(
        args.draft_tokens, args.draft, args.target, args.weight, args.num_draft, args.greedy, args.uniforms,
        args.seeds, args.offset, args.per_row_seed)
    return VerifyResult(tokens, num_accepted, accept_prob)
