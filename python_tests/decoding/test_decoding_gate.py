"""The log-probability gate: its weights against a float64 computation position by position, its output law through
the verifier (chi-square), its edges (p = q, ids the target rules out, margins at either extreme), and the decoding
loop with it (tiny random Llama pair from helpers)."""

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

from helpers import PROMPT, chi_square_tokens_p_value, sequences  # noqa: E402
from helpers.stats import P_VALUE_FLOOR  # noqa: E402
from diversed_ext import verify_logits  # noqa: E402
from diversed_ext.ops import gate_keeps  # noqa: E402
from diversed_ext.decoding import Gate, SpeculativeDecoder  # noqa: E402
from diversed_ext.decoding.gate import gated_weights  # noqa: E402
from diversed_ext.research.harness import method_specs  # noqa: E402

PROMPTS = [PROMPT, [5], [7, 7, 8, 30, 2, 11], [4, 9, 4, 9, 4]]


def expected_keep(draft_token, draft_logits, target_logits, temperature, margin):
    """Whether the gate keeps one drafted token, in float64, from the definition."""
    p = torch.softmax(target_logits.double() / temperature, -1)
    q = (torch.nn.functional.one_hot(torch.tensor(draft_token), p.numel()).double() if draft_logits is None
         else torch.softmax(draft_logits.double() / temperature, -1))
    residual = (p - q).clamp_min(0)
    if residual.sum() == 0:
        return False
    rejected = sum(float(r) * math.log(float(pi)) for r, pi in zip(residual, p) if r > 0) / float(residual.sum())
    return math.log(float(p[draft_token])) >= rejected - margin


@pytest.mark.parametrize("tokens_only", [False, True])
@pytest.mark.parametrize("margin", [-0.5, 0.0, 1.0, 3.0])
def test_gated_weights_match_the_definition(tokens_only, margin):
    generator = torch.Generator().manual_seed(7)
    rows, width, vocab, temperature = 8, 4, 11, 0.8
    target_logits = torch.randn(rows, width + 1, vocab, generator=generator) * 2
    draft_logits = torch.randn(rows, width, vocab, generator=generator) * 2
    # Drafts the target likes half of the time, so both branches of the gate run.
    likely = torch.softmax(target_logits[:, :width].reshape(-1, vocab), -1)
    tokens = torch.where(torch.rand(rows * width, generator=generator) < 0.5,
                         torch.multinomial(likely, 1, generator=generator).squeeze(1),
                         torch.randint(vocab, (rows * width,), generator=generator)).view(rows, width)
    base = torch.rand(rows, width, generator=generator)
    weights = gated_weights(Gate(margin), base, tokens, None if tokens_only else draft_logits, target_logits,
                            temperature)
    kept = 0
    for row in range(rows):
        for position in range(width):
            keep = expected_keep(int(tokens[row, position]), None if tokens_only else draft_logits[row, position],
                                 target_logits[row, position], temperature, margin)
            kept += keep
            assert float(weights[row, position]) == (0.0 if keep else float(base[row, position]))
    assert 0 < kept < rows * width  # both branches ran


def test_row_margins_gate_each_row_as_its_own_margin_and_nan_rows_not_at_all():
    # The rows form servers call: a margin per row, NaN for a request that is not gated.
    generator = torch.Generator().manual_seed(8)
    rows, vocab = 64, 9
    log_p = torch.log_softmax(torch.randn(rows, vocab, generator=generator) * 2, -1)
    q = torch.softmax(torch.randn(rows, vocab, generator=generator) * 2, -1)
    tokens = torch.multinomial(q, 1, generator=generator).squeeze(1)
    margins = torch.tensor([-0.5, 1.0, 3.0, math.nan]).repeat(rows // 4)
    keep = gate_keeps(margins, tokens, q, log_p)
    for row in range(rows):
        margin = float(margins[row])
        alone = bool(gate_keeps(margin, tokens[row:row + 1], q[row:row + 1], log_p[row:row + 1])[0])
        assert bool(keep[row]) == (False if math.isnan(margin) else alone)
        if not math.isnan(margin):
            assert alone == expected_keep(int(tokens[row]), q[row].log(), log_p[row], 1.0, margin)
    assert 0 < int(keep.sum()) < rows - rows // 4


def test_the_gate_leaves_positions_without_residual_and_extreme_margins_as_they_say():
    generator = torch.Generator().manual_seed(3)
    target_logits = torch.randn(2, 3, 9, generator=generator)
    tokens = torch.randint(9, (2, 2), generator=generator)
    # The target sure of the drafted token, the verifier seeing tokens only: p = q one-hot, no residual to compare.
    sure = torch.full((2, 3, 9), -math.inf).scatter_(-1, torch.cat([tokens, tokens[:, :1]], 1).unsqueeze(-1), 0.0)
    assert torch.equal(gated_weights(Gate(50.0), 0.4, tokens, None, sure, 1.0), torch.full((2, 2), 0.4))
    draft_logits = torch.randn(2, 2, 9, generator=generator)
    assert torch.equal(gated_weights(Gate(-1e6), 1.0, tokens, draft_logits, target_logits, 1.0), torch.ones(2, 2))
    assert torch.equal(gated_weights(Gate(1e6), 1.0, tokens, draft_logits, target_logits, 1.0), torch.zeros(2, 2))


def test_ids_the_target_rules_out_give_no_nan():
    target_logits = torch.tensor([[[2.0, -math.inf, 0.5, -math.inf], [0.0, 0.0, 0.0, 0.0]]])
    draft_logits = torch.tensor([[[0.0, 1.0, 0.0, 0.0]]])
    weights = gated_weights(Gate(0.5), 1.0, torch.tensor([[1]]), draft_logits, target_logits, 1.0)
    assert weights.tolist() == [[1.0]]  # log p(x) = -inf: never kept outright
    weights = gated_weights(Gate(0.5), 1.0, torch.tensor([[0]]), draft_logits, target_logits, 1.0)
    assert weights.tolist() == [[0.0]]  # the target's likeliest id is kept


def test_the_verifier_with_gated_weights_emits_the_gate_law():
    """One drafted position, x ~ q: the emitted token is x when the gate keeps x, else x with probability
    min(1, p(x)/q(x)), else a draw from the residual norm((p - q)+)."""
    vocab, samples = 6, 30000
    generator = torch.Generator().manual_seed(11)
    target_logits = torch.randn(1, 2, vocab, generator=generator) * 1.5
    draft_logits = torch.randn(1, 1, vocab, generator=generator) * 1.5
    p, q = torch.softmax(target_logits[0, 0].double(), -1), torch.softmax(draft_logits[0, 0].double(), -1)
    gate = Gate(0.3)
    keep = torch.tensor([expected_keep(x, draft_logits[0, 0], target_logits[0, 0], 1.0, gate.margin)
                         for x in range(vocab)])
    assert 0 < int(keep.sum()) < vocab
    residual = (p - q).clamp_min(0)
    accept = torch.where(keep, torch.ones_like(p), torch.minimum(torch.ones_like(p), p / q))
    law = q * accept + (q * (1 - accept)).sum() * residual / residual.sum()
    drafts = torch.multinomial(q.float(), samples, replacement=True, generator=generator).view(samples, 1)
    weights = gated_weights(gate, 1.0, drafts, draft_logits.expand(samples, 1, vocab),
                            target_logits.expand(samples, 2, vocab), 1.0)
    result = verify_logits(drafts, draft_logits.expand(samples, 1, vocab), target_logits.expand(samples, 2, vocab),
                           weights, uniforms=torch.rand(samples, 2, generator=generator, dtype=torch.float64))
    assert chi_square_tokens_p_value(result.tokens[:, 0], law) > P_VALUE_FLOOR


def test_a_gate_that_keeps_nothing_decodes_as_without(wide_pair):
    target, draft = wide_pair
    kwargs = dict(max_draft=4, fast_forward=False)
    plain = SpeculativeDecoder(target, draft, method="static", weight=0.7, **kwargs)
    never = SpeculativeDecoder(target, draft, method="static", weight=0.7, gate=Gate(-1e9), **kwargs)
    assert sequences(never.generate(PROMPTS, max_new_tokens=12, seed=3)) == \
        sequences(plain.generate(PROMPTS, max_new_tokens=12, seed=3))


def test_a_gate_that_keeps_everything_accepts_every_draft(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", gate=Gate(1e9), max_draft=4, fast_forward=False)
    rounds = [r for g in decoder.generate(PROMPTS, max_new_tokens=16, seed=1).generations for r in g.rounds]
    assert sum(r.drafted for r in rounds) > 0 and all(r.accepted == r.drafted for r in rounds)


def test_the_gate_keeps_more_drafts_than_sd(wide_pair):
    target, draft = wide_pair

    def acceptance(**kwargs):
        decoder = SpeculativeDecoder(target, draft, method="sd", max_draft=4, fast_forward=False, **kwargs)
        rounds = [r for g in decoder.generate(PROMPTS * 3, max_new_tokens=16, seed=1).generations for r in g.rounds]
        return sum(r.accepted for r in rounds) / max(sum(r.drafted for r in rounds), 1)

    assert acceptance(gate=Gate(1.0)) > acceptance()


@pytest.mark.parametrize("kwargs,error", [
    (dict(method="sd", gate=1.0), "gate must be a diversed_ext.decoding.Gate"),
    (dict(method="ar", gate=Gate()), "gate applies to methods that draft"),
    (dict(method="sd", gate=Gate(), temperature=0.0), "gate needs temperature > 0"),
])
def test_bad_gate_settings_raise(wide_pair, kwargs, error):
    target, draft = wide_pair
    with pytest.raises((TypeError, ValueError), match=error):
        SpeculativeDecoder(target, draft, max_draft=4, fast_forward=False, **kwargs)


@pytest.mark.parametrize("margin", [math.nan, math.inf, "1", True])
def test_gate_refuses_a_margin_that_is_not_a_finite_number(margin):
    with pytest.raises((TypeError, ValueError), match="Gate margin must be a finite number of nats"):
        Gate(margin)


def test_method_specs_put_the_gate_beside_the_other_methods():
    specs = method_specs(["sd", "gate", "static+gate"], [0.5], gate=Gate(2.0))
    assert [label for label, _ in specs] == ["sd", "gate", "static+gate w=0.5"]
    assert specs[1][1] == {"method": "sd", "gate": Gate(2.0)}
    assert specs[2][1] == {"method": "static", "weight": 0.5, "gate": Gate(2.0)}
    assert method_specs(["gate"], [])[0][1]["gate"] == Gate()  # the default margin


def test_a_temperature_set_to_zero_after_construction_is_refused_at_the_next_round(wide_pair):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", gate=Gate(), max_draft=3, fast_forward=False)
    decoder.temperature = 0.0
    with pytest.raises(ValueError, match="gate needs temperature > 0"):
        decoder.generate(PROMPT, max_new_tokens=4, seed=0)
