"""Every verify, token_stats, mix, distribution_features and gate_statistics kernel on hostile unchecked inputs, for
the compute-sanitizer tools.

Each call runs with check_inputs=False on inputs the checks would refuse: NaN, negative and infinite mass, rows without
mass, token ids outside [0, V), num_draft outside [0, K], uniforms outside [0, 1), greedy and sampled rows, tokens-only
drafts, seedless calls, rows read in place through indices outside [0, R) (verify, and distribution_features and
gate_statistics with a float32 target beside each draft dtype), vocabularies that leave rows misaligned and rows cut
into many chunks; for both kernel families (diversed_ext.set_cuda_kernels: block and split) and the three element types.
Every emitted token must stay in [-1, V), every feature in [0, 1], every log p(x) at most 0. Run it under
`compute-sanitizer --tool memcheck|racecheck|synccheck|initcheck` (scripts/gpu_check.sh does); with --device cpu it runs
the same calls on the CPU kernels, which checks the script itself anywhere.
    python scripts/gpu_hostile_inputs.py [--device cuda|cpu] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import diversed_ext as dx

FAMILIES = ("block", "split")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def hostile_problem(batch, num_positions, vocab, device, generator):
    """Draft and target probabilities with poisoned rows, ids partly outside [0, V), num_draft partly outside [0, K]."""
    draft = torch.rand(batch, num_positions, vocab, generator=generator)
    target = torch.rand(batch, num_positions + 1, vocab, generator=generator)
    if num_positions:
        draft[0, 0] = float("nan")
        target[1, 0, 0] = -1.0
        target[1 % batch, -1, vocab // 2] = float("inf")
    target[-1] = 0.0  # a request whose target has no mass anywhere
    tokens = torch.randint(-5, vocab + 5, (batch, num_positions), generator=generator)
    num_draft = torch.tensor([num_positions, max(num_positions - 1, 0), 0, num_positions + 3, -2])[:batch]
    uniforms = torch.rand(batch, num_positions + 1, dtype=torch.float64, generator=generator) * 1.5 - 0.2
    return tuple(t.to(device) for t in (tokens, draft, target, num_draft, uniforms))


def hostile_rows(batch, width, device, generator):
    """Row indices a check would refuse, beside valid ones (of rows [0, batch * width)): -1, R, and far past R."""
    rows = torch.randint(-2, batch * width + 2, (batch, width), generator=generator)
    rows.view(-1)[::4] = 2**62
    return rows.to(device)


def assert_in_range(result, vocab, what):
    tokens = result.tokens
    if not bool(((tokens >= -1) & (tokens < vocab)).all()):
        raise AssertionError(f"{what}: a token outside [-1, {vocab})")


def exercise(device, batch, num_positions, vocab, generator):
    tokens, draft, target, num_draft, uniforms = hostile_problem(batch, num_positions, vocab, device, generator)
    weight = torch.rand(batch, num_positions, generator=generator).to(device)
    greedy = (torch.arange(batch) % 2 == 1).to(device)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1e-9, float("nan")][:batch], device=device)
    seeds = torch.arange(batch, device=device)
    for dtype in DTYPES:
        q, p = draft.to(dtype), target.to(dtype)
        what = f"B={batch} K={num_positions} V={vocab} {dtype}"
        for draft_rows in (q, None):  # with draft distributions, and tokens only
            assert_in_range(dx.verify(tokens, draft_rows, p, weight, num_draft=num_draft, greedy=greedy,
                                      uniforms=uniforms, check_inputs=False), vocab, what)
            assert_in_range(dx.verify(tokens, draft_rows, p, 0.5, num_draft=num_draft, check_inputs=False), vocab,
                            what)
            logits = None if draft_rows is None else draft_rows.log()
            assert_in_range(dx.verify_logits(tokens, logits, p.log(), 0.5, num_draft=num_draft, seed=seeds,
                                             temperature=temperature, check_inputs=False), vocab, what)
        target_rows = hostile_rows(batch, num_positions + 1, device, generator)
        draft_rows = hostile_rows(batch, num_positions, device, generator)
        flat_q, flat_p = q.reshape(-1, vocab), p.reshape(-1, vocab)
        assert_in_range(dx.verify(tokens, flat_q, flat_p, weight, num_draft=num_draft, greedy=greedy,
                                  uniforms=uniforms, target_rows=target_rows, draft_rows=draft_rows,
                                  check_inputs=False), vocab, what + " rows")
        assert_in_range(dx.verify_logits(tokens, flat_q.log(), flat_p.log(), 0.5, num_draft=num_draft, seed=seeds,
                                         temperature=temperature, target_temperature=temperature,
                                         target_rows=target_rows, draft_rows=draft_rows, check_inputs=False),
                        vocab, what + " rows")
        if num_positions:
            dx.token_stats(q, p[:, :num_positions], tokens.clamp(0, vocab - 1), check_inputs=False)
            dx.mix(q, p[:, :num_positions], 0.3, check_inputs=False)
            features = dx.distribution_features(q.log(), p[:, :num_positions].log(), temperature=temperature,
                                                check_inputs=False)
            assert bool(((features >= 0) & (features <= 1)).all()), f"features outside [0, 1] at {what}"
            # rows read in place through hostile indices, the target in float32 beside the draft's dtype
            features = dx.distribution_features(flat_q.log(), flat_p.float().log(), temperature=temperature,
                                                target_temperature=temperature.flip(0),
                                                target_rows=hostile_rows(batch, num_positions, device, generator),
                                                draft_rows=draft_rows, check_inputs=False)
            assert bool(((features >= 0) & (features <= 1)).all()), f"features outside [0, 1] at {what} rows"
            # the gate's statistics: hostile ids and rows, with draft logits, probabilities and tokens only
            gate_rows = hostile_rows(batch, num_positions, device, generator)
            for draft_kind in ({"draft_logits": flat_q.log()}, {"draft_probs": flat_q}, {}):
                indexed = {"draft_rows": draft_rows} if draft_kind else {}
                statistics = dx.ops.gate_statistics(tokens, flat_p.float().log(), temperature=temperature,
                                                    target_temperature=temperature.flip(0), target_rows=gate_rows,
                                                    check_inputs=False, **draft_kind, **indexed)
                assert not bool((statistics.drafted_logprob > 0).any()), f"log p(x) above 0 at {what} gate"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small vocabularies only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_hostile_inputs: no GPU visible (use --device cpu to run the calls on the CPU)", file=sys.stderr)
        return 2
    vocabs = (1, 7, 31, 1000) if args.quick else (1, 7, 31, 1000, 32001, 49152, 262147)
    generator = torch.Generator().manual_seed(0)
    for family in FAMILIES:
        dx.set_cuda_kernels(family)
        for vocab in vocabs:
            for num_positions in (0, 1, 5):
                exercise(args.device, 5 if vocab < 100000 else 2, num_positions, vocab, generator)
        if args.device == "cuda":
            torch.cuda.synchronize()
        print(f"gpu_hostile_inputs: {family} kernels done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
