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
from helpers import commands_use, gsm8k_file  # noqa: E402

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
    ([ResultSet(prompts(0, 2), ()), ResultSet(prompts(2, 2, 2, max_draft=6), ())], "different settings (max_draft)"),
    ([ResultSet(prompts(0, 3), ()), ResultSet(prompts(2, 2, 2), ())], "parts overlap"),
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
    commands_use(monkeypatch, (target, draft, tokenizer))
    data = gsm8k_file(tmp_path / "gsm8k.jsonl", 4)
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
    (lambda saved: saved["prompts"].update(skip="2"), "no first prompt (\"skip\": '2')"),
    (lambda saved: saved["prompts"].update(skip=-1), "no first prompt"),
    (lambda saved: saved["prompts"].update(seed=None), "no seed"),
    (lambda saved: saved["prompts"].update(task=["gsm8k"]), "names no task"),
    (lambda saved: saved["prompts"].update(rules={"diversed": "h"}), "\"rules\" is not label -> settings"),
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


HEAD_A = {"head": "head", "head_sha256": "aaaa"}
HEAD_B = {"head": "head", "head_sha256": "bbbb"}


def recorded(skip, count, rules, seed=None, **settings):
    """A part's record as pareto now writes it: the drafter, batch size and each rule's own settings beside the rest."""
    return prompts(skip, count, skip if seed is None else seed,
                   **{"drafter": "model", "drafter_path": None, "batch_size": 8, "rules": rules, **settings})


@pytest.mark.parametrize("parts, message", [
    # Two heads under one label: their prompts cannot be pooled into one row.
    ([ResultSet(recorded(0, 1, {"diversed": HEAD_A}), (row("diversed", [-1.0], 3, 1, 2, 4),)),
      ResultSet(recorded(1, 1, {"diversed": HEAD_B}), (row("diversed", [-1.0], 3, 1, 2, 4),))],
     "'diversed' ran under other settings in another part (head head, head_sha256 aaaa; head head, head_sha256 "
     "bbbb)"),
    ([ResultSet(recorded(0, 1, {"diversed+fly": {**HEAD_A, "fly_window": 1}}), (row("diversed+fly", [-1.0], 3, 1, 2,
                                                                                    4),)),
      ResultSet(recorded(1, 1, {"diversed+fly": {**HEAD_A, "fly_window": 2}}), (row("diversed+fly", [-1.0], 3, 1, 2,
                                                                                    4),))],
     "'diversed+fly' ran under other settings"),
    ([ResultSet(recorded(0, 1, {}), ()), ResultSet(recorded(1, 1, {}, drafter="eagle3"), ())],
     "different settings (drafter)"),
    ([ResultSet(recorded(0, 1, {}), ()), ResultSet(recorded(1, 1, {}, batch_size=4), ())],
     "different settings (batch_size)"),
    # Prompt 2 of one run from prompt 0 with seed 0 has seed 2.
    ([ResultSet(recorded(0, 2, {}), ()), ResultSet(recorded(2, 2, {}, seed=0), ())],
     "parts do not continue the seeds: the part from prompt 2 ran with seed 0, where one run from prompt 0 with seed "
     "0 gives that prompt seed 2: rerun it with --seed 2"),
    ([ResultSet(recorded(10, 2, {}, seed=5), ()), ResultSet(recorded(14, 2, {}, seed=8), ())], "--seed 9"),
    # A part saved before the drafter, batch size and rules were recorded cannot be checked against one that has them.
    ([ResultSet(prompts(0, 2), ()), ResultSet(recorded(2, 2, {}), ())],
     "some parts record batch_size, drafter, drafter_path, rules and others do not (saved by an older diversed)"),
])
def test_parts_of_other_heads_drafters_settings_or_seeds_are_refused(parts, message):
    with pytest.raises(ValueError) as raised:
        merge_result_sets(parts)
    assert message in str(raised.value)


def test_each_rule_keeps_its_own_settings_and_parts_continue_the_seeds():
    """Parts on the same prompts hold other rules, each with its own settings (a head in one part, FLy in another):
    they join, and the joined record keeps each rule's; parts from later prompts join where their seeds continue."""
    heads = ResultSet(recorded(10, 2, {"diversed": HEAD_A}, seed=5), (row("sd", [-1.0, -2.0], 3, 1, 2, 4),
                                                                     row("diversed", [-1.5, -2.5], 3, 2, 2, 4)))
    fly = {"fly W=1 tau=0.3": {"fly_window": 1, "fly_threshold": 0.3, "fly_top_k": 8}}
    others = ResultSet(recorded(10, 2, fly, seed=5), (row("sd", [-1.0, -2.0], 3, 1, 2, 4),
                                                      row("fly W=1 tau=0.3", [-1.2, -2.2], 3, 2, 2, 4)))
    later = ResultSet(recorded(13, 1, {"diversed": HEAD_A}, seed=8), (row("sd", [-3.0], 3, 1, 2, 4),
                                                                      row("diversed", [-3.5], 3, 1, 2, 4)))
    merged, rows = merge_result_sets([heads, others])
    assert [r.label for r in rows] == ["sd", "diversed", "fly W=1 tau=0.3"]
    assert merged["rules"] == {"diversed": HEAD_A, **fly} and merged["batch_size"] == 8
    merged, rows = merge_result_sets([later, heads])
    assert merged["count"] == 3 and merged["rules"] == {"diversed": HEAD_A} and merged["seed"] == 5
    assert rows[1].fidelity_per_prompt == (-1.5, -2.5, -3.5)


def test_pareto_records_each_heads_folder_and_weights_and_report_refuses_two_under_one_label(
        experiment_pair, tmp_path, monkeypatch, capsys):
    from diversed_ext.head import EnsembleHead

    commands_use(monkeypatch, experiment_pair)
    for folder, weight in (("a", 0.3), ("b", 0.7), ("copy", 0.3)):
        EnsembleHead(16, 16, init_weight=weight).save(str(tmp_path / folder / "head"))
    common = ["--data", gsm8k_file(tmp_path / "gsm8k.jsonl", 4), "--limit", "2", "--max-new-tokens", "4", "--max-draft", "3", "--weights", "1"]

    def pareto(name, folder, *extra):
        assert cli.main(["pareto", *common, "--head", str(tmp_path / folder / "head"), *extra,
                         "--output-dir", str(tmp_path / name)]) == 0
        return str(tmp_path / name / "results.json")

    first = pareto("first", "a", "--fly", "--fly-thresholds", "0.3")
    record = load_results(first).prompts
    assert record["drafter"] == "model" and record["batch_size"] == 8 and record["drafter_path"] is None
    head = record["rules"]["diversed"]
    assert head["head"] == "head" and re.fullmatch("[0-9a-f]{16}", head["head_sha256"])
    assert record["rules"]["diversed+fly"] == {**head, "fly_window": None, "fly_threshold": 0.3, "fly_top_k": 3}
    assert record["rules"]["fly W=1 tau=0.3"] == {"fly_window": 1, "fly_threshold": 0.3, "fly_top_k": 3}
    same = pareto("same", "copy", "--skip", "2", "--seed", "2")  # another folder of the same name and weights
    other = pareto("other", "b", "--skip", "2", "--seed", "2")
    capsys.readouterr()
    assert cli.main(["report", first, same, "--output-dir", str(tmp_path / "joined")]) == 0
    assert "4 prompts, from 2 results files" in capsys.readouterr().out
    assert cli.main(["report", first, other, "--output-dir", str(tmp_path / "refused")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("diversed: 'diversed' ran under other settings in another part (head head, head_sha256 ")
    assert cli.main(["report", first, pareto("unseeded", "a", "--skip", "2"), "--output-dir",
                     str(tmp_path / "refused")]) == 2
    assert "rerun it with --seed 2" in capsys.readouterr().err
