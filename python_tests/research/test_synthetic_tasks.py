"""The generated task suite: deterministic examples per seed, disjoint splits, the exact-match rule, the CLI path."""

import collections
import json

import pytest

from diversed_ext.research import synthetic_tasks as synthetic
from diversed_ext.research.tasks import TASKS, get_task, load_task_examples
from helpers import commands_use

# ---------------------------------------------------------------------------------------------------- generation


def test_examples_are_deterministic_per_seed_and_differ_across_seeds():
    first = synthetic.load_synthetic("test", 50)
    assert first == synthetic.load_synthetic("test", 50)  # regenerated from the same seeds: the same examples
    assert [example["seed"] for example in first] == list(range(1_000_000_000, 1_000_000_050))
    # Different seeds, different problems: the large families repeat none here; days (seven questions) and sequence
    # (80) may repeat by chance, but not mostly.
    prompts = [example["prompt"] for example in first if example["family"] in ("add", "copy", "lookup")]
    assert len(set(prompts)) == len(prompts) == 30
    for family in ("days", "sequence"):
        assert len({example["prompt"] for example in first if example["family"] == family}) > 5
    # Ten of each family, in turn.
    counts = collections.Counter(example["family"] for example in first)
    assert set(counts) == set(synthetic.FAMILY_NAMES) and set(counts.values()) == {10}
    assert first[0]["family"] == synthetic.FAMILY_NAMES[0] and first[1]["family"] == synthetic.FAMILY_NAMES[1]


def test_train_and_test_splits_use_disjoint_seeds():
    train, test = synthetic.load_synthetic("train", 200), synthetic.load_synthetic("test", 200)
    assert max(example["seed"] for example in train) < synthetic.SPLIT_SEEDS["test"]
    assert {example["prompt"] for example in train if example["family"] in ("add", "copy", "lookup")}.isdisjoint(
        example["prompt"] for example in test)  # the large families: no problem in common by chance either
    with pytest.raises(ValueError, match="outside"):
        synthetic.make_example("train", synthetic.SPLIT_SIZE)  # would reach the test split's seeds
    with pytest.raises(ValueError, match="split"):
        synthetic.load_synthetic("validation", 3)


def test_answers_are_right_and_shots_never_give_the_question_away():
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    for example in synthetic.load_synthetic("train", 100):
        *shots, question = example["prompt"].split("\n")
        answer, family = example["answer"], example["family"]
        if family in ("add", "copy"):
            assert len(shots) == synthetic.SHOTS and len(set(shots)) == synthetic.SHOTS
            assert all(not shot.startswith(question + " ") for shot in shots)
        if family == "add":
            a, b = question.rstrip(" =").split(" + ")
            assert int(answer) == int(a) + int(b) and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
            assert all(int(shot.split(" = ")[1]) == sum(map(int, shot.split(" = ")[0].split(" + "))) for shot in shots)
        elif family == "copy":
            assert question == f"Copy: {answer} ->" and len(answer.split()) == 3
        elif family == "sequence":
            terms = [int(term) for term in question.rstrip(",").split(", ")] + [int(answer)]
            assert len(terms) == 6 and len({b - a for a, b in zip(terms, terms[1:])}) == 1 and not shots
        elif family == "days":
            named = question.rstrip(",").split(", ") + [answer]
            assert all(days.index(b) == (days.index(a) + 1) % 7 for a, b in zip(named, named[1:]))
        else:
            passage, shown = shots
            assert f"{question.split(chr(39))[0]} has a {answer} hat." in passage
            assert shown.split(": ")[1] != answer and passage.count(" hat.") == 4


def test_the_task_is_registered_without_a_data_file():
    task = get_task("synthetic")
    assert task is TASKS["synthetic"] and not task.chat and task.metric == "exact_match"
    examples = load_task_examples(task, None, limit=5, skip=7)  # --data left out: the held-out split
    assert [example["index"] for example in examples] == list(range(7, 12))
    assert load_task_examples(task, "train", limit=2)[0]["split"] == "train"
    assert len(load_task_examples(task, None)) == synthetic.DEFAULT_COUNT
    with pytest.raises(ValueError, match="--data names a split"):
        load_task_examples(task, "data.jsonl", limit=2)

# ---------------------------------------------------------------------------------------------------- scoring


def _example(answer):
    return {"answer": answer}


@pytest.mark.parametrize("completion", [" 9", "9", " 9\n4 + 4 = 8", "9.", " 9 \n", "\n9\n", '"9"', "09", "9.0",
                                        " 9.\nanything after the line", " 9, 10, 11,", " and 9"])
def test_a_number_is_credited_with_harmless_formatting(completion):
    assert synthetic.synthetic_exact_match(_example("9"), completion) == 1.0


@pytest.mark.parametrize("completion", [" 8", " 9 + 1", " 10, 9", " 19", " 9 10", "The answer is 9", " -9", "",
                                        " nine", "\n", " 8\n9", " 9a", " 8 and 9", " (9)", " 9 (no)"])
def test_a_number_is_refused_when_wrong_or_among_other_text(completion):
    assert synthetic.synthetic_exact_match(_example("9"), completion) == 0.0


@pytest.mark.parametrize("answer, completion", [("Tuesday", " tuesday"), ("Tuesday", " Tuesday.\nTuesday ->"),
                                                ("Tuesday", " and Tuesday, Wednesday"),
                                                ("Tuesday", " Tuesday, Wednesday, Thursday"),
                                                ("dog cat ship", " dog  cat ship"), ("dog cat ship", " 'dog cat ship'"),
                                                ("Q", " 'Q'"), ("green", " Green")])
def test_words_are_credited_ignoring_case_quotes_and_a_list_going_on(answer, completion):
    assert synthetic.synthetic_exact_match(_example(answer), completion) == 1.0


@pytest.mark.parametrize("answer, completion", [("Tuesday", " Wednesday"), ("Tuesday", " Tuesday Wednesday"),
                                                ("Tuesday", " Monday, Tuesday"), ("Tuesday", " and"),
                                                ("dog cat ship", " dog cat"), ("dog cat ship", " cat dog ship"),
                                                ("dog cat ship", " dog cat ship cake"),
                                                ("dog cat ship", " dog, cat, ship"),
                                                ("Q", " QR"), ("green", " green hat"), ("green", " blue\ngreen")])
def test_words_are_refused_when_wrong_incomplete_or_extended(answer, completion):
    assert synthetic.synthetic_exact_match(_example(answer), completion) == 0.0


def test_every_reference_scores_one_as_a_model_would_write_it():
    for example in synthetic.load_synthetic("test", 50):
        assert synthetic.synthetic_exact_match(example, f" {example['answer']}\n") == 1.0
        assert synthetic.synthetic_exact_match(example, f" {example['answer']} x\n") == 0.0

# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_eval_and_pareto_run_without_data(experiment_pair, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from diversed_ext import cli

    target, draft, tokenizer = experiment_pair
    seen = []
    encode = tokenizer.__class__.__call__

    class ChatTokenizer(tokenizer.__class__):
        """Has a chat template the synthetic task must not use: prompts reach the model as plain text."""

        chat_template = "{{ messages }}"

        def apply_chat_template(self, *args, **kwargs):
            raise AssertionError("the synthetic task's prompts are plain text")

        def __call__(self, text):
            seen.append(text)
            return encode(self, text)

    chat_tokenizer = ChatTokenizer()
    commands_use(monkeypatch, (target, draft, chat_tokenizer))
    assert cli.main(["eval", "--task", "synthetic", "--limit", "3", "--skip", "7", "--method", "ar", "sd",
                     "--max-new-tokens", "4"]) == 0
    output = capsys.readouterr().out
    assert "synthetic: 3 prompts" in output and "| ar |" in output and "| sd |" in output
    assert seen == [example["prompt"] for example in synthetic.load_synthetic("test", 10)[7:]]
    assert cli.main(["pareto", "--task", "synthetic", "--limit", "2", "--weights", "0.5", "1",
                     "--max-new-tokens", "4", "--output-dir", str(tmp_path / "pareto")]) == 0
    record = json.loads((tmp_path / "pareto" / "results.json").read_text())
    assert json.dumps(record).count('"synthetic"') >= 1 and '"chat": false' in json.dumps(record)
    # Training reads the train split, named by --data; a file name is refused with the argument named.
    seen.clear()
    assert cli.main(["train", "--task", "synthetic", "--data", "train", "--limit", "4", "--steps", "1",
                     "--batch-size", "2", "--max-new-tokens", "4", "--output-dir", str(tmp_path / "run")]) == 0
    assert set(seen) <= {example["prompt"] for example in synthetic.load_synthetic("train", 4)} and seen
    capsys.readouterr()
    assert cli.main(["eval", "--task", "synthetic", "--data", "nope.jsonl", "--limit", "1"]) == 2
    assert "--data" in capsys.readouterr().err
