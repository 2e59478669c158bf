"""The draft-length part of bench_e2e.py (``--draft-lengths``): every draft-length policy against the best fixed K.

For sd, static w = W and the default head (diversed), on the first --prompts GSM8K questions of --data, each drafts

    K=k          a fixed K for every k of --k (the sweep; the best K per method is the baseline of its rows)
    heuristic    transformers' num_assistant_tokens_schedule="heuristic" (start 5, +2 / -1)
    confidence   transformers' assistant_confidence_threshold (0.4, refitted to FPR + 3 FNR after every round)
    gain         ours: one more draft while it raises the round's expected tokens per unit of time

the adaptive ones at most --draft-cap tokens a round, first one prompt at a time (B = 1), then --batch-size prompts
decoded together. Every row decodes the same prompts with the same seeds (prompt i: seed + i) through the research
harness (rows alternate batch by batch, each row runs once untimed first), so rows compare batch by batch:
"vs best fixed K" is a row's throughput over its method's best fixed K's on the same batches, +- its jackknife
standard error over batches (at B = 1, over prompts). drafts/round is the mean number drafted per target pass;
acceptance is accepted over drafted (+- one s.e. over prompts). Quality (exact match) and fidelity (mean target
log-probability) are in the first table of each batch size: for sd the output law is the target's whatever the
lengths; for w < 1 every position a round does not draft takes its token from the target (the bonus) rather than
from nu, so a policy that drafts less stays a little closer to the target.

    python bench/bench_e2e.py --draft-lengths --data PATH/gsm8k/test.jsonl --prompts 30 \\
        --max-new-tokens 64 --k 1 2 3 4 5 --batch-size 8

bench_e2e.py writes one CSV row per (batch size, row) under bench/results/ (or --csv).
"""

from __future__ import annotations

from diversed_ext.decoding import DRAFT_LENGTHS, eos_ids
from diversed_ext.head import load_head
from diversed_ext.research.draft_length_report import against_best_fixed, draft_length_table
from diversed_ext.research.harness import evaluate, method_specs
from diversed_ext.research.report import markdown_table
from diversed_ext.research.tasks import get_task, load_task_examples


def draft_length_specs(args, head) -> list[tuple[str, dict]]:
    """sd, static at --weight and diversed, each under the fixed sweep and every adaptive policy."""
    return method_specs(["sd", "static", "diversed"], [args.weight], head, draft_lengths=DRAFT_LENGTHS,
                        fixed_ks=args.k_values)


def run_batch_size(target, draft, tokenizer, examples, specs, args, batch_size: int):
    task = get_task("gsm8k")
    return evaluate(task, examples, target, draft, tokenizer, specs, max_draft=args.draft_cap,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                    eos_token_id=eos_ids(tokenizer, target), batch_size=batch_size, warmup=True,
                    draft_cost=args.draft_cost)


def print_draft_lengths(target, draft, tokenizer, args) -> list[dict]:
    """Prints both batch sizes' tables; returns the CSV's rows."""
    examples = load_task_examples(get_task("gsm8k"), args.data, args.prompts)
    specs = draft_length_specs(args, load_head("default", target=target, draft=draft))
    rows = []
    for batch_size in dict.fromkeys([1, args.batch_size or 1]):
        results = run_batch_size(target, draft, tokenizer, examples, specs, args, batch_size)
        unit = "prompts" if batch_size == 1 else f"batches of {batch_size} prompts"
        print(f"\nDraft lengths, B = {batch_size}: {len(examples)} GSM8K prompts ({args.data}), up to "
              f"{args.max_new_tokens} new tokens, fixed K in {args.k_values}, adaptive at most {args.draft_cap}, "
              f"w = {args.weight:g} for static, temperature {args.temperature:g}, seed {args.seed}\n")
        print(markdown_table(results, "exact match"))
        print(f"\nAgainst each method's best fixed K (tokens/s, paired over {unit}):\n")
        print(draft_length_table(results))
        for result, _, ratio, ratio_se in against_best_fixed(results):
            rows.append({"batch_size": batch_size, "label": result.label, "acceptance": result.acceptance,
                         "acceptance_se": result.acceptance_se, "drafts_per_round": result.drafts_per_round,
                         "tokens_per_pass": result.tokens_per_pass, "tokens_per_s": result.tokens_per_second,
                         "vs_best_fixed": ratio, "vs_best_fixed_se": ratio_se, "exact_match": result.quality,
                         "fidelity": result.fidelity})
    return rows
