"""V2's own MTP speculators at the sampler, fed synthetic rows (no model here has MTP layers): ``MTPSpeculator`` (one
MTP module, drafted through the same target-dependent speculator as EAGLE) and ``MultiModuleMTPSpeculator`` (one
module, with its own LM head, per drafted position). Their ``sample_draft``, V2's own code run under Triton's
interpreter, turns each draft step's hidden states into drafts and writes the draft logits table, exactly as a draft
model's speculator does; the plugin's V2 sampler then reads those drafts and logits, and its head capture the MTP
hidden states (and, for greedy drafts, each position's own module's logits)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from v2_problems import Problem, emitted, fake_runner, samplers

NUM_POSITIONS, VOCAB, HIDDEN, MAX_REQUESTS = 3, 32, 8, 8
STATES = [5, 2, 7, 0]  # the requests' state slots, out of order as V2 hands them over
TEMPERATURES = [1.0, 0.7, 1.5, 0.0]  # by request; the last is greedy
SHARPNESS = 4.0  # draft distributions far from uniform, so a row read at the wrong place is rejected


def _speculator_classes():
    from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
    from vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator import MultiModuleMTPSpeculator

    return {"mtp": MTPSpeculator, "multi_module_mtp": MultiModuleMTPSpeculator}


class MTPModules:
    """Synthetic MTP modules' LM heads: position k's logits are ``hidden @ heads[k]`` (one shared head for a single
    MTP module, which V2 calls without the position)."""

    def __init__(self, multi_module: bool, generator):
        count = NUM_POSITIONS if multi_module else 1
        self.heads = [torch.randn(HIDDEN, VOCAB, generator=generator) for _ in range(count)]

    def compute_logits(self, hidden_states, spec_step_idx: int = 0):
        return hidden_states @ self.heads[spec_step_idx]


def _speculator(kind: str, probabilistic: bool, generator):
    """V2's MTP speculator of this kind with synthetic modules, built without an engine: only what ``sample_draft``
    reads is set (as ``DraftModelSpeculator.__init__`` sets it for an engine without watermarking or adaptive
    verification), and ``propose`` drives it one draft step a position with the step's hidden rows, as V2's do."""
    cls = _speculator_classes()[kind]
    speculator = object.__new__(cls)
    speculator.model = MTPModules(kind == "multi_module_mtp", generator)
    speculator.use_local_argmax_reduction = False
    speculator.draft_watermarker = None
    speculator.acceptance_estimator = None
    speculator.use_fp64_gumbel = False
    speculator.num_speculative_steps = NUM_POSITIONS
    speculator.draft_logits = torch.zeros(MAX_REQUESTS, NUM_POSITIONS, VOCAB) if probabilistic else None
    temperature, seeds = torch.zeros(MAX_REQUESTS), torch.zeros(MAX_REQUESTS, dtype=torch.int64)
    temperature[STATES] = torch.tensor(TEMPERATURES)
    seeds[STATES] = torch.arange(len(STATES)) + 11
    speculator.temperature, speculator.seeds = temperature, seeds
    speculator.hidden_by_step = [torch.randn(len(STATES), HIDDEN, generator=generator) * SHARPNESS / HIDDEN ** 0.5
                                 for _ in range(NUM_POSITIONS)]

    def propose(input_batch):
        idx_mapping = torch.as_tensor(input_batch.idx_mapping_np)
        step = torch.tensor(0)
        drafts = []
        for position, hidden in enumerate(speculator.hidden_by_step):
            step.fill_(position)
            extra = {"spec_step_idx": position} if kind == "multi_module_mtp" else {}
            drafts.append(speculator.sample_draft(hidden, torch.arange(len(STATES)) + 20 + position, idx_mapping,
                                                  temperature, seeds, step, speculator.draft_logits, **extra))
        return torch.stack(drafts, dim=1)

    speculator.propose = propose
    return speculator


def _batch():
    return SimpleNamespace(idx_mapping_np=np.array(STATES))


def _expected_logits(speculator, position: int) -> torch.Tensor:
    module = position if len(speculator.model.heads) > 1 else 0
    return speculator.model.compute_logits(speculator.hidden_by_step[position], module)


def _verification(speculator, drafts, draft_logits, target_logits) -> Problem:
    """The step V2's runner would hand its rejection sampler: each request's K + 1 target rows (``target_logits``
    [R, K + 1, V], already processed) and its drafts on rows 1..K."""
    requests = len(STATES)
    sampled = torch.zeros(requests, NUM_POSITIONS + 1, dtype=torch.int64)
    sampled[:, 1:] = drafts
    pos = torch.arange(requests * (NUM_POSITIONS + 1), dtype=torch.int64)
    return Problem(target_logits.reshape(-1, VOCAB), draft_logits, sampled.reshape(-1), pos, [NUM_POSITIONS] * requests,
                   list(STATES), NUM_POSITIONS)


def _sampler(speculator):
    """The plugin's V2 sampler over the speculator's temperature and seed tables, verifying exactly (w = 1)."""
    return samplers(NUM_POSITIONS, speculator.temperature, speculator.seeds, torch.ones(MAX_REQUESTS))[1]  # w = 1


@pytest.mark.parametrize("kind", ["mtp", "multi_module_mtp"])
def test_mtp_drafts_and_logits_reach_the_sampler_as_a_draft_models_do(kind):
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    cls = _speculator_classes()[kind]
    # the draft model's speculator and both MTP speculators sample their drafts with one function
    assert cls.sample_draft is StandaloneARSpeculator.sample_draft is DraftModelSpeculator.sample_draft
    speculator = _speculator(kind, probabilistic=True, generator=torch.Generator().manual_seed(1))
    drafts = speculator.propose(_batch())
    table = speculator.draft_logits
    for position in range(NUM_POSITIONS):  # the table holds each position's logits before temperature, by state
        torch.testing.assert_close(table[STATES, position], _expected_logits(speculator, position))
    greedy = TEMPERATURES.index(0.0)
    assert drafts[greedy].tolist() == [int(_expected_logits(speculator, position)[greedy].argmax())
                                       for position in range(NUM_POSITIONS)]

    # The target agreeing with the draft everywhere (p = the tempered table, the greedy request's argmax the
    # draft's): the plugin's exact verification of these drafts and this table keeps every draft.
    temperature = torch.tensor(TEMPERATURES)
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None, None]
    target = torch.zeros(len(STATES), NUM_POSITIONS + 1, VOCAB)
    target[:, :NUM_POSITIONS] = table[STATES] / scale
    problem = _verification(speculator, drafts, table, target)
    tokens = emitted(_sampler(speculator), problem)
    assert [row[:NUM_POSITIONS] for row in tokens] == drafts.tolist()
    # a target that disagrees (another request's rows) rejects some: the check above can fail
    other = torch.zeros_like(target)
    other[:, :NUM_POSITIONS] = table[STATES[1:] + STATES[:1]] / scale
    tokens = emitted(_sampler(speculator), _verification(speculator, drafts, table, other))
    assert sum(len(row) - 1 for row in tokens) < len(STATES) * NUM_POSITIONS


@pytest.mark.parametrize("kind", ["mtp", "multi_module_mtp"])
@pytest.mark.parametrize("probabilistic", [True, False], ids=["probabilistic", "greedy"])
def test_a_head_reads_the_mtp_hidden_states_and_each_positions_logits(kind, probabilistic):
    """The plugin's capture on V2's MTP speculator: each position's hidden rows by state, and for greedy drafts (no
    draft logits table) each position's logits from its own module, as a head reading distributions needs them."""
    from diversed_ext.vllm_plugin.settings import EngineSettings
    from diversed_ext.vllm_plugin.v2_state import StateWeights

    speculator = _speculator(kind, probabilistic, torch.Generator().manual_seed(2))
    head = SimpleNamespace(wants_distributions=True)
    runner = fake_runner(speculator, num_positions=NUM_POSITIONS, hidden=HIDDEN, vocab=VOCAB,
                         max_requests=MAX_REQUESTS)
    weights = StateWeights(runner, EngineSettings(weight=1.0, head_paths=("reads",)), {"reads": head})
    for state in STATES:
        runner.sampler.add_request(state, SimpleNamespace(extra_args={"diversed_head": "reads"}))
    speculator.propose(_batch())
    capture = weights.capture
    assert capture.captured[STATES].all() and int(capture.captured.sum()) == len(STATES)
    for position in range(NUM_POSITIONS):
        torch.testing.assert_close(capture.hidden[STATES, position], speculator.hidden_by_step[position])
        if probabilistic:  # the head reads V2's own table
            assert capture.logits is None
        else:
            torch.testing.assert_close(capture.logits[STATES, position], _expected_logits(speculator, position))
