"""The plugin's V2 rejection sampler against V2's own, on the same rows (run under Triton's interpreter on the CPU).

V2's own sampler is the oracle of exact verification (w = 1); the plugin must equal it where both are deterministic
(greedy rows), follow the same law where they sample, and move acceptance as DIVERSED says where w < 1.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats
from v2_problems import Problem, emitted, make_problem, samplers

ALPHA = 1e-3  # per test; the seeds are fixed, so each test is deterministic
LAW_REQUESTS = 600  # V2's own sampler takes about 25 ms a request under the interpreter
VOCAB = 8


def _replicated(num_requests: int, num_positions: int, *, draft_logits: bool, seed: int = 0) -> Problem:
    """One request's rows repeated, each copy with its own state (so its own seed) and its own drafts drawn from
    the draft's distribution."""
    generator = torch.Generator().manual_seed(seed)
    base = make_problem([num_positions], VOCAB, num_positions=num_positions, max_num_reqs=1, generator=generator)
    draft = base.draft_logits[:1].expand(num_requests, -1, -1).contiguous()
    q = torch.softmax(draft[0], -1)
    sampled = base.draft_sampled.repeat(num_requests).view(num_requests, -1).clone()
    for position in range(num_positions):
        sampled[:, position + 1] = torch.multinomial(q[position], num_requests, replacement=True,
                                                     generator=generator)
    return Problem(base.target_logits.repeat(num_requests, 1), draft if draft_logits else None,
                   sampled.reshape(-1), base.pos.repeat(num_requests), [num_positions] * num_requests,
                   list(range(num_requests)), num_positions)


def _tables(num_states: int, *, temperature: float = 1.0, weight: float = 1.0):
    return (torch.full((num_states,), temperature), torch.arange(num_states, dtype=torch.int64) * 7919 + 1,
            torch.full((num_states,), weight))


@pytest.mark.parametrize("draft_logits", [True, False], ids=["probabilistic", "tokens-only"])
def test_greedy_rows_equal_v2s_own_at_weight_one(draft_logits):
    generator = torch.Generator().manual_seed(1)
    problem = make_problem([3, 0, 2, 3, 1], 97, num_positions=3, draft_logits=draft_logits, generator=generator,
                           sharpness=1.0)
    # make some drafts the target's argmax, so greedy rows keep a few
    problem.draft_sampled[1] = problem.target_logits[0].argmax()
    problem.draft_sampled[7] = problem.target_logits[6].argmax()
    own, ours = samplers(3, *_tables(8, temperature=0.0))
    assert emitted(ours, problem) == emitted(own, problem)


def _first_token_counts(sampler, problem: Problem) -> np.ndarray:
    return np.bincount([tokens[0] for tokens in emitted(sampler, problem)], minlength=VOCAB)


@pytest.mark.parametrize("draft_logits", [True, False], ids=["probabilistic", "tokens-only"])
def test_the_law_at_weight_one_is_v2s_own(draft_logits):
    """The first emitted token follows the target's p_1 under both samplers, and their counts agree."""
    problem = _replicated(LAW_REQUESTS, 2, draft_logits=draft_logits)
    own, ours = samplers(2, *_tables(LAW_REQUESTS))
    ours_counts, own_counts = _first_token_counts(ours, problem), _first_token_counts(own, problem)
    p = torch.softmax(problem.target_logits[0].double(), -1).numpy()
    for counts in (ours_counts, own_counts):
        keep = p * LAW_REQUESTS >= 5
        expected = np.append(p[keep], p[~keep].sum()) * LAW_REQUESTS
        observed = np.append(counts[keep], counts[~keep].sum())
        assert stats.chisquare(observed, expected).pvalue > ALPHA, (observed, expected)
    table = np.stack([ours_counts, own_counts])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > ALPHA, table


def test_acceptance_rises_as_the_weight_falls_and_matches_one_minus_w_tv():
    """With the draft's distributions given, the first draft is kept with probability 1 - w TV(p_1, q_1)."""
    num_requests = 4000
    problem = _replicated(num_requests, 1, draft_logits=True, seed=3)
    p = torch.softmax(problem.target_logits[0].double(), -1)
    q = torch.softmax(problem.draft_logits[0, 0].double(), -1)
    total_variation = 0.5 * (p - q).abs().sum().item()
    rates = []
    for weight in (1.0, 0.6, 0.2, 0.0):
        _, ours = samplers(1, *_tables(num_requests, weight=weight))
        kept = sum(len(tokens) - 1 for tokens in emitted(ours, problem))
        expected = 1 - weight * total_variation
        bound = 4 * np.sqrt(max(expected * (1 - expected), 1e-12) / num_requests) + 1e-9
        assert abs(kept / num_requests - expected) <= bound, (weight, kept / num_requests, expected)
        rates.append(kept / num_requests)
    assert rates == sorted(rates) and rates[-1] == 1.0, rates


@pytest.mark.parametrize("draft_logits", [True, False], ids=["probabilistic", "tokens-only"])
def test_a_mixed_batch_equals_its_rows_alone(draft_logits):
    """Greedy and sampled requests, ragged drafts, different weights and states: each request's tokens are the same
    alone as in the batch (its seed and positions, not its neighbours, decide them)."""
    generator = torch.Generator().manual_seed(5)
    problem = make_problem([3, 0, 2, 3, 1], 41, num_positions=3, draft_logits=draft_logits, generator=generator,
                           states=[4, 0, 6, 2, 5], sharpness=1.0)
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.0, 0.9, 1.0])
    weight = torch.tensor([1.0, 0.2, 0.5, 0.0, 0.8, 1.0, 0.3, 1.0])
    seeds = torch.arange(8, dtype=torch.int64) * 104729 + 3
    _, ours = samplers(3, temperature, seeds, weight)
    together = emitted(ours, problem)
    alone = [emitted(ours, problem.request(index))[0] for index in range(len(problem.num_draft))]
    assert together == alone
    # and the draws move with the seed
    _, reseeded = samplers(3, temperature, seeds + 1, weight)
    assert emitted(reseeded, problem) != together


def test_the_counts_add_up():
    generator = torch.Generator().manual_seed(2)
    problem = make_problem([3, 1, 0], 23, num_positions=3, generator=generator)
    _, ours = samplers(3, *_tables(8, weight=0.0))
    tokens = emitted(ours, problem)
    counts = ours.status()
    assert counts["drafted"] == 4 and counts["accepted"] == 4 and counts["weight_sum"] == 0.0
    assert [len(row) for row in tokens] == [4, 2, 1]
    assert counts["verified_without_head"] == 0


def test_draft_logits_in_another_dtype_than_the_target_rows():
    """V2 keeps draft logits in the model's dtype while its sampling parameters make target rows float32: the
    plugin has the op read the bfloat16 table where it lies, which equals a float32 table holding the same values."""
    generator = torch.Generator().manual_seed(9)
    problem = make_problem([3, 2, 3], 29, num_positions=3, generator=generator, sharpness=1.0)
    problem.draft_logits = problem.draft_logits.to(torch.bfloat16)
    as_float = Problem(problem.target_logits, problem.draft_logits.float(), problem.draft_sampled, problem.pos,
                       problem.num_draft, problem.states, problem.num_positions)
    _, ours = samplers(3, *_tables(8, weight=0.7))
    assert emitted(ours, problem) == emitted(ours, as_float)


def test_the_token_after_the_kept_drafts_is_v2s_own_sample():
    """A request without drafts, and one whose drafts are all kept (w = 0), end with the token V2's own sampler draws
    at that row (its seed and position), so a request's tokens do not depend on whether its batch drafted."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    generator = torch.Generator().manual_seed(4)
    problem = make_problem([0, 3, 0, 2], 53, num_positions=3, generator=generator, sharpness=1.0)
    temperature, seeds, weight = _tables(8, weight=0.0)
    temperature[2] = 0.0  # a greedy request among them
    _, ours = samplers(3, temperature, seeds, weight)
    bonus_rows = torch.tensor([0, 4, 5, 8])
    states = torch.tensor(problem.states)
    expected = gumbel_sample(problem.target_logits[bonus_rows], states, temperature, seeds, problem.pos[bonus_rows],
                             apply_temperature=False, is_drafting=False)
    tokens = emitted(ours, problem)
    assert [len(row) for row in tokens] == [1, 4, 1, 3]
    assert [row[-1] for row in tokens] == expected.tolist()
    own, _ = samplers(3, temperature, seeds, weight)
    without_drafts = Problem(problem.target_logits[[0, 5]], None, problem.draft_sampled[[0, 5]], problem.pos[[0, 5]],
                             [0, 0], [0, 2], 3)
    assert emitted(own, without_drafts) == [[tokens[0][0]], [tokens[2][0]]]


def test_fly_only_extends_what_the_same_draws_keep():
    """FLy's deferral flips rejections into acceptances and nothing else: with the same seeds, every request keeps at
    least the drafts it kept without FLy, and at threshold 0 with a window of 1 some request keeps more."""
    generator = torch.Generator().manual_seed(8)
    problem = make_problem([3] * 8, 31, num_positions=3, generator=generator, sharpness=2.0)
    _, plain = samplers(3, *_tables(8))
    _, fly = samplers(3, *_tables(8))
    fly.weight_source.fly_window, fly.weight_source.fly_threshold = 1, 0.0
    without, with_fly = emitted(plain, problem), emitted(fly, problem)
    kept = [(len(a) - 1, len(b) - 1) for a, b in zip(without, with_fly)]
    assert all(after >= before for before, after in kept) and sum(b for _, b in kept) > sum(a for a, _ in kept)
    for before, after in zip(without, with_fly):
        assert after[:len(before) - 1] == before[:-1]  # the drafts kept without FLy are kept with it


def _gate_keeps(problem: Problem, margin: float) -> list:
    """Each request's drafts the gate keeps outright, from the problem's rows at temperature 1 (the oracle)."""
    from diversed_ext.ops import gate_keeps

    keeps, row = [], 0
    for request, count in enumerate(problem.num_draft):
        tokens = problem.draft_sampled[row + 1:row + 1 + count]
        log_p = torch.log_softmax(problem.target_logits[row:row + count].float(), -1)
        q = None
        if problem.draft_logits is not None:
            q = torch.softmax(problem.draft_logits[problem.states[request], :count].float(), -1)
        keeps.append(gate_keeps(margin, tokens, q, log_p).tolist())
        row += count + 1
    return keeps


@pytest.mark.parametrize("draft_logits", [True, False], ids=["probabilistic", "tokens-only"])
def test_the_gate_keeps_what_it_says_and_only_turns_rejections_into_keeps(draft_logits):
    generator = torch.Generator().manual_seed(9)
    problem = make_problem([3, 2, 3, 1, 3, 3, 0, 2], 31, num_positions=3, draft_logits=draft_logits,
                           generator=generator, sharpness=2.0)
    margin = 1.0
    _, plain = samplers(3, *_tables(8))
    _, gate = samplers(3, *_tables(8))
    gate.weight_source.gate_margin_by_state = torch.full((8,), margin)
    without, with_gate = emitted(plain, problem), emitted(gate, problem)
    keeps = _gate_keeps(problem, margin)
    assert any(any(row) for row in keeps) and not all(all(row) for row in keeps)  # both branches reached
    more = 0
    for before, after, keep, count in zip(without, with_gate, keeps, problem.num_draft):
        kept_before, kept_after = len(before) - 1, len(after) - 1
        assert kept_after >= kept_before and after[:kept_before] == before[:kept_before]
        if kept_after < count:
            assert not keep[kept_after]  # a rejection happens only where the gate did not keep the draft
        more += kept_after > kept_before
    assert more > 0


def test_the_gates_extremes_keep_every_draft_or_none_more_and_greedy_rows_are_not_gated():
    generator = torch.Generator().manual_seed(10)
    problem = make_problem([3] * 8, 31, num_positions=3, generator=generator, sharpness=2.0)
    _, plain = samplers(3, *_tables(8))
    wide, narrow = samplers(3, *_tables(8))[1], samplers(3, *_tables(8))[1]
    wide.weight_source.gate_margin_by_state = torch.full((8,), 1e6)
    narrow.weight_source.gate_margin_by_state = torch.full((8,), -1e6)
    assert [len(tokens) - 1 for tokens in emitted(wide, problem)] == problem.num_draft
    assert emitted(narrow, problem) == emitted(plain, problem)
    _, greedy_plain = samplers(3, *_tables(8, temperature=0.0))
    _, greedy_gate = samplers(3, *_tables(8, temperature=0.0))
    greedy_gate.weight_source.gate_margin_by_state = torch.full((8,), 1e6)
    assert emitted(greedy_gate, problem) == emitted(greedy_plain, problem)


@pytest.mark.parametrize("num_draft", [[3, 3, 3], [0, 0, 0], [0, 3, 1, 2]], ids=["all-K", "none", "mixed"])
def test_the_bonus_read_in_place_is_v2s_own_sample_of_the_bonus_rows(num_draft):
    """Whether the chunk's bonus rows are read through a strided view (every request with K or with no drafts) or by
    sampling every row of the chunk (mixed), each request's bonus token is what V2's gumbel_sample draws from that
    row alone; with filler cut off (the bonus not the last row) the every-row path serves too."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    from diversed_ext.vllm_plugin.v2_sampler import bonus_tokens

    generator = torch.Generator().manual_seed(12)
    problem = make_problem(num_draft, 67, num_positions=3, generator=generator, sharpness=1.0)
    temperature, seeds, _ = _tables(8)
    temperature[1] = 0.0
    sampling = SimpleNamespace(temperature=SimpleNamespace(gpu=temperature), seeds=SimpleNamespace(gpu=seeds))
    counts = torch.tensor(num_draft) + 1
    states = torch.tensor(problem.states)
    expanded = states.repeat_interleave(counts)
    for bonus_rows, last_rows in ((counts.cumsum(0) - 1, True), (counts.cumsum(0) - counts, False)):
        expected = gumbel_sample(problem.target_logits[bonus_rows], states, temperature, seeds,
                                 problem.pos[bonus_rows], apply_temperature=False, is_drafting=False)
        tokens = bonus_tokens(problem.target_logits, bonus_rows, last_rows, 3, states, expanded, problem.pos,
                              sampling, use_fp64=False)
        assert tokens.tolist() == expected.tolist()
