"""The ``diversed`` command line.

    diversed generate --prompt "..." [--method ar|sd|static|diversed] [--weight W] [--head PATH] [--k K]
                      [--temperature T] [--max-new-tokens N] [--seed S] [--target NAME_OR_PATH [--draft ...]]
    diversed demo     [--prompts N] [--max-new-tokens N] [--weights W ...] ...
                      ar, sd and static ensembles on the default pair and a few built-in prompts: one table
    diversed bench verify [ARGS...]   runs bench/bench_verify.py (from the source checkout: bench/ is not installed)
    diversed bench e2e    [ARGS...]   runs bench/bench_e2e.py
    diversed train    --task gsm8k --data PATH [--steps --batch-size --lr --acceptance-coef --fidelity-coef ...]
    diversed eval     --task gsm8k --data PATH --method ar sd static diversed [--weight W ...] [--head PATH]
    diversed pareto   --task gsm8k --data PATH [--weights W ...] [--head PATH ...] [--output-dir DIR]

Without ``--target`` the embedded default pair is used (SmolLM2-135M-Instruct and its int8 copy, see
:mod:`diversed_ext.models`). Prompts go through the tokenizer's chat template when it has one.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

from .decoding import METHODS, SpeculativeDecoder, encode_prompt, eos_ids
from .head import load_head
from .research.harness import (DEMO_NUM_DRAFT, DEMO_PROMPTS, DEMO_WEIGHTS, demo_methods, run_demo,
                               throughput_summary)
from .research.report import format_table


class UsageError(Exception):
    """A mistake on the command line or in a file it names: printed as one line, exit status 2, no traceback."""


USAGE_EXIT_STATUS = 2


def _number_in(convert, accept, description: str):
    """An argparse type: ``convert(text)``, finite and satisfying ``accept``, else "must be <description>"."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {description}, got {text!r}") from None
        if not (math.isfinite(value) and accept(value)):  # also refuses nan and inf
            raise argparse.ArgumentTypeError(f"must be {description}, got {text}")
        return value
    return parse


_positive_int = _number_in(int, lambda value: value >= 1, "an integer >= 1")
_non_negative_int = _number_in(int, lambda value: value >= 0, "an integer >= 0")
_unit_float = _number_in(float, lambda value: 0.0 <= value <= 1.0, "a number in [0, 1]")
_non_negative_float = _number_in(float, lambda value: value >= 0.0, "a finite number >= 0")
_positive_float = _number_in(float, lambda value: value > 0.0, "a finite number > 0")
_weight_of_untrained_head = _number_in(float, lambda value: 0.0 < value <= 1.0, "a number in (0, 1]")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model name or folder (default: the embedded SmolLM2-135M pair)")
    parser.add_argument("--draft", help="draft model name or folder (default: an int8 copy of the target)")
    parser.add_argument("--k", type=_positive_int, default=3, help="most tokens drafted per round (default %(default)s)")
    parser.add_argument("--temperature", type=_non_negative_float, default=1.0,
                        help="0 = greedy (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64, help="default %(default)s")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="default %(default)s")
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize the prompt as plain text")


def _add_batch_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=_positive_int, default=8,
                        help="prompts decoded together per target pass (default %(default)s; 1: one after another); "
                             "tokens/s is then every token over the wall time of the batches")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``diversed`` command."""
    parser = argparse.ArgumentParser(prog="diversed", description="DIVERSED relaxed speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a continuation of one prompt")
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument("--method", choices=METHODS, default="sd", help="default sd")
    generate.add_argument("--weight", type=_unit_float, help="weight w on the target, for --method static")
    generate.add_argument("--head", help="head folder for --method diversed ('default': the head shipped for the "
                                         "default SmolLM2-135M pair)")
    _add_model_arguments(generate)

    demo = commands.add_parser("demo", help="compare ar, sd and static ensembles on built-in prompts")
    demo.add_argument("--weights", type=_unit_float, nargs="+", default=list(DEMO_WEIGHTS),
                      help=f"static ensemble weights (default {' '.join(map(str, DEMO_WEIGHTS))})")
    demo.add_argument("--prompts", type=_positive_int, default=len(DEMO_PROMPTS),
                      help=f"how many of the built-in prompts to run (default {len(DEMO_PROMPTS)}, cycled past that)")
    _add_batch_argument(demo)
    _add_model_arguments(demo)
    demo.set_defaults(max_new_tokens=48, k=DEMO_NUM_DRAFT)

    bench = commands.add_parser("bench", help="run a benchmark script from bench/")
    bench.add_argument("which", choices=("verify", "e2e"), help="verify: bench_verify.py, e2e: bench_e2e.py")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the script")
    add_experiment_commands(commands)
    return parser


def load_models(target: Optional[str], draft: Optional[str]):
    """(target, draft, tokenizer): the default pair, or the pair named on the command line."""
    from .models import load_default_pair, load_pair

    if target is None:
        if draft is not None:
            raise UsageError("--draft needs --target")
        return load_default_pair()
    for flag, name in (("--target", target), ("--draft", draft)):
        # Nothing is downloaded here, so a name that is not a folder cannot load: say so before transformers does.
        if name is not None and not os.path.isdir(name):
            raise UsageError(f"{flag} {name}: no such model folder")
    try:
        return load_pair(target, draft)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load --target {target}: {error}") from None


def _load_head(path: str, target, draft):
    """The head at ``path`` for this pair, or a one-line error (exit 2) naming the folder and what is wrong."""
    try:
        return load_head(path, target=target, draft=draft)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load --head {path}: {error}") from None


def _run_generate(args) -> int:
    if args.method == "static" and args.weight is None:
        raise UsageError("--method static needs --weight W in [0, 1]")
    if args.method == "diversed" and args.head is None:
        raise UsageError("--method diversed needs --head PATH (or --head default for the shipped head)")
    if args.weight is not None and args.method != "static":
        raise UsageError("--weight applies to --method static")
    target, draft, tokenizer = load_models(args.target, args.draft)
    head = _load_head(args.head, target, draft) if args.head else None
    decoder = SpeculativeDecoder(target, draft, method=args.method, weight=args.weight, head=head,
                                 num_draft=args.k, temperature=args.temperature)
    prompt = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat_template)
    output = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, eos_token_id=eos_ids(tokenizer, target),
                              seed=args.seed, progress=args.max_new_tokens >= 32)
    print(tokenizer.decode(output.sequences[0].tolist(), skip_special_tokens=True))
    summary = output.summary()
    acceptance = "n/a" if math.isnan(summary.acceptance_rate) else f"{summary.acceptance_rate:.3f}"
    print(f"\n[{args.method}] {summary.new_tokens} tokens in {summary.seconds:.2f} s "
          f"({summary.tokens_per_second:.1f} tokens/s), {summary.target_passes} target passes, "
          f"{summary.tokens_per_pass:.2f} tokens/pass, acceptance {acceptance}", file=sys.stderr)
    return 0


def _run_demo(args) -> int:
    target, draft, tokenizer = load_models(args.target, args.draft)
    texts = [DEMO_PROMPTS[index % len(DEMO_PROMPTS)] for index in range(args.prompts)]
    prompts = [encode_prompt(tokenizer, text, chat=not args.no_chat_template) for text in texts]
    # The shipped head was trained for the default pair only; other pairs get the static rows.
    default_pair = args.target is None and args.draft is None
    specs = demo_methods(args.weights, head=_load_head("default", target, draft) if default_pair else None)
    wall = {}
    generations = run_demo(target, draft, prompts, specs, num_draft=args.k, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=args.seed, eos_token_id=eos_ids(tokenizer, target),
                           batch_size=args.batch_size, wall_seconds=wall)
    print(f"{len(prompts)} prompts, up to {args.max_new_tokens} new tokens, K = {args.k}, batch size "
          f"{args.batch_size}, temperature {args.temperature:g}, torch threads {torch.get_num_threads()}")
    print(format_table([(label, throughput_summary(generations[label], wall[label])) for label, _ in specs]))
    sample = generations["sd"][0].tokens.tolist()
    print(f"\nsd on \"{DEMO_PROMPTS[0]}\":\n{tokenizer.decode(sample, skip_special_tokens=True)}")
    return 0


def find_bench_script(name: str) -> Path:
    """bench/<name> in the current directory or in the source checkout this package was installed from."""
    candidates = [Path.cwd() / "bench" / name, Path(__file__).resolve().parents[1] / "bench" / name]
    for path in candidates:
        if path.is_file():
            return path
    raise UsageError(f"bench/{name} not found. The benchmark scripts are not part of the installed package; "
                     f"they live in the source checkout: cd into it (the folder holding bench/) and run again "
                     f"(looked in {', '.join(str(path.parent) for path in candidates)})")


def _run_bench(args) -> int:
    script = find_bench_script("bench_verify.py" if args.which == "verify" else "bench_e2e.py")
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    return subprocess.call([sys.executable, str(script), *extra], env=os.environ.copy())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``diversed`` console script; returns the exit status (2 for a user's mistake)."""
    args = build_parser().parse_args(argv)
    handlers = {"generate": _run_generate, "demo": _run_demo, "bench": _run_bench, **EXPERIMENT_HANDLERS}
    try:
        return handlers[args.command](args)
    except UsageError as error:
        print(f"diversed: {error}", file=sys.stderr)
        return USAGE_EXIT_STATUS


def _require_writable_folder(flag: str, path: str) -> None:
    """Create ``path`` and prove it writable now, before hours of work produce results that cannot be saved."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {path}: not writable ({error.strerror or error})") from None


# ------------------------------------------------------------------------------------------ train / eval / pareto


def _add_task_arguments(parser: argparse.ArgumentParser) -> None:
    from .research.tasks import TASKS

    parser.add_argument("--task", choices=sorted(TASKS), default="gsm8k", help="default gsm8k")
    parser.add_argument("--data", help="jsonl file of the task's examples (gsm8k: .../gsm8k/test.jsonl)")
    parser.add_argument("--limit", type=_positive_int, help="use the first N examples only")
    parser.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's choice)")


def add_experiment_commands(commands) -> None:
    """The train, eval and pareto sub-commands (see :mod:`diversed_ext.research`)."""
    from .research.harness import PARETO_WEIGHTS

    train = commands.add_parser("train", help="train an ensemble head with RL on a task")
    _add_task_arguments(train)
    train.add_argument("--steps", type=_positive_int, default=50, help="default 50")
    train.add_argument("--batch-size", type=_positive_int, default=4,
                       help="rollouts per step, decoded together (default 4)")
    train.add_argument("--lr", type=_positive_float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    train.add_argument("--warmup-steps", type=_non_negative_int, default=2, help="default 2")
    train.add_argument("--acceptance-coef", type=_non_negative_float, default=0.05,
                       help="lambda of the acceptance regulariser (default 0.05)")
    train.add_argument("--fidelity-coef", type=_non_negative_float, default=1.0,
                       help="weight of the fidelity (mean target log-prob per token) in the reward (default 1)")
    train.add_argument("--expected-fidelity-coef", type=_non_negative_float, default=0.0,
                       help="mu of the closed-form expected next-token fidelity term of the loss (default 0: off)")
    train.add_argument("--epochs", type=_positive_int, default=1,
                       help="optimiser updates per batch of rollouts (default 1)")
    train.add_argument("--head-hidden", type=_positive_int, help="hidden width of the head (default: linear head)")
    train.add_argument("--init-weight", type=_weight_of_untrained_head, default=0.5,
                       help="w of the untrained head, in (0, 1] (default 0.5)")
    train.add_argument("--rollout", choices=("speculative", "mixture"), default="speculative",
                       help="sample rollouts through the speculative loop (default) or token by token")
    train.add_argument("--output-dir", default="runs/head", help="checkpoints, log, curve, head/ (default runs/head)")
    train.add_argument("--checkpoint-every", type=_positive_int, default=5, help="default 5")
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output-dir")
    _add_model_arguments(train)
    train.set_defaults(max_new_tokens=48)

    evaluate = commands.add_parser("eval", help="acceptance, task quality, fidelity and speed per method")
    _add_task_arguments(evaluate)
    evaluate.add_argument("--method", choices=METHODS, nargs="+", default=["sd"], help="one or more (default sd)")
    evaluate.add_argument("--weight", type=_unit_float, nargs="+", default=[0.5],
                          help="w of each static ensemble (default 0.5)")
    evaluate.add_argument("--head", help="head folder for diversed ('default': the head shipped for SmolLM2-135M)")
    _add_batch_argument(evaluate)
    _add_model_arguments(evaluate)

    pareto = commands.add_parser("pareto", help="static sweep over w and every head's point: tables and PNGs")
    _add_task_arguments(pareto)
    pareto.add_argument("--weights", type=_unit_float, nargs="+", default=list(PARETO_WEIGHTS),
                        help=f"static weights (default {' '.join(format(w, 'g') for w in PARETO_WEIGHTS)})")
    pareto.add_argument("--head", nargs="+", help="one or more head folders, one DIVERSED point each ('default' for "
                        "the shipped head)")
    pareto.add_argument("--output-dir", default="runs/pareto",
                        help="where pareto.png, pareto.md and, with heads, head_weights.png and lowest_w_tokens.md go")
    _add_batch_argument(pareto)
    _add_model_arguments(pareto)


def _experiment_setup(args):
    """(task, examples, target, draft, tokenizer, eos) for the experiment commands."""
    from .research.tasks import get_task, load_task_examples

    if args.threads:
        torch.set_num_threads(args.threads)
    task = get_task(args.task)
    try:
        examples = load_task_examples(task, args.data, args.limit)
    except (OSError, ValueError) as error:
        raise UsageError(f"--data: {error}") from None
    for head in _head_paths(args):
        if head != "default" and not os.path.isdir(head):
            raise UsageError(f"--head {head}: no such head folder")
    if getattr(args, "output_dir", None) is not None:
        _require_writable_folder("--output-dir", args.output_dir)
    target, draft, tokenizer = load_models(args.target, args.draft)
    return task, examples, target, draft, tokenizer, eos_ids(tokenizer, target)


def _head_paths(args) -> list[str]:
    """The --head folders given (pareto takes several, eval one)."""
    heads = getattr(args, "head", None)
    return [] if heads is None else [heads] if isinstance(heads, str) else list(heads)


def _head_for(args, target, draft):
    return _load_head(args.head, target, draft) if getattr(args, "head", None) else None


def _heads_by_label(args, target, draft) -> dict:
    """label -> head for pareto: "diversed" for a single head, "diversed:<folder name>" for several."""
    paths = _head_paths(args)
    if len(paths) == 1:
        return {"diversed": _load_head(paths[0], target, draft)}
    labels = [f"diversed:{os.path.basename(os.path.normpath(path))}" for path in paths]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--head: two head folders share a name: {' '.join(paths)}")
    return {label: _load_head(path, target, draft) for label, path in zip(labels, paths)}


def _run_train(args) -> int:
    from .models import DEFAULT_PAIR
    from .research.recipes import build_trainer
    from .research.checkpoints import CheckpointError
    from .research.trainer import TrainerConfig, distributed_session

    if not args.data and args.task != "humaneval":
        raise UsageError("train needs --data PATH (a jsonl of training examples)")
    task, examples, target, draft, tokenizer, eos = _experiment_setup(args)
    config = TrainerConfig(output_dir=args.output_dir, steps=args.steps, batch_size=args.batch_size,
                           learning_rate=args.lr, warmup_steps=args.warmup_steps,
                           acceptance_coef=args.acceptance_coef, fidelity_coef=args.fidelity_coef,
                           expected_fidelity_coef=args.expected_fidelity_coef, epochs=args.epochs,
                           temperature=args.temperature, seed=args.seed, checkpoint_every=args.checkpoint_every)
    # Under torchrun every rank joins the job here; train() releases DDP before the group is destroyed.
    with distributed_session():
        trainer = build_trainer(task, examples, target, draft, tokenizer, config, head_hidden=args.head_hidden,
                                init_weight=args.init_weight, num_draft=args.k, max_new_tokens=args.max_new_tokens,
                                rollout=args.rollout, eos_token_id=eos, pair=None if args.target else DEFAULT_PAIR,
                                chat=not args.no_chat_template)
        try:
            history = trainer.train(resume=args.resume)
        except CheckpointError as error:
            raise UsageError(f"--resume: {error}") from None
    if history:
        last = history[-1]
        print(f"step {last['step']}: mean w {last['mean_weight']:.3f}, expected acceptance "
              f"{last['expected_acceptance']:.3f}, task reward {last['task_reward']:.3f}, "
              f"fidelity {last['fidelity']:.3f}; head saved in {os.path.join(args.output_dir, 'head')}")
    return 0


def _run_eval(args) -> int:
    from .research.harness import evaluate, method_specs
    from .research.report import compare_to_baselines, comparison_lines, markdown_table

    if "diversed" in args.method and not args.head:
        raise UsageError("--method diversed needs --head PATH (or --head default for the shipped head)")
    task, examples, target, draft, tokenizer, eos = _experiment_setup(args)
    specs = method_specs(args.method, args.weight, _head_for(args, target, draft))
    results = evaluate(task, examples, target, draft, tokenizer, specs, num_draft=args.k,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                       eos_token_id=eos, chat=not args.no_chat_template, batch_size=args.batch_size)
    print(f"{task.name}: {len(examples)} prompts, up to {args.max_new_tokens} new tokens, K = {args.k}, "
          f"temperature {args.temperature:g}, seeds {args.seed}..{args.seed + len(examples) - 1}\n")
    print(markdown_table(results, task.metric))
    comparisons = comparison_lines(compare_to_baselines(results))
    if comparisons:
        print("\n" + comparisons)
    return 0


def _run_pareto(args) -> int:
    from .research.harness import evaluate, pareto_methods
    from .research.head_usage import lowest_weight_table, plot_weight_histograms
    from .research.report import compare_to_baselines, comparison_lines, learned_rows, markdown_table, plot_pareto

    task, examples, target, draft, tokenizer, eos = _experiment_setup(args)
    specs = pareto_methods(args.weights, heads=_heads_by_label(args, target, draft))
    results = evaluate(task, examples, target, draft, tokenizer, specs, num_draft=args.k,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                       eos_token_id=eos, chat=not args.no_chat_template, batch_size=args.batch_size)
    table = markdown_table(results, task.metric)
    learned = learned_rows(results)
    comparisons = [comparison_lines(compare_to_baselines(results, row.label), row.label) for row in learned]
    if any(comparisons):
        table += "\n\n" + "\n".join(line for line in comparisons if line)
    written = [_write_text(args.output_dir, "pareto.md", table),
               plot_pareto(results, os.path.join(args.output_dir, "pareto.png"), task.metric)]
    usages = {row.label: row.weight_usage for row in learned if row.weight_usage is not None}
    if usages:
        written.append(plot_weight_histograms(usages, os.path.join(args.output_dir, "head_weights.png")))
        written.append(_write_text(args.output_dir, "lowest_w_tokens.md", lowest_weight_table(usages, tokenizer)))
    print(table)
    print(f"\nwrote {', '.join(written)}")
    return 0


def _write_text(folder: str, name: str, text: str) -> str:
    path = os.path.join(folder, name)
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text + "\n")
    return path


EXPERIMENT_HANDLERS = {"train": _run_train, "eval": _run_eval, "pareto": _run_pareto}


if __name__ == "__main__":
    sys.exit(main())
