"""The batched part of bench_e2e.py (``--batch-size B``): B requests per target pass against one at a time.

Rows, all on the same prompts, seeds (prompt i: seed + i) and lengths, stopping at EOS:

    ar B=1, sd B=1          our loop, the prompts one after another (``generate(..., batch_size=1)``)
    ar B=B, sd B=B,         our loop, B prompts decoded together (ragged drafts, per-row caches, one verify call per
    static w=W B=B          round, finished slots refilled)
    hf target B=B           ``target.generate`` on B left-padded prompts with an attention mask: transformers' own
                            batched decoding of the target alone
    hf assisted             not run: transformers' assisted generation takes one prompt at a time (B = 1 only)

The prompts are split into batches of B consecutive prompts; rows alternate batch by batch (the research harness),
after one untimed warm-up batch each. tokens/s is throughput: every new token over the wall time of the row's batches.
ms/round is that wall time over the rounds the batches ran (a batched round serves up to B prompts). overhead is the
share of our rounds' time outside the two models' forward passes (verify, head, sampling, bookkeeping).
"""

from __future__ import annotations

import math
import time

import torch

from diversed_ext.decoding import DecodingSummary, SpeculativeDecoder, eos_ids, summarize
from diversed_ext.decoding.stats import add_summaries
from diversed_ext.research.harness import run_interleaved
from diversed_ext.research.report import cell, markdown_rows


def ours_batched(target, draft, args, eos, batch_size, **kwargs):
    """A harness runner: our decoder on a batch of prompts, one summary for the batch with its wall time."""
    decoder = SpeculativeDecoder(target, draft, max_draft=args.k, temperature=args.temperature, **kwargs)

    def run(prompts, seed, max_new_tokens):
        output = decoder.generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=eos, seed=seed,
                                  batch_size=batch_size)
        summary = summarize(output.generations)
        rounds = max(len(rounds) for rounds in output.rounds) if batch_size != 1 else summary.target_passes
        return summary, output.seconds, rounds
    return run


def hf_batched(target, args, eos, pad):
    """A harness runner: transformers' batched ``target.generate`` over left-padded prompts."""
    sampling = {"do_sample": False} if args.temperature == 0 else {
        "do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}

    def run(prompts, seed, max_new_tokens):
        longest = max(len(prompt) for prompt in prompts)
        input_ids = torch.tensor([[pad] * (longest - len(prompt)) + prompt for prompt in prompts])
        mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in prompts])
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            output = target.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     eos_token_id=eos, pad_token_id=pad, **sampling)
        seconds = time.perf_counter() - start
        new = output[:, longest:]
        # A finished row is padded to the longest; count each row up to and including its first EOS.
        new_tokens = 0
        for row in new.tolist():
            ends = [index for index, token in enumerate(row) if token in eos]
            new_tokens += ends[0] + 1 if ends else len(row)
        # Each row gets one token per pass (no drafts): its passes are its tokens.
        summary = DecodingSummary(prompts=len(prompts), new_tokens=new_tokens, target_passes=new_tokens,
                                  drafted=0, accepted=0, seconds=seconds, draft_seconds=0.0, target_seconds=0.0,
                                  head_seconds=0.0, verify_seconds=0.0, round_seconds=0.0)
        return summary, seconds, new.shape[1]
    return run


def batched_methods(target, draft, tokenizer, args):
    eos = eos_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    size, label = args.batch_size, f"w={args.weight:g}"
    return [("ar B=1", ours_batched(target, None, args, eos, 1, method="ar")),
            (f"ar B={size}", ours_batched(target, None, args, eos, size, method="ar")),
            ("sd B=1", ours_batched(target, draft, args, eos, 1, method="sd")),
            (f"sd B={size}", ours_batched(target, draft, args, eos, size, method="sd")),
            (f"static {label} B={size}", ours_batched(target, draft, args, eos, size, method="static",
                                                      weight=args.weight)),
            (f"hf target B={size}", hf_batched(target, args, eos, pad))]


def run_batched(target, draft, tokenizer, prompts, args) -> list[dict]:
    methods = batched_methods(target, draft, tokenizer, args)
    runners = [(name, lambda indices, seed, max_new_tokens, run=run: [run([prompts[i] for i in indices], seed,
                                                                          max_new_tokens)])
               for name, run in methods]
    results = run_interleaved(runners, len(prompts), seed=args.seed, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, desc="bench_e2e batched")
    table = []
    for name, batches in results.items():
        total = add_summaries(summary for summary, _, _ in batches)
        seconds = sum(seconds for _, seconds, _ in batches)
        rounds = sum(rounds for _, _, rounds in batches)
        table.append({"method": name, "new_tokens": total.new_tokens, "seconds": seconds,
                      "acceptance": total.acceptance_rate, "tokens_per_pass": total.tokens_per_pass,
                      "tokens_per_s": total.new_tokens / seconds, "ms_per_round": 1e3 * seconds / rounds,
                      "overhead": total.overhead_fraction})
    reference = table[0]["tokens_per_s"]
    for row in table:
        row["x_ar_b1"] = row["tokens_per_s"] / reference
    return table


def print_batched(target, draft, tokenizer, prompts, args) -> None:
    table = run_batched(target, draft, tokenizer, prompts, args)
    print(f"batched: {len(prompts)} prompts in batches of {args.batch_size}, up to {args.max_new_tokens} new tokens, "
          f"K = {args.k}, temperature {args.temperature:g}, torch threads {torch.get_num_threads()}")
    header = ["method", "acceptance", "tokens/pass (per row)", "ms/round", "tokens/s", "overhead", "vs ar B=1"]
    rows = [[row["method"], cell(row["acceptance"], ".3f"), cell(row["tokens_per_pass"], ".2f"),
             cell(row["ms_per_round"], ".0f"), cell(row["tokens_per_s"], ".1f"), cell(row["overhead"], ".1%"),
             cell(row["x_ar_b1"], ".2f") + "x"] for row in table]
    rows.append(["hf assisted", "n/a", "n/a", "n/a", "n/a", "n/a", "B = 1 only in transformers"])
    print(markdown_rows(header, rows))
    if not math.isnan(table[0]["tokens_per_s"]):
        by_name = {row["method"]: row["tokens_per_s"] for row in table}
        size = args.batch_size
        print(f"sd B={size} / sd B=1: {by_name[f'sd B={size}'] / by_name['sd B=1']:.2f}x; "
              f"ar B={size} / ar B=1: {by_name[f'ar B={size}'] / by_name['ar B=1']:.2f}x")
