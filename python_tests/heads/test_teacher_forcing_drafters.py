"""Teacher forcing gives an ensemble head, at every token the loop drafted, the very inputs it read while decoding: with
a draft model, and with an EAGLE-3 head, whose q depends on the step of its round (the rollout's draft steps); and the
trainer trains a head for an EAGLE-3 drafter."""

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.decoding import RoundStats, SpeculativeDecoder  # noqa: E402
from diversed_ext.head import DISTRIBUTION_FEATURES, EnsembleHead  # noqa: E402
from diversed_ext.research.rollouts import draft_steps, mixture_rollout, speculative_rollout  # noqa: E402
from diversed_ext.research.teacher_forcing import teacher_forced_tokens  # noqa: E402
from diversed_ext.research.trainer import Trainer, TrainerConfig  # noqa: E402
from helpers import PROMPT, distilled_head, one_torch_thread, wide_pair_models  # noqa: E402

PROMPTS = [PROMPT, [3, 9], [5, 1, 4, 4, 2, 7, 7, 0, 9], [2, 2, 6]]
WIDE_DRAFT_IDS = [token for token in range(32) if token % 8 != 7]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def drafters():
    """The wide target, its draft model and an EAGLE-3 head distilled on it, with float and with int8 products."""
    target, draft = wide_pair_models()
    eagle = distilled_head(target, WIDE_DRAFT_IDS, (0, 1, 1), seed=4)
    return {"target": target, "model": draft, "eagle": eagle, "eagle-int8": copy.deepcopy(eagle).use_int8_products()}


def random_head(target, seed):
    """An ensemble head on both hidden states and the five features with random weights, so its w differs from token
    to token and any input that differs shows in it."""
    size = target.config.hidden_size
    head = EnsembleHead(size, size, features=DISTRIBUTION_FEATURES, use_hidden=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(parameter.shape[-1]))
    return head.eval()


def loop_and_forced_weights(drafters, kind, steps_from_rounds=True):
    """(w the loop chose at each emitted drafted token, w the head gives on the teacher-forced inputs there, the draft
    step of each) over PROMPTS, decoded together at temperature 1."""
    target, draft = drafters["target"], drafters[kind]
    head = random_head(target, 5)
    output = SpeculativeDecoder(target, draft, method="diversed", head=head, max_draft=3).generate(
        PROMPTS, max_new_tokens=20, seed=11)
    completions = [tokens.tolist() for tokens in output.sequences]
    steps = [draft_steps(rounds) for rounds in output.rounds]
    batch = teacher_forced_tokens(target, draft, PROMPTS, completions, 1.0, steps if steps_from_rounds else None)
    with torch.no_grad():
        forced = head(*batch.head_inputs(head))
    looped, taught, at_step = [], [], []
    for row, rounds in enumerate(output.rounds):
        position = 0
        for stats in rounds:
            for m in range(min(stats.drafted, stats.emitted)):
                looped.append(stats.weights[m])
                taught.append(float(forced[row, position + m]))
                at_step.append(m)
            position += stats.emitted
    return torch.tensor(looped), torch.tensor(taught), torch.tensor(at_step)


@pytest.mark.parametrize("kind", ["model", "eagle", "eagle-int8"])
def test_teacher_forced_inputs_give_the_weights_the_loop_used(drafters, kind):
    looped, taught, at_step = loop_and_forced_weights(drafters, kind)
    assert len(looped) > 20 and (at_step > 0).sum() > 5  # later draft steps are covered
    assert looped.std() > 0.01  # the head's w moves from token to token, a hundred times the tolerance below
    torch.testing.assert_close(taught, looped, rtol=0, atol=1e-4)


def test_an_eagle_heads_later_steps_need_their_draft_steps(drafters):
    """Read at step 0 everywhere, the tokens drafted at later steps get other inputs: the steps carry information."""
    looped, taught, at_step = loop_and_forced_weights(drafters, "eagle", steps_from_rounds=False)
    first = at_step == 0
    torch.testing.assert_close(taught[first], looped[first], rtol=0, atol=1e-4)
    assert (taught[~first] - looped[~first]).abs().max() > 1e-2


def test_draft_steps_of_rounds():
    rounds = [RoundStats(drafted=0, accepted=0, emitted=1), RoundStats(drafted=3, accepted=1, emitted=2),
              RoundStats(drafted=3, accepted=3, emitted=4), RoundStats(drafted=2, accepted=2, emitted=2),
              RoundStats(drafted=2, accepted=0, emitted=1)]
    # bonus tokens (after all drafts were kept) and the undrafted first round count as step 0
    assert draft_steps(rounds) == [0, 0, 1, 0, 1, 2, 0, 0, 1, 0]
    assert draft_steps([]) == []


def test_eagle_teacher_forcing_refuses_what_it_cannot_place(drafters):
    target, eagle = drafters["target"], drafters["eagle"]
    with pytest.raises(ValueError, match=r"draft_steps \(1\) and completions \(2\) must pair up"):
        teacher_forced_tokens(target, eagle, [[1, 2], [3, 4]], [[5], [6]], draft_steps=[[0]])
    with pytest.raises(ValueError, match="draft_steps: 1 steps for a completion of 2 tokens"):
        teacher_forced_tokens(target, eagle, [[1, 2]], [[5, 6]], draft_steps=[[0]])
    with pytest.raises(ValueError, match=r"token t of a completion is drafted at a step in 0 \.\. t"):
        teacher_forced_tokens(target, eagle, [[1, 2]], [[5, 6]], draft_steps=[[1, 0]])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        teacher_forced_tokens(target, eagle, [[1]], [[5, 6]])
    with pytest.raises(ValueError, match="rolls out through the speculative loop only"):
        mixture_rollout(target, eagle, random_head(target, 0), max_new_tokens=4)
    empty = teacher_forced_tokens(target, eagle, [[1, 2], [3, 4]], [[5, 6, 7], []], draft_steps=[[0, 1, 2], None])
    assert empty.mask.tolist() == [[True, True, True], [False, False, False]]
    # 7 is outside the head's draft vocabulary: q(7) = 0
    assert torch.isfinite(empty.draft_logprob[0]).tolist() == [True, True, False]


def test_a_head_trains_for_an_eagle_drafter(drafters, tmp_path):
    target, eagle = drafters["target"], drafters["eagle"]
    size = target.config.hidden_size
    head = EnsembleHead(size, size, features=DISTRIBUTION_FEATURES, use_hidden=True)
    rollout = speculative_rollout(target, eagle, head, max_new_tokens=8)
    config = TrainerConfig(output_dir=str(tmp_path), steps=3, batch_size=4, learning_rate=0.05, warmup_steps=1,
                           checkpoint_every=2, seed=7, acceptance_coef=2.0, expected_fidelity_coef=0.0)
    before = [parameter.detach().clone() for parameter in head.parameters()]
    history = Trainer(target, eagle, head, PROMPTS, list(range(len(PROMPTS))), lambda example, text: 0.0,
                      lambda ids: " ".join(map(str, ids)), rollout, config).train(progress=False)
    assert len(history) == 3 and all(math.isfinite(record["loss"]) for record in history)
    assert any((parameter - old).abs().max() > 0 for parameter, old in zip(head.parameters(), before))
    # the acceptance term alone lowers w
    assert history[-1]["mean_weight"] < history[0]["mean_weight"] - 0.02
