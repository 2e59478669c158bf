"""The speculative rollout's bonus tokens: drawn from the target p, not from nu, so each completion flags them and
the trainer leaves them out of every term that depends on the head."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.decoding import RoundStats  # noqa: E402
from diversed_ext.head import DISTRIBUTION_FEATURES, EnsembleHead  # noqa: E402
from diversed_ext.research.objective import KL_GRID_POINTS  # noqa: E402
from diversed_ext.research.rollouts import (Completion, mixture_rollout, nu_mask, speculative_rollout,  # noqa: E402
                                            verified_tokens)
from diversed_ext.research.teacher_forcing import TokenBatch  # noqa: E402
from diversed_ext.research.trainer import Trainer, TrainerConfig, head_objective  # noqa: E402
from helpers import PROMPT, one_torch_thread, prompts_and_examples, trainer_llama  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def pair():
    return trainer_llama(0), trainer_llama(1)


def test_verified_tokens_of_rounds():
    rounds = [RoundStats(drafted=3, accepted=3, emitted=4),  # all kept: the fourth token is the bonus
              RoundStats(drafted=3, accepted=1, emitted=2),  # a kept draft, then the correction: both from nu
              RoundStats(drafted=0, accepted=0, emitted=1),  # nothing drafted (one token left): from p
              RoundStats(drafted=2, accepted=2, emitted=2)]  # cut at EOS before the bonus
    assert verified_tokens(rounds) == [True, True, True, False, True, True, False, True, True]
    assert verified_tokens([]) == []


def test_a_speculative_rollout_flags_exactly_its_bonus_tokens(pair):
    # The draft is the target, so every draft is kept whatever w: with K = 1 each round emits its draft and then a
    # bonus token, and the fifth token, alone in its round (one token left, nothing drafted), is drawn from p too.
    target, _ = pair
    head = EnsembleHead(16, 16, init_weight=1.0)
    rollout = speculative_rollout(target, target, head, max_draft=1, max_new_tokens=5)
    completions = rollout([PROMPT, [2, 7]], [3, 4])
    for completion in completions:
        assert len(completion.tokens) == 5
        assert completion.verified == [True, False, True, False, False]
    # Token by token every token is drawn from nu.
    assert all(completion.verified is None
               for completion in mixture_rollout(target, target, head, max_new_tokens=3)([PROMPT], [3]))


def test_a_speculative_rollouts_flags_follow_its_rounds(pair):
    # A draft unlike the target rejects some drafts: corrections are flagged with the kept drafts, bonus tokens not.
    target, draft = pair
    rollout = speculative_rollout(target, draft, EnsembleHead(16, 16, init_weight=0.5), max_draft=3,
                                  max_new_tokens=24)
    completions = rollout(prompts_and_examples()[0], list(range(6)))
    flags = [flag for completion in completions for flag in completion.verified]
    assert len(flags) == 6 * 24 and any(flags) and not all(flags)
    assert all(len(completion.verified) == len(completion.tokens) for completion in completions)


def test_nu_mask_keeps_padding_out_and_checks_lengths():
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    completions = [Completion([1, 2, 3], None, [True, False, True]), Completion([4, 5]), Completion([])]
    assert nu_mask(completions, mask).tolist() == [[True, False, True], [True, True, False], [False, False, False]]
    with pytest.raises(ValueError, match="2 flags for a completion of 3 tokens"):
        nu_mask([Completion([1, 2, 3], None, [True, True])], mask[:1])


def random_batch(generator, rows=2, length=4, size=8):
    """A TokenBatch of random per-token quantities, the second row one token shorter (padding)."""
    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    mask = torch.ones(rows, length, dtype=torch.bool)
    mask[1, -1] = False
    return TokenBatch(draft_hidden=draw(rows, length, size), target_hidden=draw(rows, length, size),
                      target_logprob=-draw(rows, length).abs(), draft_logprob=-draw(rows, length).abs(),
                      total_variation=torch.rand(rows, length, generator=generator), mask=mask,
                      fidelity_gap=-draw(rows, length).abs(),
                      distributions=draw(rows, length, len(DISTRIBUTION_FEATURES)),
                      kl_table=torch.rand(rows, length, KL_GRID_POINTS, generator=generator))


def perturbed(batch, row, position, generator):
    """``batch`` with every per-token quantity at (row, position) redrawn."""
    fields = {name: value.clone() for name, value in vars(batch).items()}
    for name, value in fields.items():
        if name != "mask":
            value[row, position] = value[row, position] + 1.0 + torch.rand(value[row, position].shape,
                                                                           generator=generator)
    return TokenBatch(**fields)


def head_gradient(head, batch, drawn, config):
    head.zero_grad(set_to_none=True)
    rewards = torch.tensor([1.0, -0.5], dtype=torch.float64)
    _, terms = head_objective(head, head, batch, drawn, rewards, config)
    terms.loss.backward()
    return torch.cat([parameter.grad.flatten() for parameter in head.parameters()])


@pytest.mark.parametrize("closed_form, kl_coef", [("linear", 0.7), ("logistic", 0.0)])
def test_the_loss_gradient_ignores_bonus_positions(closed_form, kl_coef, tmp_path):
    generator = torch.Generator().manual_seed(0)
    head = EnsembleHead(8, 8, hidden=4, features=DISTRIBUTION_FEATURES)
    with torch.no_grad():  # random weights everywhere, the output layer's too, so every input shows in the gradient
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(parameter.shape[-1]))
    config = TrainerConfig(output_dir=str(tmp_path), acceptance_coef=0.3, expected_fidelity_coef=0.5,
                           closed_form=closed_form, expected_kl_coef=kl_coef)
    batch = random_batch(generator)
    drawn = batch.mask.clone()
    drawn[0, 1] = drawn[1, 2] = False  # two bonus tokens
    gradient = head_gradient(head, batch, drawn, config)
    assert gradient.abs().sum() > 0
    changed = perturbed(perturbed(batch, 0, 1, generator), 1, 2, generator)
    torch.testing.assert_close(head_gradient(head, changed, drawn, config), gradient, rtol=0, atol=0)
    # Counted as drawn from nu (every token, as before the bonus tokens were flagged), the same change moves it.
    assert not torch.equal(head_gradient(head, changed, batch.mask, config), head_gradient(head, batch, batch.mask,
                                                                                            config))
    # So does a change at a token drawn from nu.
    assert not torch.equal(head_gradient(head, perturbed(batch, 0, 2, generator), drawn, config), gradient)


def one_step(pair, tmp_path, bonus, verified):
    """(loss, the head's gradient) of one training step on fixed rollouts whose last token is ``bonus``, flagged
    ``verified``. The gradient, not the update: Adam's first step is about lr times the gradient's sign, whatever
    its size."""
    target, draft = pair
    torch.manual_seed(0)
    head = EnsembleHead(16, 16, hidden=8, init_weight=0.5)
    prompts, examples = prompts_and_examples()
    rollout = lambda prompts, seeds: [Completion([5, 6, bonus], None, [True, True, verified])  # noqa: E731
                                      for _ in prompts]
    config = TrainerConfig(output_dir=str(tmp_path), steps=1, batch_size=4, learning_rate=0.05, warmup_steps=1,
                           acceptance_coef=0.5, seed=7)
    # The reward reads the example alone, so changing a token changes nothing but what the loss sees of it.
    trainer = Trainer(target, draft, head, prompts, examples, lambda example, text: float(example % 2),
                      lambda ids: " ".join(map(str, ids)), rollout, config)
    record = trainer.train_step()
    assert record["tokens"] == 4 * 3 and record["verified_tokens"] == 4 * (2 + verified)
    return record["loss"], torch.cat([parameter.grad.flatten() for parameter in head.parameters()])


def test_a_training_step_does_not_read_the_bonus_token(pair, tmp_path):
    loss, gradient = one_step(pair, tmp_path / "a", 1, False)
    other_loss, other_gradient = one_step(pair, tmp_path / "b", 9, False)
    assert gradient.abs().sum() > 0 and other_loss == loss
    torch.testing.assert_close(other_gradient, gradient, rtol=0, atol=0)
    # Flagged as drawn from nu, the last token's log nu enters the policy term and moves the gradient.
    _, counted = one_step(pair, tmp_path / "c", 1, True)
    _, other = one_step(pair, tmp_path / "d", 9, True)
    assert (counted - other).abs().max() > 1e-3 * counted.abs().max()
