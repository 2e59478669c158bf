"""train / eval / pareto: argument parsing, and the functions behind them end to end on a tiny random Llama pair."""

import math
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext import cli  # noqa: E402
from diversed_ext.research import harness, plots, recipes, report  # noqa: E402
from diversed_ext.head import (DEFAULT_HEAD_DIR, DISTRIBUTION_FEATURES, EnsembleHead, load_head,  # noqa: E402
                               wants_distributions)
from diversed_ext.research.tasks import TASKS  # noqa: E402
from helpers import commands_use, gsm8k_examples, gsm8k_file  # noqa: E402

# ---------------------------------------------------------------------------------------------------- parsing

def test_train_arguments():
    args = cli.build_parser().parse_args(["train", "--task", "gsm8k", "--data", "d.jsonl", "--steps", "3",
                                          "--batch-size", "2", "--lr", "0.01", "--acceptance-coef", "0.2",
                                          "--fidelity-coef", "0.5", "--max-new-tokens", "16", "--resume",
                                          "--output-dir", "out"])
    assert (args.command, args.task, args.data, args.steps, args.batch_size) == ("train", "gsm8k", "d.jsonl", 3, 2)
    assert (args.lr, args.acceptance_coef, args.fidelity_coef, args.max_new_tokens) == (0.01, 0.2, 0.5, 16)
    assert args.resume and args.output_dir == "out" and args.rollout == "speculative"
    assert cli.build_parser().parse_args(["train", "--data", "d"]).max_new_tokens == 48


def test_eval_and_pareto_arguments():
    args = cli.build_parser().parse_args(["eval", "--data", "d", "--method", "sd", "static", "diversed",
                                          "--weight", "0.25", "0.5", "--head", "h", "--limit", "5"])
    assert args.method == ["sd", "static", "diversed"] and args.weight == [0.25, 0.5] and args.limit == 5
    args = cli.build_parser().parse_args(["pareto", "--data", "d"])
    assert args.weights == list(harness.PARETO_WEIGHTS) and len(args.weights) >= 8 and args.head is None
    assert cli.build_parser().parse_args(["pareto", "--data", "d", "--head", "a", "b"]).head == ["a", "b"]


@pytest.mark.parametrize("argv", [["eval", "--method", "beam"], ["eval", "--weight", "1.5"],
                                  ["train", "--steps", "0"], ["train", "--acceptance-coef", "-1"],
                                  ["pareto", "--task", "nope"]])
def test_bad_arguments_exit(argv):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv)


def test_train_needs_data(capsys):
    assert cli.main(["train", "--task", "gsm8k"]) == 2  # a user's mistake: one line, exit status 2
    assert "--data" in capsys.readouterr().err


def test_method_specs():
    labels = [label for label, _ in harness.method_specs(["ar", "sd", "static"], [0.25, 0.75])]
    assert labels == ["ar", "sd", "static w=0.25", "static w=0.75"]
    with pytest.raises(ValueError, match="head"):
        harness.method_specs(["diversed"], [])
    assert [label for label, _ in harness.pareto_methods((0.0, 1.0), head=lambda d, t: None)] == [
        "static w=0", "static w=1", "diversed"]


# ---------------------------------------------------------------------------------------------------- end to end

def result(label, weight, acceptance, fidelities, qualities):
    return report.MethodResult(label, weight, acceptance, 1.0, sum(qualities) / len(qualities),
                                    sum(fidelities) / len(fidelities), 1.0, 10, 1.0, tuple(fidelities),
                                    tuple(qualities))


def test_paired_comparison_against_sd_and_the_static_frontier():
    results = [result("static w=0.5", 0.5, 0.7, [-3.0, -2.0, -4.0], [0.0, 0.0, 1.0]),
               result("sd", 1.0, 0.5, [-2.0, -1.0, -3.0], [0.0, 1.0, 1.0]),
               result("diversed", 0.6, 0.6, [-2.0, -1.5, -3.5], [1.0, 0.0, 1.0])]
    against_sd, against_frontier = report.compare_to_baselines(results)
    assert against_sd.baseline.startswith("sd")
    assert math.isclose(against_sd.fidelity, (0.0 - 0.5 - 0.5) / 3)  # paired: prompt by prompt
    assert math.isclose(against_sd.quality, (1.0 - 1.0 + 0.0) / 3)
    # Acceptance 0.6 is half-way between the two static points: the frontier is their per-prompt average.
    assert "w = 0.75" in against_frontier.baseline
    frontier = [-2.5, -1.5, -3.5]
    expected = [a - b for a, b in zip([-2.0, -1.5, -3.5], frontier)]
    assert math.isclose(against_frontier.fidelity, sum(expected) / 3)
    mean = sum(expected) / 3
    assert math.isclose(against_frontier.fidelity_se, math.sqrt(sum((x - mean) ** 2 for x in expected) / 2 / 3))
    text = report.comparison_lines([against_sd, against_frontier])
    assert text.count("paired over prompts") == 2
    assert report.compare_to_baselines(results[:2]) == []  # no diversed row: nothing to compare


def test_evaluate_on_a_tiny_pair(experiment_pair, tmp_path):
    target, draft, tokenizer = experiment_pair
    head = EnsembleHead(16, 16, init_weight=0.5)
    specs = harness.method_specs(["ar", "sd", "static", "diversed"], [0.0], head)
    results = harness.evaluate(TASKS["gsm8k"], gsm8k_examples(), target, draft, tokenizer, specs,
                                   max_draft=3, max_new_tokens=8, seed=5, progress=False)
    by_label = {row.label: row for row in results}
    assert list(by_label) == ["ar", "sd", "static w=0", "diversed"]
    assert math.isnan(by_label["ar"].acceptance) and by_label["ar"].tokens_per_pass == 1.0
    assert by_label["static w=0"].acceptance == 1.0  # w = 0: nu = q, every draft is accepted
    assert by_label["sd"].weight == 1.0
    assert by_label["diversed"].weight == pytest.approx(0.5)  # the untrained head's weight, as recorded
    for row in results:
        assert row.new_tokens == 3 * 8  # no EOS among the tiny vocabulary's ids: every prompt runs to the limit
        assert 0.0 <= row.quality <= 1.0 and row.fidelity < 0 and row.tokens_per_second > 0
        # The target entropy of every prompt's visited positions, scored in the same pass: at most log V.
        assert len(row.entropy_per_prompt) == 3 and 0 < row.entropy <= math.log(32) + 1e-6
    table = report.markdown_table(results, "exact_match")
    assert table.count("\n") == 1 + len(results) and "| exact_match |" in table
    assert by_label["diversed"].weight_usage.weights and by_label["sd"].weight_usage is None
    assert len(by_label["sd"].acceptance_per_prompt) == 3 and by_label["sd"].acceptance_se >= 0
    path = plots.plot_pareto(results, str(tmp_path / "pareto.png"))
    assert os.path.getsize(path) > 1000


def test_build_trainer_trains_through_the_speculative_loop(experiment_pair, tmp_path):
    from diversed_ext.research.trainer import TrainerConfig

    target, draft, tokenizer = experiment_pair
    config = TrainerConfig(output_dir=str(tmp_path), steps=2, batch_size=2, learning_rate=0.05, warmup_steps=1,
                           acceptance_coef=1.0, checkpoint_every=1)
    trainer = recipes.build_trainer(TASKS["gsm8k"], gsm8k_examples(), target, draft, tokenizer, config,
                                        max_new_tokens=6, max_draft=2)
    history = trainer.train(progress=False)
    assert len(history) == 2 and history[-1]["tokens"] > 0
    head = load_head(str(tmp_path / "head"), draft_hidden=16, target_hidden=16)
    assert not head.training


def test_mixed_in_tasks_join_the_pool_each_prompted_and_rewarded_by_its_own(experiment_pair, tmp_path):
    from diversed_ext.research.synthetic_tasks import load_synthetic
    from diversed_ext.research.trainer import TrainerConfig

    target, draft, tokenizer = experiment_pair
    config = TrainerConfig(output_dir=str(tmp_path), steps=1, batch_size=4, learning_rate=0.05, warmup_steps=1)
    math_problems, synthetic = gsm8k_examples(), load_synthetic("train", 3)
    plain = recipes.build_trainer(TASKS["gsm8k"], math_problems, target, draft, tokenizer, config, max_new_tokens=4)
    trainer = recipes.build_trainer(TASKS["gsm8k"], math_problems, target, draft, tokenizer, config,
                                    max_new_tokens=4, mixed_in=[(TASKS["synthetic"], synthetic)])
    assert trainer.prompts[:len(math_problems)] == plain.prompts
    assert trainer.prompts[len(math_problems):] == harness.encode_examples(TASKS["synthetic"], synthetic, tokenizer)
    gsm8k_answer = math_problems[0]["answer"].split("####")[-1].strip()
    assert trainer.reward(trainer.examples[0], gsm8k_answer) == 1.0
    assert trainer.reward(trainer.examples[len(math_problems)], synthetic[0]["answer"]) == 1.0
    assert trainer.reward(trainer.examples[len(math_problems)], gsm8k_answer + "x") == 0.0
    assert len(trainer.train(progress=False)) == 1


def test_cli_train_eval_pareto_end_to_end(experiment_pair, tmp_path, monkeypatch, capsys):
    target, draft, tokenizer = experiment_pair
    commands_use(monkeypatch, (target, draft, tokenizer))
    data = gsm8k_file(tmp_path / "gsm8k.jsonl")
    run = tmp_path / "run"
    assert cli.main(["train", "--data", str(data), "--steps", "1", "--batch-size", "2", "--max-new-tokens", "4",
                     "--output-dir", str(run)]) == 0
    assert (run / "head" / "head.safetensors").is_file() and (run / "train_log.jsonl").is_file()
    capsys.readouterr()
    assert cli.main(["eval", "--data", str(data), "--limit", "2", "--method", "sd", "diversed",
                     "--head", str(run / "head"), "--max-new-tokens", "4"]) == 0
    output = capsys.readouterr().out
    assert "| sd |" in output and "| diversed |" in output and "2 prompts" in output
    assert "| target entropy | g |" in output and "g = fidelity + target entropy" in output
    assert cli.main(["pareto", "--data", str(data), "--limit", "1", "--weights", "0", "1", "--max-new-tokens", "4",
                     "--output-dir", str(tmp_path / "pareto")]) == 0
    assert (tmp_path / "pareto" / "pareto.png").is_file() and (tmp_path / "pareto" / "pareto.md").is_file()
    assert not (tmp_path / "pareto" / "head_weights.png").exists()  # no head, no histogram
    # Two heads: one point each, labelled by folder, a histogram of their weights and their lowest-w tokens.
    shutil.copytree(run / "head", tmp_path / "second")
    capsys.readouterr()
    # 24 tokens a prompt: enough accept tests that w = 1 rejects some drafts whatever the draws (w = 0 rejects none),
    # so the static rows' acceptances differ and each head has a frontier to be compared with.
    assert cli.main(["pareto", "--data", str(data), "--limit", "2", "--weights", "0", "0.5", "1",
                     "--max-new-tokens", "24", "--head", str(run / "head"), str(tmp_path / "second"),
                     "--output-dir", str(tmp_path / "heads")]) == 0
    table = capsys.readouterr().out
    assert "| diversed:head |" in table and "| diversed:second |" in table
    placed = table.split("task: above FLy's frontier |")[1]  # the table of each rule against the lines
    assert "| diversed:head |" in placed and "| diversed:second |" in placed
    assert os.path.getsize(tmp_path / "heads" / "head_weights.png") > 1000
    lowest = (tmp_path / "heads" / "lowest_w_tokens.md").read_text()
    assert "### diversed:head:" in lowest and "### diversed:second:" in lowest
    # Two folders with one name would give two points one label: refused before any model runs.
    shutil.copytree(run / "head", tmp_path / "elsewhere" / "head")
    assert cli.main(["pareto", "--data", str(data), "--head", str(run / "head"), str(tmp_path / "elsewhere" / "head"),
                     "--output-dir", str(tmp_path / "clash")]) == 2
    assert "share a name" in capsys.readouterr().err


def test_compare_drafts_end_to_end(experiment_pair, tmp_path, monkeypatch, capsys):
    """diversed compare-drafts: sd and static w, each with the draft's distributions and its tokens only (and an
    n-gram drafter), in one table with the paired differences against the first source."""
    target, draft, tokenizer = experiment_pair
    commands_use(monkeypatch, (target, draft, tokenizer))
    data = gsm8k_file(tmp_path / "gsm8k.jsonl")
    assert cli.main(["compare-drafts", "--data", str(data), "--limit", "2", "--max-new-tokens", "6",
                     "--drafts", "distributions", "tokens", "ngram", "--weight", "0.5"]) == 0
    output = capsys.readouterr().out
    for label in ("sd / distributions", "sd / tokens", "sd / ngram", "static w=0.5 / distributions",
                  "static w=0.5 / tokens", "static w=0.5 / ngram"):
        assert f"| {label} |" in output
    assert output.count("paired over prompts") == 4  # two sources against the first, for each method
    assert "sd / tokens - sd / distributions: fidelity" in output and "2 prompts" in output


def test_draft_source_specs_and_their_comparisons():
    specs = harness.draft_source_specs(["distributions", "tokens", "ngram"], [0.25])
    assert [label for label, _ in specs] == ["sd / distributions", "sd / tokens", "sd / ngram",
                                             "static w=0.25 / distributions", "static w=0.25 / tokens",
                                             "static w=0.25 / ngram"]
    assert specs[1][1] == {"method": "sd", "draft_mode": "tokens"}
    assert specs[5][1]["weight"] == 0.25 and callable(specs[5][1]["drafter"]) and "draft_mode" not in specs[5][1]
    with pytest.raises(ValueError, match="unknown draft source 'beam'"):
        harness.draft_source_specs(["beam"], [0.5])
    results = [result("sd / distributions", 1.0, 0.5, [-2.0, -1.0], [0.0, 1.0]),
               result("sd / tokens", 1.0, 0.4, [-2.5, -1.0], [0.0, 0.0]),
               result("static w=0.5 / distributions", 0.5, 0.7, [-3.0, -2.0], [1.0, 1.0])]
    lines = report.source_comparison_lines(results).splitlines()
    assert len(lines) == 1 and lines[0].startswith("sd / tokens - sd / distributions: fidelity -0.250 +- 0.250")


def test_shipped_head_loads_for_the_default_pair():
    # The package ships its default head (pyproject.toml's package data): a missing file is a packaging fault.
    assert os.path.isfile(os.path.join(DEFAULT_HEAD_DIR, "head.safetensors")), f"no head shipped in {DEFAULT_HEAD_DIR}"
    head = load_head("default", draft_hidden=576, target_hidden=576)
    features = (torch.rand(1, 2, len(DISTRIBUTION_FEATURES)),) if wants_distributions(head) else ()
    weights = head(torch.zeros(1, 2, 576), torch.randn(1, 2, 576), *features)
    assert weights.shape == (1, 2) and bool(((weights > 0) & (weights < 1)).all())


def test_evaluate_batched_gives_the_same_results_per_prompt(experiment_pair):
    target, draft, tokenizer = experiment_pair
    specs = harness.method_specs(["ar", "static"], [0.5], None)
    runs = [harness.evaluate(TASKS["gsm8k"], gsm8k_examples(), target, draft, tokenizer, specs, max_draft=3,
                             max_new_tokens=8, temperature=0.0, seed=5, progress=False, batch_size=batch_size)
            for batch_size in (1, 2)]
    for alone, batched in zip(*runs):
        assert alone.label == batched.label
        assert (alone.acceptance, alone.tokens_per_pass) == (batched.acceptance, batched.tokens_per_pass)
        assert alone.quality_per_prompt == batched.quality_per_prompt
        assert alone.fidelity_per_prompt == pytest.approx(batched.fidelity_per_prompt, rel=1e-5)


def test_eval_compares_draft_lengths_with_each_methods_best_fixed_k(experiment_pair, tmp_path, monkeypatch, capsys):
    """diversed eval --draft-length ... --fixed-k ...: one row per method and policy (fixed once per K), the
    drafts per round of each, then every policy against its method's best fixed K."""
    target, draft, tokenizer = experiment_pair
    commands_use(monkeypatch, (target, draft, tokenizer))
    data = gsm8k_file(tmp_path / "gsm8k.jsonl")
    assert cli.main(["eval", "--data", str(data), "--limit", "2", "--max-new-tokens", "12", "--method", "ar", "sd",
                     "static", "--weight", "0.5", "--draft-length", "fixed", "heuristic", "confidence", "gain",
                     "--fixed-k", "1", "3", "--max-draft", "5", "--batch-size", "1"]) == 0
    output = capsys.readouterr().out
    for label in ("ar", "sd / K=1", "sd / K=3", "sd / heuristic", "sd / confidence", "sd / gain",
                  "static w=0.5 / K=1", "static w=0.5 / gain"):
        assert f"| {label} |" in output
    assert "drafts/round" in output and "K = 1, 3; draft length heuristic (at most 5)" in output
    comparison = output.split("best fixed K (tokens/s, paired over the prompts)")[1]
    assert comparison.count("(best fixed)") == 2 and "| static w=0.5 | gain |" in comparison
    # One draft length: the labels stay the methods' own, and the table has no comparison.
    assert cli.main(["eval", "--data", str(data), "--limit", "1", "--max-new-tokens", "6", "--method", "sd",
                     "--draft-length", "gain", "--draft-cost", "0.1"]) == 0
    output = capsys.readouterr().out
    assert "| sd |" in output and "best fixed K" not in output and "draft length gain (at most 3)" in output
    # A policy reading the draft's probabilities next to the n-gram drafter: one line, exit status 2.
    assert cli.main(["compare-drafts", "--data", str(data), "--limit", "1", "--max-new-tokens", "4",
                     "--drafts", "distributions", "ngram", "--draft-length", "gain"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--draft-length 'gain' reads the draft model's probabilities" in error and "\n" not in error
