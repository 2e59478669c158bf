"""The calibration gap g = fidelity + target entropy beside fidelity: the entropy against a direct computation, g near 0
for exact sampling and clearly positive for a colder sampler, the "sharper than the target" mark in the tables, and
results saved before the entropy was recorded joined with NaN and a note."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext import cli  # noqa: E402
from diversed_ext.research import calibration, harness, report  # noqa: E402
from diversed_ext.research.plots import plot_pareto  # noqa: E402
from diversed_ext.research.result_sets import ResultSet, load_results, merge_result_sets, save_results  # noqa: E402
from diversed_ext.research.tasks import TASKS  # noqa: E402
from diversed_ext.research.teacher_forcing import fidelity, target_scores  # noqa: E402
from helpers import EXPERIMENT_VOCAB, CharTokenizer, gsm8k_examples, random_llama  # noqa: E402

PROMPTS = 48
NEW_TOKENS = 16


def peaked_llama(seed):
    """The experiment pair's shape with its LM head scaled up: next-token entropies of about 1 to 3 nats (the
    unscaled pair's are all near log 32, where sampling colder changes little)."""
    return random_llama(seed, sharpness=20.0, vocab_size=EXPERIMENT_VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def peaked_pair():
    return peaked_llama(0), peaked_llama(1), CharTokenizer()


def test_target_scores_match_a_direct_computation(peaked_pair):
    target = peaked_pair[0]
    prompt, completion = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5]
    for temperature, scale in ((0.7, 0.7), (1.0, 1.0), (0.0, 1.0)):  # greedy (0) is scored at 1
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt + completion])).logits[0].double()
        positions = range(len(prompt) - 1, len(prompt) + len(completion) - 1)
        picked, entropies = [], []
        for position, token in zip(positions, completion):
            probs = torch.softmax(logits[position] / scale, -1)
            picked.append(math.log(probs[token]))
            entropies.append(-sum(float(p) * math.log(float(p)) for p in probs))
        got_fidelity, got_entropy = target_scores(target, prompt, completion, temperature)
        assert got_fidelity == pytest.approx(sum(picked) / len(picked), abs=1e-5)
        assert got_entropy == pytest.approx(sum(entropies) / len(entropies), abs=1e-5)
        assert fidelity(target, prompt, completion, temperature) == got_fidelity
    assert all(math.isnan(value) for value in target_scores(target, prompt, [], 1.0))


def _sd_row(pair, temperature, score_temperature=None):
    target, draft, tokenizer = pair
    (row,) = harness.evaluate(TASKS["gsm8k"], gsm8k_examples(PROMPTS), target, draft, tokenizer,
                              harness.method_specs(["sd"], []), max_draft=3, max_new_tokens=NEW_TOKENS,
                              temperature=temperature, seed=11, progress=False, batch_size=16,
                              score_temperature=score_temperature)
    assert len(row.entropy_per_prompt) == PROMPTS and not any(map(math.isnan, row.calibration_gap_per_prompt))
    return row


def test_g_is_zero_for_exact_sampling_and_positive_for_a_colder_sampler(peaked_pair):
    exact = _sd_row(peaked_pair, 1.0)
    # sd is exact sampling from the target: E[log p(y_t)] = -H(p_t) at every position, so g is 0 in expectation.
    assert exact.entropy > 0.5 and exact.calibration_gap_se > 0
    assert abs(exact.calibration_gap) < 3 * exact.calibration_gap_se
    assert "sharper" not in report.gap_cell(exact)
    # sd at T' = 0.5, scored against the target at T = 1: its tokens are the likelier ones, so fidelity rises by
    # more than the contexts' entropy falls.
    colder = _sd_row(peaked_pair, 0.5, score_temperature=1.0)
    assert colder.calibration_gap > calibration.SHARPER_THRESHOLD + 3 * colder.calibration_gap_se
    assert colder.fidelity > exact.fidelity  # what fidelity alone would call a better rule
    assert report.gap_cell(colder).endswith("(sharper than the target)")


def row(label, acceptance, fidelities, entropies=(), weight=1.0):
    return report.MethodResult(label, weight, acceptance, 2.0, 0.0, sum(fidelities) / len(fidelities), 1.0, 10, 1.0,
                               tuple(fidelities), (0.0,) * len(fidelities), (acceptance,) * len(fidelities),
                               drafted=10, accepted=int(acceptance * 10), target_passes=5,
                               entropy_per_prompt=tuple(entropies), tokens_per_prompt=(8,) * len(fidelities),
                               drafted_per_prompt=(10 / len(fidelities),) * len(fidelities))


def test_the_tables_and_the_plot_mark_rules_sharper_than_the_target(tmp_path):
    results = [row("static w=0.5", 0.7, [-3.0, -2.0], [2.9, 2.1], weight=0.5),  # g = -0.1, +0.1: not marked
               row("sd", 0.5, [-2.0, -1.0], [2.0, 1.0]),  # g = 0
               row("gate margin=2", 0.6, [-1.0, -1.5], [1.4, 1.7])]  # g = 0.4, 0.2: marked
    table = report.markdown_table(results, "exact_match")
    lines = {line.split(" | ")[0][2:]: line for line in table.splitlines()[2:]}
    assert "| fidelity (mean log p) | target entropy | g |" in table
    assert "| +0.300 +- 0.100 (sharper than the target) |" in lines["gate margin=2"]
    assert "sharper" not in lines["sd"] and "sharper" not in lines["static w=0.5"]
    assert "| 2.500 +- 0.400 | +0.000 +- 0.100 |" in lines["static w=0.5"]
    assert "(sharper than the target)" in report.frontier_table(results, ["gate margin=2"])
    assert "exact sampling" in calibration.LEGEND and calibration.marked("x", math.nan) == "x"
    assert calibration.missing_entropy_note(results) == ""
    assert plot_pareto(results, str(tmp_path / "p.png")) == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_parts_saved_without_the_entropy_join_with_nan_and_a_note(tmp_path, capsys):
    settings = {"task": "gsm8k", "data": "test.jsonl", "max_draft": 3, "temperature": 1.0}
    old = {**settings, "skip": 0, "count": 2, "seed": 0}
    new = {**settings, "skip": 2, "count": 2, "seed": 2}
    save_results(str(tmp_path / "old.json"), old, [row("sd", 0.5, [-2.0, -1.0], [2.0, 1.0])])
    saved = json.loads((tmp_path / "old.json").read_text())
    assert saved["rows"][0]["calibration_gap"] == 0.0 and saved["rows"][0]["entropy"] == 1.5
    for record in saved["rows"]:  # as written before the entropy was recorded
        for key in ("entropy_per_prompt", "entropy", "entropy_se", "calibration_gap", "calibration_gap_se"):
            del record[key]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    save_results(str(tmp_path / "new.json"), new, [row("sd", 0.5, [-1.5, -2.5], [1.7, 2.7])])
    _, (joined,) = merge_result_sets([load_results(str(tmp_path / name)) for name in ("old.json", "new.json")])
    assert joined.fidelity_per_prompt == (-2.0, -1.0, -1.5, -2.5)
    assert all(map(math.isnan, joined.entropy_values[:2])) and joined.entropy_values[2:] == (1.7, 2.7)
    assert joined.calibration_gap == pytest.approx(0.2) and joined.entropy == pytest.approx(2.2)
    note = calibration.missing_entropy_note([joined])
    assert "sd (2 of 4)" in note and "NaN" in note
    # The same rule on the same prompts, once without the entropy and once with it: the part that has it is kept.
    with_entropy = ResultSet(old, (row("sd", 0.5, [-2.0, -1.0], [2.0, 1.0]),))
    _, (kept,) = merge_result_sets([load_results(str(tmp_path / "old.json")), with_entropy])
    assert kept.entropy_per_prompt == (2.0, 1.0)
    assert cli.main(["report", str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                     "--output-dir", str(tmp_path / "joined")]) == 0
    out = capsys.readouterr().out
    assert "sd (2 of 4)" in out and "g = fidelity + target entropy" in out
    assert "sd (2 of 4)" in (tmp_path / "joined" / "pareto.md").read_text()
