"""FLy's frontier and the pareto sweep: the frontier's corners (the upper concave envelope from its highest point on),
paired distances above it, the sweep's settings and labels, and `diversed pareto --fly --gate-margin` end to end on a
tiny random Llama pair."""

import json
import math

import pytest

pytest.importorskip("transformers")

from diversed_ext import cli  # noqa: E402
from diversed_ext.decoding import Fly, Gate  # noqa: E402
from diversed_ext.research import baselines, harness, report  # noqa: E402
from helpers import commands_use, gsm8k_file  # noqa: E402


def result(label, acceptance, fidelities, weight=1.0, entropies=()):
    return report.MethodResult(label, weight, acceptance, 1.0, 0.0, sum(fidelities) / len(fidelities), 1.0, 10, 1.0,
                               tuple(fidelities), (0.0,) * len(fidelities), entropy_per_prompt=tuple(entropies))


def corners(rows):
    return [row.label for row in baselines.envelope(rows, "fidelity")]


def test_the_upper_envelope_drops_points_under_a_mixture_of_two_others():
    rows = [result("sd", 0.5, [-2.0]), result("fly a", 0.6, [-3.0]), result("fly b", 0.7, [-2.5]),
            result("fly c", 0.8, [-3.4]), result("fly d", 0.9, [-4.0]), result("fly e", 0.8, [-3.0])]
    # a lies under the segment sd..b; c shares its acceptance with e and has less fidelity; d stays (the last).
    assert corners(rows) == ["sd", "fly b", "fly e", "fly d"]
    assert baselines.envelope([], "fidelity") == []


def test_the_frontier_drops_points_another_beats_on_both_acceptance_and_fidelity():
    # fly a has more acceptance and more fidelity than sd: the concave hull's rising part (sd .. a) is no frontier.
    rows = [result("sd", 0.5, [-2.0]), result("fly a", 0.6, [-1.0]), result("fly b", 0.8, [-1.5]),
            result("fly c", 0.7, [-1.0])]
    # c ties a's fidelity at more acceptance: it beats a, and the frontier starts there.
    assert corners(rows) == ["fly c", "fly b"]
    assert corners(rows[:3]) == ["fly a", "fly b"]


def test_a_rule_beaten_on_both_axes_is_below_the_frontier():
    # A FLy point at 0.60 / -1.0 has more acceptance and more fidelity than the rule at 0.55 / -1.2: the frontier at
    # 0.55 is at least -1.0, so the rule is at least 0.2 below it (the hull's rising part, sd .. W=1, put it above).
    rows = [result("sd", 0.5, [-2.0] * 4), result("fly W=1 tau=0.1", 0.6, [-1.0] * 4),
            result("fly W=2 tau=0.1", 0.8, [-1.5] * 4), result("diversed", 0.55, [-1.2] * 4)]
    (below,) = report.compare_to_fly_frontier(rows, "diversed")
    assert below.fidelity == pytest.approx(-0.2) and "fly W=1 tau=0.1, at 0.600" in below.baseline
    assert baselines.distance(rows, "diversed", "FLy", "fidelity") == pytest.approx((-0.2, 0.0, True))
    # Further on the frontier is the line between its corners: at 0.7, half-way from -1.0 to -1.5.
    rows[-1] = result("diversed", 0.7, [-1.2] * 4)
    assert report.compare_to_fly_frontier(rows, "diversed")[0].fidelity == pytest.approx(0.05)


def test_distance_above_flys_frontier_is_paired_and_interpolated():
    results = [result("sd", 0.5, [-2.0, -1.0, -3.0]), result("fly W=1 tau=0.3", 0.7, [-3.0, -2.0, -4.0]),
               result("static w=0.5", 0.7, [-5.0, -5.0, -5.0], 0.5),
               result("gate margin=1", 0.6, [-1.0, -1.0, -1.0], entropies=[1.2, 1.1, 1.3])]
    (above,) = report.compare_to_fly_frontier(results, "gate margin=1")
    expected = [-1.0 - x for x in (-2.5, -1.5, -3.5)]  # half-way between sd and FLy, prompt by prompt
    assert math.isclose(above.fidelity, sum(expected) / 3)
    mean = sum(expected) / 3
    assert math.isclose(above.fidelity_se, math.sqrt(sum((x - mean) ** 2 for x in expected) / 2 / 3))
    assert "sd .. fly W=1 tau=0.3" in above.baseline
    beyond = results + [result("gate margin=9", 0.95, [-1.0, -2.0, -1.0])]
    (top,) = report.compare_to_fly_frontier(beyond, "gate margin=9")  # beyond FLy's reach: its highest point
    assert math.isclose(top.fidelity, (2.0 + 0.0 + 3.0) / 3) and "FLy's highest acceptance, 0.700" in top.baseline
    outside = results + [result("gate margin=0", 0.4, [-1.0, -1.0, -1.0], entropies=[1.0, 1.0, 1.0])]
    # below sd's acceptance: sd reaches more acceptance, so the frontier there is sd's fidelity, prompt by prompt
    (under,) = report.compare_to_fly_frontier(outside, "gate margin=0")
    assert math.isclose(under.fidelity, (1.0 + 0.0 + 2.0) / 3) and "(sd, at 0.500)" in under.baseline
    (above_static,) = [item for item in report.compare_to_baselines(results, "gate margin=1")
                       if item.baseline.startswith("static frontier")]
    table = report.frontier_table(results, ["gate margin=1"])
    # g = fidelity + entropy prompt by prompt: 0.2, 0.1, 0.3, above +0.1, so marked sharper than the target.
    assert (f"| gate margin=1 | 0.600 | -1.000 +- 0.000 | +0.200 +- 0.058 (sharper than the target) | "
            f"{above_static.fidelity:+.3f} +- {above_static.fidelity_se:.3f} | {above.fidelity:+.3f} +- "
            f"{above.fidelity_se:.3f} |") in table
    assert "| - |" in report.frontier_table(outside, ["gate margin=0"])
    # The static sweep's w = 1 is sd: the same anchor.
    swept = [result("static w=1", 0.5, [-2.0, -1.0, -3.0])] + results[1:]
    assert report.compare_to_fly_frontier(swept, "gate margin=1")[0].fidelity == above.fidelity


def test_the_frontier_table_gives_the_task_score_against_sd_and_above_flys_frontier():
    gate = report.MethodResult("gate margin=1", 1.0, 0.6, 1.0, 2 / 3, -1.0, 1.0, 10, 1.0, (-1.0,) * 3, (1.0, 0.0, 1.0))
    fly = report.MethodResult("fly W=1 tau=0.3", 1.0, 0.7, 1.0, 2 / 3, -3.0, 1.0, 10, 1.0, (-3.0,) * 3,
                              (1.0, 1.0, 0.0))
    results = [result("sd", 0.5, [-2.0, -1.0, -3.0]), gate]
    # Scores 1, 0, 1 against sd's 0, 0, 0: +2/3, s.e. sqrt(var / n) = sqrt((1/3) / 3) = 1/3. FLy's frontier is sd
    # alone, which is no frontier: "-".
    assert "| 0.667 +- 0.333 | +0.667 +- 0.333 | - | - |" in report.frontier_table(results, ["gate margin=1"])
    # With FLy's point at 0.7 the frontier at 0.6 is half-way from sd's scores to FLy's: 0.5, 0.5, 0; the gate's
    # differences 0.5, -0.5, 1: mean 1/3, s.e. sqrt((7/12) / 3).
    table = report.frontier_table(results + [fly], ["gate margin=1"])
    assert table.endswith(f"| +0.333 +- {math.sqrt(7 / 36):.3f} |")
    assert report.frontier_table([gate], ["gate margin=1"]).endswith("| 0.667 +- 0.333 | - | - | - |")  # no sd


def test_the_sweep_covers_every_window_below_k_and_every_threshold():
    sweep = harness.fly_sweep(4)
    assert sweep == [Fly(window, threshold) for window in (1, 2, 3) for threshold in (0.1, 0.3, 0.6)]
    assert harness.fly_sweep(1) == []  # K = 1 leaves no room to defer
    specs = harness.pareto_methods((1.0,), heads={"diversed:h": "HEAD"}, fly=Fly(1), fly_sweep=harness.fly_sweep(2),
                                   gates=[Gate(2.0)])
    assert [label for label, _ in specs] == [
        "static w=1", "diversed:h", "fly W=1 tau=0.1", "fly W=1 tau=0.3", "fly W=1 tau=0.6", "diversed:h+fly",
        "gate margin=2", "diversed:h+gate margin=2"]
    assert dict(specs)["diversed:h+gate margin=2"] == {"method": "diversed", "head": "HEAD", "gate": Gate(2.0)}
    rows = [result(label, 0.5, [-1.0]) for label, _ in specs]
    assert [row.label for row in report.fly_rows(rows)] == [
        "fly W=1 tau=0.1", "fly W=1 tau=0.3", "fly W=1 tau=0.6", "diversed:h+fly"]
    assert [row.label for row in report.gate_rows(rows)] == ["gate margin=2", "diversed:h+gate margin=2"]


def test_pareto_and_eval_parse_the_sweep_and_the_gate():
    args = cli.build_parser().parse_args(["pareto", "--data", "d", "--fly", "--fly-thresholds", "0.2", "0.4",
                                          "--gate-margin", "1", "-0.5"])
    assert args.fly and args.fly_thresholds == [0.2, 0.4] and args.gate_margin == [1.0, -0.5]
    assert cli.build_parser().parse_args(["pareto", "--data", "d"]).gate_margin == []
    args = cli.build_parser().parse_args(["eval", "--data", "d", "--method", "gate", "static+gate"])
    assert args.method == ["gate", "static+gate"] and args.gate_margin == Gate().margin


def test_a_margin_that_is_not_a_finite_number_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.build_parser().parse_args(["eval", "--data", "d", "--method", "gate", "--gate-margin", "inf"])
    assert stop.value.code == 2 and "--gate-margin: must be a finite number of nats" in capsys.readouterr().err


def test_pareto_places_fly_and_the_gate_end_to_end(experiment_pair, tmp_path, monkeypatch, capsys):
    target, draft, tokenizer = experiment_pair
    commands_use(monkeypatch, (target, draft, tokenizer))
    data = gsm8k_file(tmp_path / "gsm8k.jsonl")
    assert cli.main(["pareto", "--data", str(data), "--limit", "2", "--weights", "0", "1", "--max-new-tokens", "12",
                     "--max-draft", "3", "--fly", "--fly-thresholds", "0.3", "--gate-margin", "1",
                     "--output-dir", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    for label in ("fly W=1 tau=0.3", "fly W=2 tau=0.3", "gate margin=1"):
        assert f"| {label} |" in table.split("task: above FLy's frontier |")[1]
    saved = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [row["label"] for row in saved] == ["static w=0", "static w=1", "fly W=1 tau=0.3", "fly W=2 tau=0.3",
                                               "gate margin=1"]
    assert all(len(row["fidelity_per_prompt"]) == 2 for row in saved)
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 1000
