"""The free baselines on every plane: Medusa's typical acceptance against a literal port of its rule (in the ops'
arguments and in the decoding loop), the temperature family and typical acceptance as pareto points with their KL and
TV, the families' frontiers and "above all" on the fidelity and KL planes, and `diversed pareto --temperatures
--typical` end to end with `report` joining parts with the new columns."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext import cli  # noqa: E402
from diversed_ext.decoding import Fly, Gate, SpeculativeDecoder, Typical  # noqa: E402
from diversed_ext.decoding.typical import typical_verify_arguments  # noqa: E402
from diversed_ext.research import baselines, harness, report  # noqa: E402
from diversed_ext.research.result_sets import load_results, merge_result_sets, save_results  # noqa: E402
from diversed_ext.research.tasks import TASKS  # noqa: E402
from helpers import commands_use, gsm8k_examples, gsm8k_file  # noqa: E402


def medusa_accept_lengths(logits, candidates, temperature, posterior_threshold=0.09, posterior_alpha=0.3):
    """Medusa's evaluate_posterior, sampling='typical', fast=True, literally (logits [N, K + 1, V] of the target over
    candidates [N, K + 1], the first candidate the token already emitted): the accept length of each candidate."""
    posterior_prob = torch.softmax(logits[:, :-1] / temperature, dim=-1)
    candidates_prob = torch.gather(posterior_prob, dim=-1, index=candidates[:, 1:].unsqueeze(-1)).squeeze(-1)
    posterior_entropy = -torch.sum(posterior_prob * torch.log(posterior_prob + 1e-5), dim=-1)
    threshold = torch.minimum(torch.ones_like(posterior_entropy) * posterior_threshold,
                              torch.exp(-posterior_entropy) * posterior_alpha)
    posterior_mask = candidates_prob > threshold
    return (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)


@pytest.mark.parametrize("settings", [Typical(), Typical(0.3, 0.6), Typical(0.01, 0.1)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_typical_acceptance_matches_a_literal_port_of_medusas_rule(settings, temperature):
    generator = torch.Generator().manual_seed(7)
    rows, width, vocab = 256, 4, 12
    logits = torch.randn(rows, width + 1, vocab, generator=generator) * 3
    drafts = torch.randint(vocab, (rows, width), generator=generator)
    medusa = medusa_accept_lengths(logits, torch.cat([torch.zeros(rows, 1, dtype=torch.int64), drafts], 1),
                                   temperature, settings.eps, settings.delta)
    full = torch.full((rows,), width, dtype=torch.int64)
    cut, weight = typical_verify_arguments(settings, drafts, full, logits, temperature)
    assert torch.equal(cut, medusa) and 0 < int(medusa.sum()) < rows * width
    assert float(weight.abs().max()) == 0.0
    short = torch.full((rows,), 2, dtype=torch.int64)  # a row's own draft count caps its prefix
    assert torch.equal(typical_verify_arguments(settings, drafts, short, logits, temperature)[0],
                       medusa.clamp(max=2))


def test_the_loop_accepts_exactly_medusas_prefix_each_round(wide_pair):
    target, draft = wide_pair
    prompt = [1, 3, 0, 2]
    decoder = SpeculativeDecoder(target, draft, method="sd", typical=Typical(), max_draft=4, temperature=1.0)
    generation = decoder.generate(prompt, max_new_tokens=40, seed=3).generations[0]
    emitted, rounds = list(prompt), 0
    for stats in generation.rounds:
        drafts = list(stats.draft_tokens)
        if drafts:
            with torch.no_grad():
                logits = target(input_ids=torch.tensor([emitted + drafts])).logits[:, len(emitted) - 1:]
            candidates = torch.tensor([[emitted[-1]] + drafts])
            assert stats.accepted == int(medusa_accept_lengths(logits.float(), candidates, 1.0)[0])
            rounds += 1
        emitted += generation.tokens.tolist()[len(emitted) - len(prompt):][:stats.emitted]
    assert rounds > 5 and 0 < generation.summary().acceptance_rate < 1


def test_typical_is_refused_where_it_does_not_apply(wide_pair):
    target, draft = wide_pair
    with pytest.raises(ValueError, match="typical applies to method 'sd'"):
        SpeculativeDecoder(target, draft, method="static", weight=0.5, typical=Typical())
    with pytest.raises(ValueError, match="does not combine"):
        SpeculativeDecoder(target, draft, method="sd", typical=Typical(), gate=Gate())
    with pytest.raises(ValueError, match="temperature > 0"):
        SpeculativeDecoder(target, draft, method="sd", typical=Typical(), temperature=0.0)
    with pytest.raises(TypeError, match="typical must be"):
        SpeculativeDecoder(target, draft, method="sd", typical=0.09)
    with pytest.raises(ValueError, match="eps"):
        Typical(eps=-1.0)


def test_every_rule_gets_its_divergence_and_the_colder_sampler_is_not_exact(experiment_pair):
    target, draft, tokenizer = experiment_pair
    specs = harness.pareto_methods((0.5, 1.0), fly_sweep=[Fly(1, 0.0)], gates=[Gate(2.0)], temperatures=[0.7],
                                   typicals=[Typical()])
    results = {row.label: row for row in harness.evaluate(TASKS["gsm8k"], gsm8k_examples()[:3], target, draft,
                                                          tokenizer, specs, max_draft=3, max_new_tokens=10,
                                                          batch_size=3, progress=False)}
    assert set(results) == {"static w=0.5", "static w=1", "fly W=1 tau=0", "gate margin=2", "sd T=0.7",
                            "typical eps=0.09 delta=0.3"}
    exact = results["static w=1"]
    assert exact.kl == pytest.approx(0.0, abs=1e-9) and exact.tv == pytest.approx(0.0, abs=1e-9)
    for label in ("static w=0.5", "gate margin=2", "sd T=0.7", "typical eps=0.09 delta=0.3"):
        assert results[label].kl > 1e-4 and results[label].tv > 1e-3, label
        assert len(results[label].kl_per_prompt) == 3
    fly = results["fly W=1 tau=0"]
    assert math.isnan(fly.kl) and fly.tv >= 0.0  # FLy: TV from its deferral estimate, no KL


def result(label, acceptance, fidelities, kls=()):
    return report.MethodResult(label, 1.0, acceptance, 1.0, 0.0, sum(fidelities) / len(fidelities), 1.0, 10, 1.0,
                               tuple(fidelities), (0.0,) * len(fidelities), kl_per_prompt=tuple(kls))


def test_a_rule_is_above_only_when_above_every_family():
    rows = [result("static w=0", 0.8, [-3.0, -3.2], [0.50, 0.52]),
            result("static w=1", 0.4, [-1.0, -1.2], [0.0, 0.0]),
            result("sd T=0.7", 0.65, [-0.5, -0.7], [0.05, 0.05]),
            result("fly W=1 tau=0.1", 0.7, [-2.0, -2.2]),
            result("gate margin=4", 0.6, [-1.5, -1.7], [0.10, 0.12])]
    # fidelity: the static line at 0.6 is -2.1; FLy's (sd .. fly) -1.7667; the temperature family's -0.6, sd at
    # T=0.7's own (it beats sd on both acceptance and fidelity, so it is the best reached at 0.6 or more); typical
    # acceptance did not run (sd alone is no family)
    assert baselines.distance(rows, "gate margin=4", "static", "fidelity")[0] == pytest.approx(0.5)
    assert baselines.distance(rows, "gate margin=4", "FLy", "fidelity")[0] == pytest.approx(1 / 6)
    assert baselines.distance(rows, "gate margin=4", "temperature", "fidelity")[0] == pytest.approx(-1.0)
    assert baselines.distance(rows, "gate margin=4", "typical", "fidelity") is None
    assert baselines.above_all(rows, "gate margin=4", "fidelity") is False
    assert baselines.above_all(rows[:2] + rows[3:], "gate margin=4", "fidelity") is True  # no colder sd: above
    # KL, lower is better: the static line at 0.6 has KL 0.25 and 0.26; the temperature family's 0.04;
    # FLy has no KL, so no frontier there
    assert baselines.distance(rows, "gate margin=4", "static", "KL")[0] == pytest.approx(0.145)
    assert baselines.distance(rows, "gate margin=4", "temperature", "KL")[0] == pytest.approx(-0.07)
    # a family that does not reach the rule's acceptance is compared at its best point, marked, and not counted
    slow = [row for row in rows if row.label != "sd T=0.7"] + [result("sd T=0.7", 0.45, [-0.5, -0.7])]
    assert baselines.distance(slow, "gate margin=4", "temperature", "fidelity") == pytest.approx((-1.0, 0.0, False))
    assert baselines.above_all(slow, "gate margin=4", "fidelity") is True
    assert "(beyond)" in baselines.baseline_table(slow, ["gate margin=4"])
    assert baselines.distance(rows, "gate margin=4", "FLy", "KL") is None
    table = baselines.baseline_table(rows, ["gate margin=4"], "KL")
    assert "| KL above temperature |" in table and "| no |" in table


def test_the_kl_envelope_is_the_lower_convex_one():
    rows = [result("static w=1", 0.2, [-1.0], [0.0]), result("static w=0.5", 0.5, [-1.5], [0.30]),
            result("static w=0", 0.8, [-3.0], [0.40])]
    assert [row.label for row in baselines.envelope(rows, "KL")] == ["static w=1", "static w=0"]
    assert [row.label for row in baselines.envelope(rows, "fidelity")] == ["static w=1", "static w=0.5",
                                                                           "static w=0"]


def test_a_family_point_with_more_acceptance_and_less_kl_sets_the_frontier_below_it():
    # On the KL plane (lower is better) w=0.75 beats w=0.9 on both axes: the frontier at 0.5 is w=0.75's KL 0.1, not
    # the chord from w=0.9 (0.2 at 0.4) to it; below every member's acceptance it is the best member's.
    rows = [result("static w=0.9", 0.4, [-1.0, -1.0], [0.2, 0.2]),
            result("static w=0.75", 0.6, [-1.5, -1.5], [0.1, 0.1]),
            result("static w=0", 0.8, [-3.0, -3.0], [0.3, 0.3]),
            result("gate margin=2", 0.5, [-1.2, -1.2], [0.15, 0.15])]
    assert [row.label for row in baselines.envelope(rows, "KL")] == ["static w=0.75", "static w=0"]
    assert baselines.distance(rows, "gate margin=2", "static", "KL") == pytest.approx((-0.05, 0.0, True))
    slow = rows[:3] + [result("gate margin=2", 0.3, [-1.2, -1.2], [0.15, 0.15])]
    assert baselines.distance(slow, "gate margin=2", "static", "KL") == pytest.approx((-0.05, 0.0, True))
    assert baselines.distance(slow, "gate margin=2", "static", "fidelity") == pytest.approx((-0.2, 0.0, True))


def test_pareto_runs_the_free_baselines_and_report_joins_their_divergences(experiment_pair, tmp_path, monkeypatch,
                                                                           capsys):
    target, draft, tokenizer = experiment_pair
    commands_use(monkeypatch, (target, draft, tokenizer))
    data = gsm8k_file(tmp_path / "gsm8k.jsonl")
    common = ["--data", str(data), "--limit", "2", "--weights", "0", "1", "--max-new-tokens", "8", "--max-draft", "3",
              "--temperatures", "0.7", "--typical", "0.09", "0.3", "--gate-margin", "1"]
    for part, skip in (("a", "0"), ("b", "2")):
        assert cli.main(["pareto", *common, "--skip", skip, "--seed", skip, "--output-dir", str(tmp_path / part)]) == 0
    table = capsys.readouterr().out
    assert "| sd T=0.7 |" in table and "| typical eps=0.09 delta=0.3 |" in table
    assert "(acceptance, KL) plane" in table and "| gate margin=1 |" in table.split("(acceptance, KL) plane")[1]
    parts = [load_results(str(tmp_path / part / "results.json")) for part in "ab"]
    assert all(len(row.kl_per_prompt) == 2 for row in parts[0].rows)
    prompts, joined = merge_result_sets(parts)
    rows = {row.label: row for row in joined}
    assert len(rows["sd T=0.7"].kl_per_prompt) == len(gsm8k_examples()) and rows["sd T=0.7"].kl > 0
    path = save_results(str(tmp_path / "joined.json"), prompts, joined)
    assert json.loads(open(path).read())["rows"][0]["kl"] == pytest.approx(rows["static w=0"].kl)
    assert cli.main(["report", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                     "--output-dir", str(tmp_path / "joined")]) == 0
    assert "KL to target" in capsys.readouterr().out
    args = cli.build_parser().parse_args(["pareto", "--data", "d", "--typical"])
    assert args.typical == [] and cli.build_parser().parse_args(["pareto", "--data", "d"]).typical is None
