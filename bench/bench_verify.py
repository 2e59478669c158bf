"""Microbenchmarks: fused diversed_ext ops against their pure-PyTorch references, side by side in one run.

For every configuration the same inputs go to every implementation; each is warmed up, then all are timed in
interleaved rounds (so a passing load on a shared machine hits them alike) and the medians are reported, with the
speed-up (reference / fused) and the effective bandwidth over the bytes the fused kernel must read. Uses CUDA when a
GPU is present (pass --device cpu to force the CPU). The run ends with the Python cost of a call: an unchecked
dx.verify with default arguments against the registered op alone.

    python bench/bench_verify.py                 # full grid, CSV in bench/results/
    python bench/bench_verify.py --quick         # a few configurations
    python bench/bench_verify.py --ops verify --batch 8 --draft 4 --vocab 49152 --dtype float32

Ops: verify and verify_logits with draft distributions; verify_tokens and verify_logits_tokens for drafters that give
tokens only (draft_probs / draft_logits = None), whose "one-hot" columns time what a caller must do without that
option: materialise one-hot draft rows (and, from logits, softmax the target) and call the distribution API;
token_stats, mix, distribution_features (what a DIVERSED head reads at each drafted position) and mixture_divergence
(KL(nu_w || p) at 17 weights, what the trainer's divergence term reads) from logits; gate and
gate_tokens, the log-probability gate's statistics (diversed_ext.ops.gate_statistics) with the draft's logits or its
tokens only, whose plain column is the PyTorch gate a server ran before (a log-softmax of the drafted rows, the
residual's sums, the test at margin 4).

Columns: fused (serving configuration, check_inputs=False), fused with checks, reference (the test oracle, which forms
whole [B, K, V] mixtures), speed-up over it, a careful plain PyTorch verifier (bench/plain_verifiers.py: gathers p(x)
and q(x), accept tests on the gathered values, then the residual of the one row per request that needs it; checked
equal to the reference on identical uniforms before it is timed) and the fused kernel's speed-up over it, the one-hot
call and the fused kernel's speed-up over it (tokens-only ops), effective GB/s over the bytes the fused kernel must
read, and the streaming floor: torch.sum over exactly those bytes, with the fused kernel's ratio to it.
That floor swings with what the caches still hold (the bytes may sit in the last-level cache after another
implementation read them), so the last two columns give the DRAM floor too: the same bytes at the speed torch.sum
streams a buffer far larger than the caches, measured once per run.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import statistics
import sys
import time
from typing import Callable

import torch
from tqdm import tqdm

import diversed_ext as dx
from diversed_ext.ops import (CUDA_KERNEL_FAMILIES, gate_keeps, gate_statistics, gate_statistics_reference,
                              position_rows)
from diversed_ext.ops.gate import keeps
from arguments import check_writable_file, positive_int, torch_device
from plain_verifiers import plain_verify, plain_verify_logits
from verify_problems import (OpBench, Problem, all_rows_bytes, make_problem, pair_bytes, stream_logits,
                             stream_two_rows, target_row_bytes, target_rows_bytes, verify_bytes)

BATCHES = (1, 8, 64)
DRAFT_LENGTHS = (1, 4, 8)
VOCABS = (32000, 49152, 128256, 262144)
DTYPES = ("float32", "bfloat16")
QUICK_GRID = [(1, 4, 49152), (8, 4, 49152), (64, 8, 128256)]
WARMUP_CALLS = 3
MIN_REPEATS = 5
MAX_REPEATS = 50
TIME_BUDGET_S = 1.5  # per implementation and configuration, after warm-up
WEIGHT = 0.5
STREAM_BUFFER_BYTES = 512 * 2**20  # for the DRAM floor: far beyond any last-level cache
STREAM_REPEATS = 10


def _one_hot(pr: Problem) -> torch.Tensor:
    """What a caller of the draft-distribution API must build for a drafter that gives tokens only."""
    vocab = pr.target_probs.shape[-1]
    return torch.nn.functional.one_hot(pr.draft_tokens, vocab).to(pr.target_probs.dtype)


def _stats_tokens(pr: Problem):
    return pr.draft_tokens


def _verify_inputs(pr: Problem, from_logits: bool, tokens_only: bool) -> tuple:
    """(draft_tokens, draft, target) of a verify call: probabilities or logits, the draft's rows or None."""
    draft = None if tokens_only else (pr.draft_logits if from_logits else pr.draft_probs)
    return pr.draft_tokens, draft, pr.target_logits if from_logits else pr.target_probs


def _one_hot_call(pr: Problem, from_logits: bool):
    """What a tokens-only drafter costs through the distribution API: one-hot draft rows (and, from logits, a softmax
    of the target, since logits cannot be one-hot), then the call on probabilities."""
    target = pr.target_logits.float().softmax(-1).to(pr.target_logits.dtype) if from_logits else pr.target_probs
    return dx.verify(pr.draft_tokens, _one_hot(pr), target, WEIGHT, seed=0, check_inputs=False)


# (bytes_read, streaming) per (from_logits, tokens_only): what each verify call must read.
_VERIFY_FLOORS = {
    (False, False): (verify_bytes, stream_two_rows),
    (False, True): (target_row_bytes, lambda pr: torch.sum(pr.target_probs[:, 0])),
    (True, False): (all_rows_bytes, stream_logits),
    (True, True): (target_rows_bytes, lambda pr: torch.sum(pr.target_logits)),
}


# FLy's settings of the fused, checked and reference calls (--fly-*): (window, threshold, top_k); window 0 is off. A
# window the shape's K cannot fit (W >= K) defers nothing, so it is passed as 0 there.
FLY_SETTINGS = [0, 0.3, 3]


def _fly(pr: Problem) -> dict:
    window, threshold, top_k = FLY_SETTINGS
    return dict(fly_window=window if window < pr.draft_tokens.shape[1] else 0, fly_threshold=threshold,
                fly_top_k=top_k)


def _verify_bench(name: str, from_logits: bool, tokens_only: bool) -> OpBench:
    """One of the four verify entries: from probabilities or logits, with the draft's rows or its tokens only."""
    fused_op, reference_op, plain_op = ((dx.verify_logits, dx.verify_logits_reference, plain_verify_logits)
                                        if from_logits else (dx.verify, dx.verify_reference, plain_verify))
    bytes_read, streaming = _VERIFY_FLOORS[(from_logits, tokens_only)]

    def inputs(pr):
        return _verify_inputs(pr, from_logits, tokens_only)

    return OpBench(
        name,
        fused=lambda pr: fused_op(*inputs(pr), WEIGHT, seed=0, check_inputs=False, **_fly(pr)),
        reference=lambda pr: reference_op(*inputs(pr), WEIGHT, seed=0, check_inputs=False, **_fly(pr)),
        fused_checked=lambda pr: fused_op(*inputs(pr), WEIGHT, seed=0, **_fly(pr)),
        bytes_read=bytes_read,
        streaming=streaming,
        plain=lambda pr, u: plain_op(*inputs(pr), u, WEIGHT),
        reference_on=lambda pr, u: reference_op(*inputs(pr), WEIGHT, uniforms=u, check_inputs=False),
        one_hot=(lambda pr: _one_hot_call(pr, from_logits)) if tokens_only else None,
    )


def _pair_bench(name: str, fused, reference, fused_checked=None) -> OpBench:
    """An op over the draft logits and the target's first K positions, which it reads whole."""
    return OpBench(name, fused=fused, reference=reference, fused_checked=fused_checked, bytes_read=pair_bytes,
                   streaming=lambda pr: (torch.sum(pr.draft_logits), torch.sum(pr.target_logits[:, :-1])))


OPS = {
    "verify": _verify_bench("verify", from_logits=False, tokens_only=False),
    "verify_tokens": _verify_bench("verify_tokens", from_logits=False, tokens_only=True),
    "verify_logits": _verify_bench("verify_logits", from_logits=True, tokens_only=False),
    "verify_logits_tokens": _verify_bench("verify_logits_tokens", from_logits=True, tokens_only=True),
    "token_stats": _pair_bench(
        "token_stats",
        fused=lambda pr: dx.token_stats(pr.draft_logits, pr.target_logits[:, :-1], pr.draft_tokens, from_logits=True,
                                        check_inputs=False),
        reference=lambda pr: dx.token_stats_reference(pr.draft_logits, pr.target_logits[:, :-1], pr.draft_tokens,
                                                      from_logits=True, check_inputs=False)),
    "mix": _pair_bench(
        "mix", fused=lambda pr: dx.mix(pr.draft_logits, pr.target_logits, WEIGHT, from_logits=True, check_inputs=False),
        reference=lambda pr: dx.mix_reference(pr.draft_logits, pr.target_logits, WEIGHT, from_logits=True,
                                              check_inputs=False)),
    "distribution_features": _pair_bench(
        "distribution_features",
        fused=lambda pr: dx.distribution_features(pr.draft_logits, pr.target_logits[:, :-1], check_inputs=False),
        reference=lambda pr: dx.distribution_features_reference(pr.draft_logits, pr.target_logits[:, :-1],
                                                                check_inputs=False),
        fused_checked=lambda pr: dx.distribution_features(pr.draft_logits, pr.target_logits[:, :-1])),
    "mixture_divergence": _pair_bench(
        "mixture_divergence",
        fused=lambda pr: dx.mixture_divergence(pr.draft_logits, pr.target_logits[:, :-1], check_inputs=False),
        reference=lambda pr: dx.mixture_divergence_reference(pr.draft_logits, pr.target_logits[:, :-1],
                                                             check_inputs=False)),
}
GATE_MARGIN = 4.0  # the decoding loop's default


def _gate_statistics(pr: Problem, tokens_only: bool, fused: bool):
    """The gate's statistics of every drafted position: fused, reading the first K target positions in place in the
    [B (K + 1), V] view, or the float64 reference on the sliced logits."""
    draft = None if tokens_only else pr.draft_logits
    if not fused:
        return gate_statistics_reference(pr.draft_tokens, pr.target_logits[:, :-1], draft, check_inputs=False)
    target_rows, index = position_rows(pr.target_logits, pr.draft_tokens.shape[1])
    return gate_statistics(pr.draft_tokens, target_rows, draft, target_rows=index, check_inputs=False)


def _plain_gate(pr: Problem, tokens_only: bool) -> tuple:
    """What a server gated with before the fused op: a log-softmax of the drafted target rows (and a softmax of the
    draft's), the residual's sums in PyTorch, the test at GATE_MARGIN: (keeps [B K],)."""
    log_p = pr.target_logits[:, :-1].float().log_softmax(-1).flatten(0, 1)
    q = None if tokens_only else pr.draft_logits.float().softmax(-1).flatten(0, 1)
    return (gate_keeps(GATE_MARGIN, pr.draft_tokens.flatten(), q, log_p),)


def _gate_bench(name: str, tokens_only: bool) -> OpBench:
    """The gate's statistics, with the draft's logits or its tokens only; the plain column is the PyTorch gate, checked
    to keep the drafts the reference keeps."""
    def bytes_read(batch, num_positions, vocab, element_size):  # the drafted positions' target rows, and draft rows
        return (1 if tokens_only else 2) * batch * num_positions * vocab * element_size

    def streaming(pr):
        return torch.sum(pr.target_logits[:, :-1]), None if tokens_only else torch.sum(pr.draft_logits)

    return OpBench(name, fused=lambda pr: _gate_statistics(pr, tokens_only, True),
                   reference=lambda pr: _gate_statistics(pr, tokens_only, False),
                   fused_checked=None, bytes_read=bytes_read, streaming=streaming,
                   plain=lambda pr, u: _plain_gate(pr, tokens_only),
                   reference_on=lambda pr, u: (keeps(GATE_MARGIN, _gate_statistics(pr, tokens_only, False)).flatten(),))


OPS["gate"] = _gate_bench("gate", tokens_only=False)
OPS["gate_tokens"] = _gate_bench("gate_tokens", tokens_only=True)
# token_stats is meant for whole sequences: its own configuration, T = 256 positions, joins the quick grid.
STATS_CONFIG = (8, 256, 49152)


def _synchronize(device: torch.device) -> None:
    """Waits for the device's queued work, so that a timing covers it (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(functions: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved rounds (one call of each per round, after
    warm-up), so that a load which comes and goes on a shared machine falls on every implementation alike."""
    for function in functions.values():
        for _ in range(WARMUP_CALLS):
            function()
    _synchronize(device)
    samples = {name: [] for name in functions}
    budget_end = time.perf_counter() + TIME_BUDGET_S * len(functions)
    while (len(samples[next(iter(functions))]) < MAX_REPEATS
           and (len(samples[next(iter(functions))]) < MIN_REPEATS or time.perf_counter() < budget_end)):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            _synchronize(device)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def memory_bandwidth(device: torch.device) -> float:
    """Bytes per second that torch.sum streams from memory, over a buffer of STREAM_BUFFER_BYTES (several times the
    last-level cache, so it comes from DRAM, or HBM on a GPU): the machine's streaming speed, for the DRAM floor. The
    fastest of STREAM_REPEATS sums after a warm-up: a floor is the best the machine does."""
    buffer = torch.ones(STREAM_BUFFER_BYTES // 4, dtype=torch.float32, device=device)
    torch.sum(buffer)
    times = []
    for _ in range(STREAM_REPEATS):
        _synchronize(device)
        start = time.perf_counter()
        torch.sum(buffer)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return STREAM_BUFFER_BYTES / min(times)


def call_overhead(device: torch.device, calls_per_sample: int = 50) -> dict[str, float]:
    """Microseconds per call at B = 8, K = 4, V = 8, where the kernel is negligible: an unchecked dx.verify with
    default arguments against the registered op it dispatches to, called directly with the same arguments."""
    problem = make_problem(8, 4, 8, torch.float32, device)
    tokens, draft, target = problem.draft_tokens, problem.draft_probs, problem.target_probs
    op = torch.ops.diversed.verify_probs.default

    def repeat(call):
        return lambda: [call() for _ in range(calls_per_sample)]

    medians = interleaved_medians({
        "dx.verify": repeat(lambda: dx.verify(tokens, draft, target, WEIGHT, seed=0, check_inputs=False)),
        "registered op": repeat(lambda: op(tokens, draft, target, None, None, None, None, None, 0, False, WEIGHT, 0)),
    }, device)
    return {name: seconds / calls_per_sample * 1e6 for name, seconds in medians.items()}


def run(args) -> list[dict]:
    device = torch.device(args.device)
    grid = QUICK_GRID if args.quick else list(itertools.product(args.batch, args.draft, args.vocab))
    configs = list(itertools.product(args.ops, grid, args.dtype))
    if "token_stats" in args.ops and (args.quick or args.stats_sequence):
        configs += [("token_stats", STATS_CONFIG, dtype) for dtype in args.dtype]
    bandwidth = memory_bandwidth(device)
    rows = []
    for op_name, (batch, num_positions, vocab), dtype_name in tqdm(configs, desc="bench", unit="config",
                                                                   file=sys.stderr):
        op = OPS[op_name]
        dtype = getattr(torch, dtype_name)
        problem = make_problem(batch, num_positions, vocab, dtype, device)
        functions = {"fused": lambda: op.fused(problem), "reference": lambda: op.reference(problem),
                     "stream": lambda: op.streaming(problem)}
        if op.fused_checked:
            functions["checked"] = lambda: op.fused_checked(problem)
        if op.one_hot:
            functions["one_hot"] = lambda: op.one_hot(problem)
        plain_equal = ""
        if op.plain is not None and num_positions > 0:
            uniforms = torch.rand(batch, num_positions + 1, dtype=torch.float64, device=device)
            plain_equal = bool(torch.equal(op.plain(problem, uniforms)[0], op.reference_on(problem, uniforms)[0]))
            functions["plain"] = lambda: op.plain(problem, uniforms)
        medians = interleaved_medians(functions, device)
        fused_s, reference_s, stream_s = medians["fused"], medians["reference"], medians["stream"]
        checked_s, plain_s = medians.get("checked", float("nan")), medians.get("plain", float("nan"))
        one_hot_s = medians.get("one_hot", float("nan"))
        bytes_read = op.bytes_read(batch, num_positions, vocab, problem.draft_probs.element_size())
        rows.append({
            "op": op_name, "device": device.type, "B": batch, "K": num_positions, "V": vocab, "dtype": dtype_name,
            "fused_us": fused_s * 1e6, "fused_checked_us": checked_s * 1e6, "reference_us": reference_s * 1e6,
            "speedup": reference_s / fused_s, "plain_us": plain_s * 1e6, "plain_over_fused": plain_s / fused_s,
            "plain_equals_reference": plain_equal,
            "one_hot_us": one_hot_s * 1e6, "one_hot_over_fused": one_hot_s / fused_s,
            "fused_GBps": bytes_read / fused_s / 1e9,
            "stream_us": stream_s * 1e6, "fused_over_stream": fused_s / stream_s,
            "dram_floor_us": bytes_read / bandwidth * 1e6, "fused_over_dram_floor": fused_s * bandwidth / bytes_read,
        })
        del problem
    return rows


def print_table(rows: list[dict]) -> None:
    header = (f"{'op':<21}{'B':>4}{'K':>5}{'V':>8} {'dtype':<9}{'fused us':>10}{'+checks us':>11}"
              f"{'reference us':>13}{'vs ref':>8}{'plain us':>10}{'vs plain':>9}{'one-hot us':>11}{'vs 1-hot':>9}"
              f"{'GB/s':>7}{'floor us':>10}"
              f"{'fused/floor':>12}{'DRAM floor':>11}{'fused/DRAM':>11}")
    print(header)
    print("-" * len(header))
    for row in rows:
        mark = "" if row["plain_equals_reference"] in (True, "") else "!"  # ! = plain differs from the reference
        print(f"{row['op']:<21}{row['B']:>4}{row['K']:>5}{row['V']:>8} {row['dtype']:<9}{row['fused_us']:>10.1f}"
              f"{row['fused_checked_us']:>11.1f}{row['reference_us']:>13.1f}{row['speedup']:>7.1f}x"
              f"{row['plain_us']:>10.1f}{row['plain_over_fused']:>8.1f}x{mark:1}{row['one_hot_us']:>11.1f}"
              f"{row['one_hot_over_fused']:>8.1f}x{row['fused_GBps']:>6.1f}"
              f"{row['stream_us']:>10.1f}{row['fused_over_stream']:>11.2f}x{row['dram_floor_us']:>11.1f}"
              f"{row['fused_over_dram_floor']:>10.2f}x")
    speedups = [row["speedup"] for row in rows]
    print(f"\nspeed-up over the reference: min {min(speedups):.1f}x, median {statistics.median(speedups):.1f}x, "
          f"max {max(speedups):.1f}x over {len(rows)} configurations "
          f"({'never slower' if min(speedups) >= 1 else 'SLOWER somewhere'})")
    plain = [row["plain_over_fused"] for row in rows if row["plain_over_fused"] == row["plain_over_fused"]]
    if plain:
        print(f"speed-up over the careful plain verifier: min {min(plain):.1f}x, median {statistics.median(plain):.1f}x;"
              f" fused / streaming floor: median {statistics.median(r['fused_over_stream'] for r in rows):.2f}x")


def write_csv(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS), help="the ops to time (default all)")
    parser.add_argument("--batch", nargs="+", type=positive_int, default=list(BATCHES),
                        help=f"batch sizes B of the grid (default {' '.join(map(str, BATCHES))})")
    parser.add_argument("--draft", nargs="+", type=positive_int, default=list(DRAFT_LENGTHS),
                        help=f"draft lengths K of the grid (default {' '.join(map(str, DRAFT_LENGTHS))})")
    parser.add_argument("--vocab", nargs="+", type=positive_int, default=list(VOCABS),
                        help=f"vocabulary sizes V of the grid (default {' '.join(map(str, VOCABS))})")
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=["float32", "bfloat16", "float16"],
                        help="dtypes of the distributions (default all three)")
    parser.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:N] (default cuda where a GPU is visible, else cpu)")
    parser.add_argument("--quick", action="store_true",
                        help="three representative shapes in place of the grid of --batch, --draft and --vocab")
    parser.add_argument("--cuda-kernels", choices=CUDA_KERNEL_FAMILIES, default="auto",
                        help="the CUDA verify kernels to run (diversed_ext.set_cuda_kernels; default auto)")
    parser.add_argument("--fly-window", type=int, default=0,
                        help="FLy's window in the fused, checked and reference verify calls (default 0: off)")
    parser.add_argument("--fly-threshold", type=float, default=0.3, help="FLy's entropy threshold (default 0.3)")
    parser.add_argument("--fly-top-k", type=int, default=3, help="FLy's entropy top-k (default 3)")
    parser.add_argument("--stats-sequence", action="store_true",
                        help="also time token_stats on whole sequences (B=8, T=256, V=49152); on by default with --quick")
    parser.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "bench_verify.csv"), help="where the rows go (CSV)")
    args = parser.parse_args(argv)
    if args.fly_window < 0 or not 1 <= args.fly_top_k <= 32:  # a window >= a shape's K is off there (_fly)
        parser.error("--fly-window must be >= 0 and --fly-top-k in [1, 32]")
    check_writable_file(parser, "--csv", args.csv)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    dx.set_cuda_kernels(args.cuda_kernels)
    FLY_SETTINGS[:] = [args.fly_window, args.fly_threshold, args.fly_top_k]
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}" + (f", FLy W={args.fly_window}" if args.fly_window else ""))
    rows = run(args)
    print_table(rows)
    overhead = call_overhead(torch.device(args.device))
    print(f"unchecked dx.verify with default arguments: {overhead['dx.verify']:.2f} us per call, the registered op "
          f"alone {overhead['registered op']:.2f} us: {overhead['dx.verify'] - overhead['registered op']:+.2f} us "
          f"(B=8, K=4, V=8); load average at the end {os.getloadavg()[0]:.2f}")
    write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
