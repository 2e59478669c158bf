"""The EAGLE-3 head against the int8 draft on the default pair: what a draft token costs, how often drafts are kept,
and the tokens/s each gives over ar, side by side in one run.

Rows, for each drafter (``eagle3``: the EAGLE-3 head on the target's hidden states; ``eagle3-int8``: the same head
with int8 products, ``Eagle3Head.use_int8_products``, with --int8-head; ``int8``: the target's int8 copy):

    sd        standard speculative decoding (w = 1: the output follows the target)
    gate      sd with the log-probability gate at its default margin (lossy)
    diversed  the shipped default DIVERSED head of each drafter: with the int8 draft the default head, with the
              EAGLE-3 head the same recipe trained on that head's output states, a third of its rollouts on
              synthetic problems (``smollm2-135m-eagle3-lambda4-mixed``)

at every K of --k, plus ar. Prompts: held-out GSM8K test problems (--data, the first --prompts after --skip) in the
chat format ``diversed eval --task gsm8k`` uses, T = --temperature (default 1), one request at a time, prompt i with
seed + i for every row. Rows alternate prompt by prompt (the research harness), each first runs once untimed.

Figures: acceptance = accepted / drafted over all prompts (the EAGLE-3 drafter drafts nothing in a request's first
round, which reads the prompt, so that round does not count); mean w = the mean over drafted tokens of the weight
on the target the DIVERSED head chose (its rows only: where it reads states unlike its training drafter's, a low
mean w flags acceptance bought by moving off the target); tokens/pass = new tokens per target pass; tokens/s =
the median over prompts of each prompt's tokens over its seconds; "x ar" = the median over prompts of the prompt's
tokens/s over ar's on the same prompt (paired, so a slow spell of a shared machine cancels out).

Per-token costs (medians of --pass-repeats after a warm-up, on a prompt's cache): the target's 1-token pass, the int8
draft's 1-token pass, and one EAGLE-3 draft step (the head's decoder layer and draft-vocabulary LM head for one
token, plus drawing the token; with --int8-head also with int8 products), and the fusion of one position's aux hidden
states (paid once per verified position).

Targets checked at the end: a draft token at most 1/10 of a target pass; sd acceptance at least 0.45 at K = 3; the best
rule at least 2x ar and sd at least 1.5x ar.

    python bench/bench_drafters.py [--drafter-path FOLDER | --random-head] [--data gsm8k/test.jsonl] [--prompts N]
                                   [--skip N] [--max-new-tokens N] [--k K [K ...]] [--temperature T] [--seed S]
                                   [--pass-repeats N] [--costs-only] [--no-int8] [--int8-head] [--threads N]

--random-head runs an untrained head (random weights, the shipped head's shapes) to check the script end to end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Optional

import torch

from diversed_ext.decoding import Gate, SpeculativeDecoder, encode_prompt, eos_ids
from diversed_ext.decoding.batch import sample_drafts
from diversed_ext.forward.llama_runner import LlamaRunner
from diversed_ext.head import DEFAULT_EAGLE3_HEAD_NAME, load_head
from diversed_ext.models import load_default_pair
from diversed_ext.models.eagle3 import Eagle3Config, Eagle3Head, default_drafter_path
from diversed_ext.research.harness import decoder_runner, run_interleaved
from diversed_ext.research.report import cell, markdown_rows
from diversed_ext.research.tasks import gsm8k_prompt, load_gsm8k

WARMUP_PASSES = 3
EAGLE_DRAFTERS = ("eagle3", "eagle3-int8")
RANDOM_DRAFT_VOCAB = 32000


def load_head_under_test(args, target) -> Eagle3Head:
    """The EAGLE-3 head: --drafter-path, the shipped one, or a random one of the same shapes (--random-head)."""
    embed = target.get_input_embeddings()
    if args.random_head:
        config = Eagle3Config.from_target(target.config.to_dict(), RANDOM_DRAFT_VOCAB)
        torch.manual_seed(args.seed)
        return Eagle3Head(config, embed).eval()
    return Eagle3Head.from_pretrained(args.drafter_path or default_drafter_path(), embed)


def gsm8k_prompts(args, tokenizer) -> list[list[int]]:
    examples = load_gsm8k(args.data, args.skip + args.prompts)[args.skip:]
    return [encode_prompt(tokenizer, gsm8k_prompt(example)) for example in examples]


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times[WARMUP_PASSES:])


@torch.no_grad()
def per_token_costs(target, draft, head: Eagle3Head, prompt: list[int], repeats: int,
                    int8_head: Optional[Eagle3Head] = None) -> dict:
    """Median milliseconds: target and int8 draft 1-token passes, one EAGLE-3 draft step (and one of ``int8_head``'s,
    when given), one position's fusion; interleaved pass by pass, each on its own cache of ``prompt``."""
    target_runner, draft_runner = LlamaRunner(target), LlamaRunner(draft)
    _, _, (target_cache,), aux = target_runner.run_rows([prompt], [None], [1], False,
                                                        aux_layers=head.config.aux_layer_ids)
    draft_cache = draft_runner(prompt, None, 1, False)[2]
    head_cache = head.new_cache()
    features = head.fuse(aux)
    _, hidden = head.step(torch.tensor(prompt[1:] + [prompt[0]]), features, head_cache)
    generator = [torch.Generator().manual_seed(0)]
    times = {"target 1-token pass": [], "int8 draft 1-token pass": [], "EAGLE-3 draft step": [],
             "EAGLE-3 fuse, one position": []}
    steps = {"EAGLE-3 draft step": head}
    if int8_head is not None:
        steps["EAGLE-3 int8 draft step"] = int8_head
        times["EAGLE-3 int8 draft step"] = []
    for repeat in range(WARMUP_PASSES + repeats):
        token = [prompt[repeat % len(prompt)]]
        start = time.perf_counter()
        target_runner(token, target_cache, 1, False)
        times["target 1-token pass"].append(time.perf_counter() - start)
        target_cache.crop(-1)
        start = time.perf_counter()
        draft_runner(token, draft_cache, 1, False)
        times["int8 draft 1-token pass"].append(time.perf_counter() - start)
        draft_cache.crop(-1)
        for label, stepped in steps.items():
            start = time.perf_counter()
            logits, _ = stepped.step(torch.tensor(token), hidden[-1:], head_cache)
            int(stepped.draft_to_target[sample_drafts(logits, 1.0, generator)[0]])
            times[label].append(time.perf_counter() - start)
            head_cache.crop(len(prompt))
        start = time.perf_counter()
        head.fuse(aux[-1:])
        times["EAGLE-3 fuse, one position"].append(time.perf_counter() - start)
    return {label: median_ms(values) for label, values in times.items()}


def method_specs(k_values, diversed_head) -> list[tuple[str, int, dict]]:
    """(method, K, SpeculativeDecoder keyword arguments) of one drafter's rows."""
    specs = []
    for k in k_values:
        specs += [("sd", k, {"method": "sd"}), ("gate", k, {"method": "sd", "gate": Gate()}),
                  ("diversed", k, {"method": "diversed", "head": diversed_head})]
    return specs


def run_rows(target, drafts: dict, prompts, eos, args) -> dict:
    """label -> (drafter, method, K, generations per prompt), every row and ar interleaved prompt by prompt."""
    rows, runners = {"ar": ("-", "ar", 0)}, []
    decoders = {"ar": SpeculativeDecoder(target, method="ar", temperature=args.temperature)}
    for drafter, (draft, diversed_head) in drafts.items():
        for method, k, kwargs in method_specs(args.k, diversed_head):
            label = f"{drafter} {method} K={k}"
            rows[label] = (drafter, method, k)
            decoders[label] = SpeculativeDecoder(target, draft, max_draft=k, temperature=args.temperature, **kwargs)
    runners = [(label, decoder_runner(decoder, prompts, eos)) for label, decoder in decoders.items()]
    results = run_interleaved(runners, len(prompts), seed=args.seed, max_new_tokens=args.max_new_tokens,
                              desc="drafters", progress=not args.quiet)
    return {label: (*rows[label], results[label]) for label in rows}


def speed(generation) -> float:
    return len(generation.tokens) / max(generation.seconds, 1e-9)


def summary_rows(results: dict) -> list[dict]:
    ar = results["ar"][3]
    table = []
    for label, (drafter, method, k, generations) in results.items():
        rounds = [stats for generation in generations for stats in generation.rounds]  # one a target pass
        drafted, accepted = sum(stats.drafted for stats in rounds), sum(stats.accepted for stats in rounds)
        passes, tokens = len(rounds), sum(len(generation.tokens) for generation in generations)
        weights = [w for stats in rounds for w in stats.weights]
        table.append({"drafter": drafter, "method": method, "K": k,
                      "acceptance": accepted / drafted if drafted else float("nan"),
                      "mean w": statistics.fmean(weights) if weights else None,
                      "tokens/pass": tokens / passes,
                      "tokens/s": statistics.median(speed(generation) for generation in generations),
                      "x ar": statistics.median(speed(mine) / speed(base) for mine, base in zip(generations, ar))})
    return table


def check_targets(costs: dict, table: list[dict]) -> list[str]:
    """One line per target of the issue: met or not, with the figure."""
    def best(drafter, method=None):
        rows = [row for row in table if row["drafter"] == drafter and (method is None or row["method"] == method)]
        return max(rows, key=lambda row: row["x ar"]) if rows else None

    lines = []
    for label in ("EAGLE-3 draft step", "EAGLE-3 int8 draft step"):
        if label in costs:
            ratio = costs[label] / costs["target 1-token pass"]
            lines.append(f"draft token <= 1/10 target pass: {'met' if ratio <= 0.1 else 'NOT met'} "
                         f"({label} {ratio:.3f} of a target pass; int8 draft "
                         f"{costs['int8 draft 1-token pass'] / costs['target 1-token pass']:.3f})")
    for drafter in EAGLE_DRAFTERS:
        at3 = [row for row in table if row["drafter"] == drafter and row["method"] == "sd" and row["K"] == 3]
        if at3:
            value = at3[0]["acceptance"]
            lines.append(f"{drafter}: sd acceptance >= 0.45 at K = 3: {'met' if value >= 0.45 else 'NOT met'} "
                         f"({value:.3f})")
    for drafter in (*EAGLE_DRAFTERS, "int8"):
        top, sd = best(drafter), best(drafter, "sd")
        if top is not None:
            lines.append(f"{drafter}: best rule >= 2x ar: {'met' if top['x ar'] >= 2 else 'NOT met'} "
                         f"({top['method']} K={top['K']}: {top['x ar']:.2f}x); sd >= 1.5x ar: "
                         f"{'met' if sd['x ar'] >= 1.5 else 'NOT met'} (K={sd['K']}: {sd['x ar']:.2f}x)")
    return lines


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    head = parser.add_mutually_exclusive_group()
    head.add_argument("--drafter-path", help="the EAGLE-3 head's folder (default: the shipped one)")
    head.add_argument("--random-head", action="store_true", help="an untrained head, to check the script")
    parser.add_argument("--data", required=True, help="GSM8K test jsonl (held out)")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--skip", type=int, default=0, help="problems skipped at the start of --data")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pass-repeats", type=int, default=30)
    parser.add_argument("--no-int8", action="store_true", help="only the EAGLE-3 rows (and ar)")
    parser.add_argument("--int8-head", action="store_true", help="also the EAGLE-3 head with int8 products")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--costs-only", action="store_true", help="the per-token costs alone (they depend on the "
                        "head's shapes, not its weights)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_default_pair()
    head = load_head_under_test(args, target)
    prompts = gsm8k_prompts(args, tokenizer)
    eos = eos_ids(tokenizer, target)
    int8_head = load_head_under_test(args, target).use_int8_products() if args.int8_head else None
    costs = per_token_costs(target, draft, head, prompts[0], args.pass_repeats, int8_head)
    print(f"Per-token costs, ms (median of {args.pass_repeats} after {WARMUP_PASSES} warm-up passes; torch threads "
          f"{torch.get_num_threads()}; a shared, busy 2-core CPU):")
    target_ms = costs["target 1-token pass"]
    print(markdown_rows(["pass", "ms", "of a target pass"],
                        [[label, cell(ms, ".2f"), cell(ms / target_ms, ".3f")] for label, ms in costs.items()]))
    if args.costs_only:
        return 0
    eagle_head = load_head(DEFAULT_EAGLE3_HEAD_NAME, target=target, draft=head)
    drafts = {"eagle3": (head, eagle_head)}
    if int8_head is not None:
        drafts["eagle3-int8"] = (int8_head, eagle_head)
    if not args.no_int8:
        drafts["int8"] = (draft, load_head("default", target=target, draft=draft))
    results = run_rows(target, drafts, prompts, eos, args)
    table = summary_rows(results)
    print(f"\n{len(prompts)} GSM8K test problems (from #{args.skip}), up to {args.max_new_tokens} new tokens, "
          f"T = {args.temperature:g}, one request at a time, seed {args.seed} + prompt index"
          f"{' (RANDOM head: checks the script only)' if args.random_head else ''}:")
    columns = ["drafter", "method", "K", "acceptance", "mean w", "tokens/pass", "tokens/s", "x ar"]
    formats = {"acceptance": ".3f", "mean w": ".3f", "tokens/pass": ".2f", "tokens/s": ".1f", "x ar": ".2f"}
    print(markdown_rows(columns, [[cell(row[name], formats[name]) if name in formats else str(row[name])
                                   for name in columns] for row in table]))
    print("\nTargets:")
    for line in check_targets(costs, table):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
