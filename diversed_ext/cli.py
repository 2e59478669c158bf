"""The ``diversed`` command line.

    diversed generate --prompt "..." [--method ar|sd|static|diversed] [--weight W] [--head PATH] [--k K]
                      [--temperature T] [--max-new-tokens N] [--seed S] [--target NAME_OR_PATH [--draft ...]]
    diversed demo     [--prompts N] [--max-new-tokens N] [--weights W ...] ...
                      ar, sd and static ensembles on the default pair and a few built-in prompts: one table
    diversed bench verify [ARGS...]   runs bench/bench_verify.py (from the source checkout: bench/ is not installed)
    diversed bench e2e    [ARGS...]   runs bench/bench_e2e.py

Without ``--target`` the embedded default pair is used (SmolLM2-135M-Instruct and its int8 copy, see
:mod:`diversed_ext.models`). Prompts go through the tokenizer's chat template when it has one.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from .decoding import METHODS, DecodingSummary, SpeculativeDecoder, summarize

DEMO_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three tips for staying focused while studying.",
    "What is the capital of France, and what is it famous for?",
)
DEMO_WEIGHTS = (0.75, 0.5)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _unit_float(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0.0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model name or folder (default: the embedded SmolLM2-135M pair)")
    parser.add_argument("--draft", help="draft model name or folder (default: an int8 copy of the target)")
    parser.add_argument("--k", type=_positive_int, default=3, help="most tokens drafted per round (default 3)")
    parser.add_argument("--temperature", type=_non_negative_float, default=1.0, help="0 = greedy (default 1)")
    parser.add_argument("--max-new-tokens", type=_non_negative_int, default=64, help="default 64")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize the prompt as plain text")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``diversed`` command."""
    parser = argparse.ArgumentParser(prog="diversed", description="DIVERSED relaxed speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a continuation of one prompt")
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument("--method", choices=METHODS, default="sd", help="default sd")
    generate.add_argument("--weight", type=_unit_float, help="weight w on the target, for --method static")
    generate.add_argument("--head", help="weight head for --method diversed (a saved module)")
    _add_model_arguments(generate)

    demo = commands.add_parser("demo", help="compare ar, sd and static ensembles on built-in prompts")
    demo.add_argument("--weights", type=_unit_float, nargs="+", default=list(DEMO_WEIGHTS),
                      help=f"static ensemble weights (default {' '.join(map(str, DEMO_WEIGHTS))})")
    demo.add_argument("--prompts", type=_positive_int, default=len(DEMO_PROMPTS),
                      help=f"how many of the built-in prompts to run (default {len(DEMO_PROMPTS)}, cycled past that)")
    _add_model_arguments(demo)
    demo.set_defaults(max_new_tokens=48)

    bench = commands.add_parser("bench", help="run a benchmark script from bench/")
    bench.add_argument("which", choices=("verify", "e2e"), help="verify: bench_verify.py, e2e: bench_e2e.py")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the script")
    return parser


def load_models(target: Optional[str], draft: Optional[str]):
    """(target, draft, tokenizer): the default pair, or the pair named on the command line."""
    from .models import load_default_pair, load_pair

    if target is None:
        if draft is not None:
            raise SystemExit("diversed: --draft needs --target")
        return load_default_pair()
    return load_pair(target, draft)


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user prompt: through the chat template (with the assistant turn opened) when there is one."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
        ids = encoded["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    return [int(token) for token in ids]


def eos_ids(tokenizer, model) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS and the model's generation_config EOS ids."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if config_eos is not None:
        ids.update(int(token) for token in (config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]))
    return sorted(ids)


def load_head(path: str):
    """A weight head saved at ``path``: through ``diversed_ext.head.load_head`` when that module provides it, else a
    whole ``nn.Module`` saved with ``torch.save`` (trusted files only: this unpickles)."""
    try:
        from . import head as head_module
    except ImportError:
        head_module = None
    if head_module is not None and hasattr(head_module, "load_head"):
        return head_module.load_head(path)
    head = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(head, torch.nn.Module):
        raise SystemExit(f"diversed: --head {path} holds a {type(head).__name__}, not a saved nn.Module")
    return head.eval()


def _run_generate(args) -> int:
    if args.method == "static" and args.weight is None:
        raise SystemExit("diversed: --method static needs --weight W in [0, 1]")
    if args.method == "diversed" and args.head is None:
        raise SystemExit("diversed: --method diversed needs --head PATH")
    if args.weight is not None and args.method != "static":
        raise SystemExit("diversed: --weight applies to --method static")
    head = load_head(args.head) if args.head else None
    target, draft, tokenizer = load_models(args.target, args.draft)
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


def format_table(rows: Sequence[tuple[str, DecodingSummary]], baseline: str = "ar") -> str:
    """A plain-text table of summaries: acceptance, tokens per target pass, tokens/s and speed against ``baseline``."""
    reference = dict(rows).get(baseline)
    header = f"{'method':<16}{'acceptance':>11}{'tokens/pass':>13}{'tokens/s':>10}{'vs ' + baseline:>9}"
    lines = [header, "-" * len(header)]
    for name, summary in rows:
        acceptance = "-" if math.isnan(summary.acceptance_rate) else f"{summary.acceptance_rate:.3f}"
        speed = summary.tokens_per_second / reference.tokens_per_second if reference else math.nan
        lines.append(f"{name:<16}{acceptance:>11}{summary.tokens_per_pass:>13.2f}{summary.tokens_per_second:>10.1f}"
                     f"{speed:>8.2f}x")
    return "\n".join(lines)


def demo_methods(weights: Sequence[float]) -> list[tuple[str, dict]]:
    """(label, SpeculativeDecoder keyword arguments) of the demo's methods: ar, sd, then static at each weight."""
    methods = [("ar", {"method": "ar"}), ("sd", {"method": "sd"})]
    methods += [(f"static w={weight:g}", {"method": "static", "weight": weight}) for weight in weights]
    return methods


def _run_demo(args) -> int:
    target, draft, tokenizer = load_models(args.target, args.draft)
    texts = [DEMO_PROMPTS[index % len(DEMO_PROMPTS)] for index in range(args.prompts)]
    prompts = [encode_prompt(tokenizer, text, chat=not args.no_chat_template) for text in texts]
    eos = eos_ids(tokenizer, target)
    methods = demo_methods(args.weights)
    decoders = {label: SpeculativeDecoder(target, draft, num_draft=args.k, temperature=args.temperature, **kwargs)
                for label, kwargs in methods}
    # One short untimed run per method first: the first forward passes pay for allocations and lazy imports.
    for decoder in decoders.values():
        decoder.generate(prompts[0], max_new_tokens=4, seed=args.seed)
    generations = {label: [] for label, _ in methods}
    runs = [(index, label) for index in range(len(prompts)) for label, _ in methods]
    # Methods alternate prompt by prompt, so a slow spell of a shared machine does not land on one method.
    for index, label in tqdm(runs, desc="demo", unit="run"):
        output = decoders[label].generate(prompts[index], max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                          seed=args.seed + index)
        generations[label].extend(output.generations)
    print(f"{len(prompts)} prompts, up to {args.max_new_tokens} new tokens, K = {args.k}, "
          f"temperature {args.temperature:g}, torch threads {torch.get_num_threads()}")
    print(format_table([(label, summarize(generations[label])) for label, _ in methods]))
    sample = generations["sd"][0].tokens.tolist()
    print(f"\nsd on \"{DEMO_PROMPTS[0]}\":\n{tokenizer.decode(sample, skip_special_tokens=True)}")
    return 0


def find_bench_script(name: str) -> Path:
    """bench/<name> in the current directory or in the source checkout this package was installed from."""
    candidates = [Path.cwd() / "bench" / name, Path(__file__).resolve().parents[1] / "bench" / name]
    for path in candidates:
        if path.is_file():
            return path
    raise SystemExit(f"diversed: bench/{name} not found. The benchmark scripts are not part of the installed package; "
                     f"they live in the source checkout: cd into it (the folder holding bench/) and run again "
                     f"(looked in {', '.join(str(path.parent) for path in candidates)})")


def _run_bench(args) -> int:
    script = find_bench_script("bench_verify.py" if args.which == "verify" else "bench_e2e.py")
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    return subprocess.call([sys.executable, str(script), *extra], env=os.environ.copy())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``diversed`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    handlers = {"generate": _run_generate, "demo": _run_demo, "bench": _run_bench}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
