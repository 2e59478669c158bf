"""Per-request weights and learned heads on vLLM's V2 model runner, kept in tables indexed by request state.

V2 keeps no sampling parameters per step: it reads them once, when it admits a request into a state slot
(``Sampler.add_request(req_idx, sampling_params)``), into tables that its kernels index with ``idx_mapping``. The
weights do the same: on admission a request's choice (``diversed_weight``, ``diversed_head`` or the engine default)
is written into a weight table, a head table, FLy's window and threshold tables and a gate margin table, and each step
reads them with the step's ``idx_mapping``, so the
weights path has no host sync and no Python loop over requests.

A head weighs drafted token i of a request from the draft's hidden state that produced q_i, the target's that
produced p_i, and (for heads that read them) the distribution features of q_i and p_i:

- the draft's are captured while V2 proposes: its speculator calls ``sample_draft(hidden_states, positions,
  idx_mapping, ...)`` once per draft step with exactly those hidden states, one row per request; they are written into
  a ``[max_num_reqs, K, H]`` table at the requests' states (and the draft's logits beside them when the drafter
  samples greedily and a head reads distributions);
- the target's are captured when V2 samples: ``sample(hidden_states, input_batch, ...)`` gathers them at
  ``input_batch.logits_indices``, one per logits row.

Each loaded head runs once per step over every request of the step; its w replaces the static weight on the rows of
the requests that chose it. A head request whose drafts were not captured is verified at the engine's static weight
and counted (``verified_without_head`` in ``diversed_status``).
"""

from __future__ import annotations

import math

import torch

from ..head import distribution_features
from ..ops import distribution_temperature
from .settings import EngineSettings, parse_request, request_settings

NO_HEAD = -1


class DraftCapture:
    """The draft's hidden states (and logits, when needed) of every request's last proposal, by request state."""

    def __init__(self, speculator, max_num_reqs: int, num_positions: int, hidden_size: int, vocab_size: int,
                 keep_logits: bool, device, dtype):
        self.num_positions = num_positions
        self.hidden = torch.zeros(max_num_reqs, num_positions, hidden_size, dtype=dtype, device=device)
        # V2 keeps the draft's logits itself when it drafts probabilistically; greedy drafting never materialises
        # them, so they are recomputed here, once per draft step, only for heads that read distributions.
        self.logits = None
        if keep_logits and getattr(speculator, "draft_logits", None) is None:
            self.logits = torch.zeros(max_num_reqs, num_positions, vocab_size, dtype=torch.float32, device=device)
        self.captured = torch.zeros(max_num_reqs, dtype=torch.bool, device=device)
        self._step = 0
        self._install(speculator)

    def _install(self, speculator) -> None:
        propose, sample_draft = speculator.propose, speculator.sample_draft

        def capture_proposal(*args, **kwargs):
            self._step = 0
            return propose(*args, **kwargs)

        def capture_draft_step(hidden_states, positions, idx_mapping, *args, **kwargs):
            states = idx_mapping.to(torch.int64)
            if self._step < self.num_positions:
                rows = hidden_states[:states.shape[0]]
                self.hidden[states, self._step] = rows.to(self.hidden.dtype)
                if self.logits is not None:
                    self.logits[states, self._step] = speculator.compute_draft_logits(rows, self._step).float()
                self.captured[states] = True
            self._step += 1
            return sample_draft(hidden_states, positions, idx_mapping, *args, **kwargs)

        speculator.propose = capture_proposal
        speculator.sample_draft = capture_draft_step

    def forget(self, state: int) -> None:
        """A new request took this state: nothing of it is captured yet."""
        self.captured[state] = False


class StateWeights:
    """The weight on the target of each request of a step: [R] (static weights only) or [R, K] (some head)."""

    def __init__(self, runner, settings: EngineSettings, heads: dict, counts_owner=None):
        device, max_num_reqs = runner.device, runner.max_num_reqs
        self.settings = settings
        self.head_names = list(heads)
        self.heads = [heads[name] for name in self.head_names]
        self.weight_by_state = torch.full((max_num_reqs,), settings.weight, dtype=torch.float32, device=device)
        self.head_by_state = torch.full((max_num_reqs,), NO_HEAD, dtype=torch.int64, device=device)
        self.fly_window_by_state = torch.full((max_num_reqs,), settings.fly.window, dtype=torch.int64, device=device)
        self.fly_threshold_by_state = torch.full((max_num_reqs,), settings.fly.threshold, dtype=torch.float32,
                                                 device=device)
        self.gate_margin_by_state = torch.full((max_num_reqs,), math.nan, dtype=torch.float32, device=device)
        self.gating = False  # whether any request was admitted with a gate: steps before it skip the gate's pass
        self.counts_owner = counts_owner  # the sampler, whose counts record tokens verified without their head
        self.target_hidden = None
        self.capture = None
        if self.heads:
            spec = runner.speculative_config
            self.capture = DraftCapture(
                runner.speculator, max_num_reqs, spec.num_speculative_tokens,
                spec.draft_model_config.get_hidden_size(), runner.vocab_size,
                any(head.wants_distributions for head in self.heads), device, runner.model_config.dtype)
            self._capture_target_hidden(runner)
        self._admit_through(runner.sampler)

    def _admit_through(self, sampler) -> None:
        add_request = sampler.add_request

        def admit(req_idx, sampling_params, *args, **kwargs):
            add_request(req_idx, sampling_params, *args, **kwargs)
            self.admit(req_idx, getattr(sampling_params, "extra_args", None))

        sampler.add_request = admit

    def _capture_target_hidden(self, runner) -> None:
        sample = runner.sample

        def capture_then_sample(hidden_states, input_batch, *args, **kwargs):
            self.target_hidden = hidden_states[input_batch.logits_indices]
            return sample(hidden_states, input_batch, *args, **kwargs)

        runner.sample = capture_then_sample

    def admit(self, state: int, extra_args) -> None:
        """Write a newly admitted request's choice into the tables (checked when it was admitted by the engine)."""
        request = request_settings(parse_request(extra_args, self.settings), self.settings)
        self.weight_by_state[state] = request.weight
        self.head_by_state[state] = NO_HEAD if request.head is None else self.head_names.index(request.head)
        self.fly_window_by_state[state] = request.fly_window
        self.fly_threshold_by_state[state] = request.fly_threshold
        self.gate_margin_by_state[state] = math.nan if request.gate_margin is None else request.gate_margin
        self.gating |= request.gate_margin is not None
        if self.capture is not None:
            self.capture.forget(state)

    def fly(self, states) -> dict:
        """The FLy arguments of the ops for these requests (a window of 0 leaves a request's verification as it is)."""
        return dict(fly_window=self.fly_window_by_state[states], fly_threshold=self.fly_threshold_by_state[states],
                    fly_top_k=self.settings.fly.top_k)

    def gate_margin(self, states):
        """[R] these requests' gate margins (NaN: not gated), or None while no request was ever admitted with one."""
        return self.gate_margin_by_state[states] if self.gating else None

    def __call__(self, states, num_draft, target_hidden_rows, target_logits, target_rows, draft_logits,
                 temperature):
        """``states`` [R] the requests' state slots, ``target_hidden_rows`` [R, K] the step-wide logits rows of their
        drafted positions, ``target_rows`` [R, K + 1] the same rows within ``target_logits`` (this chunk's rows)."""
        weight = self.weight_by_state[states]
        if not self.heads:
            return weight
        num_positions = target_hidden_rows.shape[1]
        head_of_row = self.head_by_state[states]
        head_weight = self._head_weights(states, target_hidden_rows, target_logits, target_rows[:, :num_positions],
                                         draft_logits, temperature, head_of_row)
        missing = (head_of_row != NO_HEAD) & ~self.capture.captured[states]
        if self.counts_owner is not None:
            self.counts_owner.counts.add_without_head(torch.where(missing, num_draft, 0))
        uses_head = (head_of_row != NO_HEAD) & ~missing
        return torch.where(uses_head[:, None], head_weight, weight[:, None].expand(-1, num_positions))

    def _head_weights(self, states, target_hidden_rows, target_logits, target_rows, draft_logits, temperature,
                      head_of_row):
        draft_hidden = self.capture.hidden[states]
        target_hidden = self.target_hidden[target_hidden_rows].to(draft_hidden.dtype)
        features = None
        if any(head.wants_distributions for head in self.heads):
            drafts = self.capture.logits if self.capture.logits is not None else draft_logits
            scale = distribution_temperature(temperature)[:, None, None]
            features = distribution_features(drafts[states].float() / scale,
                                             target_logits[target_rows].float())
        weight = torch.zeros(states.shape[0], target_rows.shape[1], dtype=torch.float32, device=states.device)
        with torch.no_grad():
            for index, head in enumerate(self.heads):
                inputs = (draft_hidden, target_hidden, features) if head.wants_distributions else (draft_hidden,
                                                                                                    target_hidden)
                weight = torch.where((head_of_row == index)[:, None], head(*inputs).float(), weight)
        return weight
