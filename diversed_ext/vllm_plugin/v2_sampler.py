"""vLLM's V2 rejection sampler (``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py``), verifying with diversed_ext.

V2 hands verification its batch as logits rows: request r owns rows ``cu_num_logits[r] .. cu_num_logits[r + 1] - 1``,
one per drafted token plus the bonus row (a request without drafts has one row), and the input token of each row
(``draft_sampled``: row j + 1 holds draft j; -1 marks a draft that must be rejected). Draft logits, when the drafter
samples probabilistically, stay where the drafter wrote them: ``[max_num_reqs, K, V]``, indexed by the request's
state (``idx_mapping``), before temperature. Per-request temperature and seed live in the sampler's state tables,
indexed the same way.

Everything of V2's own that is not the acceptance rule is kept, because only :meth:`_verify`'s call of V2's
``rejection_sample`` is replaced: its chunking of large batches, its sampling parameters (allowed token ids, bad
words, min_tokens, penalties, custom logits processors, the thinking budget, temperature, min-p, top-k / top-p)
applied to every target row by its own sampler, its log-probabilities and its output (``sampled`` [num_reqs, K + 1]
and ``num_sampled``). The replacement is one diversed_ext verify call per chunk that reads the rows where they lie
(row indices, no padded copy), with

- the target rows as V2 processed them (already divided by the temperature, so the op's target temperature is 1),
  and the draft logits, in the drafter's own dtype, divided by the request's temperature in the op. A draft that
  the processed target rules out (probability 0) is never kept, whatever the weight (the ops' support rule), so
  every hard constraint above holds at any w;
- greedy rows (temperature 0) verified greedily against nu;
- randomness from the request's seed and the position of its first row, so a request's tokens do not depend on its
  neighbours in the batch and a seeded request repeats them;
- the token after a request's last kept draft (the bonus, and the only token of a request without drafts) sampled by
  V2's own sampler (``gumbel_sample`` at the request's seed and that row's position, reading the rows in place), so
  a request's tokens are the same whether or not its batch drafted;
- each request's weight, or its head's weight per drafted token, and its FLy window and threshold (FLy's deferral
  on top of the weight; a window of 0 leaves verification exact against nu) (:mod:`.v2_state`);
- each gated request's margin: the weight is set to 0 where the log-probability gate keeps a draft outright
  (:func:`diversed_ext.ops.gate_keeps_logits`, lossy), before the verify call; only gated requests' rows are read,
  in place.
"""

from __future__ import annotations

import math

import torch
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

from .. import ops as dx_ops
from .counts import VerifyCounts
from .sampler import gated, with_bonus

# Mixes a request's seed with the position of its first row into the seed of this step's draws: an odd multiplier
# (2^64 / golden ratio) so that distinct (seed, position) pairs give distinct seeds, whatever the batch.
SEED_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64


def request_rows(cu_num_logits: torch.Tensor, num_positions: int, num_logits: int):
    """Where each request's rows lie: ``first`` [R] its first logits row, ``num_draft`` [R] its drafted tokens,
    ``target_rows`` [R, K + 1] its K + 1 target rows (clamped into the chunk: rows past a request's own are never
    read) and ``draft_token_rows`` [R, K], the rows whose input token is each draft."""
    first = cu_num_logits[:-1].to(torch.int64)
    num_draft = (cu_num_logits[1:] - cu_num_logits[:-1]).to(torch.int64) - 1
    offsets = torch.arange(num_positions + 1, dtype=torch.int64, device=first.device)
    last_row = max(num_logits - 1, 0)
    target_rows = (first[:, None] + offsets[None, :]).clamp_(max=last_row)
    draft_token_rows = (first[:, None] + 1 + offsets[None, :num_positions]).clamp_(max=last_row)
    return first, num_draft.clamp_(min=0), target_rows, draft_token_rows


def step_seeds(seeds: torch.Tensor, first_positions: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds of this step: a request's seed mixed with the sequence position of its first row (fresh draws
    every step, the same draws for the same request and position in any batch)."""
    return seeds.to(torch.int64) * SEED_MIX + first_positions.to(torch.int64)


class DiversedV2RejectionSampler(RejectionSampler):
    """V2's RejectionSampler with the acceptance rule replaced (see the module docstring)."""

    # For a drafter that pads with filler (V2's n-gram): each request state's count of real drafts
    # (:class:`.drafters.RealDraftCounts`); positions past it are not verified, so no weight keeps filler.
    real_drafts = None

    def bind(self, weights, device, exact_vllm: bool = False) -> "DiversedV2RejectionSampler":
        """``weights`` gives each step's weight on the target (:class:`.v2_state.StateWeights`); ``exact_vllm``
        keeps V2's own acceptance (a control for benchmarks)."""
        self.weight_source = weights
        self.exact_vllm = exact_vllm
        self.diversed_verifier = "vllm" if exact_vllm else "diversed"
        self.counts = VerifyCounts(device)
        self._step_logits = None
        return self

    def status(self) -> dict:
        """What this sampler verified so far (read by ``collective_rpc("diversed_status")``)."""
        return dict(sampler=type(self).__name__, verifier=self.diversed_verifier, runner="v2", **self.counts.read())

    def __call__(self, logits, input_batch, *args, **kwargs):
        self._step_logits = logits  # _verify sees chunks of it; a head's target hidden rows are indexed by the whole
        try:
            return super().__call__(logits, input_batch, *args, **kwargs)
        finally:
            self._step_logits = None

    def _verify(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, idx_mapping_np,
                expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np, verify_draft_sampled=None):
        if self.exact_vllm:
            return super()._verify(logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping,
                                   idx_mapping_np, expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np,
                                   verify_draft_sampled)
        processed_logits = self.sampler.apply_sampling_params(
            logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, draft_sampled, expanded_local_pos,
            seq_lens_upper_bound_np)
        if verify_draft_sampled is None:
            verify_draft_sampled = draft_sampled
        sampled, num_sampled = self._verify_chunk(processed_logits, draft_logits, verify_draft_sampled, pos,
                                                  cu_num_logits, idx_mapping, idx_mapping_np, expanded_idx_mapping,
                                                  self._chunk_start(logits))
        return processed_logits, sampled, num_sampled

    def _chunk_start(self, chunk: torch.Tensor) -> int:
        """The first row of ``chunk`` in the step's logits (V2 passes chunks as row slices of one tensor)."""
        whole = self._step_logits
        if whole is None or chunk.shape[0] == 0:
            return 0
        return (chunk.data_ptr() - whole.data_ptr()) // (whole.stride(0) * whole.element_size())

    def _verify_chunk(self, target_logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping,
                      idx_mapping_np, expanded_idx_mapping, chunk_start: int):
        num_positions = self.num_speculative_steps
        first, num_draft, target_rows, draft_token_rows = request_rows(cu_num_logits, num_positions,
                                                                      target_logits.shape[0])
        states = idx_mapping.to(torch.int64)
        if self.real_drafts is not None:
            num_draft = torch.minimum(num_draft, self.real_drafts.by_state[states])
        sampling = self.sampler.sampling_states
        temperature = sampling.temperature.gpu[states].to(torch.float32)
        draft_tokens = draft_sampled[draft_token_rows]
        weight = self.weight_source(states, idx_mapping_np, num_draft, chunk_start + target_rows[:, :num_positions],
                                    target_logits, target_rows, draft_logits, temperature)
        gate = self.weight_source.gate(states, idx_mapping_np)
        if gate is not None:
            weight = gated(weight, gate_keeps_of(*gate, draft_tokens, draft_logits, target_logits,
                                                 target_rows[:, :num_positions], states, temperature, num_draft))
        draft_rows = None
        if draft_logits is not None:
            draft_logits, draft_rows = dx_ops.position_rows(draft_logits, slots=states)
        result = verify_rows(draft_tokens, draft_logits, draft_rows, target_logits, target_rows, weight,
                             temperature, num_draft, step_seeds(sampling.seeds.gpu[states], pos[first]),
                             self.weight_source.fly(states))
        self.counts.add(num_draft, result.num_accepted, weight)
        # with filler drafts cut off (real_drafts), a request's bonus row need not be its last row
        bonus = bonus_tokens(target_logits, first + num_draft, self.real_drafts is None, num_positions, states,
                             expanded_idx_mapping, pos, sampling, self.sampler.use_fp64_gumbel)
        return with_bonus(result.tokens, result.num_accepted, num_draft, bonus), result.num_accepted + 1


def gate_keeps_of(requests_np, margin, draft_tokens, draft_logits, target_logits, target_rows, states, temperature,
                  num_draft):
    """[R, K] bool: the drafts the log-probability gate keeps outright, reading only the rows of the gated requests
    (``requests_np`` their positions in the chunk, ``margin`` [G] their margins). The target rows are V2's processed
    (tempered) ones; the draft's distributions are its logits at the request's state divided by the request's
    temperature (None: tokens only). Greedy requests and positions past a request's drafts are not gated."""
    requests, num_positions = target_rows.shape
    index = torch.as_tensor(requests_np, device=target_rows.device)
    temperature, num_draft = temperature[index], num_draft[index]
    positions = torch.arange(num_positions, device=num_draft.device)
    gated_rows = ~dx_ops.is_greedy_temperature(temperature)[:, None] & (positions[None, :] < num_draft[:, None])
    margin = torch.where(gated_rows, margin[:, None], math.nan)
    draft_rows = None
    if draft_logits is not None:
        draft_logits, draft_rows = dx_ops.position_rows(draft_logits, num_positions, states[index])
    keep_rows = dx_ops.gate_keeps_logits(margin, draft_tokens[index], target_logits, draft_logits,
                                         temperature=temperature, target_temperature=1.0,
                                         target_rows=target_rows[index], draft_rows=draft_rows, check_inputs=False)
    keep = torch.zeros(requests, num_positions, dtype=torch.bool, device=target_rows.device)
    return keep.index_put_((index,), keep_rows)


def bonus_tokens(target_logits, bonus_rows, last_rows: bool, num_positions: int, states, expanded_idx_mapping, pos,
                 sampling, use_fp64: bool):
    """[R] the token each request emits after keeping all its drafts, drawn by V2's own ``gumbel_sample`` (the
    request's seed and temperature, the bonus row's position), which reads a row tensor in place: when the bonus rows
    are the requests' last rows (``last_rows``) and every request of the chunk has as many rows, a strided view of
    them; else every row of the chunk, of which the bonus rows' tokens are kept. No [R, V] copy is made. A request
    has 1 to K + 1 rows, so the host knows they all have as many when the chunk has R or R (K + 1) rows."""
    requests, num_rows = states.shape[0], target_logits.shape[0]
    if last_rows and requests and num_rows in (requests, requests * (num_positions + 1)):
        stride = num_rows // requests
        rows = target_logits.as_strided((requests, target_logits.shape[1]),
                                        (stride * target_logits.stride(0), target_logits.stride(1)),
                                        target_logits.storage_offset() + (stride - 1) * target_logits.stride(0))
        return gumbel_sample(rows, states, sampling.temperature.gpu, sampling.seeds.gpu, pos[bonus_rows],
                             apply_temperature=False, is_drafting=False, use_fp64=use_fp64)
    every_row = gumbel_sample(target_logits, expanded_idx_mapping, sampling.temperature.gpu, sampling.seeds.gpu, pos,
                              apply_temperature=False, is_drafting=False, use_fp64=use_fp64)
    return every_row[bonus_rows]


def verify_rows(draft_tokens, draft_logits, draft_rows, target_logits, target_rows, weight, temperature, num_draft,
                seeds, fly: dict):
    """One unchecked verify_logits call on rows where they lie: the target rows already tempered, the draft rows
    divided by each request's temperature (0 marks a greedy request); ``fly`` the requests' FLy arguments."""
    return dx_ops.verify_logits(draft_tokens, draft_logits, target_logits, weight, temperature=temperature,
                                target_temperature=1.0, num_draft=num_draft, seed=seeds, target_rows=target_rows,
                                draft_rows=draft_rows, check_inputs=False, **fly)
