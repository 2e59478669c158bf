"""build_trainer: a new head's random initial weights come from the run's seed, so a recipe reproduces its head."""

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.research import recipes  # noqa: E402
from diversed_ext.research.tasks import TASKS  # noqa: E402
from diversed_ext.research.trainer import TrainerConfig  # noqa: E402
from helpers import gsm8k_examples  # noqa: E402


def initial_head(experiment_pair, tmp_path, seed, **options):
    target, draft, tokenizer = experiment_pair
    config = TrainerConfig(output_dir=str(tmp_path), steps=1, batch_size=2, seed=seed)
    trainer = recipes.build_trainer(TASKS["gsm8k"], gsm8k_examples(), target, draft, tokenizer, config,
                                    max_new_tokens=4, **options)
    return {name: value.clone() for name, value in trainer.head.state_dict().items()}


@pytest.mark.parametrize("head_inputs", ["hidden", "both"])
def test_a_hidden_layer_starts_from_the_runs_seed(experiment_pair, tmp_path, head_inputs):
    # Draws between the two builds must not matter: the head's weights come from the seed alone.
    first = initial_head(experiment_pair, tmp_path, 3, head_hidden=8, head_inputs=head_inputs)
    torch.rand(5)
    again = initial_head(experiment_pair, tmp_path, 3, head_hidden=8, head_inputs=head_inputs)
    other = initial_head(experiment_pair, tmp_path, 4, head_hidden=8, head_inputs=head_inputs)
    assert first.keys() == again.keys() and "body.0.weight" in first
    for name, value in first.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0)
    assert not torch.equal(other["body.0.weight"], first["body.0.weight"])


def test_building_a_head_leaves_the_callers_random_draws_alone(experiment_pair, tmp_path):
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    initial_head(experiment_pair, tmp_path, 0, head_hidden=8)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)
