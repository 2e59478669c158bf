"""End-to-end decoding on the default pair: our loop against transformers, same prompts, seeds and lengths.

Rows (the default pair: SmolLM2-135M-Instruct float32 target, its int8 dynamically quantised copy as draft):

    ar              our loop, the target alone (K = 0, one token per target pass)
    hf target       ``target.generate(do_sample=True)``: transformers, the target alone
    hf assisted     ``target.generate(assistant_model=draft, do_sample=True)``: transformers' speculative decoding
    hf static w=W   the same with ``assistant_ensemble_weight=W`` (transformers >= 5.18; skipped, with a note, when the
                    installed version has no such option or W is not in the open interval (0, 1))
    sd              our loop, standard speculative decoding (w = 1)
    sd, hf forward  the same through the models' own forward passes (``fast_forward=False``): the loop alone
    static w=W      our loop, static ensemble at the same W

Our rows run the Llama models through :mod:`diversed_ext.forward` (same weights, a preallocated KV cache, skinny
products laid out for MKL), except ``sd, hf forward``, which separates what the loop gains from what the lean
forward gains.

Every row generates from the same prompts (the chat prompts of ``diversed demo``, or the first questions of a GSM8K
jsonl given with --data), with seed + prompt index per prompt, up to --max-new-tokens tokens, stopping at EOS. Methods
alternate prompt by prompt, so a slow spell of a shared machine does not land on one method, and every method runs one
short untimed generation first. Figures are totals over all prompts (tokens over seconds, accepted over drafted).
Acceptance carries +- one standard error over prompts (drafts within one generation are correlated, so the prompts
are the independent samples), and the acceptance of our sd and static rows minus transformers' at the same w is
printed paired over prompts. ms/pass is the wall time per target pass (one round): unlike tokens/s it does not depend
on how many drafts happened to be accepted, so it compares the speed of two loops even when a few prompts leave their
acceptance rates apart.

transformers is set up to do what our loop does: the draft proposes exactly K tokens per round
(``num_assistant_tokens=K``, ``num_assistant_tokens_schedule="constant"``, ``assistant_confidence_threshold=0``, set on
the draft's generation_config, which is what transformers reads), sampling is plain softmax(logits / T) (``top_k=0``,
``top_p=1``), and the same EOS ids end a generation.

How the transformers rows are measured, since transformers reports no statistics: a forward pre-hook on the target
counts its forward passes (the prefill included, as in our loop where the first round reads the prompt), a forward
pre-hook on the draft counts drafted tokens (every assistant forward pass proposes one candidate), and accepted drafts
are new tokens minus target passes (each pass emits its accepted drafts plus one token). Neither loop drafts past the
length budget, so this equals the verifier's count except where a round is cut at an EOS. The time split is not
available for transformers (overhead n/a); ours is from RoundStats: the share of the rounds' time outside the two
models' forward passes.

    python bench/bench_e2e.py [--prompts N] [--max-new-tokens N] [--k K [K ...]] [--weight W] [--temperature T]
                              [--seed S] [--data gsm8k/test.jsonl] [--csv PATH] [--pass-repeats N]
                              [--batch-size B [--batched-only]]
    python bench/bench_e2e.py --draft-lengths --data gsm8k/test.jsonl [--prompts N] [--k K [K ...]]
                              [--draft-cap N] [--draft-cost C] [--batch-size B]

Before that table it prints the per-pass costs (bench/pass_costs.py: draft 1-token, target 1-token, target K+1-token,
medians, and the draft's weight-streaming floor) and, when --k names several values, a sweep of ar / sd / static /
diversed over them: the table above then runs at the K with the most sd tokens/s, so no K is picked by hand.

--batch-size B adds the batched comparison of bench/bench_e2e_batched.py (its docstring says how it counts), at the
K the sweep chose; --batched-only runs that comparison alone, at the first --k.

--draft-lengths runs, instead of all of the above, the draft-length comparison of bench/bench_draft_lengths.py (its
docstring says how it counts): sd, static w and the default head under a fixed K for every --k, transformers'
heuristic and confidence rules and our gain rule (at most --draft-cap drafts), at B = 1 and at --batch-size.

Writes a markdown table to stdout and a CSV under bench/results/ (or --csv).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from diversed_ext.decoding import DecodingSummary, Fly, SpeculativeDecoder, encode_prompt, eos_ids
from diversed_ext.decoding.stats import add_summaries
from diversed_ext.research.harness import DEMO_PROMPTS, run_interleaved
from diversed_ext.research.report import cell, markdown_rows, paired_difference, ratio_estimate, with_error
from diversed_ext.models import load_default_pair
from arguments import check_writable_file
from pass_costs import k_sweep_table, pass_cost_table, pass_costs, sweep_methods

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class ForwardCounter:
    """Counts a module's forward calls with a forward pre-hook, while active."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def remove(self) -> None:
        self._handle.remove()


def hf_ensemble_supported() -> bool:
    """Whether the installed transformers has the static ensemble option ``assistant_ensemble_weight``."""
    from transformers import GenerationConfig

    return hasattr(GenerationConfig(), "assistant_ensemble_weight")


def load_prompts(args, tokenizer) -> list[list[int]]:
    """Token ids of the first --prompts prompts: GSM8K questions from --data, else the demo's chat prompts."""
    if args.data:
        texts = []
        with open(args.data) as lines:
            for line in lines:
                if line.strip():
                    texts.append(json.loads(line)["question"])
                if len(texts) == args.prompts:
                    break
    else:
        texts = [DEMO_PROMPTS[index % len(DEMO_PROMPTS)] for index in range(args.prompts)]
    return [encode_prompt(tokenizer, text) for text in texts]


def ours(target, draft, args, eos, **kwargs) -> Callable:
    """A runner (prompt, seed, max_new_tokens) -> DecodingSummary of our SpeculativeDecoder."""
    decoder = SpeculativeDecoder(target, draft, max_draft=args.k, temperature=args.temperature, **kwargs)

    def run(prompt, seed, max_new_tokens):
        return decoder.generate(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos, seed=seed).summary()
    return run


def hf(target, draft, args, eos, pad, **kwargs) -> Callable:
    """A runner of ``target.generate`` (assisted when ``draft`` is given), counted with forward pre-hooks."""
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}
    if args.temperature == 0:
        sampling = {"do_sample": False}
    if draft is not None:
        config = draft.generation_config
        config.num_assistant_tokens = args.k
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft

    def run(prompt, seed, max_new_tokens):
        input_ids = torch.tensor([prompt], dtype=torch.int64)
        counters = [ForwardCounter(target)] + ([ForwardCounter(draft)] if draft is not None else [])
        torch.manual_seed(seed)
        try:
            start = time.perf_counter()
            with torch.no_grad():
                output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                                         **sampling, **kwargs)
            seconds = time.perf_counter() - start
        finally:
            for counter in counters:
                counter.remove()
        new_tokens = output.shape[1] - input_ids.shape[1]
        passes = counters[0].count
        drafted = counters[1].count if draft is not None else 0
        accepted = new_tokens - passes if draft is not None else 0
        # No time split for transformers: round_seconds = 0 makes the overhead fraction NaN (n/a).
        return DecodingSummary(prompts=1, new_tokens=new_tokens, target_passes=passes, drafted=drafted,
                               accepted=accepted, seconds=seconds, draft_seconds=0.0, target_seconds=0.0,
                               head_seconds=0.0, verify_seconds=0.0, round_seconds=0.0)
    return run


def build_methods(target, draft, tokenizer, args) -> list[tuple[str, Callable]]:
    eos = eos_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    methods = [("ar", ours(target, None, args, eos, method="ar")),
               ("hf target", hf(target, None, args, eos, pad)),
               ("hf assisted", hf(target, draft, args, eos, pad))]
    label = f"w={args.weight:g}"
    if not hf_ensemble_supported():
        import transformers

        print(f"hf static {label}: unavailable (transformers {transformers.__version__} has no "
              f"assistant_ensemble_weight; it needs >= 5.18); row skipped", file=sys.stderr)
    elif not 0.0 < args.weight < 1.0:
        print(f"hf static {label}: skipped (transformers takes assistant_ensemble_weight in (0, 1) only)",
              file=sys.stderr)
    else:
        methods.append((f"hf static {label}",
                        hf(target, draft, args, eos, pad, assistant_ensemble_weight=args.weight)))
    methods += [("sd", ours(target, draft, args, eos, method="sd")),
                ("sd, hf forward", ours(target, draft, args, eos, method="sd", fast_forward=False)),
                (f"static {label}", ours(target, draft, args, eos, method="static", weight=args.weight))]
    if args.fly:
        fly = Fly(args.fly_window, args.fly_threshold, args.fly_top_k)
        methods += [("fly", ours(target, draft, args, eos, method="fly", fly=fly)),
                    (f"static+fly {label}", ours(target, draft, args, eos, method="static", weight=args.weight,
                                                 fly=fly))]
    return methods


def one_prompt_at_a_time(run: Callable, prompts) -> Callable:
    """A harness runner (batch of prompt indices, seed, max_new_tokens) -> [result] from a one-prompt runner ``run``
    (prompt, seed, max_new_tokens) -> result; the harness hands it batches of one prompt (its batch_size 1)."""
    return lambda indices, seed, max_new_tokens: [run(prompts[indices[0]], seed, max_new_tokens)]


def run_all(methods, prompts, args) -> dict[str, list[DecodingSummary]]:
    """Every method on every prompt through the research harness (warm-up, interleaving, seed + i)."""
    runners = [(name, one_prompt_at_a_time(run, prompts)) for name, run in methods]
    return run_interleaved(runners, len(prompts), seed=args.seed, max_new_tokens=args.max_new_tokens,
                           desc="bench_e2e")


def acceptance_se(summaries: list[DecodingSummary]) -> float:
    """Standard error of the acceptance pooled over prompts (accepted over drafted, the table's figure) by the ratio
    estimator: drafts within one generation are correlated, so the prompts, not the drafts, are the independent
    samples."""
    return ratio_estimate([summary.accepted for summary in summaries], [summary.drafted for summary in summaries])[1]


def paired_acceptance(per_prompt: dict[str, list[DecodingSummary]], ours: str, theirs: str):
    """Mean and standard error over prompts of acceptance(ours) - acceptance(theirs), same prompts and seeds (a prompt
    where either side drafted nothing has no acceptance rate and is skipped)."""
    return paired_difference([summary.acceptance_rate for summary in per_prompt[ours]],
                             [summary.acceptance_rate for summary in per_prompt[theirs]])


def rows(per_prompt: dict[str, list[DecodingSummary]]) -> list[dict]:
    """One dict per method; overhead as a fraction of the rounds' time; speed ratios against ar and hf assisted."""
    totals = {name: add_summaries(summaries) for name, summaries in per_prompt.items()}
    references = {"ar": totals.get("ar"), "hf assisted": totals.get("hf assisted")}
    table = []
    for name, total in totals.items():
        row = {"method": name, "new_tokens": total.new_tokens, "target_passes": total.target_passes,
               "drafted": total.drafted, "accepted": total.accepted,
               "acceptance": total.acceptance_rate, "acceptance_se": acceptance_se(per_prompt[name]),
               "tokens_per_pass": total.tokens_per_pass, "tokens_per_s": total.tokens_per_second,
               "ms_per_pass": 1e3 * total.seconds / total.target_passes if total.target_passes else math.nan,
               "overhead": total.overhead_fraction}
        for reference_name, reference in references.items():
            ratio = total.tokens_per_second / reference.tokens_per_second if reference else math.nan
            row[f"x_{reference_name.replace(' ', '_')}"] = ratio
        table.append(row)
    return table


def markdown(table: list[dict]) -> str:
    header = ["method", "acceptance", "tokens/pass", "ms/pass", "tokens/s", "overhead", "vs ar", "vs hf assisted"]
    return markdown_rows(header, [[row["method"], with_error(row["acceptance"], row["acceptance_se"]),
                                   cell(row["tokens_per_pass"], ".2f"), cell(row["ms_per_pass"], ".0f"),
                                   cell(row["tokens_per_s"], ".1f"), cell(row["overhead"], ".1%"),
                                   cell(row["x_ar"], ".2f") + "x", cell(row["x_hf_assisted"], ".2f") + "x"]
                                  for row in table])


def write_csv(table: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)


def print_pass_costs(target, draft, prompt: list[int], args) -> None:
    print(f"Per-pass costs (median of {args.pass_repeats} after warm-up, torch threads {torch.get_num_threads()}):")
    print(pass_cost_table(pass_costs(target, draft, prompt, args.k, args.pass_repeats)))


def run_k_sweep(target, draft, tokenizer, prompts, args) -> int:
    """Every sweep method at every K (methods alternate prompt by prompt); prints the table, returns sd's best K."""
    eos = eos_ids(tokenizer, target)
    methods = sweep_methods(target, draft, args.weight, args.k)
    runners = []
    for label, k, kwargs in methods:
        at_k = argparse.Namespace(**{**vars(args), "k": max(k, 1)})  # ar drafts nothing; its K is unused
        run = ours(target, draft if label != "ar" else None, at_k, eos, **kwargs)
        runners.append(((label, k), one_prompt_at_a_time(run, prompts)))
    per_prompt = run_interleaved(runners, len(prompts), seed=args.seed, max_new_tokens=args.max_new_tokens,
                                 desc="k sweep")
    table, best = k_sweep_table(per_prompt, methods, args.k)
    print(f"K sweep ({len(prompts)} prompts, up to {args.max_new_tokens} new tokens, temperature {args.temperature:g}, "
          f"w = {args.weight:g} for static, the shipped head for diversed):")
    print(table)
    return best["sd"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="number of prompts (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="default 32")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6],
                        help="tokens drafted per round; several values run the K sweep first (default 1 to 6)")
    parser.add_argument("--pass-repeats", type=int, default=30, help="timed passes per pass kind (default 30)")
    parser.add_argument("--weight", type=float, default=0.5, help="w on the target for the static rows (default 0.5)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i runs with seed + i (default 0)")
    parser.add_argument("--data", help="GSM8K-style jsonl with a 'question' field (default: the demo prompts)")
    parser.add_argument("--csv", type=Path, help="CSV output (default bench/results/e2e-<time>.csv)")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="also run the batched comparison at this batch size (default 0: off)")
    parser.add_argument("--batched-only", action="store_true", help="skip the B = 1 table")
    parser.add_argument("--draft-lengths", action="store_true",
                        help="compare the draft-length policies with the fixed K of every --k (needs --data)")
    parser.add_argument("--draft-cap", type=int, default=8,
                        help="the most drafts a round of the adaptive policies (default 8)")
    parser.add_argument("--draft-cost", type=float,
                        help="the gain policy's draft pass over target pass (default: the policy's, 0.33)")
    parser.add_argument("--fly", action="store_true", help="also sd and static with FLy (lossy; --fly-*)")
    parser.add_argument("--fly-window", type=int, help="FLy's window W < K (default vLLM's, min(6, K - 1))")
    parser.add_argument("--fly-threshold", type=float, default=0.3, help="FLy's entropy threshold (default 0.3)")
    parser.add_argument("--fly-top-k", type=int, default=3, help="FLy's entropy top-k (default 3)")
    args = parser.parse_args(argv)
    if (args.prompts < 1 or args.max_new_tokens < 1 or min(args.k) < 1 or args.pass_repeats < 1
            or args.batch_size < 0 or args.draft_cap < 1):
        parser.error("--prompts, --max-new-tokens, --k, --pass-repeats and --draft-cap must be >= 1, "
                     "--batch-size >= 0")
    if args.draft_cost is not None and not 0.0 <= args.draft_cost < float("inf"):
        parser.error("--draft-cost must be a finite number >= 0")
    if args.draft_lengths and not args.data:
        parser.error("--draft-lengths needs --data (a GSM8K jsonl, e.g. gsm8k/test.jsonl)")
    if not 0.0 <= args.weight <= 1.0:
        parser.error("--weight must be in [0, 1]")
    if not args.temperature >= 0.0:
        parser.error("--temperature must be >= 0")
    if args.data and not os.path.isfile(args.data):
        parser.error(f"--data {args.data}: no such file")
    if args.fly and args.fly_window is not None and not 0 <= args.fly_window < min(args.k):
        parser.error(f"--fly-window must lie in [0, {min(args.k)}) (below every --k)")
    if args.csv is not None:
        check_writable_file(parser, "--csv", args.csv)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    target, draft, tokenizer = load_default_pair()
    if args.draft_lengths:
        from bench_draft_lengths import print_draft_lengths

        args.k_values = list(dict.fromkeys(args.k))
        path = args.csv or RESULTS_DIR / f"draft-lengths-{time.strftime('%Y%m%d-%H%M%S')}.csv"
        write_csv(print_draft_lengths(target, draft, tokenizer, args), path)
        print(f"CSV: {path}")
        return 0
    prompts = load_prompts(args, tokenizer)
    if args.batched_only:
        args.k = args.k[0]
    else:
        print_pass_costs(target, draft, prompts[0], args)
        args.k = run_k_sweep(target, draft, tokenizer, prompts, args) if len(args.k) > 1 else args.k[0]
    if args.batch_size:
        from bench_e2e_batched import print_batched

        print_batched(target, draft, tokenizer, prompts, args)
        if args.batched_only:
            return 0
    per_prompt = run_all(build_methods(target, draft, tokenizer, args), prompts, args)
    table = rows(per_prompt)
    print(f"{len(prompts)} prompts ({args.data or 'demo prompts'}), up to {args.max_new_tokens} new tokens, "
          f"K = {args.k}, w = {args.weight:g}, temperature {args.temperature:g}, seed {args.seed}, "
          f"torch threads {torch.get_num_threads()}")
    print(markdown(table))
    pairs = [("sd", "hf assisted"), (f"static w={args.weight:g}", f"hf static w={args.weight:g}")]
    for ours_name, theirs_name in pairs:
        if ours_name in per_prompt and theirs_name in per_prompt:
            mean, se = paired_acceptance(per_prompt, ours_name, theirs_name)
            print(f"acceptance {ours_name} - {theirs_name}, paired over prompts: {mean:+.3f} +- {se:.3f}")
    path = args.csv or RESULTS_DIR / f"e2e-{time.strftime('%Y%m%d-%H%M%S')}.csv"
    write_csv(table, path)
    print(f"CSV: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
