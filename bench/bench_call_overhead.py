"""Host time of one unchecked verify / verify_logits call (check_inputs=False, what a serving loop pays), per argument
form, for two checkouts of the package in one run.

The tensors are tiny (B = 4, K = 4, V = 64) so the kernel is negligible and the figure is the Python and dispatch cost
of a call. Each checkout runs in its own subprocess (PYTHONPATH set to it, its in-place extension loaded); the
checkouts alternate for ``--repeats`` rounds so a passing load on a shared machine hits them alike, and the table
gives, per case and checkout, the median over rounds of each round's median microseconds per call, with the spread
(min-max of the round medians) that says how noisy the machine was.

    python bench/bench_call_overhead.py --against /path/to/other/checkout      # this checkout vs that one
    python bench/bench_call_overhead.py --one-round                             # one round here, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH, POSITIONS, VOCAB = 4, 4, 64
CALLS_PER_SAMPLE = 200
SAMPLES = 15
WARMUP_CALLS = 500


def _cases():
    """(name, function, positional arguments, keyword arguments) of every timed call."""
    import torch
    import diversed_ext as dx

    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(BATCH, POSITIONS + 1, VOCAB, generator=generator)
    probs /= probs.sum(-1, keepdim=True)
    draft, target = probs[:, :POSITIONS].contiguous(), probs.contiguous()
    logits = torch.randn(BATCH, POSITIONS + 1, VOCAB, generator=generator)
    draft_logits, target_logits = logits[:, :POSITIONS].contiguous(), logits.contiguous()
    tokens64 = torch.randint(0, VOCAB, (BATCH, POSITIONS), generator=generator)
    tokens32 = tokens64.to(torch.int32)
    weight_rows = torch.full((BATCH,), 0.5)
    weight_tokens = torch.full((BATCH, POSITIONS), 0.5)
    seeds = torch.arange(BATCH, dtype=torch.int64)
    num_draft = torch.full((BATCH,), POSITIONS, dtype=torch.int64)
    unchecked = dict(check_inputs=False)
    return [
        ("verify  scalar w, int64 tokens", dx.verify, (tokens64, draft, target, 0.5), dict(seed=1, **unchecked)),
        ("verify  [B,K] w, int64 tokens", dx.verify, (tokens64, draft, target, weight_tokens),
         dict(seed=1, **unchecked)),
        ("verify  [B] w, int64 tokens", dx.verify, (tokens64, draft, target, weight_rows), dict(seed=1, **unchecked)),
        ("verify  scalar w, int32 tokens", dx.verify, (tokens32, draft, target, 0.5), dict(seed=1, **unchecked)),
        ("verify  per-request seeds", dx.verify, (tokens64, draft, target, 0.5),
         dict(seed=seeds, num_draft=num_draft, **unchecked)),
        ("logits  scalar w, int64 tokens", dx.verify_logits, (tokens64, draft_logits, target_logits, 0.5),
         dict(seed=1, **unchecked)),
        ("logits  [B] w, int32 tokens", dx.verify_logits, (tokens32, draft_logits, target_logits, weight_rows),
         dict(seed=1, **unchecked)),
        ("logits  per-request seeds", dx.verify_logits, (tokens64, draft_logits, target_logits, 0.5),
         dict(seed=seeds, num_draft=num_draft, **unchecked)),
    ]


def one_round() -> dict:
    """Median microseconds per call of every case, in this process."""
    import torch

    torch.set_num_threads(1)  # the kernel's work is a few microseconds; threads would only add noise
    results = {}
    for name, function, args, kwargs in _cases():
        for _ in range(WARMUP_CALLS):
            function(*args, **kwargs)
        samples = []
        for _ in range(SAMPLES):
            start = time.perf_counter()
            for _ in range(CALLS_PER_SAMPLE):
                function(*args, **kwargs)
            samples.append((time.perf_counter() - start) / CALLS_PER_SAMPLE * 1e6)
        results[name] = statistics.median(samples)
    return results


def _round_in(checkout: Path) -> dict:
    environment = dict(os.environ, PYTHONPATH=str(checkout))
    output = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one-round"], env=environment,
                            check=True, capture_output=True, text=True).stdout
    return json.loads(output)


def compare(checkouts: dict[str, Path], repeats: int) -> None:
    rounds = {label: [] for label in checkouts}
    for _ in range(repeats):
        for label, checkout in checkouts.items():
            rounds[label].append(_round_in(checkout))
    labels = list(checkouts)
    print(f"unchecked call, host us per call (B={BATCH}, K={POSITIONS}, V={VOCAB}); median of {repeats} rounds "
          f"[min-max of the round medians]")
    print(f"{'case':34}" + "".join(f"{label:>24}" for label in labels))
    for name in rounds[labels[0]][0]:
        cells = []
        for label in labels:
            values = [result[name] for result in rounds[label]]
            cells.append(f"{statistics.median(values):7.2f} [{min(values):5.2f}-{max(values):6.2f}]")
        print(f"{name:34}" + "".join(f"{cell:>24}" for cell in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one-round", action="store_true", help="time one round here and print JSON")
    parser.add_argument("--against", type=Path, help="another checkout to compare with (its extension built)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds per checkout")
    options = parser.parse_args()
    if options.one_round:
        print(json.dumps(one_round()))
        return
    checkouts = {"this": Path(__file__).resolve().parents[1]}
    if options.against is not None:
        checkouts["against"] = options.against.resolve()
    compare(checkouts, options.repeats)


if __name__ == "__main__":
    main()
