"""One rule per kind of number (diversed_ext.rules), one default per option: the command line takes its defaults from
the library, and a shipped head's recipe reruns the options that trained it."""

import argparse
import json
import math
import os

import pytest

pytest.importorskip("safetensors")
from diversed_ext import cli, rules  # noqa: E402
from diversed_ext.cli.common import library_defaults  # noqa: E402
from diversed_ext.decoding import DEFAULT_MAX_DRAFT, SpeculativeDecoder  # noqa: E402
from diversed_ext.head import EnsembleHead, head_recipe, load_head, shipped_heads  # noqa: E402
from diversed_ext.research.harness import evaluate, run_demo  # noqa: E402
from diversed_ext.research.recipes import build_trainer  # noqa: E402
from diversed_ext.research.trainer import TrainerConfig  # noqa: E402
from diversed_ext.research.validation import sample_validation_tokens  # noqa: E402


@pytest.mark.parametrize("rule, good, bad_values, bad_types", [
    (rules.weight, [0, 0.0, 0.25, 1, 1.0], [-0.1, 1.5, math.nan, math.inf], ["0.5", True, None]),
    (rules.positive_weight, [0.5, 1.0], [0.0, -1.0, 1.01, math.nan], ["1", False]),
    (rules.temperature, [0, 0.0, 0.7, 2], [-1e-9, math.nan, math.inf], ["1", True]),
    (rules.draft_length, [1, 7], [0, -3], [2.0, "3", True]),
    (rules.seed, [0, -5, 2**63 - 1, 2**64 - 1, -(2**63)], [2**64, -(2**63) - 1], [1.5, "3", True]),
])
def test_each_rule_accepts_and_refuses_naming_the_argument(rule, good, bad_values, bad_types):
    for value in good:
        rule(value, "x")
    for value in bad_values:
        with pytest.raises(ValueError, match="^x "):
            rule(value, "x")
    for value in bad_types:
        with pytest.raises(TypeError, match="^x must be"):
            rule(value, "x")


def test_seeds_keep_the_ops_int64_reading():
    assert rules.seed(2**63) == -(2**63) and rules.seed(2**64 - 1) == -1 and rules.seed(-7) == -7


def test_the_decoder_the_command_line_and_the_vllm_settings_share_the_weight_rule():
    from diversed_ext.vllm_plugin.settings import weight_value

    for value in (0.0, 0.3, 1, 1.5, -0.1, math.nan, "0.5", True):
        try:
            expected = rules.weight(value)
        except (TypeError, ValueError):
            expected = None
        try:
            settings = weight_value(value, "w")
        except ValueError:
            settings = None
        assert settings == expected, value
        try:
            parsed = cli.common._unit_float(str(value))
        except argparse.ArgumentTypeError:  # argparse's refusal; any other exception is a crash and fails the test
            parsed = None
        if not isinstance(value, (str, bool)):
            assert (parsed is None) == (expected is None), value


def _parsed(command: str, *extra) -> dict:
    required = {"generate": ["--prompt", "hi"]}.get(command, [])
    return vars(cli.build_parser().parse_args([command, *required, *extra]))


@pytest.mark.parametrize("command, functions", [
    ("generate", (SpeculativeDecoder.generate, SpeculativeDecoder)),
    ("demo", (run_demo,)),
    ("eval", (evaluate,)),
    ("pareto", (evaluate,)),
    ("compare-drafts", (evaluate,)),
    ("validate", (sample_validation_tokens,)),
    ("train", (build_trainer, TrainerConfig)),
])
def test_every_command_takes_its_defaults_from_the_library(command, functions):
    parsed = _parsed(command)
    defaults = library_defaults(*functions)
    for name in ("max_draft", "temperature", "max_new_tokens", "seed", "batch_size"):
        if name in parsed:
            assert parsed[name] == defaults[name], (command, name)
    assert parsed["max_draft"] == DEFAULT_MAX_DRAFT


def test_train_defaults_are_the_trainer_config():
    parsed, config = _parsed("train"), TrainerConfig(output_dir="x")
    names = {"steps": "steps", "batch_size": "batch_size", "lr": "learning_rate", "warmup_steps": "warmup_steps",
             "acceptance_coef": "acceptance_coef", "fidelity_coef": "fidelity_coef", "epochs": "epochs",
             "expected_fidelity_coef": "expected_fidelity_coef", "expected_kl_coef": "expected_kl_coef",
             "closed_form": "closed_form",
             "checkpoint_every": "checkpoint_every", "temperature": "temperature", "seed": "seed"}
    for option, field in names.items():
        assert parsed[option] == getattr(config, field), option


@pytest.mark.skipif(not shipped_heads(), reason="no shipped heads")
def test_every_shipped_head_records_the_recipe_that_trained_it():
    for name in shipped_heads():
        recipe = head_recipe(name)
        assert recipe["task"] == "gsm8k" and recipe["max_draft"] == 3 and recipe["head_inputs"] == "both", name
        assert load_head(name).config.recipe == recipe


def test_recipe_reruns_the_recorded_options_and_given_options_win(tmp_path):
    parser = cli.build_parser()
    argv = ["train", "--recipe", "smollm2-135m-lambda4", "--steps", "2", "--data", "mine.jsonl"]
    args = cli.with_recipe(parser, argv, parser.parse_args(argv))
    recipe = head_recipe("smollm2-135m-lambda4")
    assert (args.steps, args.data, args.output_dir) == (2, "mine.jsonl", "runs/smollm2-135m-lambda4")
    for name in ("acceptance_coef", "lr", "epochs", "batch_size", "limit", "max_new_tokens", "closed_form"):
        assert getattr(args, name) == recipe[name], name


def test_a_trained_head_records_its_recipe_and_a_recipe_round_trips(tmp_path):
    head = EnsembleHead(4, 4, recipe={"steps": 3, "lr": 0.5, "task": "gsm8k"})
    head.save(str(tmp_path / "head"))
    assert json.loads((tmp_path / "head" / "head.json").read_text())["recipe"] == {"steps": 3, "lr": 0.5,
                                                                                   "task": "gsm8k"}
    parser = cli.build_parser()
    argv = ["train", "--recipe", str(tmp_path / "head"), "--data", "d.jsonl"]
    args = cli.with_recipe(parser, argv, parser.parse_args(argv))
    assert cli.train.recipe_of(args) == {**cli.train.recipe_of(parser.parse_args(["train", "--data", "d.jsonl"])),
                                         "steps": 3, "lr": 0.5}


def test_a_recipe_records_the_data_file_without_this_machines_path():
    parser = cli.build_parser()
    machine_path = os.path.join(os.sep, "srv", "copies", "gsm8k", "train.jsonl")
    args = parser.parse_args(["train", "--data", machine_path])
    assert cli.train.recipe_of(args)["data"] == os.path.join("gsm8k", "train.jsonl")
    assert cli.train.recipe_of(parser.parse_args(["train", "--data", "d.jsonl"]))["data"] == "d.jsonl"
    args = parser.parse_args(["train", "--data", "d.jsonl", "--mix-in", f"gsm8k:{machine_path}:40"])
    assert cli.train.recipe_of(args)["mix_in"] == f"gsm8k:{os.path.join('gsm8k', 'train.jsonl')}:40"
    args = parser.parse_args(["train", "--data", "d.jsonl", "--mix-in", "synthetic:train:3500"])
    assert cli.train.recipe_of(args)["mix_in"] == "synthetic:train:3500"


def test_recipe_mistakes_are_one_line_errors(tmp_path, capsys):
    EnsembleHead(4, 4).save(str(tmp_path / "plain"))
    EnsembleHead(4, 4, recipe={"flux": 1}).save(str(tmp_path / "odd"))
    for folder, expected in (("plain", "records no recipe"), ("odd", "'flux'"), ("absent", "cannot read --recipe")):
        assert cli.main(["train", "--recipe", str(tmp_path / folder)]) == 2
        error = capsys.readouterr().err
        assert expected in error and "\n" not in error.strip()
    assert cli.main(["train", "--recipe", "smollm2-135m-lambda4", "--output-dir", str(tmp_path / "run")]) == 2
    assert "pass --data PATH" in capsys.readouterr().err
