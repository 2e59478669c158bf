"""Microbenchmarks: fused diversed_ext ops against their pure-PyTorch references, side by side in one run.

For every configuration the same inputs go to both implementations; each is warmed up, then timed over many repeats
and the median is reported, with the speed-up (reference / fused) and the effective bandwidth over the bytes the fused
kernel must read. Uses CUDA when a GPU is present (pass --device cpu to force the CPU).

    python bench/bench_verify.py                 # full grid, CSV in bench/results/
    python bench/bench_verify.py --quick         # a few configurations
    python bench/bench_verify.py --ops verify --batch 8 --draft 4 --vocab 49152 --dtype float32

Columns: fused (serving configuration, check_inputs=False), fused with checks, the project's reference (the test
oracle), for verify a careful plain-PyTorch verifier (bench/plain_verifier.py, checked equal to the reference on the
same uniforms before it is timed) and the fused kernel's speed-up over it, the streaming floor (torch.sum over exactly
as many bytes as the fused kernel must read) with the fused kernel's ratio to it, effective GB/s, and for the logits
ops one torch.logsumexp over the same tensors.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

import diversed_ext as dx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain_verifier import plain_verify  # noqa: E402

BATCHES = (1, 8, 64)
DRAFT_LENGTHS = (1, 4, 8)
VOCABS = (32000, 49152, 128256, 262144)
DTYPES = ("float32", "bfloat16")
QUICK_GRID = [(1, 4, 49152), (8, 4, 49152), (64, 8, 128256)]
WARMUP_CALLS = 3
MIN_REPEATS = 5
MAX_REPEATS = 50
TIME_BUDGET_S = 1.5  # per implementation and configuration, after warm-up
DRAFT_TARGET_AGREEMENT = 1.0  # scale of the noise between draft and target logits: about half the drafts pass at w=1
WEIGHT = 0.5


@dataclass
class Problem:
    draft_tokens: torch.Tensor
    draft_logits: torch.Tensor
    target_logits: torch.Tensor
    draft_probs: torch.Tensor
    target_probs: torch.Tensor


@dataclass
class OpBench:
    name: str
    fused: Callable[[Problem], object]
    reference: Callable[[Problem], object]
    fused_checked: Callable[[Problem], object] | None
    bytes_read: Callable[[int, int, int, int], int]  # (B, K, V, element size) -> bytes the fused kernel must read
    streaming: Callable[[Problem], object] | None = None  # one plain streaming read of the same inputs


def make_problem(batch, num_positions, vocab, dtype, device, seed=0) -> Problem:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    draft_logits = torch.randn(batch, num_positions + 1, vocab, generator=generator) * 2.0
    target_logits = draft_logits + torch.randn(draft_logits.shape, generator=generator) * DRAFT_TARGET_AGREEMENT
    draft_logits = draft_logits[:, :num_positions].contiguous()
    draft_probs = draft_logits.softmax(-1)
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(batch, num_positions)
    return Problem(tokens.to(device), draft_logits.to(device=device, dtype=dtype),
                   target_logits.to(device=device, dtype=dtype), draft_probs.to(device=device, dtype=dtype),
                   target_logits.softmax(-1).to(device=device, dtype=dtype))


def _verify_bytes(batch, num_positions, vocab, element_size):
    # Gathered values are negligible; the correction row needs p and q at one position per request.
    return batch * 2 * vocab * element_size


def _all_rows_bytes(batch, num_positions, vocab, element_size):
    # Logits need every row's normaliser: draft [B, K, V] and target [B, K+1, V] are read whole.
    return batch * (2 * num_positions + 1) * vocab * element_size


def _pair_bytes(batch, num_positions, vocab, element_size):
    return batch * 2 * num_positions * vocab * element_size


def _stream_logits(pr: Problem):
    return torch.logsumexp(pr.draft_logits, -1), torch.logsumexp(pr.target_logits, -1)


def _stats_tokens(pr: Problem):
    return pr.draft_tokens


OPS = {
    "verify": OpBench(
        "verify",
        fused=lambda pr: dx.verify(pr.draft_tokens, pr.draft_probs, pr.target_probs, WEIGHT, seed=0, check_inputs=False),
        reference=lambda pr: dx.verify_reference(pr.draft_tokens, pr.draft_probs, pr.target_probs, WEIGHT, seed=0,
                                                 check_inputs=False),
        fused_checked=lambda pr: dx.verify(pr.draft_tokens, pr.draft_probs, pr.target_probs, WEIGHT, seed=0),
        bytes_read=_verify_bytes,
    ),
    "verify_logits": OpBench(
        "verify_logits",
        fused=lambda pr: dx.verify_logits(pr.draft_tokens, pr.draft_logits, pr.target_logits, WEIGHT, seed=0,
                                          check_inputs=False),
        reference=lambda pr: dx.verify_logits_reference(pr.draft_tokens, pr.draft_logits, pr.target_logits, WEIGHT,
                                                        seed=0, check_inputs=False),
        fused_checked=lambda pr: dx.verify_logits(pr.draft_tokens, pr.draft_logits, pr.target_logits, WEIGHT, seed=0),
        bytes_read=_all_rows_bytes,
        streaming=_stream_logits,
    ),
    "token_stats": OpBench(
        "token_stats",
        fused=lambda pr: dx.token_stats(pr.draft_logits, pr.target_logits[:, :-1], pr.draft_tokens, from_logits=True,
                                        check_inputs=False),
        reference=lambda pr: dx.token_stats_reference(pr.draft_logits, pr.target_logits[:, :-1], pr.draft_tokens,
                                                      from_logits=True, check_inputs=False),
        fused_checked=None,
        bytes_read=_pair_bytes,
        streaming=lambda pr: (torch.logsumexp(pr.draft_logits, -1), torch.logsumexp(pr.target_logits[:, :-1], -1)),
    ),
    "mix": OpBench(
        "mix",
        fused=lambda pr: dx.mix(pr.draft_logits, pr.target_logits, WEIGHT, from_logits=True, check_inputs=False),
        reference=lambda pr: dx.mix_reference(pr.draft_logits, pr.target_logits, WEIGHT, from_logits=True,
                                              check_inputs=False),
        fused_checked=None,
        bytes_read=_pair_bytes,
    ),
}
# token_stats is meant for whole sequences: its own configuration, T = 256 positions, joins the quick grid.
STATS_CONFIG = (8, 256, 49152)


def median_seconds(function: Callable[[], object], device: torch.device) -> float:
    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(WARMUP_CALLS):
        function()
    synchronize()
    samples = []
    budget_end = time.perf_counter() + TIME_BUDGET_S
    while len(samples) < MAX_REPEATS and (len(samples) < MIN_REPEATS or time.perf_counter() < budget_end):
        start = time.perf_counter()
        function()
        synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run(args) -> list[dict]:
    device = torch.device(args.device)
    grid = QUICK_GRID if args.quick else list(itertools.product(args.batch, args.draft, args.vocab))
    configs = list(itertools.product(args.ops, grid, args.dtype))
    if "token_stats" in args.ops and (args.quick or args.stats_sequence):
        configs += [("token_stats", STATS_CONFIG, dtype) for dtype in args.dtype]
    rows = []
    for op_name, (batch, num_positions, vocab), dtype_name in tqdm(configs, desc="bench", unit="config",
                                                                   file=sys.stderr):
        op = OPS[op_name]
        dtype = getattr(torch, dtype_name)
        problem = make_problem(batch, num_positions, vocab, dtype, device)
        fused_s = median_seconds(lambda: op.fused(problem), device)
        reference_s = median_seconds(lambda: op.reference(problem), device)
        checked_s = median_seconds(lambda: op.fused_checked(problem), device) if op.fused_checked else float("nan")
        stream_s = median_seconds(lambda: op.streaming(problem), device) if op.streaming else float("nan")
        bytes_read = op.bytes_read(batch, num_positions, vocab, problem.draft_probs.element_size())
        floor_data = torch.ones(bytes_read // problem.draft_probs.element_size(), dtype=dtype, device=device)
        floor_s = median_seconds(lambda: torch.sum(floor_data), device)
        plain_s = _plain_seconds(problem, device) if op_name == "verify" else float("nan")
        rows.append({
            "op": op_name, "device": device.type, "B": batch, "K": num_positions, "V": vocab, "dtype": dtype_name,
            "fused_us": fused_s * 1e6, "fused_checked_us": checked_s * 1e6, "reference_us": reference_s * 1e6,
            "speedup": reference_s / fused_s, "fused_GBps": bytes_read / fused_s / 1e9,
            "stream_us": stream_s * 1e6, "fused_over_stream": fused_s / stream_s,
            "plain_us": plain_s * 1e6, "plain_over_fused": plain_s / fused_s,
            "floor_us": floor_s * 1e6, "fused_over_floor": fused_s / floor_s,
        })
        del problem
    return rows


def _plain_seconds(problem: Problem, device: torch.device) -> float:
    """The plain verifier's median time, after checking it against the reference on the same uniforms."""
    batch, num_positions = problem.draft_tokens.shape
    uniforms = torch.rand(batch, num_positions + 1, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1)).to(device)
    args = (problem.draft_tokens, problem.draft_probs, problem.target_probs, WEIGHT)
    tokens, num_accepted = plain_verify(*args, uniforms)
    expected = dx.verify_reference(*args, uniforms=uniforms, check_inputs=False)
    if not (torch.equal(tokens, expected.tokens) and torch.equal(num_accepted.int(), expected.num_accepted.int())):
        raise AssertionError("the plain verifier disagrees with the reference: its timing would mean nothing")
    return median_seconds(lambda: plain_verify(*args, uniforms), device)


def print_table(rows: list[dict]) -> None:
    header = (f"{'op':<14}{'B':>4}{'K':>5}{'V':>8} {'dtype':<9}{'fused us':>10}{'+checks':>9}{'reference':>11}"
              f"{'speedup':>8}{'plain us':>10}{'plain/fused':>12}{'floor us':>10}{'fused/floor':>12}"
              f"{'fused GB/s':>11}{'stream us':>10}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['op']:<14}{row['B']:>4}{row['K']:>5}{row['V']:>8} {row['dtype']:<9}{row['fused_us']:>10.1f}"
              f"{row['fused_checked_us']:>9.1f}{row['reference_us']:>11.1f}{row['speedup']:>7.1f}x"
              f"{row['plain_us']:>10.1f}{row['plain_over_fused']:>11.1f}x{row['floor_us']:>10.1f}"
              f"{row['fused_over_floor']:>11.1f}x{row['fused_GBps']:>11.2f}{row['stream_us']:>10.1f}")
    speedups = [row["speedup"] for row in rows]
    print(f"\nspeed-up over the reference: min {min(speedups):.1f}x, median {statistics.median(speedups):.1f}x, "
          f"max {max(speedups):.1f}x over {len(rows)} configurations "
          f"({'never slower' if min(speedups) >= 1 else 'SLOWER somewhere'})")


def write_csv(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    parser.add_argument("--batch", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--draft", nargs="+", type=int, default=list(DRAFT_LENGTHS))
    parser.add_argument("--vocab", nargs="+", type=int, default=list(VOCABS))
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="three representative shapes instead of the full grid")
    parser.add_argument("--stats-sequence", action="store_true",
                        help="also time token_stats on whole sequences (B=8, T=256, V=49152); on by default with --quick")
    parser.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "bench_verify.csv"))
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    rows = run(args)
    print_table(rows)
    write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
