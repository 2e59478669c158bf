"""Saved results joined as one run: rules side by side on the same prompts, prompt sets one after the other, from
exact counts; refusals for parts that cannot be joined; `diversed report` against one run over all the prompts."""

import dataclasses
import json
import math
import re

import pytest

pytest.importorskip("transformers")

from diversed_ext import cli  # noqa: E402
from diversed_ext.research.report import MethodResult  # noqa: E402
from diversed_ext.research.result_sets import (ResultSet, load_results, merge_result_sets,  # noqa: E402
                                               save_results)
from helpers import gsm8k_examples  # noqa: E402

SETTINGS = {"task": "gsm8k", "data": "test.jsonl", "max_draft": 3, "max_new_tokens": 32, "temperature": 1.0}


def prompts(skip, count, seed=0, **settings):
    return {**SETTINGS, "skip": skip, "count": count, "seed": seed, **settings}


def row(label, fidelities, drafted, accepted, passes, new_tokens, weight=1.0):
    return MethodResult(label, weight, accepted / drafted, new_tokens / passes, 0.0,
                        sum(fidelities) / len(fidelities), new_tokens / 1.0, new_tokens, 1.0, tuple(fidelities),
                        (0.0,) * len(fidelities), (accepted / drafted,) * len(fidelities),
                        drafts_per_round=drafted / passes, batch_work=((new_tokens, 1.0),), target_passes=passes,
                        drafted=drafted, accepted=accepted)


def test_prompt_sets_join_prompt_by_prompt_from_exact_counts():
    first = ResultSet(prompts(0, 2), (row("sd", [-1.0, -2.0], 30, 10, 20, 40), row("gate margin=1", [-1.5, -1.0],
                                                                                   30, 20, 15, 44, weight=0.4)))
    second = ResultSet(prompts(2, 1, seed=2), (row("sd", [-4.0], 10, 9, 5, 14),
                                               row("gate margin=1", [-0.5], 10, 2, 9, 12, weight=0.8)))
    merged, rows = merge_result_sets([second, first])  # the order of the files does not matter
    assert merged["count"] == 3 and [part["skip"] for part in merged["parts"]] == [0, 2]
    sd, gate = rows
    assert sd.label == "sd" and sd.fidelity_per_prompt == (-1.0, -2.0, -4.0)
    assert math.isclose(sd.fidelity, -7.0 / 3)
    assert math.isclose(sd.acceptance, 19 / 40) and sd.drafted == 40 and sd.accepted == 19
    assert math.isclose(sd.tokens_per_pass, 54 / 25) and math.isclose(sd.drafts_per_round, 40 / 25)
    assert sd.batch_work == ((40, 1.0), (14, 1.0)) and sd.new_tokens == 54 and sd.seconds == 2.0
    assert math.isclose(gate.weight, (0.4 * 30 + 0.8 * 10) / 40)  # a head's mean w is over its drafted tokens
    assert math.isclose(gate.acceptance, 22 / 40)
    assert sd.tokens_per_prompt == () and sd.drafted_per_prompt == ()  # no part has counts


def test_a_part_saved_without_token_counts_joins_with_nan_there():
    counted = dataclasses.replace(row("sd", [-1.0, -2.0], 30, 10, 20, 40), tokens_per_prompt=(5, 7),
                                  drafted_per_prompt=(12, 18))
    merged, (sd,) = merge_result_sets([ResultSet(prompts(0, 2), (counted,)),
                                       ResultSet(prompts(2, 1, seed=2), (row("sd", [-4.0], 10, 9, 5, 14),))])
    assert sd.tokens_per_prompt[:2] == (5, 7) and math.isnan(sd.tokens_per_prompt[2])
    assert sd.drafted_per_prompt[:2] == (12, 18) and math.isnan(sd.drafted_per_prompt[2])


def test_rules_on_the_same_prompts_join_side_by_side_and_a_rule_some_prompts_lack_is_left_out():
    rules_a = ResultSet(prompts(0, 2), (row("sd", [-1.0, -2.0], 30, 10, 20, 40), row("static w=0", [-3.0, -3.0],
                                                                                      30, 30, 10, 40, weight=0.0)))
    rules_b = ResultSet(prompts(0, 2), (row("sd", [-1.0, -2.0], 30, 10, 20, 40), row("fly W=1 tau=0.3", [-2.0, -2.0],
                                                                                     30, 20, 15, 40)))
    more = ResultSet(prompts(2, 1, seed=2), (row("sd", [-4.0], 10, 9, 5, 14), row("static w=0", [-5.0], 10, 10, 3,
                                                                                  14, weight=0.0)))
    merged, rows = merge_result_sets([rules_a, rules_b])
    assert [r.label for r in rows] == ["sd", "static w=0", "fly W=1 tau=0.3"] and merged["count"] == 2
    merged, rows = merge_result_sets([rules_a, rules_b, more])
    assert [r.label for r in rows] == ["sd", "static w=0"]  # FLy never ran on prompt 2
    assert rows[1].fidelity_per_prompt == (-3.0, -3.0, -5.0)


@pytest.mark.parametrize("parts, message", [
    ([ResultSet(prompts(0, 2), (row("sd", [-1.0, -2.0], 3, 1, 2, 4),)),
      ResultSet(prompts(0, 2), (row("sd", [-1.0, -2.5], 3, 1, 2, 4),))], "'sd' ran twice on the same prompts"),
    ([ResultSet(prompts(0, 2), ()), ResultSet(prompts(2, 2, max_draft=6), ())], "different settings (max_draft)"),
    ([ResultSet(prompts(0, 3), ()), ResultSet(prompts(2, 2), ())], "parts overlap"),
    ([], "no results"),
])
def test_parts_that_cannot_be_joined_are_refused(parts, message):
    with pytest.raises(ValueError) as raised:
        merge_result_sets(parts)
    assert message in str(raised.value)


def test_a_saved_part_reads_back_as_it_was(tmp_path):
    rows = (row("sd", [-1.0, float("nan")], 30, 10, 20, 40),)
    save_results(str(tmp_path / "results.json"), prompts(0, 2), rows)
    loaded = load_results(str(tmp_path / "results.json"))
    assert loaded.prompts == prompts(0, 2) and loaded.rows[0].drafted == 30
    assert loaded.rows[0].fidelity_per_prompt[0] == -1.0 and math.isnan(loaded.rows[0].fidelity_per_prompt[1])
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="not a results file"):
        load_results(str(tmp_path / "list.json"))


def test_report_of_parts_is_the_run_over_all_prompts(experiment_pair, tmp_path, monkeypatch, capsys):
    target, draft, tokenizer = experiment_pair
    monkeypatch.setattr(cli.common, "load_models", lambda target_name, draft_name, device, **drafter: (target, draft, tokenizer))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(example) + "\n" for example in gsm8k_examples(4)))
    common = ["--data", str(data), "--max-new-tokens", "10", "--max-draft", "3", "--batch-size", "1"]

    def pareto(name, *extra):
        assert cli.main(["pareto", *common, *extra, "--output-dir", str(tmp_path / name)]) == 0
        return str(tmp_path / name / "results.json")

    whole = pareto("whole", "--weights", "0", "1", "--gate-margin", "1")
    parts = [pareto("rules-a", "--limit", "2", "--weights", "0", "1"),
             pareto("rules-b", "--limit", "2", "--weights", "1", "--gate-margin", "1"),
             pareto("more", "--skip", "2", "--seed", "2", "--weights", "0", "1", "--gate-margin", "1")]
    capsys.readouterr()
    assert cli.main(["report", *parts, "--output-dir", str(tmp_path / "joined")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 prompts, from 3 results files") and "above FLy's frontier" in out
    expected = {r.label: r for r in load_results(whole).rows}
    joined = load_results(str(tmp_path / "joined" / "results.json"))
    assert [r.label for r in joined.rows] == ["static w=0", "static w=1", "gate margin=1"]
    for got in joined.rows:
        want = expected[got.label]
        assert got.fidelity_per_prompt == want.fidelity_per_prompt
        assert (got.drafted, got.accepted, got.target_passes, got.new_tokens) == (
            want.drafted, want.accepted, want.target_passes, want.new_tokens)
        assert got.acceptance == want.acceptance and got.fidelity == want.fidelity
        assert got.tokens_per_prompt == want.tokens_per_prompt and len(got.tokens_per_prompt) == 4
        assert got.drafted_per_prompt == want.drafted_per_prompt  # so g and the s.e. pool as over the whole run
        assert got.acceptance_se == want.acceptance_se
        assert math.isnan(got.tokens_per_second)  # speeds of different runs do not compare
    assert (tmp_path / "joined" / "pareto.png").stat().st_size > 1000


@pytest.mark.parametrize("damage, message", [
    (lambda saved: saved.update(rows=[]), "holds no rows"),
    (lambda saved: saved.update(rows=[5]), "a row is not an object: 5"),
    (lambda saved: saved["rows"][0].update(acceptance="high"), "row 'sd': acceptance is not what a results file"),
    (lambda saved: saved["rows"][0].update(fidelity_per_prompt=[-1.0, -2.0, -3.0]), "fidelity_per_prompt"),
    (lambda saved: saved["rows"][0].update(batch_work=[[1]]), "batch_work"),
    (lambda saved: saved["rows"][0].pop("label"), "a row is not a result"),
    (lambda saved: saved["prompts"].update(count="x"), "no prompt count"),
    (lambda saved: saved["prompts"].pop("count"), "no prompt count"),
])
def test_a_damaged_results_file_is_refused_naming_what_is_wrong(tmp_path, capsys, damage, message):
    """What `report` reads must be a results file through and through: a row or a field of another kind is a
    one-line error naming the file, never a traceback from the plot or the table."""
    path = tmp_path / "results.json"
    save_results(str(path), prompts(0, 2), (row("sd", [-1.0, -2.0], 30, 10, 20, 40),))
    saved = json.loads(path.read_text())
    damage(saved)
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_results(str(path))
    assert cli.main(["report", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    assert "results.json: " in capsys.readouterr().err


def test_report_usage_errors_name_the_file(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{")
    assert cli.main(["report", str(tmp_path / "bad.json"), "--output-dir", str(tmp_path / "out")]) == 2
    assert "bad.json: not JSON" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "missing.json"), "--output-dir", str(tmp_path / "out")]) == 2
    assert "missing.json: No such file or directory" in capsys.readouterr().err
