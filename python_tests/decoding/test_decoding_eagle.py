"""The decoding loop with an EAGLE-3 head drafting from the target's hidden states (``draft=Eagle3Head``): greedy
exactness, the output law at w = 1 (chi-square, fixed seeds), w = 0, the head's cache through prefill and rollback
(every round's drafts against a fresh head over the whole context), batch invariance, the ``diversed`` head's inputs,
and argument errors.

The heads are distilled for a few steps on the tiny targets of helpers/models.py so that drafts are sometimes kept and
sometimes rejected (a random head is almost never right, which would leave the rollback paths untested); their draft
vocabularies leave some target ids out, so q is zero there.
"""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

from diversed_ext.decoding import SpeculativeDecoder  # noqa: E402
from diversed_ext.models.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from helpers import (P_VALUE_FLOOR, PROMPT, SMALL_VOCAB, WIDE_VOCAB, assert_prompts_decode_as_alone,  # noqa: E402
                     chi_square_cells_p_value, distilled_head, exact_joint, sequences, small_pair_models,
                     one_torch_thread, require_forward_ops, target_features, wide_pair_models)

PROMPTS = [PROMPT, [5], [7, 7, 8, 30, 2, 11], [4, 9, 4, 9, 4]]
WIDE_DRAFT_IDS = [token for token in range(WIDE_VOCAB) if token % 8 != 7]  # 28 of the 32 ids
SAMPLES = 2000


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def wide_eagle():
    """(target, its distilled EAGLE-3 head) on the two-layer 32-token target."""
    target, _ = wide_pair_models()
    return target, distilled_head(target, WIDE_DRAFT_IDS, (0, 1, 1), seed=4)


@pytest.fixture(scope="module")
def small_eagle():
    """(target, its head) on the 4-token target, whose output laws are computed exactly; the head drafts ids 0-2."""
    target, _ = small_pair_models()
    return target, distilled_head(target, [0, 1, 2], (0, 0, 0), seed=5, steps=40)


def reference_drafts(target, head, context, count, eos=()):
    """Greedy drafts of a fresh head over ``context`` (no cache reuse): the pairs of every position the target has
    read, then its own output states; stops after an EOS draft, as the loop does."""
    aux, _ = target_features(target, head, context[:-1])
    cache = head.new_cache()
    logits, hidden = head.step(torch.tensor(context[1:]), head.fuse(aux), cache)
    drafts = []
    while True:
        drafts.append(int(head.draft_to_target[logits[-1].argmax()]))
        if len(drafts) == count or drafts[-1] in eos:
            return drafts
        logits, hidden = head.step(torch.tensor(drafts[-1:]), hidden[-1:], cache)


# ---- exactness -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_draft", [1, 3, 6])
def test_greedy_sd_with_an_eagle_head_equals_greedy_ar_token_for_token(wide_eagle, max_draft):
    target, head = wide_eagle
    ar = SpeculativeDecoder(target, method="ar", temperature=0).generate(PROMPTS, max_new_tokens=24)
    output = SpeculativeDecoder(target, head, method="sd", max_draft=max_draft, temperature=0).generate(
        PROMPTS, max_new_tokens=24, batch_size=3)  # ragged rows, and a slot refilled mid-run
    assert sequences(output) == sequences(ar)
    summary = output.summary()
    assert 0 < summary.accepted < summary.drafted  # kept and rejected drafts: both rollback paths ran
    for rounds in output.rounds:
        assert rounds[0].drafted == 0  # the first round reads the prompt: no target features to draft from yet
        assert all(stats.drafted == min(max_draft, 24 - sum(earlier.emitted for earlier in rounds[:index]) - 1)
                   for index, stats in enumerate(rounds) if index > 0)


@pytest.mark.parametrize("max_draft", [2, 5])
def test_every_round_drafts_what_a_fresh_head_drafts_over_the_whole_context(wide_eagle, max_draft):
    """Prefill and rollback: after any number of kept and rejected drafts, the head's cache and pending features give
    the drafts a fresh head computes from the target's hidden states over the whole context."""
    target, head = wide_eagle
    output = SpeculativeDecoder(target, head, method="sd", max_draft=max_draft, temperature=0).generate(
        PROMPTS, max_new_tokens=20, eos_token_id=[9], batch_size=2)
    checked = 0
    for prompt, tokens, rounds in zip(PROMPTS, sequences(output), output.rounds):
        emitted = 0
        for stats in rounds:
            if stats.drafted:
                context = prompt + tokens[:emitted]
                assert list(stats.draft_tokens) == reference_drafts(target, head, context, stats.drafted, eos=(9,))
                checked += 1
            emitted += stats.emitted
    assert checked > 10


def test_the_models_own_forward_gives_the_same_drafts(wide_eagle):
    """The aux hidden states through transformers' forward (``fast_forward=False``) feed the head as the lean
    forward's do."""
    target, head = wide_eagle
    outputs = [SpeculativeDecoder(target, head, method="sd", max_draft=3, temperature=0, fast_forward=fast).generate(
        PROMPTS[:2], max_new_tokens=16) for fast in (True, False)]
    assert sequences(outputs[0]) == sequences(outputs[1])
    assert [[stats.draft_tokens for stats in rounds] for rounds in outputs[0].rounds] == \
        [[stats.draft_tokens for stats in rounds] for rounds in outputs[1].rounds]


@pytest.mark.parametrize("draft_mode", ["distributions", "tokens", "sampled_tokens"])
def test_sampled_sd_with_an_eagle_head_follows_the_target(small_eagle, draft_mode):
    target, head = small_eagle
    decoder = SpeculativeDecoder(target, head, method="sd", max_draft=2, temperature=1.0, draft_mode=draft_mode)
    output = decoder.generate([PROMPT] * SAMPLES, max_new_tokens=4, seed=0)
    assert sum(stats.drafted for rounds in output.rounds for stats in rounds) > SAMPLES  # tokens 2-4 were drafted
    samples = [tuple(tokens) for tokens in sequences(output)]
    assert chi_square_cells_p_value(samples, exact_joint(target, None, PROMPT, 4, SMALL_VOCAB)) > P_VALUE_FLOOR
    # The test can fail: the same samples reject the target's law at another temperature.
    other = exact_joint(target, None, PROMPT, 4, SMALL_VOCAB, temperature=0.5)
    assert chi_square_cells_p_value(samples, other) < 1e-6


def test_sampled_sd_with_int8_products_still_follows_the_target(small_eagle):
    """int8 products change the drafts' distribution, never the output's: the verifier reads the law they came from."""
    require_forward_ops()
    target, head = small_eagle
    try:
        output = SpeculativeDecoder(target, head.use_int8_products(), method="sd", max_draft=2,
                                    temperature=1.0).generate([PROMPT] * SAMPLES, max_new_tokens=4, seed=1)
    finally:
        head.use_int8_products(False)
    samples = [tuple(tokens) for tokens in sequences(output)]
    assert chi_square_cells_p_value(samples, exact_joint(target, None, PROMPT, 4, SMALL_VOCAB)) > P_VALUE_FLOOR


def test_static_weight_zero_keeps_every_eagle_draft(wide_eagle):
    target, head = wide_eagle
    decoder = SpeculativeDecoder(target, head, method="static", weight=0.0, max_draft=4, temperature=1.0)
    output = decoder.generate([PROMPT, [9, 4]], max_new_tokens=26, seed=11)
    for rounds in output.rounds:
        assert [stats.drafted for stats in rounds] == [0] + [4] * 5
        assert all(stats.accepted == stats.drafted and stats.emitted == stats.drafted + 1 for stats in rounds)


def test_drafts_come_from_the_draft_vocabulary(wide_eagle):
    target, head = wide_eagle
    output = SpeculativeDecoder(target, head, method="static", weight=0.0, max_draft=4).generate(
        PROMPTS, max_new_tokens=30, seed=3)
    drafted = {token for rounds in output.rounds for stats in rounds for token in stats.draft_tokens}
    assert drafted and drafted <= set(WIDE_DRAFT_IDS)


@pytest.mark.parametrize("kwargs", [{"method": "sd"}, {"method": "static", "weight": 0.5},
                                    {"method": "sd", "draft_mode": "tokens"},
                                    {"method": "sd", "draft_length": "confidence"}])
def test_prompt_tokens_do_not_depend_on_batch_size_or_neighbours(wide_eagle, kwargs):
    target, head = wide_eagle
    decoder = SpeculativeDecoder(target, head, max_draft=3, temperature=1.0, **kwargs)
    assert_prompts_decode_as_alone(decoder, PROMPTS, seed=40, max_new_tokens=14, eos=(5, 9))


# ---- the diversed head, the gate and FLy -----------------------------------------------------------------------------


class RecordingHead:
    """A diversed head returning a fixed weight and recording what it reads; with ``wants_distributions`` it also
    takes the distribution features (which must be finite: q is zero outside the draft vocabulary)."""

    wants_distributions = True

    def __init__(self, weight):
        self.weight, self.calls = weight, []

    def __call__(self, draft_hidden, target_hidden, distributions):
        assert torch.isfinite(distributions).all()
        self.calls.append((draft_hidden.clone(), target_hidden.clone()))
        return torch.full(draft_hidden.shape[:2], self.weight)


def test_a_diversed_head_reads_the_eagle_heads_output_states(wide_eagle):
    target, head = wide_eagle
    recording = RecordingHead(1.0)
    output = SpeculativeDecoder(target, head, method="diversed", head=recording, max_draft=3, temperature=0).generate(
        PROMPT, max_new_tokens=16)
    ar = SpeculativeDecoder(target, method="ar", temperature=0).generate(PROMPT, max_new_tokens=16)
    assert sequences(output) == sequences(ar)  # w = 1 everywhere is sd
    rounds = [stats for stats in output.rounds[0] if stats.drafted]
    assert len(recording.calls) == len(rounds)
    emitted = output.rounds[0][0].emitted
    for stats, (draft_hidden, target_hidden) in zip(rounds, recording.calls):
        assert draft_hidden.shape == (1, stats.drafted, head.config.hidden_size)
        assert target_hidden.shape == (1, stats.drafted, target.config.hidden_size)
        # The first draft's state is the head's output at the last real pair of the context.
        context = PROMPT + sequences(output)[0][:emitted]
        aux, _ = target_features(target, head, context[:-1])
        _, hidden = head.step(torch.tensor(context[1:]), head.fuse(aux), head.new_cache())
        torch.testing.assert_close(draft_hidden[0, 0], hidden[-1], rtol=1e-4, atol=1e-5)
        emitted += stats.emitted


def test_a_diversed_head_of_zero_keeps_every_draft(wide_eagle):
    target, head = wide_eagle
    output = SpeculativeDecoder(target, head, method="diversed", head=RecordingHead(0.0), max_draft=3).generate(
        [PROMPT, [3]], max_new_tokens=17, seed=2)
    assert all(stats.accepted == stats.drafted for rounds in output.rounds for stats in rounds)


@pytest.mark.parametrize("kind", ["gate", "fly"])
def test_the_gate_and_fly_run_on_eagle_drafts(wide_eagle, kind):
    from diversed_ext.decoding import Fly, Gate

    target, head = wide_eagle
    extra = {"gate": Gate()} if kind == "gate" else {"fly": Fly()}
    output = SpeculativeDecoder(target, head, method="sd", max_draft=4, temperature=1.0, **extra).generate(
        PROMPTS, max_new_tokens=20, seed=6)
    summary = output.summary()
    assert summary.new_tokens == 20 * len(PROMPTS) and 0 < summary.accepted <= summary.drafted


# ---- errors ----------------------------------------------------------------------------------------------------------


def test_a_head_that_does_not_fit_the_target_is_refused_naming_draft(wide_eagle):
    target, head = wide_eagle
    small_target, _ = small_pair_models()
    with pytest.raises(ValueError, match="draft: the EAGLE-3 head maps to a vocabulary of 32"):
        SpeculativeDecoder(small_target, head, method="sd")
    config = Eagle3Config.from_target(target.config.to_dict(), 8, aux_layer_ids=(0, 1, 2))
    deep = Eagle3Head(config, target.model.embed_tokens)
    with pytest.raises(ValueError, match=r"draft: the EAGLE-3 head reads target layers \[0, 1, 2\]"):
        SpeculativeDecoder(target, deep, method="sd")
    with pytest.raises(ValueError, match="not both"):
        SpeculativeDecoder(target, head, method="sd", drafter=lambda context, k: [])


# ---- the command line ------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_pair_loader(monkeypatch, wide_eagle):
    """The commands' pair loader returning the wide target (no tokenizer needed to load a head)."""
    from diversed_ext.cli import common

    target, _ = wide_eagle
    monkeypatch.setattr(common, "_load_pair", lambda name, draft, device: (target, None, None))
    return common


@pytest.mark.parametrize("kwargs, expected", [
    ({"drafter_path": "/no/such/folder"}, "--drafter-path /no/such/folder: no such folder"),
    ({"drafter": "model", "drafter_path": "."}, "--drafter-path names an EAGLE-3 head"),
    ({"drafter": "eagle3", "draft": "x"}, "--drafter eagle3 drafts in place of a draft model: drop --draft"),
])
def test_drafter_flag_mistakes_are_usage_errors_before_models_load(monkeypatch, kwargs, expected):
    from diversed_ext.cli import common

    monkeypatch.setattr(common, "_load_pair", lambda *args: pytest.fail("models loaded before the flags were checked"))
    draft = kwargs.pop("draft", None)
    with pytest.raises(common.UsageError, match=expected):
        common.load_models(None, draft, "cpu", **kwargs)


def test_a_saved_head_loads_through_drafter_path_and_a_bad_one_names_the_flag(tmp_path, tiny_pair_loader,
                                                                               wide_eagle):
    target, head = wide_eagle
    head.save_pretrained(tmp_path / "good")
    _, loaded, _ = tiny_pair_loader.load_models(None, None, "cpu", drafter_path=str(tmp_path / "good"))
    output = SpeculativeDecoder(target, loaded, method="sd", temperature=0).generate(PROMPT, max_new_tokens=12)
    expected = SpeculativeDecoder(target, head, method="sd", temperature=0).generate(PROMPT, max_new_tokens=12)
    assert output.rounds[0][1:] and [stats.draft_tokens for stats in output.rounds[0]] == \
        [stats.draft_tokens for stats in expected.rounds[0]]
    (tmp_path / "empty").mkdir()
    with pytest.raises(tiny_pair_loader.UsageError, match=f"cannot load --drafter-path {tmp_path / 'empty'}: "):
        tiny_pair_loader.load_models(None, None, "cpu", drafter_path=str(tmp_path / "empty"))
    small_target, _ = small_pair_models()
    foreign = Eagle3Head(Eagle3Config.from_target(small_target.config.to_dict(), 3, aux_layer_ids=(0, 0, 0)),
                         small_target.model.embed_tokens)
    foreign.save_pretrained(tmp_path / "foreign")
    with pytest.raises(tiny_pair_loader.UsageError, match="cannot load --drafter-path .*foreign: .*embed_tokens"):
        tiny_pair_loader.load_models(None, None, "cpu", drafter_path=str(tmp_path / "foreign"))


@pytest.mark.parametrize("drafter, int8", [("eagle3", False), ("eagle3-int8", True)])
def test_drafter_eagle3_int8_loads_the_head_with_int8_products(tmp_path, tiny_pair_loader, wide_eagle, drafter, int8):
    from diversed_ext.models.eagle3_layers import int8_products

    _, head = wide_eagle
    head.save_pretrained(tmp_path / "head")
    _, loaded, _ = tiny_pair_loader.load_models(None, None, "cpu", drafter=drafter, drafter_path=str(tmp_path / "head"))
    assert int8_products(loaded) is int8
    with pytest.raises(tiny_pair_loader.UsageError, match=f"--drafter {drafter} drafts in place of a draft model"):
        tiny_pair_loader.load_models(None, "x", "cpu", drafter=drafter)


def test_eval_scores_every_closed_form_rule_with_an_eagle_head(wide_eagle):
    """The harness's divergence to the target with an EAGLE-3 drafter: exact sd's is 0; a lossy rule's closed form
    reads the head's q at each token's draft step, so it is measured (finite, above 0)."""
    import math

    from diversed_ext.research.harness import evaluate, method_specs
    from diversed_ext.research.tasks import get_task
    from helpers import CharTokenizer, gsm8k_examples

    target, head = wide_eagle
    results = evaluate(get_task("gsm8k"), gsm8k_examples(2), target, head, CharTokenizer(),
                       method_specs(["sd", "gate"], []), max_new_tokens=6, progress=False, batch_size=1)
    by_label = {result.label: result for result in results}
    assert all(abs(value) < 1e-9 for value in by_label["sd"].kl_per_prompt + by_label["sd"].tv_per_prompt)
    assert all(math.isfinite(value) and value > 0 for value in by_label["gate"].kl_per_prompt
               + by_label["gate"].tv_per_prompt)


def test_a_static_rules_tv_with_an_eagle_head_is_its_weight_times_the_heads_tv_at_each_draft_step(wide_eagle):
    """Static w: out = w p + (1 - w) q at each position, so TV(out, p) = (1 - w) TV(q, p), q the head's at the step the
    loop drafted each token at (teacher forcing's total_variation with the same steps); at step 0 everywhere the
    figure differs, so the steps are read."""
    from diversed_ext.research.divergence import RuleLaw, position_divergences
    from diversed_ext.research.rollouts import draft_steps
    from diversed_ext.research.teacher_forcing import teacher_forced_tokens

    target, head = wide_eagle
    prompts = [PROMPT, [7, 7, 8, 30, 2, 11], [4, 9, 4, 9, 4]]
    output = SpeculativeDecoder(target, head, method="static", weight=0.3, max_draft=4).generate(
        prompts, max_new_tokens=24, seed=3)
    completions = [tokens.tolist() for tokens in output.sequences]
    steps = [draft_steps(rounds) for rounds in output.rounds]
    assert any(step > 0 for row in steps for step in row)
    law = RuleLaw("static", 0.3)
    measured = position_divergences(target, head, prompts, completions, law, draft_steps=steps)
    batch = teacher_forced_tokens(target, head, prompts, completions, draft_steps=steps)
    expected = [0.7 * float(tv[mask].double().mean()) for tv, mask in zip(batch.total_variation, batch.mask)]
    assert [tv for _, tv in measured] == pytest.approx(expected, rel=1e-4)
    at_step_zero = position_divergences(target, head, prompts, completions, law)
    assert max(abs(a[1] - b[1]) for a, b in zip(at_step_zero, measured)) > 1e-3


def test_the_default_head_with_an_eagle_drafter_is_the_one_trained_on_its_states(wide_eagle):
    """``--head default`` names the head for the drafter at hand: the shipped heads are the default pair's (hidden
    size 576), so on the tiny pair the refusal shows which folder was picked."""
    from diversed_ext.cli import common
    from diversed_ext.head import DEFAULT_EAGLE3_HEAD_NAME, DEFAULT_HEAD_NAME

    target, head = wide_eagle
    _, draft = wide_pair_models()
    for drafter, name in ((head, DEFAULT_EAGLE3_HEAD_NAME), (draft, DEFAULT_HEAD_NAME)):
        with pytest.raises(common.UsageError, match=f"cannot load --head default: the head at .*/{name}' expects"):
            common._load_head("default", target, drafter)
