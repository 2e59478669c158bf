"""Per-request weights and learned heads on vLLM's V2 model runner, kept in tables indexed by request state.

V2 keeps no sampling parameters per step: it reads them once, when it admits a request into a state slot
(``Sampler.add_request(req_idx, sampling_params)``), into tables that its kernels index with ``idx_mapping``. The
weights do the same: on admission a request's choice (``diversed_weight``, ``diversed_head`` or the engine default)
is written into a weight table, a head table, FLy's window and threshold tables and a gate margin table, and each step
reads them with the step's ``idx_mapping``, so the weights path has no host sync and no Python loop over requests.
The head and gate choices are also kept on the host, by state, so that each step knows from its ``idx_mapping_np``
which of its requests use a head or the gate: nothing is computed for the others, and a step none of whose requests
uses either costs what a step of static weights costs.

A head weighs drafted token i of a request from the draft's hidden state that produced q_i, the target's that
produced p_i, and (for heads that read them) the distribution features of q_i and p_i:

- the draft's are captured while V2 proposes: its speculator calls ``sample_draft(hidden_states, positions,
  idx_mapping, ...)`` once per draft step with exactly those hidden states, one row per request; they are written into
  a ``[max_num_reqs, K, H]`` table at the requests' states (and the draft's logits beside them when the drafter
  samples greedily and a head reads distributions);
- the target's are captured when V2 samples: ``sample(hidden_states, input_batch, ...)`` gathers them at
  ``input_batch.logits_indices``, one per logits row.

Only the rows of requests that use a head are captured (the draft's logits only where the head reads distributions);
each head runs once per step over the requests that chose it, and its w replaces their static weight. A head request
whose drafts were not captured is verified at the engine's static weight and counted (``verified_without_head`` in
``diversed_status``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .heads import drafted_features
from .settings import EngineSettings, parse_request, request_settings

NO_HEAD = -1
ALL_ROWS = "all"  # a proposal whose states the host does not know keeps every row


class DraftCapture:
    """The draft's hidden states (and logits, when needed) of head requests' last proposal, by request state.
    ``plan(states_np)`` says, for the states of a proposing batch, which rows to keep and which of them need the
    draft's logits (two numpy arrays of row positions)."""

    def __init__(self, speculator, max_num_reqs: int, num_positions: int, hidden_size: int, vocab_size: int,
                 keep_logits: bool, device, dtype, plan):
        self.num_positions = num_positions
        self.plan = plan
        self.device = device
        self._rows = self._logit_rows = None  # this proposal's kept rows, on the device (None: none)
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
            input_batch = kwargs.get("input_batch", args[0] if args else None)
            self._plan_rows(getattr(input_batch, "idx_mapping_np", None))
            return propose(*args, **kwargs)

        def capture_draft_step(hidden_states, positions, idx_mapping, *args, **kwargs):
            if self._rows is ALL_ROWS:  # the proposal's states were not known on the host: keep every row
                self._rows = torch.arange(idx_mapping.shape[0], device=self.device)
                self._logit_rows = self._rows if self.logits is not None else None
            if self._step < self.num_positions and self._rows is not None:
                states = idx_mapping.to(torch.int64)
                self.hidden[states[self._rows], self._step] = hidden_states[self._rows].to(self.hidden.dtype)
                if self._logit_rows is not None:
                    self.logits[states[self._logit_rows], self._step] = speculator.compute_draft_logits(
                        hidden_states[self._logit_rows], self._step).float()
                self.captured[states[self._rows]] = True
            self._step += 1
            return sample_draft(hidden_states, positions, idx_mapping, *args, **kwargs)

        speculator.propose = capture_proposal
        speculator.sample_draft = capture_draft_step

    def _plan_rows(self, states_np) -> None:
        """The rows this proposal keeps, from the host's view of its states (every row where it has none)."""
        if states_np is None:
            self._rows = ALL_ROWS
            return
        rows, logit_rows = self.plan(states_np)
        self._rows = torch.as_tensor(rows, device=self.device) if len(rows) else None
        keep_logits = self.logits is not None and len(logit_rows)
        self._logit_rows = torch.as_tensor(logit_rows, device=self.device) if keep_logits else None

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
        self.fly_window_by_state = torch.full((max_num_reqs,), settings.fly.window, dtype=torch.int64, device=device)
        self.fly_threshold_by_state = torch.full((max_num_reqs,), settings.fly.threshold, dtype=torch.float32,
                                                 device=device)
        self.gate_margin_by_state = torch.full((max_num_reqs,), math.nan, dtype=torch.float32, device=device)
        # On the host, by state: each request's head (NO_HEAD: none) and whether it is gated, read with a step's
        # idx_mapping_np to pick the rows that need either
        self.head_by_state = np.full(max_num_reqs, NO_HEAD, dtype=np.int64)
        self.gated_by_state = np.zeros(max_num_reqs, dtype=bool)
        self.reads_distributions = np.array([head.wants_distributions for head in self.heads], dtype=bool)
        self.counts_owner = counts_owner  # the sampler, whose counts record tokens verified without their head
        self.device = device
        self.target_hidden = None
        self.capture = None
        if self.heads:
            spec = runner.speculative_config
            self.capture = DraftCapture(
                runner.speculator, max_num_reqs, spec.num_speculative_tokens,
                spec.draft_model_config.get_hidden_size(), runner.vocab_size, bool(self.reads_distributions.any()),
                device, runner.model_config.dtype, self.capture_plan)
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
            uses_head = (self.head_by_state[input_batch.idx_mapping_np] != NO_HEAD).any()
            self.target_hidden = hidden_states[input_batch.logits_indices] if uses_head else None
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
        self.gated_by_state[state] = request.gate_margin is not None
        if self.capture is not None:
            self.capture.forget(state)

    def capture_plan(self, states_np) -> tuple:
        """(the rows of a proposing batch whose requests use a head, those of them whose head reads the draft's
        distributions), as numpy arrays of row positions."""
        heads = self.head_by_state[states_np]
        rows = np.flatnonzero(heads != NO_HEAD)
        return rows, rows[self.reads_distributions[heads[rows]]]

    def fly(self, states) -> dict:
        """The FLy arguments of the ops for these requests (a window of 0 leaves a request's verification as it is)."""
        return dict(fly_window=self.fly_window_by_state[states], fly_threshold=self.fly_threshold_by_state[states],
                    fly_top_k=self.settings.fly.top_k)

    def gate(self, states, states_np):
        """(the positions of this chunk's gated requests, a numpy array, and their margins [G]), or None when none of
        its requests is gated."""
        rows = np.flatnonzero(self.gated_by_state[states_np])
        if not rows.size:
            return None
        return rows, self.gate_margin_by_state[states[torch.as_tensor(rows, device=self.device)]]

    def __call__(self, states, states_np, num_draft, target_hidden_rows, target_logits, target_rows, draft_logits,
                 temperature):
        """``states`` [R] the requests' state slots (``states_np`` the same on the host), ``target_hidden_rows``
        [R, K] the step-wide logits rows of their drafted positions, ``target_rows`` [R, K + 1] the same rows within
        ``target_logits`` (this chunk's rows). Heads run on the rows of the requests that chose them only."""
        weight = self.weight_by_state[states]
        heads = self.head_by_state[states_np] if self.heads else None
        if heads is None or (heads == NO_HEAD).all():
            return weight
        num_positions = target_hidden_rows.shape[1]
        weight = weight[:, None].repeat(1, num_positions)
        for index in np.unique(heads[heads != NO_HEAD]):
            rows = torch.as_tensor(np.flatnonzero(heads == index), device=self.device)
            head_weight = self._head_weights(self.heads[index], states[rows], target_hidden_rows[rows], target_logits,
                                             target_rows[rows, :num_positions], draft_logits, temperature[rows])
            captured = self.capture.captured[states[rows]]
            if self.counts_owner is not None:
                self.counts_owner.counts.add_without_head(torch.where(captured, 0, num_draft[rows]))
            weight[rows] = torch.where(captured[:, None], head_weight, weight[rows])
        return weight

    def _head_weights(self, head, states, target_hidden_rows, target_logits, target_rows, draft_logits, temperature):
        """One head's w [M, K] for M requests (an uncaptured request's rows hold what the table last held there)."""
        draft_hidden = self.capture.hidden[states]
        inputs = [draft_hidden, self.target_hidden[target_hidden_rows].to(draft_hidden.dtype)]
        if head.wants_distributions:
            drafts = self.capture.logits if self.capture.logits is not None else draft_logits
            inputs.append(drafted_features(drafts, states, target_logits, target_rows, temperature))
        with torch.no_grad():
            return head(*inputs).reshape(target_rows.shape).float()
