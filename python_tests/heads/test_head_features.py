"""Heads that read distribution features: the features against float64 formulas and their edges, the head's checks
and persistence, the loop handing each drafted position its own features (checked against full forward passes),
and a trainer step through them."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.decoding import SpeculativeDecoder  # noqa: E402
from diversed_ext.head import (DISTRIBUTION_FEATURES, HEAD_INPUTS, EnsembleHead, distribution_features,  # noqa: E402
                               load_head)
from diversed_ext.research.rollouts import mixture_rollout  # noqa: E402
from diversed_ext.research.teacher_forcing import teacher_forced_tokens  # noqa: E402
from diversed_ext.research.trainer import Trainer, TrainerConfig  # noqa: E402
from helpers import PROMPT, wide_pair_models  # noqa: E402

PROMPTS = [PROMPT, [3], [5, 1, 4, 4, 2, 7, 7, 0, 9], [2, 2]]


def expected_features(draft_logits, target_logits, temperature):
    """The five features in float64, written out."""
    scale = 1.0 if temperature == 0 else temperature
    q = (draft_logits.double() / scale).softmax(-1)
    p = (target_logits.double() / scale).softmax(-1)

    def entropy(probs):
        return -(probs * probs.clamp_min(1e-300).log()).sum(-1) / math.log(probs.shape[-1])

    return torch.stack([entropy(q), entropy(p), q.amax(-1), p.amax(-1), 0.5 * (p - q).abs().sum(-1)], dim=-1)


@pytest.mark.parametrize("vocab", [2, 7, 129])
@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_features_against_float64(vocab, temperature):
    generator = torch.Generator().manual_seed(vocab)
    draft = torch.randn(3, 5, vocab, generator=generator) * 3
    target = torch.randn(3, 5, vocab, generator=generator) * 3
    features = distribution_features(draft, target, temperature)
    assert features.shape == (3, 5, len(DISTRIBUTION_FEATURES)) and features.dtype == torch.float32
    torch.testing.assert_close(features.double(), expected_features(draft, target, temperature), atol=2e-6, rtol=0)


def test_feature_edges():
    uniform, peaked = torch.zeros(1, 8), torch.tensor([[0.0] + [float("-inf")] * 7])
    features = distribution_features(torch.cat([uniform, peaked]), torch.cat([uniform, uniform]))
    torch.testing.assert_close(features[0], torch.tensor([1.0, 1.0, 1 / 8, 1 / 8, 0.0]))  # same uniform rows
    torch.testing.assert_close(features[1], torch.tensor([0.0, 1.0, 1.0, 1 / 8, 7 / 8]))  # one-hot draft, -inf logits
    single = distribution_features(torch.zeros(4, 1), torch.ones(4, 1))  # V = 1: no spread, no disagreement
    torch.testing.assert_close(single, torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0]] * 4))
    assert distribution_features(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, 5)
    with pytest.raises(ValueError, match="same shape"):
        distribution_features(torch.zeros(2, 3), torch.zeros(2, 4))


def test_features_of_any_leading_shape_and_dtype():
    """The head's call of the fused op: [..., V] of any leading shape, each dtype as it lies, and a draft and a
    target of different dtypes (a server's bfloat16 draft beside its float32 target rows) each read as it lies."""
    generator = torch.Generator().manual_seed(3)
    draft, target = torch.randn(2, 3, 4, 50, generator=generator), torch.randn(2, 3, 4, 50, generator=generator)
    features = distribution_features(draft, target, 0.8)
    assert features.shape == (2, 3, 4, 5)
    torch.testing.assert_close(features.double(), expected_features(draft, target, 0.8), atol=2e-6, rtol=0)
    bf16_draft = draft.bfloat16()
    torch.testing.assert_close(distribution_features(bf16_draft, target, 0.8),
                               distribution_features(bf16_draft.float(), target, 0.8), atol=0, rtol=0)
    torch.testing.assert_close(distribution_features(bf16_draft, target.bfloat16(), 0.8).double(),
                               expected_features(bf16_draft, target.bfloat16(), 0.8), atol=2e-6, rtol=0)
    torch.testing.assert_close(distribution_features(draft.double(), target.double(), 0.8), features, atol=0, rtol=0)


def random_output(head, seed, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale / math.sqrt(parameter.shape[-1]))
    return head


@pytest.mark.parametrize("inputs", sorted(HEAD_INPUTS))
def test_head_inputs_initial_weight_and_gradients(inputs):
    features, use_hidden = HEAD_INPUTS[inputs]
    head = EnsembleHead(6, 10, hidden=4, init_weight=0.3, features=features, use_hidden=use_hidden)
    draft_hidden, target_hidden = torch.randn(2, 5, 6), torch.randn(2, 5, 10)
    distributions = torch.rand(2, 5, len(DISTRIBUTION_FEATURES))
    torch.testing.assert_close(head(draft_hidden, target_hidden, distributions), torch.full((2, 5), 0.3))
    assert head.wants_distributions == bool(features)
    random_output(head, 0)(draft_hidden, target_hidden, distributions).sum().backward()
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in head.parameters())


def test_head_reads_only_its_features():
    head = random_output(EnsembleHead(4, 4, features=["total_variation", "draft_entropy"], use_hidden=False), 1)
    distributions = torch.rand(7, 5)
    changed = distributions.clone()
    changed[:, [1, 2, 3]] = torch.rand(7, 3)  # the three features it does not read
    torch.testing.assert_close(head(torch.zeros(7, 4), torch.zeros(7, 4), distributions),
                               head(torch.randn(7, 4), torch.randn(7, 4), changed))


def test_head_feature_checks():
    with pytest.raises(ValueError, match="distinct names"):
        EnsembleHead(4, 4, features=["entropy"])
    with pytest.raises(ValueError, match="distinct names"):
        EnsembleHead(4, 4, features=["total_variation", "total_variation"])
    with pytest.raises(ValueError, match="at least one feature"):
        EnsembleHead(4, 4, use_hidden=False)
    with pytest.raises(TypeError, match="sequence of names"):
        EnsembleHead(4, 4, features="total_variation")
    head = EnsembleHead(4, 4, features=DISTRIBUTION_FEATURES)
    with pytest.raises(ValueError, match="distributions must have shape"):
        head(torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="distributions must have shape"):
        head(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3, 4))


def test_features_round_trip_and_bad_configs(tmp_path):
    head = random_output(EnsembleHead(6, 10, hidden=3, features=["target_max_prob"], use_hidden=False), 2)
    head.save(str(tmp_path))
    loaded = load_head(str(tmp_path))
    assert loaded.config == head.config
    distributions = torch.rand(4, 5)
    torch.testing.assert_close(loaded(torch.zeros(4, 6), torch.zeros(4, 10), distributions),
                               head(torch.zeros(4, 6), torch.zeros(4, 10), distributions))
    config_path = tmp_path / "head.json"
    stored = json.loads(config_path.read_text())
    for bad in ({"features": ["nope"]}, {"features": "target_max_prob"}, {"use_hidden": "yes"},
                {"features": [], "use_hidden": False}):
        config_path.write_text(json.dumps({**stored, **bad}))
        with pytest.raises(ValueError, match="head.json"):
            load_head(str(tmp_path))


def test_shipped_default_head_reads_hidden_states_and_every_feature():
    head = load_head("default")
    assert head.config.features == list(DISTRIBUTION_FEATURES) and head.config.use_hidden and head.wants_distributions


def test_head_saved_before_features_loads_as_hidden_states_only(tmp_path):
    # The first heads' head.json had neither key: they read the two hidden states alone.
    EnsembleHead(6, 10).save(str(tmp_path))
    config_path = tmp_path / "head.json"
    stored = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({key: value for key, value in stored.items()
                                       if key not in ("features", "use_hidden")}))
    head = load_head(str(tmp_path))
    assert head.config.features == [] and head.config.use_hidden and not head.wants_distributions


def last_position(model, tokens):
    output = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return output.hidden_states[-1][0, -1], output.logits[0, -1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("inputs", ["distributions", "both"])
def test_loop_gives_each_drafted_position_its_own_features(double_pair, inputs, temperature):
    """Every weight a batched round recorded equals the head on that draft's prefix, recomputed from scratch."""
    target, draft = double_pair
    features, use_hidden = HEAD_INPUTS[inputs]
    head = random_output(EnsembleHead(16, 16, hidden=8, features=features, use_hidden=use_hidden), 3).double()
    decoder = SpeculativeDecoder(target, draft, method="diversed", head=head, max_draft=3, temperature=temperature)
    output = decoder.generate(PROMPTS, max_new_tokens=9, seed=4)
    checked = 0
    with torch.no_grad():
        for prompt, generation in zip(PROMPTS, output.generations):
            emitted = 0
            for stats in generation.rounds:
                prefix = prompt + generation.tokens[:emitted].tolist()
                for position, weight in enumerate(stats.weights):
                    tokens = prefix + list(stats.draft_tokens[:position])
                    draft_hidden, draft_logits = last_position(draft, tokens)
                    target_hidden, target_logits = last_position(target, tokens)
                    expected = head(draft_hidden, target_hidden,
                                    distribution_features(draft_logits, target_logits, temperature))
                    assert weight == pytest.approx(float(expected), abs=1e-5)
                    checked += 1
                emitted += stats.emitted
    assert checked >= 12  # several rounds of several rows were drafted and weighed


def test_trainer_step_through_features(tmp_path):
    target, draft = (model.float() for model in wide_pair_models())
    head = EnsembleHead(16, 16, features=DISTRIBUTION_FEATURES, use_hidden=False)
    batch = teacher_forced_tokens(target, draft, [[1, 2, 3]], [[5, 6, 7]], temperature=0.7)
    input_ids = torch.tensor([[1, 2, 3, 5, 6]])
    with torch.no_grad():
        expected = distribution_features(draft(input_ids).logits[0, 2:5], target(input_ids).logits[0, 2:5], 0.7)
    torch.testing.assert_close(batch.distributions[0], expected, atol=1e-5, rtol=0)
    rollout = mixture_rollout(target, draft, head, max_new_tokens=4)
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    trainer = Trainer(target, draft, head, prompts, list(range(4)), lambda example, text: float(len(text) % 3),
                      decode=lambda ids: " ".join(map(str, ids)), rollout=rollout,
                      config=TrainerConfig(output_dir=str(tmp_path), steps=2, batch_size=4, learning_rate=0.1,
                                           warmup_steps=1, acceptance_coef=1.0))
    before = head.output.weight.detach().clone()
    history = trainer.train(progress=False)
    assert len(history) == 2 and all(math.isfinite(record["loss"]) for record in history)
    assert not torch.equal(head.output.weight, before)  # the features carried a gradient
