"""The V2 weight tables without an engine: on a runner that loaded a head, nothing is computed for requests that did
not ask for one (no head runs, no draft row is captured, no gate pass), which the host knows from the states of the
step; the rows of requests that did ask get their head's w and are captured alone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from diversed_ext.vllm_plugin.settings import EngineSettings
from diversed_ext.vllm_plugin.v2_state import StateWeights
from v2_problems import fake_runner

NUM_POSITIONS, HIDDEN, VOCAB, MAX_REQUESTS = 3, 4, 11, 6


class CountingHead:
    """A head that records the rows it ran on and weighs every token 0.25."""

    def __init__(self, wants_distributions: bool):
        self.wants_distributions = wants_distributions
        self.calls = []

    def __call__(self, draft_hidden, target_hidden, *features):
        self.calls.append((draft_hidden.shape[0], len(features)))
        return torch.full(draft_hidden.shape[:2], 0.25)


class Speculator:
    """What the capture wraps: propose (one draft step per position) and sample_draft, with logits on request."""

    draft_logits = None

    def __init__(self):
        self.logit_rows = []

    def compute_draft_logits(self, hidden, step):
        self.logit_rows.append(hidden.shape[0])
        return torch.zeros(hidden.shape[0], VOCAB)

    def sample_draft(self, hidden_states, positions, idx_mapping, *args):
        return torch.zeros(hidden_states.shape[0], dtype=torch.int64)

    def propose(self, input_batch):
        hidden = torch.arange(len(input_batch.idx_mapping_np) * HIDDEN, dtype=torch.float32).reshape(-1, HIDDEN)
        for _ in range(NUM_POSITIONS):
            self.sample_draft(hidden, None, torch.as_tensor(input_batch.idx_mapping_np))


def _weights(heads: dict):
    speculator = Speculator()
    runner = fake_runner(speculator, num_positions=NUM_POSITIONS, hidden=HIDDEN, vocab=VOCAB,
                         max_requests=MAX_REQUESTS)
    settings = EngineSettings(weight=0.5, head_paths=tuple(heads))
    return StateWeights(runner, settings, heads), runner


def _admit(runner, state: int, extra_args):
    runner.sampler.add_request(state, SimpleNamespace(extra_args=extra_args))


def _step(weights, runner, states: list):
    """Propose for these states, sample (the target's hidden states), then ask for the step's weights."""
    states_np = np.array(states)
    batch = SimpleNamespace(idx_mapping_np=states_np, logits_indices=torch.arange(len(states) * (NUM_POSITIONS + 1)))
    runner.speculator.propose(batch)
    runner.sample(torch.ones(len(states) * (NUM_POSITIONS + 1), HIDDEN), batch)
    rows = torch.arange(len(states) * (NUM_POSITIONS + 1)).reshape(len(states), -1)
    target_logits = torch.zeros(rows.numel(), VOCAB)
    states_t = torch.as_tensor(states_np)
    return weights(states_t, states_np, torch.full((len(states),), NUM_POSITIONS), rows[:, :NUM_POSITIONS],
                   target_logits, rows, None, torch.ones(len(states))), weights.gate(states_t, states_np)


def test_a_loaded_head_nobody_asked_for_costs_nothing():
    head = CountingHead(wants_distributions=True)
    weights, runner = _weights({"default": head})
    for state, extra_args in enumerate([None, {"diversed_weight": 0.2}, None]):
        _admit(runner, state, extra_args)
    weight, gate = _step(weights, runner, [0, 1, 2])
    assert weight.shape == (3,) and weight.tolist() == [0.5, np.float32(0.2), 0.5]
    assert gate is None and head.calls == [] and runner.speculator.logit_rows == []
    assert not weights.capture.captured.any() and weights.target_hidden is None


def test_heads_and_the_gate_run_on_their_requests_rows_only():
    reads, hidden_only = CountingHead(wants_distributions=True), CountingHead(wants_distributions=False)
    weights, runner = _weights({"reads": reads, "hidden": hidden_only})
    admitted = [None, {"diversed_head": "hidden"}, {"diversed_gate_margin": 2.0}, {"diversed_head": "reads"}, None]
    for state, extra_args in enumerate(admitted):
        _admit(runner, state, extra_args)
    weight, gate = _step(weights, runner, [4, 3, 2, 1, 0])
    assert reads.calls == [(1, 1)] and hidden_only.calls == [(1, 0)]  # one row each; features for "reads" only
    assert runner.speculator.logit_rows == [1] * NUM_POSITIONS  # draft logits recomputed for the reading row only
    assert weights.capture.captured.tolist() == [False, True, False, True, False, False]
    assert weight.tolist() == [[0.5] * 3, [0.25] * 3, [0.5] * 3, [0.25] * 3, [0.5] * 3]
    assert gate[0].tolist() == [2] and gate[1].tolist() == [2.0]
    _admit(runner, 2, None)  # a new request in the gated one's state: no gate any more
    assert _step(weights, runner, [4, 3, 2, 1, 0])[1] is None
