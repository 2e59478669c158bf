"""Verification problems in vLLM V2's layout, and V2's own rejection sampler beside the plugin's on the same inputs.

V2's ``RejectionSampler._verify`` is called directly: its sampler's sampling parameters are an identity here (the
logits given are the processed ones), and the per-request temperature and seed tables are the sampler's, indexed by
request state as V2 indexes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch


class IdentitySampler:
    """What V2's rejection sampler reads of its Sampler: the state tables, and sampling parameters (none here)."""

    logprobs_mode = "raw_logprobs"
    return_sampling_mask = False
    use_fp64_gumbel = False

    def __init__(self, temperature: torch.Tensor, seeds: torch.Tensor):
        self.sampling_states = SimpleNamespace(temperature=SimpleNamespace(gpu=temperature),
                                               seeds=SimpleNamespace(gpu=seeds))

    def apply_sampling_params(self, logits, *args, **kwargs):
        return logits


def spec_config(num_positions: int):
    return SimpleNamespace(num_speculative_tokens=num_positions, enable_adaptive_verification=False,
                           rejection_sample_method="standard", synthetic_acceptance_rates=None,
                           fly_window_size=None, fly_entropy_threshold=0.3, fly_entropy_top_k=3)


class TableWeights:
    """A weight per request state, as the plugin's tables give it."""

    def __init__(self, weight_by_state: torch.Tensor):
        self.weight_by_state = weight_by_state
        self.fly_window, self.fly_threshold = 0, 0.3  # FLy off unless a test sets a window
        self.gate_margin_by_state = None  # no gate unless a test sets margins
        self.settings = SimpleNamespace(weight=1.0, head=None, head_paths=())

    def __call__(self, states, states_np, *args):
        return self.weight_by_state[states]

    def fly(self, states) -> dict:
        return dict(fly_window=self.fly_window, fly_threshold=self.fly_threshold, fly_top_k=3)

    def gate(self, states, states_np):
        """(the gated requests' positions, their margins), as the plugin's tables give them; None: none gated."""
        if self.gate_margin_by_state is None:
            return None
        margins = self.gate_margin_by_state[states]
        rows = np.flatnonzero(~np.isnan(margins.numpy()))
        return (rows, margins[torch.as_tensor(rows)]) if rows.size else None


@dataclass
class Problem:
    """A step of R requests: request r has ``num_draft[r]`` drafts and ``num_draft[r] + 1`` logits rows."""

    target_logits: torch.Tensor  # [num_logits, V]
    draft_logits: torch.Tensor | None  # [max_num_reqs, K, V]
    draft_sampled: torch.Tensor  # [num_logits]: row j + 1 of a request holds its draft j
    pos: torch.Tensor  # [num_logits]
    num_draft: list
    states: list  # request state of each request
    num_positions: int

    def verify_arguments(self) -> tuple:
        counts = [n + 1 for n in self.num_draft]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
        idx_mapping = torch.tensor(self.states, dtype=torch.int32)
        expanded = idx_mapping.repeat_interleave(torch.tensor(counts))
        local = torch.cat([torch.arange(count, dtype=torch.int32) for count in counts])
        return (self.target_logits, self.draft_logits, self.draft_sampled, self.pos, cu, idx_mapping,
                idx_mapping.numpy(), expanded, local, np.zeros(len(counts), dtype=np.int64), self.draft_sampled)

    def request(self, index: int) -> "Problem":
        """Request ``index`` alone, at the same state and positions."""
        starts = np.concatenate([[0], np.cumsum([n + 1 for n in self.num_draft])])
        rows = slice(int(starts[index]), int(starts[index + 1]))
        return Problem(self.target_logits[rows], self.draft_logits, self.draft_sampled[rows], self.pos[rows],
                       [self.num_draft[index]], [self.states[index]], self.num_positions)


def make_problem(num_draft: list, vocab: int, *, num_positions: int, max_num_reqs: int = 8, draft_logits=True,
                 generator=None, states=None, sharpness: float = 2.0, drafts_from=None) -> Problem:
    """Random logits; drafts drawn from the draft's softmax (or the argmax of ``drafts_from`` rows)."""
    generator = generator or torch.Generator().manual_seed(0)
    num_logits = sum(n + 1 for n in num_draft)
    states = list(range(len(num_draft))) if states is None else states
    target = torch.randn(num_logits, vocab, generator=generator) * sharpness
    draft = torch.randn(max_num_reqs, num_positions, vocab, generator=generator) * sharpness
    sampled = torch.zeros(num_logits, dtype=torch.int64)
    pos = torch.zeros(num_logits, dtype=torch.int64)
    row = 0
    for request, count in enumerate(num_draft):
        pos[row:row + count + 1] = torch.arange(count + 1) + 10 * request + 7
        for position in range(count):
            probs = torch.softmax(draft[states[request], position], -1)
            sampled[row + 1 + position] = torch.multinomial(probs, 1, generator=generator)[0]
        row += count + 1
    return Problem(target, draft if draft_logits else None, sampled, pos, list(num_draft), states, num_positions)


def samplers(num_positions: int, temperature: torch.Tensor, seeds: torch.Tensor, weight_by_state: torch.Tensor):
    """(V2's own rejection sampler, the plugin's) over the same sampler state."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    from diversed_ext.vllm_plugin.v2_sampler import DiversedV2RejectionSampler

    sampler = IdentitySampler(temperature, seeds)
    device = torch.device("cpu")
    own = RejectionSampler(sampler, spec_config(num_positions), device)
    ours = DiversedV2RejectionSampler(sampler, spec_config(num_positions), device)
    return own, ours.bind(TableWeights(weight_by_state), device)


def emitted(sampler, problem: Problem) -> list:
    """Each request's emitted tokens: the kept drafts, then the correction or bonus token."""
    _, sampled, num_sampled = sampler._verify(*problem.verify_arguments())
    return [sampled[row, :int(count)].tolist() for row, count in enumerate(num_sampled)]


def fake_runner(speculator, *, num_positions: int, hidden: int, vocab: int, max_requests: int) -> SimpleNamespace:
    """What the plugin's V2 state reads of a model runner (device, sizes, speculative config, speculator, sampler),
    around ``speculator``, for tests that drive the state without an engine."""
    spec = SimpleNamespace(num_speculative_tokens=num_positions,
                           draft_model_config=SimpleNamespace(get_hidden_size=lambda: hidden))
    return SimpleNamespace(device=torch.device("cpu"), max_num_reqs=max_requests, speculative_config=spec,
                           speculator=speculator, vocab_size=vocab, model_config=SimpleNamespace(dtype=torch.float32),
                           sample=lambda hidden_states, input_batch: None,
                           sampler=SimpleNamespace(add_request=lambda req_idx, params: None))
