"""Per-pass costs of the default pair and the --k sweep of bench_e2e.py (kept apart so that file stays one table).

pass_costs: median wall time of each forward pass a decoding round makes, through the runners our loop uses (the lean
Llama forward): the draft's 1-token pass, the target's 1-token pass (ar) and its (K + 1)-token verify pass for each K,
interleaved pass by pass after a warm-up, on a demo prompt's cache; plus the draft's weight-streaming floor (its int8
bytes over the machine's measured read bandwidth).

k_sweep: tokens/s of ar and of sd, static and diversed (the shipped head) at every K given, methods alternating prompt
by prompt through the research harness; the best K per method is the one with the most tokens/s.
"""

from __future__ import annotations

import statistics
import time

import torch

from diversed_ext.forward.llama_runner import LlamaRunner
from diversed_ext.decoding.stats import add_summaries
from diversed_ext.head import load_head
from diversed_ext.research.report import cell, markdown_rows

WARMUP_PASSES = 3
STREAM_BYTES = 256 * 2**20


def read_bandwidth(repeats: int = 7) -> float:
    """GB/s of one sum over a tensor far larger than the caches (median of repeats): the weight-streaming rate."""
    data = torch.ones(STREAM_BYTES // 4)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return STREAM_BYTES / statistics.median(seconds[1:]) / 1e9


def int8_weight_bytes(runner: LlamaRunner) -> int:
    """Bytes of packed int8 weights one pass of ``runner`` reads (0 for a float model)."""
    groups = [group for products in runner.projections for group in products] + [runner.head]
    return sum(group.int8.packed.numel() for group in groups if group.int8 is not None)


def pass_costs(target, draft, prompt: list[int], k_values, repeats: int) -> dict:
    """Median milliseconds per pass: 'draft 1-token', 'target 1-token', 'target K+1-token' for each K."""
    runners = {"draft": LlamaRunner(draft), "target": LlamaRunner(target)}
    caches = {name: runner(prompt, None, 1, False)[2] for name, runner in runners.items()}
    passes = [("draft 1-token", "draft", 1), ("target 1-token", "target", 1)]
    passes += [(f"target {k + 1}-token (K={k})", "target", k + 1) for k in k_values]
    times = {label: [] for label, _, _ in passes}
    for repeat in range(WARMUP_PASSES + repeats):
        for label, name, count in passes:
            feed = [prompt[(repeat + offset) % len(prompt)] for offset in range(count)]
            start = time.perf_counter()
            runners[name](feed, caches[name], count, False)
            elapsed = time.perf_counter() - start
            caches[name].crop(-count)
            if repeat >= WARMUP_PASSES:
                times[label].append(elapsed)
    costs = {label: 1e3 * statistics.median(values) for label, values in times.items()}
    costs["draft floor"] = 1e3 * int8_weight_bytes(runners["draft"]) / (read_bandwidth() * 1e9)
    return costs


def pass_cost_table(costs: dict) -> str:
    target_one = costs["target 1-token"]
    rows = [[label, cell(ms, ".2f"), cell(target_one / ms, ".2f") + "x"] for label, ms in costs.items()]
    return markdown_rows(["pass", "ms (median)", "target 1-token / this"], rows)


def sweep_methods(target, draft, weight: float, k_values) -> list[tuple[str, int, dict]]:
    """(method label, K, SpeculativeDecoder keyword arguments) of the sweep; ar once, with K = 0."""
    head = load_head("default", target=target, draft=draft)
    methods = [("ar", 0, {"method": "ar"})]
    for k in k_values:
        methods += [("sd", k, {"method": "sd"}), (f"static w={weight:g}", k, {"method": "static", "weight": weight}),
                    ("diversed", k, {"method": "diversed", "head": head})]
    return methods


def k_sweep_table(per_prompt: dict, methods, k_values) -> tuple[str, dict]:
    """Markdown of tokens/s per method and K (x ar), and the best K per method."""
    speed = {key: add_summaries(summaries).tokens_per_second for key, summaries in per_prompt.items()}
    ar_speed = speed[("ar", 0)]
    best = {}
    rows = [["ar", *([cell(ar_speed, ".1f")] * len(k_values)), "-"]]
    for label in dict.fromkeys(label for label, k, _ in methods if k):
        best[label] = max(k_values, key=lambda k: speed[(label, k)])
        rows.append([label, *(cell(speed[(label, k)], ".1f") + f" ({speed[(label, k)] / ar_speed:.2f}x)"
                              for k in k_values), str(best[label])])
    return markdown_rows(["tokens/s (x ar)", *(f"K={k}" for k in k_values), "best K"], rows), best
