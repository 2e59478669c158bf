"""Learned heads inside vLLM: the hidden states they read, captured from the runner, and their w per drafted token.

A head weighs drafted token i of a request from the draft's last hidden state that produced q_i, the target's that
produced p_i, and (for heads that read them) the distribution features of q_i and p_i. vLLM computes these at two
moments:

- the draft's, while proposing: the drafter calls ``_sample_draft_tokens(hidden_states, ...)`` once per draft
  position with exactly those hidden states, one row per request of the batch. The capture wraps that method on the
  runner's drafter and keeps, per request id, the K rows (and the draft's logits, which greedy drafting never
  materialises as probabilities), until the next step verifies them;
- the target's, in ``execute_model``: ``execute_model_state.sample_hidden_states`` holds one row per logits row, so
  the sampler's ``target_logits_indices`` index it. The capture reads it when ``sample_tokens`` starts.

Proposing for step t + 1 happens after step t's verification, so what a step verifies was always captured the step
before, keyed by request id: the rows of a batch may move between steps. Only the rows of requests that use a head
are kept (and their draft logits recomputed only where a head reads distributions): which rows those are is known on
the host when the proposal starts (:attr:`HiddenStateCapture.plan`), so a batch without head requests captures nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..head import load_head
from ..ops import distribution_features, position_rows


def load_heads(head_paths, draft_hidden: int, target_hidden: int, eagle3_drafter: bool = False) -> dict:
    """Each head loaded once, by the name the engine entry gave it, checked against the engine's hidden sizes (a head
    for other sizes is refused); ``"default"`` with an EAGLE-3 drafter (``eagle3_drafter``) is the default head
    trained on such a drafter's states."""
    return {path: load_head(path, draft_hidden=draft_hidden, target_hidden=target_hidden,
                            eagle3_drafter=eagle3_drafter) for path in head_paths}


class HiddenStateCapture:
    """What the heads read, captured from one runner and its drafter (see the module docstring)."""

    def __init__(self, runner, keep_draft_logits: bool):
        self.runner = runner
        self.keep_draft_logits = keep_draft_logits  # only heads that read distribution features need them
        self.target_hidden: Optional[torch.Tensor] = None  # [N + B, H] this step, in vLLM's logits row order
        # the last proposal: draft hidden states [P, K, H] and logits [P, K, V] (or None), by the row each request
        # had in the batch that proposed them (rows move between steps, so requests are found by id)
        self.hidden: Optional[torch.Tensor] = None
        self.logits: Optional[torch.Tensor] = None
        self.row_of: dict = {}
        self._proposing: list = []  # per draft position: (hidden [M, H], logits [M, V] or None) of the propose
        # request ids of the proposing batch, in row order -> (the rows to keep, whether their draft logits are read);
        # set by the weights (every row, logits as keep_draft_logits says, until then)
        self.plan = lambda request_ids: (list(range(len(request_ids))), keep_draft_logits)
        self._rows: Optional[torch.Tensor] = None  # this proposal's kept rows on the device; None: keep none
        self._logits = False
        self._request_ids: list = []
        self._install()

    def _install(self) -> None:
        runner, drafter = self.runner, self.runner.drafter
        sample_tokens, propose, sample_draft = runner.sample_tokens, drafter.propose, drafter._sample_draft_tokens

        def capture_target_then_sample(*args, **kwargs):
            state = runner.execute_model_state
            self.target_hidden = None if state is None else state.sample_hidden_states
            return sample_tokens(*args, **kwargs)

        def capture_proposal(*args, **kwargs):
            self._start_proposal()
            try:
                return propose(*args, **kwargs)
            finally:
                self._commit_proposal()

        def capture_draft_position(hidden_states, sampling_metadata):
            if self._rows is not None:
                kept = hidden_states.detach()[self._rows]
                # greedy drafting never materialises the draft's logits outside the drafter: recompute them here,
                # once, for the kept rows
                logits = drafter.model.compute_logits(kept).detach() if self._logits else None
                self._proposing.append((kept, logits))
            return sample_draft(hidden_states, sampling_metadata)

        runner.sample_tokens = capture_target_then_sample
        drafter.propose = capture_proposal
        drafter._sample_draft_tokens = capture_draft_position

    def _start_proposal(self) -> None:
        """Which rows of the proposing batch to keep, decided on the host from its request ids."""
        self._proposing = []
        self._request_ids = list(self.runner.input_batch.req_ids)
        rows, self._logits = self.plan(self._request_ids)
        self._request_ids = [self._request_ids[row] for row in rows]
        self._rows = torch.tensor(rows, dtype=torch.int64, device=self.runner.device) if rows else None
        self._logits = bool(rows) and self._logits and self.keep_draft_logits

    def _commit_proposal(self) -> None:
        self.row_of = {}
        if not self._proposing:
            return
        self.hidden = torch.stack([position[0] for position in self._proposing], dim=1)
        self.logits = torch.stack([position[1] for position in self._proposing], dim=1) if self._logits else None
        self.row_of = {request_id: row for row, request_id in enumerate(self._request_ids)}
        self._proposing = []


def head_weights(head, capture: HiddenStateCapture, proposal_rows: torch.Tensor, target_index: torch.Tensor,
                 target_logits: torch.Tensor, logits_rows: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """w [M, K] for M requests' drafted tokens, in one call of the head. ``proposal_rows`` [M] are the requests' rows
    in the captured proposal, ``target_index`` [M, K] their drafted positions' rows in ``target_logits`` ([N, V]
    after temperature, top-k and top-p), ``logits_rows`` [N] the step's logits row of each target row (the target
    hidden states' index), ``temperature`` [M] the requests' temperatures (0: greedy)."""
    width = target_index.shape[1]
    draft_hidden = capture.hidden[proposal_rows, :width]
    target_hidden = capture.target_hidden[logits_rows[target_index]].to(draft_hidden.dtype)
    inputs = [draft_hidden, target_hidden]
    if head.wants_distributions:
        inputs.append(drafted_features(capture.logits, proposal_rows, target_logits, target_index, temperature))
    with torch.no_grad():
        return head(*inputs).reshape(target_index.shape).float()


def drafted_features(draft_table: torch.Tensor, table_slots: torch.Tensor, target_logits: torch.Tensor,
                     target_rows: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The distribution features [M, K, 5] of M requests' K drafted positions, every row read where it lies (no gather,
    no copy, no host sync): the draft's raw logits at slots ``table_slots`` [M] of ``draft_table`` [S, Kd, V] (Kd >= K,
    read through :func:`diversed_ext.ops.position_rows`), taken at the requests' ``temperature`` [M] (0: greedy, taken
    at 1), beside the target's rows ``target_rows`` [M, K] of ``target_logits`` [N, V], which vLLM has divided by that
    temperature already."""
    draft_logits, draft_rows = position_rows(draft_table, target_rows.shape[1], table_slots)
    return distribution_features(draft_logits, target_logits, temperature=temperature, target_temperature=1.0,
                                 target_rows=target_rows, draft_rows=draft_rows, check_inputs=False)
