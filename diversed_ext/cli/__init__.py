"""The ``diversed`` command line (each command's ``--help`` lists all its flags).

    diversed generate --prompt "..." [--method ar|sd|static|diversed|fly] [--weight W] [--head PATH] [--max-draft K]
                      [--temperature T] [--max-new-tokens N] [--seed S] [--target NAME_OR_PATH [--draft ...]]
    diversed demo     [--prompts N] [--max-new-tokens N] [--weights W ...] ...
                      ar, sd, static ensembles, the default head (default pair only) and, at a sampling temperature,
                      sd with the log-probability gate, on a few built-in prompts: one table
    diversed bench verify [ARGS...]   runs bench/bench_verify.py (from the source checkout: bench/ is not installed)
    diversed bench e2e    [ARGS...]   runs bench/bench_e2e.py
    diversed train    --task gsm8k --data PATH [--steps --batch-size --lr --acceptance-coef --fidelity-coef ...]
    diversed train    --recipe smollm2-135m-lambda4 --data PATH/gsm8k/train.jsonl
                      a shipped head's training run again, from the recipe in its head.json
    diversed train-drafter --out FOLDER --data PATH/gsm8k/train.jsonl [--prompts N --steps N --draft-vocab V ...]
                      an EAGLE-3 draft head for the default pair, by self-distillation (the shipped head's recipe)
    diversed eval     --task gsm8k --data PATH --method ar sd static diversed [--weight W ...] [--head PATH]
                      also the lossy methods fly, static+fly, diversed+fly, gate, static+gate, diversed+gate, typical
    diversed pareto   --task gsm8k --data PATH [--weights W ...] [--head PATH ...] [--output-dir DIR]
    diversed report   RESULTS_JSON ... [--output-dir DIR]
                      pareto's table, frontier and plot from saved results.json files, joined as one run
    diversed validate --task gsm8k --data PATH [--head PATH ...] [--acceptance-coef L ...] [--tokens FILE]
                      heads and coefficients placed on held-out contexts in closed form, without decoding per head
    diversed compare-drafts [--task gsm8k --data PATH] [--drafts distributions tokens ...] [--weight W ...]
                      sd and static verified with the draft's distributions or its tokens only: one table
    diversed export-pair DIR [--overwrite]
                      the default pair as DIR/target and DIR/draft, plain folders vLLM loads

Without ``--target`` the embedded default pair is used (SmolLM2-135M-Instruct and its int8 copy, see
:mod:`diversed_ext.models`). Prompts go through the tokenizer's chat template when it has one.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import __version__, cuda_kernels_registered
from ..decoding import METHODS, SpeculativeDecoder, encode_prompt, eos_ids
from ..ops import is_greedy_temperature
from ..models.export import export_default_pair
from ..models.pairs import MissingPackage
from ..research.harness import (DEMO_PROMPTS, DEMO_WEIGHTS, demo_methods, run_demo,
                                throughput_summary, with_draft_length)
from ..research.report import format_table
from . import common
from .checks import check_flags_read, check_repeated_values, given_flags
from .common import (USAGE_EXIT_STATUS, UsageError, _add_batch_argument, _add_draft_length_arguments,
                     _add_model_arguments, _check_draft_cost, _decoder_error, _draft_length_words, _load_head,
                     _positive_int, _unit_float, library_defaults)
from .experiments import EXPERIMENT_HANDLERS, add_experiment_commands
from .train import add_train_command, add_train_drafter_command, run_train, run_train_drafter, with_recipe

__all__ = ["build_parser", "main", "UsageError"]


def _version_line() -> str:
    kernels = "CPU and CUDA kernels" if cuda_kernels_registered() else "CPU kernels only"
    return f"diversed {__version__} (torch {torch.__version__}; {kernels})"


def _prompt_text(text: str) -> str:
    """An argparse type: any text but the empty one (it may encode to no token at all, and a continuation needs one)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``diversed`` command."""
    # No abbreviated flags: one written as typed is what the unread-flag check sees, and an abbreviation valid today
    # turns ambiguous once a flag sharing its prefix is added.
    parser = argparse.ArgumentParser(prog="diversed", description="DIVERSED relaxed speculative decoding",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=_version_line(),
                        help="the package's version, the torch it runs on and whether its CUDA kernels are built")
    commands = parser.add_subparsers(dest="command", required=True,
                                     parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))

    generate = commands.add_parser("generate", help="generate a continuation of one prompt")
    generate.add_argument("--prompt", type=_prompt_text, required=True, help="the prompt text")
    generate.add_argument("--method", choices=METHODS, default="sd", help="default sd")
    generate.add_argument("--weight", type=_unit_float, help="weight w on the target, for --method static")
    generate.add_argument("--head", help="head folder for --method diversed, or a shipped head's name ('default': "
                                         "the default SmolLM2-135M pair's default head, the one trained on the "
                                         "EAGLE-3 drafter's states with --drafter eagle3)")
    _add_model_arguments(generate, library_defaults(SpeculativeDecoder.generate, SpeculativeDecoder))
    _add_draft_length_arguments(generate)

    demo = commands.add_parser("demo", help="compare ar, sd, static ensembles, the default head and the "
                                  "gate on built-in prompts")
    demo.add_argument("--weights", type=_unit_float, nargs="+", default=list(DEMO_WEIGHTS),
                      help=f"static ensemble weights (default {' '.join(map(str, DEMO_WEIGHTS))})")
    demo.add_argument("--prompts", type=_positive_int, default=len(DEMO_PROMPTS),
                      help=f"how many of the built-in prompts to run (default {len(DEMO_PROMPTS)}, cycled past that)")
    _add_batch_argument(demo, library_defaults(run_demo))
    _add_model_arguments(demo, library_defaults(run_demo))
    _add_draft_length_arguments(demo)

    bench = commands.add_parser("bench", help="run a benchmark script from bench/")
    bench.add_argument("which", choices=("verify", "e2e"), help="verify: bench_verify.py, e2e: bench_e2e.py")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the script")

    export = commands.add_parser("export-pair", help="write the default pair as two folders vLLM loads")
    export.add_argument("directory", type=Path, help="gets target/ and draft/")
    export.add_argument("--overwrite", action="store_true", help="replace existing target/ and draft/ folders")
    add_train_command(commands)
    add_train_drafter_command(commands)
    add_experiment_commands(commands)
    return parser


def _run_generate(args) -> int:
    if args.method == "static" and args.weight is None:
        raise UsageError("--method static needs --weight W in [0, 1]")
    if args.method == "diversed" and args.head is None:
        raise UsageError("--method diversed needs --head PATH (or --head default for the shipped head)")
    if args.weight is not None and args.method != "static":
        raise UsageError("--weight applies to --method static")
    _check_draft_cost(args)
    common.check_head_arguments([args.head] if args.head else [], args)
    target, draft, tokenizer = common.load_command_models(args)
    head = _load_head(args.head, target, draft) if args.head else None
    with _decoder_error():
        decoder = SpeculativeDecoder(target, draft, method=args.method, weight=args.weight, head=head,
                                     max_draft=args.max_draft, temperature=args.temperature,
                                     draft_length=args.draft_length, draft_cost=args.draft_cost)
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
    _check_draft_cost(args)
    target, draft, tokenizer = common.load_command_models(args)
    texts = [DEMO_PROMPTS[index % len(DEMO_PROMPTS)] for index in range(args.prompts)]
    prompts = [encode_prompt(tokenizer, text, chat=not args.no_chat_template) for text in texts]
    # The shipped head was trained for the default pair only; other pairs get the static rows.
    default_pair = args.target is None and args.draft is None
    specs = demo_methods(args.weights, head=_load_head("default", target, draft) if default_pair else None,
                         gate=not is_greedy_temperature(args.temperature))
    specs = with_draft_length(specs, args.draft_length)
    wall = {}
    with _decoder_error():
        generations = run_demo(target, draft, prompts, specs, max_draft=args.max_draft,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                               eos_token_id=eos_ids(tokenizer, target), batch_size=args.batch_size,
                               wall_seconds=wall, draft_cost=args.draft_cost)
    print(f"{len(prompts)} prompts, up to {args.max_new_tokens} new tokens, {_draft_length_words(args)}, batch size "
          f"{args.batch_size}, temperature {args.temperature:g}, torch threads {torch.get_num_threads()}")
    print(format_table([(label, throughput_summary(generations[label], wall[label])) for label, _ in specs]))
    sample = generations["sd"][0].tokens.tolist()
    print(f"\nsd on \"{DEMO_PROMPTS[0]}\":\n{tokenizer.decode(sample, skip_special_tokens=True)}")
    return 0


def find_bench_script(name: str) -> Path:
    """bench/<name> in the current directory or in the source checkout this package was installed from."""
    candidates = [Path.cwd() / "bench" / name, Path(__file__).resolve().parents[2] / "bench" / name]
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


def _run_export_pair(args) -> int:
    try:
        folders = export_default_pair(args.directory, overwrite=args.overwrite)
    except OSError as error:  # the library's FileExistsError (no errno) says how to overwrite
        if isinstance(error, FileExistsError) and error.errno is None:
            raise UsageError(str(error).replace("overwrite=True (--overwrite)", "--overwrite")) from error
        raise UsageError(f"cannot write to {args.directory}: {error.strerror or error} ({error.filename})") from error
    print(f"target: {folders.target}\ndraft:  {folders.draft} (the int8 draft's weights, dequantised to float32)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``diversed`` console script; returns the exit status (2 for a user's mistake)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"generate": _run_generate, "demo": _run_demo, "bench": _run_bench, "export-pair": _run_export_pair,
                "train": run_train, "train-drafter": run_train_drafter, **EXPERIMENT_HANDLERS}
    try:
        given = given_flags(argv)
        check_flags_read(args, given)
        check_repeated_values(args, given)
        if getattr(args, "recipe", None):
            args = with_recipe(parser, argv, args)
        return handlers[args.command](args)
    except (UsageError, MissingPackage) as error:  # a missing package's message is the pip command that installs it
        print(f"diversed: {error}", file=sys.stderr)
        return USAGE_EXIT_STATUS

