"""vLLM's V1 rejection sampler, verifying with diversed_ext.

vLLM hands the sampler its batch flattened: N draft tokens of B requests (``cu_num_draft_tokens`` marks where each
request ends, a request may have none), the target's logits at the N drafted positions plus B bonus positions, and
the draft's probabilities at the N positions or None (drafters that give tokens only). The forward here keeps every
step of vLLM's own that is not the acceptance rule:

1. the bonus token, sampled by vLLM's own sampler from the bonus logits (every logits processor, the request's seeded
   generator): the token emitted when all of a request's drafts are kept;
2. vLLM's logits processing of the drafted target rows (its ``apply_logits_processors``: penalties, allowed token
   ids, bad words, min_tokens, the thinking budget; vLLM refuses logit_bias, min_p and custom logits processors when
   speculative decoding is on), then temperature, top-k and top-p per request. vLLM's CPU build expands those
   per-request values with a kernel that leaves float outputs unwritten, so that expansion is done here with
   ``torch.repeat_interleave``;
3. verification: one ``verify_logits`` call (drafts as tokens: q one-hot at each draft) or ``verify`` call (the
   draft's probabilities) that reads the N rows where they lie through [B, K] row indices (K = the longest request's
   draft count), with each request's weight (a static weight, or a learned head's w per token; 0 where the
   request's log-probability gate keeps a draft outright), its seed and its greedy flag. A drafted token that the
   processed target rules out (probability 0) is never kept, whatever the weight (the ops' support rule), so every
   constraint of step 2 holds at any w;
4. vLLM's log-probabilities of the emitted tokens, and its output layout: [B, K + 1] int32, the kept drafts, then the
   correction or bonus token, then -1.

Target rows reach the verifier already divided by the request's temperature, so sampled rows are verified at
temperature 1; greedy rows (temperature 0 in vLLM) are verified greedily: they keep a draft while it is the argmax of
nu, which is the target's argmax only at w = 1, with q one-hot at the drafted token (vLLM gives a batch of greedy
requests alone no draft distributions; a greedy request among sampled ones is verified alike).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Callable, Optional

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample import rejection_sampler as vllm_rejection
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from .. import ops as dx_ops
from .counts import VerifyCounts

PLACEHOLDER_TOKEN_ID = -1  # vLLM's marker for "no token here" in the [B, K + 1] output
SEED_HIGH = 2**62  # per-step seeds are drawn from [0, SEED_HIGH): inside the ops' int64 seed range
# What vLLM's own forward passes rejection_sample of its sampler's settings, where the release has them (FLy's from
# 0.33.0): the exact verifier passes the same, so vLLM's FLy is not dropped with verifier "vllm"
VLLM_SAMPLE_SETTINGS = ("use_fp64_gumbel", "fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k")
# A request with no drafts this step still gets a row; its verification is skipped by num_draft = 0.


def expand_per_request(values: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                       replace_from: float = 0, replace_to: float = 0) -> torch.Tensor:
    """[B] per-request values -> [num_tokens], each repeated over its request's tokens (``cu_num_tokens`` is the
    inclusive cumulative count), with ``replace_from`` values replaced first: what vLLM's expand kernel computes."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(values == replace_from, torch.as_tensor(replace_to, dtype=values.dtype,
                                                                 device=values.device), values)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def apply_sampling_constraints(logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                               sampling_metadata) -> torch.Tensor:
    """Temperature, top-k and top-p on the [N, V] target rows, in place where vLLM does it in place; greedy rows
    keep their logits (their temperature 0 counts as 1)."""
    if sampling_metadata.all_greedy:
        return logits
    num_tokens = logits.shape[0]
    temperature = expand_per_request(sampling_metadata.temperature, cu_num_draft_tokens, num_tokens,
                                     replace_from=vllm_rejection.GREEDY_TEMPERATURE, replace_to=1)
    logits.div_(temperature.unsqueeze(-1))
    top_k = top_p = None
    if sampling_metadata.top_k is not None:
        top_k = expand_per_request(sampling_metadata.top_k, cu_num_draft_tokens, num_tokens)
    if sampling_metadata.top_p is not None:
        top_p = expand_per_request(sampling_metadata.top_p, cu_num_draft_tokens, num_tokens)
    if num_tokens == 0:  # vLLM's top-k reads k.max() of an empty tensor
        return logits
    return apply_top_k_top_p(logits, top_k, top_p)


class PaddedRows:
    """Where request b's i-th draft lives in vLLM's flattened rows, as [B, K] gather indices and a validity mask."""

    def __init__(self, num_draft_tokens: list, cu_num_draft_tokens: torch.Tensor, max_spec_len: int):
        device = cu_num_draft_tokens.device
        self.batch = len(num_draft_tokens)
        self.width = max_spec_len
        self.num_draft = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
        starts = cu_num_draft_tokens.to(torch.int64) - self.num_draft
        positions = torch.arange(max_spec_len, dtype=torch.int64, device=device)
        self.valid = positions[None, :] < self.num_draft[:, None]
        total = int(sum(num_draft_tokens))
        self.index = (starts[:, None] + positions[None, :]).clamp_(0, max(total - 1, 0))

    def gather(self, flat: torch.Tensor, fill=0) -> torch.Tensor:
        """[N, ...] flattened rows -> [B, K, ...], positions past a request's drafts set to ``fill``."""
        rows = flat[self.index]
        mask = self.valid.reshape(*self.valid.shape, *([1] * (rows.dim() - 2)))
        return torch.where(mask, rows, torch.as_tensor(fill, dtype=rows.dtype, device=rows.device))


def greedy_rows(sampling_metadata, batch: int, device) -> torch.Tensor:
    """[B] bool: the requests vLLM samples greedily (temperature 0)."""
    if sampling_metadata.all_greedy:
        return torch.ones(batch, dtype=torch.bool, device=device)
    return sampling_metadata.temperature[:batch] == vllm_rejection.GREEDY_TEMPERATURE


def row_seeds(sampling_metadata, num_draft_tokens: list, device) -> torch.Tensor:
    """[B] int64 seeds for this step: a seeded request draws its seed from its own generator (so it reproduces its
    tokens whatever its neighbours), the others share one draw from torch's default generator."""
    batch = len(num_draft_tokens)
    seeds = torch.randint(0, SEED_HIGH, (batch,), dtype=torch.int64, device=device)
    for row, generator in sampling_metadata.generators.items():
        if row < batch and num_draft_tokens[row] > 0:  # vLLM's own sampler draws nothing for rows without drafts
            seeds[row] = torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, generator=generator,
                                       device=generator.device)[0].to(device)
    return seeds


def greedy_drafts_as_tokens(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, greedy: torch.Tensor,
                            rows: PaddedRows) -> torch.Tensor:
    """The [N, V] draft distributions with each greedy request's rows one-hot at its drafted token. vLLM hands no
    distributions for a batch of greedy requests alone, whose drafts are then verified as tokens; a greedy request
    among sampled ones is verified the same way, so its tokens do not depend on its neighbours. (An id outside the
    vocabulary, vLLM's -1, is rejected by the op whatever its row holds.)"""
    greedy_rows = torch.repeat_interleave(greedy, rows.num_draft, output_size=draft_token_ids.shape[0])
    ids = draft_token_ids.to(torch.int64).clamp(0, draft_probs.shape[-1] - 1)
    one_hot = torch.zeros_like(draft_probs).scatter_(1, ids[:, None], 1.0)
    return torch.where(greedy_rows[:, None], one_hot, draft_probs)


def verify_in_place(rows: PaddedRows, draft_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor],
                    target_logits: torch.Tensor, weight: torch.Tensor, greedy: torch.Tensor,
                    seeds: torch.Tensor, fly: dict, any_greedy: bool = False) -> dx_ops.VerifyResult:
    """One diversed_ext call that reads vLLM's [N, V] rows where they lie. The target's bonus position reads any row:
    the bonus comes from vLLM's sampler. With the draft's probabilities the target is needed as probabilities too: one
    softmax of the N rows, as vLLM's own rejection sampling computes. ``any_greedy`` (a host flag): whether any
    request is greedy, whose rows of the draft's distributions are then made one-hot."""
    drafts = rows.gather(draft_token_ids.to(torch.int64))
    target_rows = torch.cat([rows.index, rows.index[:, :1]], dim=1)
    if draft_probs is None:
        temperature = torch.where(greedy, 0.0, 1.0).to(torch.float32)
        return dx_ops.verify_logits(drafts, None, target_logits, weight, temperature=temperature,
                                    num_draft=rows.num_draft, seed=seeds, target_rows=target_rows,
                                    check_inputs=False, **fly)
    draft_probs = draft_probs.to(torch.float32)
    if any_greedy:
        draft_probs = greedy_drafts_as_tokens(draft_probs, draft_token_ids, greedy, rows)
    return dx_ops.verify(drafts, draft_probs, target_logits.softmax(-1), weight,
                         num_draft=rows.num_draft, greedy=greedy, seed=seeds, target_rows=target_rows,
                         draft_rows=rows.index, check_inputs=False, **fly)


def gate_keeps_rows(margin: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                    target_logits: torch.Tensor, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[M] bool: the drafted tokens ``draft_tokens`` [M] the log-probability gate keeps outright
    (:func:`diversed_ext.ops.gate_keeps_logits`, one fused call), at the rows ``index`` [M] of the [N, V] tempered
    target logits, read where they lie (None: all N rows, M = N), with the draft's probabilities there (``draft_probs``
    [N, V], or None: tokens only). ``margin`` [M] is NaN on rows not gated; an id outside the vocabulary (vLLM's -1 for
    a draft that must be rejected) is never kept, nor is a token the processed target forbids (a bad word, a token
    outside allowed_token_ids, EOS before min_tokens), whatever the margin."""
    if index is None:
        target, draft, rows = target_logits[:, None], None if draft_probs is None else draft_probs[:, None], None
    else:
        target, draft, rows = target_logits, draft_probs, index[:, None]
    keep = dx_ops.gate_keeps_logits(margin[:, None], draft_tokens.to(torch.int64)[:, None], target, draft_probs=draft,
                                    target_rows=rows, draft_rows=None if draft is None else rows, check_inputs=False)
    return keep[:, 0]


def gate_keeps_requests(rows: PaddedRows, requests: list, margin: torch.Tensor, greedy: torch.Tensor, metadata,
                        draft_probs: Optional[torch.Tensor], target_logits: torch.Tensor) -> torch.Tensor:
    """[B, K] bool: the drafts the log-probability gate keeps outright, reading only the rows of the gated
    ``requests`` (a host list of batch rows, ``margin`` [G] theirs); greedy requests are not gated (they have no
    log-probabilities to compare). The gated rows are found on the host from vLLM's draft counts."""
    num_draft = metadata.num_draft_tokens
    starts = [0, *itertools.accumulate(num_draft)]
    flat = [row for request in requests for row in range(starts[request], starts[request + 1])]
    keep = torch.zeros(target_logits.shape[0], dtype=torch.bool, device=target_logits.device)
    if flat:
        device = target_logits.device
        requests_t = torch.tensor(requests, dtype=torch.int64, device=device)
        counts = torch.tensor([num_draft[request] for request in requests], dtype=torch.int64, device=device)
        margin = torch.repeat_interleave(torch.where(greedy[requests_t], math.nan, margin), counts,
                                         output_size=len(flat))
        every_row = len(flat) == target_logits.shape[0]  # all rows gated: no index
        index = None if every_row else torch.tensor(flat, dtype=torch.int64, device=device)
        keep_rows = gate_keeps_rows(margin, metadata.draft_token_ids if every_row else metadata.draft_token_ids[index],
                                    draft_probs, target_logits, index)
        keep = keep_rows if every_row else keep.index_put_((index,), keep_rows)
    return rows.gather(keep, fill=False)


def gated(weight: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[B] or [B, K] weights as [B, K], 0 where the gate keeps the draft (nu is then the draft there)."""
    weight = weight[:, None].expand(keep.shape) if weight.dim() == 1 else weight
    return torch.where(keep, torch.zeros_like(weight), weight)


def with_bonus(tokens: torch.Tensor, num_accepted: torch.Tensor, num_draft: torch.Tensor,
               bonus: torch.Tensor) -> torch.Tensor:
    """``tokens`` [B, K + 1] with vLLM's own ``bonus`` [B] in place of the op's final token where a request kept all
    its ``num_draft`` [B] drafts (both runners sample that token with vLLM's own sampler)."""
    kept_all = num_accepted.to(torch.int64) == num_draft
    position = num_draft[:, None]
    final = torch.where(kept_all, bonus.to(tokens.dtype), tokens.gather(1, position).squeeze(1))
    return tokens.scatter(1, position, final[:, None])


def vllm_layout(result: dx_ops.VerifyResult, rows: PaddedRows, bonus_token_ids: torch.Tensor) -> torch.Tensor:
    """[B, K + 1] int32 in vLLM's layout, with vLLM's bonus token where a request kept all its drafts."""
    return with_bonus(result.tokens.to(torch.int64), result.num_accepted, rows.num_draft,
                      bonus_token_ids.reshape(-1)).to(torch.int32)


# What the sampler asks for each step's weights: (rows, the [N, V] target rows after constraints, vLLM's sampling
# metadata, the [N] logits rows they came from) -> [B] or [B, K] float32 weights on the target.
WeightSource = Callable[[PaddedRows, torch.Tensor, object, torch.Tensor], torch.Tensor]


class DiversedRejectionSampler(vllm_rejection.RejectionSampler):
    """vLLM's RejectionSampler with the acceptance rule replaced (see the module docstring)."""

    def bind(self, weights: Optional[WeightSource], device, exact_vllm: bool = False) -> "DiversedRejectionSampler":
        """Where weights come from; ``exact_vllm`` keeps vLLM's own acceptance (with the repaired constraints)."""
        self.weight_source = weights
        self.exact_vllm = exact_vllm
        self.diversed_verifier = "vllm" if exact_vllm else "diversed"
        self.counts = VerifyCounts(device)
        return self

    def status(self) -> dict:
        """What this sampler verified so far (read by ``collective_rpc("diversed_status")``)."""
        return dict(sampler=type(self).__name__, verifier=self.diversed_verifier, runner="v1", **self.counts.read())

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        bonus_logits = logits[metadata.bonus_logits_indices]
        bonus_output = self.sampler(
            logits=bonus_logits, sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits")
        bonus_token_ids = bonus_output.sampled_token_ids
        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = raw_target_logits if self.is_processed_logprobs_mode else raw_target_logits.clone()
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        target_logits = apply_sampling_constraints(target_logits, metadata.cu_num_draft_tokens, sampling_metadata)
        output_token_ids = self._accept(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata)
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus_output.logprobs_tensors.logprobs, output_token_ids)
        return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=logprobs_tensors)

    def _accept(self, metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata) -> torch.Tensor:
        if self.exact_vllm:
            return vllm_rejection.rejection_sample(
                metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                metadata.cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                **{name: getattr(self, name) for name in VLLM_SAMPLE_SETTINGS if hasattr(self, name)})
        rows = PaddedRows(metadata.num_draft_tokens, metadata.cu_num_draft_tokens, metadata.max_spec_len)
        device = target_logits.device
        if rows.width == 0 or target_logits.shape[0] == 0:  # no drafts anywhere: every request emits its bonus
            output = torch.full((rows.batch, rows.width + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device)
            output[:, 0] = bonus_token_ids.reshape(-1).to(torch.int32)
            return output
        weight = self.weight_source(rows, target_logits, sampling_metadata, metadata.target_logits_indices)
        greedy = greedy_rows(sampling_metadata, rows.batch, device)
        gate = self.weight_source.gate()
        if gate is not None:
            weight = gated(weight, gate_keeps_requests(rows, *gate, greedy, metadata, draft_probs, target_logits))
        result = verify_in_place(rows, metadata.draft_token_ids, draft_probs, target_logits, weight, greedy,
                                 row_seeds(sampling_metadata, metadata.num_draft_tokens, device),
                                 self.weight_source.fly(), any_greedy=not sampling_metadata.all_random)
        self.counts.add(rows.num_draft, result.num_accepted, weight)
        return vllm_layout(result, rows, bonus_token_ids)
