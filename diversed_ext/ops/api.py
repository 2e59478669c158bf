"""The public ops: one fused native call each (mixture_divergence's on the CPU), after one pass of argument checks.

verify / verify_logits: DIVERSED verification of a batch of draft blocks. For row b with drafts x_1..x_n
(n = num_draft[b]) sampled from q_i, target distributions p_1..p_{n+1} and weights w_i on the target:

    nu_i = w_i * p_i + (1 - w_i) * q_i
    accept x_i  iff  u_i * q_i(x_i) < nu_i(x_i)                 (probability min(1, nu_i(x_i) / q_i(x_i)))
    first rejection at m: emit y ~ norm(max(0, p_m - q_m))      (= norm(max(0, nu_m - q_m)) for w_m > 0)
    all n accepted:       emit the bonus y ~ p_{n+1}
    greedy rows:          accept while x_i == argmax nu_i, emit argmax nu_m or argmax p_{n+1}; ties go to the lowest id

Tokens the target forbids (probability below MIN_TARGET_MASS = 2^-64: a server's bad words, allowed token ids, -inf or
-100 logit biases) stay out whatever the weight: a drafted token the target forbids verifies with w = 1 (never
accepted, corrected from the residual), greedy rows take the argmax over the target's support, FLy never defers such a
draft. Every emitted token at a drafted position follows nu' = w p + (1 - w) (q 1_S + q(not S) norm(max(0, p - q))),
S the target's support, which is nu wherever S covers q's support (docs/api.md); with w = 1 the output follows the
target exactly. This is
speculative sampling (Leviathan, Kalman and Matias, ICML 2023, arXiv:2211.17192; Chen et al., arXiv:2302.01318)
verified against DIVERSED's ensemble (Wang et al., AISTATS 2026, arXiv:2604.07622).

token_stats / mix: what the trainer and the analyses need: p(y), q(y), TV(p, q) per position, and nu materialised.
distribution_features: what a DIVERSED head reads of the two distributions at a position (DISTRIBUTION_FEATURES).
mixture_divergence: KL(nu_w || p) at a grid of weights per position, the table a loss on the divergence reads.
Logits path, per-token statistics and the materialised mixture, as fused native ops.

Servers hold logits, not probabilities; the trainer needs p(y), q(y) and TV(p, q) over whole sequences. These ops
never materialise [B, K, V] probabilities: each needed row gets its softmax normaliser (max, sum of exp) in one pass,
and later passes recompute softmax on the fly. Temperature divides the logits before the softmax; temperature 0 marks
a greedy row, decided on the untempered (T = 1) distributions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import rules
from . import _fake  # noqa: F401  (registers the native ops and their fake kernels)
from ._divergence import divergence_table
from ._fly import fly_arguments, fly_as_given
from ._inputs import weight_tensor
from ._pair_inputs import normalize_stat_tokens, prepare_features, prepare_pair
from ._prepare import prepare_verify
from ._temperature import temperature_argument
from ._unchecked import (greedy_as_given, rows_as_given, target_temperature_as_given, temperature_as_given,
                         unchecked_arguments)

# The verify overloads, looked up once: torch.ops.<namespace>.<op> is two attribute lookups and an overload resolution
# on every call, which the serving path (one call per decoding step) should not pay.
_VERIFY_PROBS = torch.ops.diversed.verify_probs.default
_VERIFY_LOGITS = torch.ops.diversed.verify_logits.default
_DISTRIBUTION_FEATURES = torch.ops.diversed.distribution_features.default  # a head's call in every decoding step


class VerifyResult(NamedTuple):
    """What one verification call returns for a batch of B draft blocks of K tokens.

    Attributes:
        tokens: int64 [B, K+1]. Row b holds its ``num_accepted[b]`` accepted drafts, then the correction token (first
            rejection) or the bonus token (all accepted), then -1 padding.
        num_accepted: int32 [B]. Accepted drafts, the final token not counted: row b emits ``num_accepted[b] + 1``
            tokens.
        accept_prob: float32 [B, K]. ``min(1, nu_i(x_i) / q_i(x_i))`` at every drafted position i < num_draft (for
            greedy rows 1 if x_i is the argmax of nu_i, else 0); 0 past num_draft and for out-of-range ids.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    accept_prob: torch.Tensor


def verify(draft_tokens, draft_probs, target_probs, weight, *, num_draft=None, greedy=None, uniforms=None, seed=None,
           offset=0, check_inputs=True, target_rows=None, draft_rows=None, fly_window=0,
           fly_threshold=rules.FLY_DEFAULT_THRESHOLD, fly_top_k=rules.FLY_DEFAULT_TOP_K) -> VerifyResult:
    """Verify a batch of draft blocks against the DIVERSED mixture, in one fused native call.

    Args:
        draft_tokens: int32/int64 [B, K], the drafted ids. Entries at positions >= num_draft[b] are ignored.
        draft_probs: [B, K, V] draft distributions q (float32, bfloat16 or float16), or None when the drafter gives
            tokens only (EAGLE, MTP, ngram lookup): q is then one-hot at each drafted token, so x_i is accepted with
            probability w_i p_i(x_i) + 1 - w_i and a rejection draws from p_m without x_m. No draft row is read.
        target_probs: [B, K+1, V] target distributions p on the same device; row K (or num_draft[b]) gives the bonus.
            Its dtype may differ from ``draft_probs``' (each float32, bfloat16 or float16, read as it lies: no copy).
            [R, V] rows with ``target_rows`` (and ``draft_probs`` [Rd, V] rows with ``draft_rows``).
        weight: weight w on the target: a float, a [B] tensor (per request) or a [B, K] tensor (per token, e.g. from
            :class:`diversed_ext.head.EnsembleHead`). 1 is standard speculative decoding, 0 accepts every draft.
        num_draft: optional int [B] in [0, K]: ragged rows; row b verifies positions < num_draft[b].
        greedy: optional bool [B] (or one bool): rows decided by argmax instead of sampling.
        uniforms: optional [B, K+1] in [0, 1): u_0..u_{K-1} for the accept tests, u_K for the final sample. Makes the
            call reproducible and comparable across implementations.
        seed: int, or int64 [B] for per-request seeds (a row then depends only on its own inputs and seed). Without
            uniforms or seed, a seed is drawn from torch's default generator (so ``torch.manual_seed`` repeats runs).
        offset: counter of the generator; pass the decoding step so successive calls draw fresh numbers.
        check_inputs: validate values (token ids, probabilities, weights, uniforms, num_draft, row indices), which
            syncs with the device. False skips those checks (CUDA-graph friendly); the kernels then treat out-of-range
            ids as rejected, NaN/negative/infinite mass as zero and clamp row indices into [0, R), and never access
            memory out of bounds.
        target_rows: optional int32/int64 [B, K+1]: read the target in place from a row tensor. ``target_probs`` is
            then [R, V] and position i of request b reads its row ``target_rows[b, i]`` (B and K come from
            ``draft_tokens``); rows may repeat and come in any order. Positions the request does not read (past
            num_draft[b], the bonus row num_draft[b] excepted) may hold any index. With check_inputs an index read
            outside [0, R) is a ValueError; without, the kernels clamp it into [0, R) (a meaningless but well-formed
            result: ids in [0, V), counts in range).
        draft_rows: optional int32/int64 [B, K]: the same for ``draft_probs`` as an [Rd, V] row tensor (positions
            >= num_draft[b] are not read). Only with a draft tensor: a tokens-only call (draft_probs None) that
            passes draft_rows is a ValueError.
        fly_window: FLy's window W, an int or an int [B] tensor per request (0, the default, switches FLy off for
            the row): a draft the exact test rejects is accepted anyway when the next W drafts pass their own exact
            tests, the draft has p > 0 (and q > 0 on a sampled row), and the target's top-k entropy there is at least
            ``fly_threshold``. W must be < K (with check_inputs; the kernels clamp it into [0, K - 1] otherwise).
            Lossy: the output no longer follows nu. ``accept_prob`` still reports the exact test.
        fly_threshold: FLy's entropy threshold tau, a float or a float [B] tensor, >= 0.
        fly_top_k: how many of the target's largest probabilities FLy's entropy sums, in [1, 32].

    Returns:
        :class:`VerifyResult` with ``tokens`` [B, K+1] int64, ``num_accepted`` [B] int32, ``accept_prob`` [B, K]
        float32.

    Raises:
        TypeError / ValueError naming the offending argument.
    """
    rows = (target_rows, draft_rows)
    fly = (fly_window, fly_threshold, fly_top_k)
    if not check_inputs and (greedy is None or greedy_as_given(greedy)) and rows_as_given(*rows) \
            and (fly_given := fly_as_given(*fly)) is not None:
        op_arguments = unchecked_arguments(draft_tokens, draft_probs, target_probs, weight, num_draft, greedy,
                                           uniforms, seed, offset)
        if op_arguments is not None:
            # Trailing arguments left at their defaults are not passed: each costs the dispatcher a fraction of a us.
            extra = () if target_rows is None and draft_rows is None and not fly_given else (*rows, *fly_given)
            try:
                return VerifyResult(*_VERIFY_PROBS(*op_arguments, *extra))
            except RuntimeError as error:
                refusal = error  # a size or device the op refuses: the rules below name the argument, or it stands
            _prepare_probs(draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms, seed, offset,
                           False, rows, fly)
            raise refusal
    return VerifyResult(*_VERIFY_PROBS(*_prepare_probs(draft_tokens, draft_probs, target_probs, weight, num_draft,
                                                       greedy, uniforms, seed, offset, check_inputs, rows, fly)))


def _prepare_probs(draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms, seed, offset,
                   check_inputs, rows, fly) -> tuple:
    """verify's op arguments through the argument rules (prepare_verify, then FLy's); ``rows``: (target_rows,
    draft_rows); ``fly``: (fly_window, fly_threshold, fly_top_k)."""
    arguments = prepare_verify(draft_tokens, draft_probs, target_probs, weight, num_draft=num_draft, greedy=greedy,
                               uniforms=uniforms, seed=seed, offset=offset, check_inputs=check_inputs,
                               draft_name="draft_probs", target_name="target_probs", kind="probabilities",
                               target_rows=rows[0], draft_rows=rows[1])
    return (*arguments, *fly_arguments(*fly, *arguments[0].shape, arguments[2].device, check_inputs))


class TokenStats(NamedTuple):
    """Per-position statistics of a draft/target pair at given tokens y, each float32 [B, T].

    Attributes:
        target_prob: p(y).
        draft_prob: q(y).
        total_variation: TV(p, q) = 0.5 * sum_v |p(v) - q(v)|; the acceptance rate at weight w is 1 - w * TV.
        target_logprob: log p(y), exact even where p(y) underflows (from logits).
        draft_logprob: log q(y).
    Not differentiable: the trainer's gradient flows through w in log(w p(y) + (1 - w) q(y)).
    """

    target_prob: torch.Tensor
    draft_prob: torch.Tensor
    total_variation: torch.Tensor
    target_logprob: torch.Tensor
    draft_logprob: torch.Tensor


def verify_logits(draft_tokens, draft_logits, target_logits, weight, *, temperature=1.0, num_draft=None,
                  uniforms=None, seed=None, offset=0, check_inputs=True, target_rows=None, draft_rows=None,
                  target_temperature=None, fly_window=0, fly_threshold=rules.FLY_DEFAULT_THRESHOLD,
                  fly_top_k=rules.FLY_DEFAULT_TOP_K) -> VerifyResult:
    """:func:`diversed_ext.verify` straight from logits, with a fused online softmax.

    Args:
        draft_logits: [B, K, V] draft logits (float32, bfloat16 or float16); -inf entries mask tokens out. None when
            the drafter gives tokens only (q one-hot at each drafted token, as in :func:`diversed_ext.verify`).
        target_logits: [B, K+1, V] target logits on the same device ([R, V] rows with ``target_rows``); its dtype may
            differ from ``draft_logits``' (each float32, bfloat16 or float16, read as it lies: a bfloat16 draft beside
            float32 target rows needs no copy).
        temperature: float or [B] tensor, >= 0. Probabilities are softmax(logits / temperature); 0 makes the row
            greedy (accept while x_i = argmax nu_i, with nu formed from the temperature-1 softmax).
        target_temperature: None (the target logits are divided by ``temperature`` too), or a float or [B] tensor,
            >= 0, that divides the target logits instead: for a server that hands target logits already divided by
            the request's temperature (pass 1.0) and draft logits not yet divided. ``temperature`` still divides the
            draft logits and marks greedy rows; a target temperature of 0 counts as 1 (untempered), as greedy
            rows' distributions do.
        target_rows, draft_rows: rows read in place, as in :func:`diversed_ext.verify` (``target_logits`` [R, V],
            ``draft_logits`` [Rd, V]); out-of-range indices without checks are clamped into [0, R).
        Everything else as :func:`diversed_ext.verify` (weights, ragged rows, uniforms, seeds, offset, check_inputs,
        FLy's fly_window, fly_threshold and fly_top_k, whose entropy comes from the target at its temperature).
    """
    extras = (target_rows, draft_rows, target_temperature)
    fly = (fly_window, fly_threshold, fly_top_k)
    temperature_given = None if check_inputs else temperature_as_given(temperature)
    target_temperature_given = None if temperature_given is None else target_temperature_as_given(target_temperature)
    fly_given = None if target_temperature_given is None else fly_as_given(*fly)
    if fly_given is not None and rows_as_given(target_rows, draft_rows):
        op_arguments = unchecked_arguments(draft_tokens, draft_logits, target_logits, weight, num_draft,
                                           temperature_given[0], uniforms, seed, offset, temperature_given[1])
        if op_arguments is not None:
            extra = (() if target_rows is None and draft_rows is None and target_temperature is None and not fly_given
                     else (target_rows, draft_rows, *target_temperature_given, *fly_given))  # as in verify
            try:
                return VerifyResult(*_VERIFY_LOGITS(*op_arguments, *extra))
            except RuntimeError as error:
                refusal = error  # as in verify
            _prepare_logits(draft_tokens, draft_logits, target_logits, weight, temperature, num_draft, uniforms, seed,
                            offset, extras, fly, check_inputs=False)
            raise refusal
    op_arguments = _prepare_logits(draft_tokens, draft_logits, target_logits, weight, temperature, num_draft,
                                   uniforms, seed, offset, extras, fly, check_inputs)
    return VerifyResult(*_VERIFY_LOGITS(*op_arguments))


def _prepare_logits(draft_tokens, draft_logits, target_logits, weight, temperature, num_draft, uniforms, seed, offset,
                    extras, fly, check_inputs) -> tuple:
    """verify_logits' op arguments through the argument rules: prepare_verify's, with the temperature (its own rule)
    in the place of greedy and its value before the seed, after the row indices the target temperature (``extras``:
    target_rows, draft_rows, target_temperature), then FLy's (``fly``: fly_window, fly_threshold, fly_top_k)."""
    target_rows, draft_rows, target_temperature = extras
    (draft_ids, draft, target, weight_t, num_draft_t, _, uniforms_t, seeds, offset_i, per_row_seed, weight_value,
     seed_value, target_rows_t, draft_rows_t) = prepare_verify(
        draft_tokens, draft_logits, target_logits, weight, num_draft=num_draft, greedy=None, uniforms=uniforms,
        seed=seed, offset=offset, check_inputs=check_inputs, draft_name="draft_logits", target_name="target_logits",
        kind="logits", target_rows=target_rows, draft_rows=draft_rows)
    batch = draft_ids.shape[0]
    temperature_t, temperature_value = temperature_argument(temperature, batch, target.device, check_inputs)
    target_temperature_t, target_temperature_value = None, None
    if target_temperature is not None:
        target_temperature_t, target_temperature_value = temperature_argument(
            target_temperature, batch, target.device, check_inputs, "target_temperature")
        if target_temperature_t is not None:
            target_temperature_value = None  # the tensor gives the values
    return (draft_ids, draft, target, weight_t, num_draft_t, temperature_t, uniforms_t, seeds, offset_i, per_row_seed,
            weight_value, temperature_value, seed_value, target_rows_t, draft_rows_t, target_temperature_t,
            target_temperature_value, *fly_arguments(*fly, batch, draft_ids.shape[1], target.device, check_inputs))


def token_stats(draft, target, tokens, *, from_logits=False, temperature=1.0, check_inputs=True) -> TokenStats:
    """p(y), q(y), TV(p, q) and log-probabilities per position, in one or two passes over V.

    Args:
        draft: [B, T, V] draft probabilities or logits.
        target: [B, T, V] target probabilities or logits (same dtype and device).
        tokens: int32/int64 [B, T], the tokens y (for example a generated sequence, teacher-forced).
        from_logits: treat draft and target as logits (softmax(x / temperature) per row).
        temperature: float or [B]; only used with logits (0 counts as 1).
    Returns :class:`TokenStats` with float32 [B, T] fields. No [B, T, V] temporary is created.
    """
    batch, length, vocab, temperature_t = prepare_pair(draft, target, from_logits=from_logits,
                                                        temperature=temperature, check_inputs=check_inputs,
                                                        same_positions=True)
    tokens_t = normalize_stat_tokens(tokens, batch, length, vocab, draft.device, check_inputs)
    fields = torch.ops.diversed.token_stats(draft.contiguous(), target.contiguous(), tokens_t, temperature_t,
                                            bool(from_logits))
    return TokenStats(*fields)


def distribution_features(draft_logits, target_logits, *, temperature=1.0, target_temperature=None, target_rows=None,
                          draft_rows=None, check_inputs=True) -> torch.Tensor:
    """The :data:`~diversed_ext.DISTRIBUTION_FEATURES` of q = softmax(draft_logits / T) and p = softmax(target_logits /
    T) at every position, each in [0, 1], fused (one exp per element on the CPU, two on CUDA): the entropies of q and
    p divided by log V (so a head sees the same scale for any vocabulary; 0 for V = 1), their largest probabilities
    and TV(p, q).

    Args:
        draft_logits: [B, T, V] draft logits; -inf rules a token out. [Rd, V] with ``draft_rows``.
        target_logits: [B, T, V] target logits on the same device ([R, V] with ``target_rows``). Each tensor float32,
            bfloat16 or float16, read as it lies (a bfloat16 draft beside float32 target rows needs no copy).
        temperature: float or [B]; 0 counts as 1, as for the verifier.
        target_temperature: None (the target logits are divided by ``temperature`` too), or a float or [B] that
            divides the target logits instead: 1.0 for a server's target rows already divided by the request's
            temperature beside draft logits that are not.
        target_rows, draft_rows: int [B, T]: position t of request b reads row ``target_rows[b, t]`` of
            ``target_logits`` [R, V] (``draft_rows``: of ``draft_logits``), in place, with no gather copy; B and T come
            from the other, 3-D tensor, or from ``target_rows`` when both are given. Unchecked, an index outside
            [0, R) is clamped into it.
        check_inputs: check the values too (NaN, +inf, a row without a finite logit, indices in range); this reads
            them on the host. Unchecked, a row without a finite logit has entropy 0 and largest probability 0, and
            every output stays in [0, 1].
    Returns float32 [B, T, len(DISTRIBUTION_FEATURES)].
    """
    args = prepare_features(draft_logits, target_logits, temperature=temperature,
                            target_temperature=target_temperature, target_rows=target_rows, draft_rows=draft_rows,
                            check_inputs=check_inputs)
    return _DISTRIBUTION_FEATURES(draft_logits.contiguous(), target_logits.contiguous(), args.temperature,
                                  args.target_rows, args.draft_rows, args.target_temperature)


def mix(draft, target, weight, *, from_logits=False, temperature=1.0, check_inputs=True) -> torch.Tensor:
    """nu = w * p + (1 - w) * q materialised as float32 [B, K, V], for callers who need the whole distribution.

    Args:
        draft: [B, K, V] draft probabilities or logits.
        target: [B, K, V] or [B, K+1, V] target probabilities or logits (positions past K are ignored).
        weight: float, [B] or [B, K] weight on the target, in [0, 1].
        from_logits: treat draft and target as logits, softmax(x / temperature) per row.
        temperature: float or [B]; only used with logits (0 counts as 1).
    """
    batch, positions, _, temperature_t = prepare_pair(draft, target, from_logits=from_logits,
                                                       temperature=temperature, check_inputs=check_inputs,
                                                       same_positions=False)
    weight_t = weight_tensor(weight, batch, positions, draft.device, check_inputs)
    return torch.ops.diversed.mix(draft.contiguous(), target.contiguous(), weight_t, temperature_t, bool(from_logits))


def mixture_divergence(draft_logits, target_logits, *, temperature=1.0, grid_points=rules.DEFAULT_GRID_POINTS,
                       log_floor=rules.DEFAULT_LOG_FLOOR, check_inputs=True) -> torch.Tensor:
    """KL(nu_w || p) of nu_w = w p + (1 - w) q at ``grid_points`` evenly spaced weights on the target, w = g / (G - 1)
    for g = 0 .. G - 1, at every position, for q = softmax(draft_logits / T) and p = softmax(target_logits / T): a
    table from which a loss reads the divergence of each token's law from the target's at any w (convex in w, 0 at
    w = 1, KL(q || p) at w = 0).

    KL(nu_w || p) = sum nu_w log nu_w - w sum p log p - (1 - w) sum q log p: the two cross sums once, the first once
    per weight. On the CPU one native pass reads the two rows once and takes G logarithms per element, with float64
    sums across blocks of the vocabulary; on other devices the same sums run as torch ops, in float32.

    Args:
        draft_logits: [B, T, V] draft logits; -inf rules a token out.
        target_logits: [B, T, V] target logits, of the same dtype (float32, bfloat16 or float16) and device.
        temperature: float or [B]; 0 counts as 1.
        grid_points: G, an int in [2, 1025] (17 gives w = 0, 1/16, ..., 1).
        log_floor: log p is floored at this many nats (finite), so mass the draft puts on a token the target rules
            out costs at most -log_floor per unit rather than making the divergence infinite.
        check_inputs: check the values too (NaN, +inf, a row without a finite logit); this reads them on the host.
    Returns float32 [B, T, G], every entry >= 0.
    """
    grid_points, log_floor = rules.grid_points(grid_points), rules.log_floor(log_floor)
    _, _, _, temperature_t = prepare_pair(draft_logits, target_logits, from_logits=True, temperature=temperature,
                                          check_inputs=check_inputs, same_positions=True)
    if draft_logits.device.type != "cpu":
        return divergence_table(draft_logits, target_logits, temperature_t, grid_points, log_floor)
    return torch.ops.diversed.mixture_divergence(draft_logits.contiguous(), target_logits.contiguous(), temperature_t,
                                                 grid_points, log_floor)
