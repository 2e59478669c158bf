"""Checks across a command's flags, made before any model loads (diversed_ext/cli/checks.py): a value given twice to
one flag, which would make two rows under one label and pool their prompts, and a rule that needs a sampling
temperature asked for at --temperature 0."""

import pytest

pytest.importorskip("transformers")

from diversed_ext import cli  # noqa: E402
from diversed_ext.research.harness import run_interleaved  # noqa: E402
from helpers import gsm8k_file, run_cli  # noqa: E402


@pytest.fixture
def data(tmp_path):
    return gsm8k_file(tmp_path / "data.jsonl", 1)


@pytest.mark.parametrize("argv, expected", [
    (["eval", "--method", "sd", "sd"], "--method: sd is given twice"),
    (["eval", "--method", "sd", "static", "--weight", "0.5", "0.5"], "--weight: 0.5 is given twice"),
    (["eval", "--method", "static", "--weight", "0.5", ".5"], "--weight: 0.5 is given twice"),  # as parsed
    (["eval", "--draft-length", "fixed", "gain", "fixed"], "--draft-length: fixed is given twice"),
    (["eval", "--draft-length", "fixed", "--fixed-k", "3", "2", "3"], "--fixed-k: 3 is given twice"),
    (["pareto", "--weights", "1", "1"], "--weights: 1 is given twice"),
    (["pareto", "--gate-margin", "1", "2", "1.0"], "--gate-margin: 1 is given twice"),
    (["pareto", "--head", "default", "default"], "--head: default is given twice"),
    (["pareto", "--temperatures", "0.7", "0.7"], "--temperatures: 0.7 is given twice"),
    (["pareto", "--typical", "0.09", "0.09"], "--typical: 0.09 is given twice"),
    (["pareto", "--fly", "--fly-thresholds", "0.1", "0.1"], "--fly-thresholds: 0.1 is given twice"),
    (["validate", "--acceptance-coef", "2", "2"], "--acceptance-coef: 2 is given twice"),
    (["compare-drafts", "--drafts", "tokens", "tokens"], "--drafts: tokens is given twice"),
    (["demo", "--weights", "0.5", "0.5"], "--weights: 0.5 is given twice"),
])
def test_a_value_given_twice_is_refused_naming_the_flag(tmp_path, data, capsys, no_models, argv, expected):
    """Each value is one row labelled by it: given twice, the two rows' per-prompt values would be pooled under one
    label, doubling the samples behind its standard errors."""
    extra = [] if argv[0] == "demo" else ["--data", data]
    extra += ["--output-dir", str(tmp_path / "out")] if argv[0] == "pareto" else []
    status, error = run_cli([*argv, *extra], capsys)
    assert status == 2 and error == f"diversed: {expected}; each value makes one row, so give it once", error


def test_distinct_values_pass_the_check(data, capsys, no_models):
    with pytest.raises(AssertionError, match="models were loaded"):
        cli.main(["eval", "--data", data, "--method", "sd", "static", "--weight", "0.25", "0.5"])


def test_runners_under_one_label_are_refused():
    def run(indices, seed, max_new_tokens):
        return list(indices)

    with pytest.raises(ValueError, match="'sd' is given twice"):
        run_interleaved([("sd", run), ("sd", run)], 2, seed=0, max_new_tokens=1, progress=False)


@pytest.mark.parametrize("argv, expected", [
    (["eval", "--method", "sd", "gate"], "--temperature 0 with --method gate: gate needs temperature > 0"),
    (["eval", "--method", "static+gate", "diversed+gate", "--head", "default"],
     "--temperature 0 with --method static+gate diversed+gate: gate needs temperature > 0"),
    (["eval", "--method", "typical"], "--temperature 0 with --method typical: typical needs temperature > 0"),
    (["pareto", "--gate-margin", "1"], "--temperature 0 with --gate-margin: gate needs temperature > 0"),
    (["pareto", "--typical"], "--temperature 0 with --typical: typical needs temperature > 0"),
    (["pareto", "--typical", "0.1", "--temperature", "0.0"], "--temperature 0 with --typical: typical needs"),
])
def test_a_rule_that_needs_sampling_at_temperature_0_is_refused_before_any_model_loads(tmp_path, data, capsys,
                                                                                       no_models, argv, expected):
    extra = ["--output-dir", str(tmp_path / "out")] if argv[0] == "pareto" else []
    temperature = [] if "--temperature" in argv else ["--temperature", "0"]
    status, error = run_cli([*argv, *temperature, "--data", data, *extra], capsys)
    assert status == 2 and error.startswith(f"diversed: {expected}") and "\n" not in error, error


@pytest.mark.parametrize("argv", [["eval", "--method", "sd", "fly", "static", "--temperature", "0"],
                                  ["eval", "--method", "gate", "typical", "--temperature", "0.5"],
                                  ["pareto", "--temperatures", "0.7", "--temperature", "0"]])
def test_greedy_rules_and_sampled_gates_pass_the_check(tmp_path, data, no_models, argv):
    extra = ["--output-dir", str(tmp_path / "out")] if argv[0] == "pareto" else []
    with pytest.raises(AssertionError, match="models were loaded"):
        cli.main([*argv, "--data", data, *extra])
