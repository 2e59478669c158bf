"""vLLM's V1 rejection-sampling step alone: the DIVERSED plugin against vLLM's own exact step, on the same inputs.

Both run through the plugin's V1 sampler (``DiversedRejectionSampler.forward(metadata, draft_probs, logits,
sampling_metadata)``), the way vLLM's runner calls it:

    vLLM exact      ``bind(None, exact_vllm=True)``: vLLM's own ``rejection_sample`` (its C++ fallbacks of the Triton
                    kernels, registered as vLLM's CPU worker does), with the plugin's repaired CPU expansion of
                    temperature/top-k/top-p. One measurement serves every plugin row.
    plugin static   ``bind(RequestWeights(...))`` with the engine entry {"weight": 0.5}: diversed_ext verifies.
    plugin head unused  {"weight": 0.5, "heads": ["default"]}: the head loaded, no request asking for it.
    plugin head     the same with {"head": "default"}: the shipped default head (hidden size 576) picks w per drafted
                    token from a fake runner and capture exposing exactly what weights.py / heads.py read
                    (``input_batch.req_ids``, ``requests[id].sampling_params.extra_args``, the captured draft hidden
                    states and logits of the last proposal, and ``target_hidden`` [N + B, H]).
    plugin gate     {"weight": 0.5, "gate_margin": 4}: the static weight with the log-probability gate.

Every step includes what vLLM's step includes: the bonus token from vLLM's own ``Sampler()``, the gathers of the
target rows, the constraints, acceptance and the [B, K + 1] output. Inputs per shape (B requests, K drafts each,
vocabulary V): float32 logits [N + B, V] (N = B K; each request's K drafted rows, then its bonus row, as vLLM lays
them out); the draft's logits are Gaussian with one favoured token per position holding 70% of its law, the target's
are the draft's plus unit noise (vLLM's exact step keeps about half the tokens-only drafts), drafts are sampled from
the draft's softmax; ``SpecDecodeMetadata.make_dummy`` with the real row indices; ``SamplingMetadata`` built as vLLM's
``_dummy_sampler_run`` builds it, at temperature 1 for every request, no top-k/top-p (what vLLM's input batch passes
when no request asks for them), no penalties, unseeded. Drafts are tokens only (vLLM's default: draft_probs None) or
probabilistic (draft_probs [N, V], the draft's softmax).

Timing: each implementation is warmed up, then all are called in interleaved rounds (one call of each per round, so a
passing load falls on all alike; each round starts one implementation later) and the median per step is reported;
few rounds at the largest shapes. Allocations: one more step of each under ``torch.profiler.profile(profile_memory=
True)``; "alloc" sums every allocation the step makes through torch's CPU allocator (the profiler's raw memory
records, frees ignored), "peak" is the highest sum of live allocations during the step. Memory that a kernel takes
outside torch's allocator (malloc'd scratch of a C++ op) is not seen. The floor is the bytes of logits a step must
read, (N + B) x V x 4, at the speed torch.sum streams a 512 MiB buffer (the fastest of 10, measured once).

    .venv-vllm/bin/python bench/bench_vllm_sampler.py [--quick] [--batch 1 8 64] [--draft 3 5]
                                                      [--vocab 49152 128256] [--drafts tokens probs]
                                                      [--weights static "head unused" head gate] [--csv PATH]

Writes a markdown table to stdout and a CSV under bench/results/ (or --csv).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import statistics
import sys
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from vllm_common import require_vllm, write_csv

BATCHES = (1, 8, 64)
DRAFT_LENGTHS = (3, 5)
VOCABS = (49152, 128256)
DRAFT_MODES = ("tokens", "probs")
WEIGHT_ROWS = ("static", "head unused", "head", "gate")  # the plugin's rows, each against vLLM's exact step
QUICK = dict(batch=[1, 8], draft=[3], vocab=[49152], drafts=["tokens"])
WEIGHT = 0.5
HEAD = "default"
GATE_MARGIN = 4.0
HIDDEN = 576  # the shipped default head's draft and target hidden size
SPREAD = 2.0  # scale of the Gaussian logits
FAVOURITE_MASS = 0.7  # of the draft's law on each position's favoured token
NOISE = 1.0  # scale of the target's difference from the draft logits (vLLM exact accepts about half the drafts)
WARMUP_CALLS = 2
MIN_ROUNDS = 5
MAX_ROUNDS = 30
ROUND_BUDGET_S = 6.0  # per shape, all implementations together, after warm-up (at least MIN_ROUNDS rounds)
STREAM_BUFFER_BYTES = 512 * 2**20
STREAM_REPEATS = 10
TARGET_RATIO = 1.1  # plugin static / vLLM exact, every shape
TARGET_HEAD_COST = 0.2  # plugin head over plugin static, at B = 64
TARGET_UNUSED_HEAD_COST = 0.05  # a head loaded but unused over plugin static, every shape


@dataclass
class Step:
    """One shape's inputs, as vLLM's runner hands them to the rejection sampler."""

    metadata: object  # SpecDecodeMetadata
    draft_probs: Optional[torch.Tensor]
    logits: torch.Tensor
    sampling_metadata: object  # SamplingMetadata
    draft_logits: torch.Tensor  # [B, K, V], what the capture holds for the head


def register_vllm_cpu_kernels() -> None:
    """vLLM's CPU worker swaps its Triton kernels (rejection sampling among them) for C++ fallbacks when it starts;
    a bench calling the sampler in one process must do the same, or vLLM's rejection_sample cannot launch them."""
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def sampling_metadata(batch: int, draft_tokens: list):
    """As vLLM's ``_dummy_sampler_run`` builds it, at temperature 1 for every request (all rows sampled)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    def full(value):
        return torch.full((batch,), value, dtype=torch.float32)

    return SamplingMetadata(
        temperature=full(1.0), all_greedy=False, all_random=True, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, logprob_token_ids=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=full(0.0), presence_penalties=full(0.0), repetition_penalties=full(1.0),
        output_token_ids=[[] for _ in range(batch)], spec_token_ids=draft_tokens, allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def spec_metadata(draft_tokens: list):
    """``make_dummy`` leaves every row index 0; here they point at each request's rows: K drafts, then the bonus."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    metadata = SpecDecodeMetadata.make_dummy(draft_tokens, torch.device("cpu"))
    batch, width = len(draft_tokens), len(draft_tokens[0])
    rows = torch.arange(batch * (width + 1), dtype=torch.int32).reshape(batch, width + 1)
    metadata.target_logits_indices = rows[:, :width].reshape(-1).contiguous()
    metadata.bonus_logits_indices = rows[:, width].contiguous()
    metadata.logits_indices = rows.reshape(-1).contiguous()
    return metadata


def make_step(batch: int, width: int, vocab: int, probabilistic: bool, seed: int = 0) -> Step:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width + 1, vocab, generator=generator).mul_(SPREAD)
    # One favoured token per position, as a language model's distributions often have: Gaussian logits of spread s
    # hold about V exp(s^2 / 2) of exp-mass, so this boost gives the favourite FAVOURITE_MASS of the draft's law.
    boost = math.log(vocab) + SPREAD**2 / 2 + math.log(FAVOURITE_MASS / (1 - FAVOURITE_MASS))
    favourite = torch.randint(vocab, (batch, width + 1, 1), generator=generator)
    logits.scatter_add_(-1, favourite, torch.full(favourite.shape, boost))
    draft_logits = logits[:, :width].clone()
    logits.add_(torch.randn(logits.shape, generator=generator), alpha=NOISE)
    draft_probs = draft_logits.reshape(-1, vocab).softmax(-1)
    tokens = torch.multinomial(draft_probs, 1, generator=generator).reshape(batch, width).tolist()
    return Step(spec_metadata(tokens), draft_probs if probabilistic else None, logits.reshape(-1, vocab),
                sampling_metadata(batch, tokens), draft_logits)


class FakeCapture:
    """What the plugin's hidden-state capture holds when a step verifies: the last proposal's draft hidden states and
    logits (by request id, and as [P, K, ...] tensors with each request's row) and the target's [N + B, H]."""

    def __init__(self, request_ids: list, draft_hidden: torch.Tensor, draft_logits: torch.Tensor,
                 target_hidden: torch.Tensor):
        self.keep_draft_logits = True  # the default head reads distribution features
        self.target_hidden = target_hidden
        self.hidden, self.logits = draft_hidden, draft_logits
        self.row_of = {request_id: row for row, request_id in enumerate(request_ids)}
        self.drafted = {request_id: (draft_hidden[row], draft_logits[row])
                        for row, request_id in enumerate(request_ids)}


def fake_runner(batch: int):
    """The two things RequestWeights reads from vLLM's V1 runner: the batch's request ids in row order, and each
    request's sampling params (no ``diversed_*`` extra_args: every request takes the engine's default)."""
    from vllm import SamplingParams

    request_ids = [f"request-{row}" for row in range(batch)]
    requests = {request_id: types.SimpleNamespace(sampling_params=SamplingParams(temperature=1.0))
                for request_id in request_ids}
    return types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=request_ids), requests=requests)


def samplers(step: Step, head, timed: tuple = WEIGHT_ROWS) -> dict:
    """{label: sampler} for one shape: vLLM exact and the plugin with each of ``timed`` (static always)."""
    from vllm.v1.sample.sampler import Sampler

    from diversed_ext.vllm_plugin.sampler import DiversedRejectionSampler
    from diversed_ext.vllm_plugin.settings import EngineSettings
    from diversed_ext.vllm_plugin.weights import RequestWeights

    cpu = torch.device("cpu")
    batch, width = len(step.metadata.num_draft_tokens), step.metadata.max_spec_len
    runner = fake_runner(batch)
    generator = torch.Generator().manual_seed(1)
    capture = FakeCapture(runner.input_batch.req_ids, torch.randn(batch, width, HIDDEN, generator=generator),
                          step.draft_logits, torch.randn(step.logits.shape[0], HIDDEN, generator=generator))
    chosen = {"vLLM exact": None, "plugin static": (EngineSettings(weight=WEIGHT), {}),
              "plugin head unused": (EngineSettings(weight=WEIGHT, head_paths=(HEAD,)), {HEAD: head}),
              "plugin head": (EngineSettings(head=HEAD, head_paths=(HEAD,)), {HEAD: head}),
              "plugin gate": (EngineSettings(weight=WEIGHT, gate_margin=GATE_MARGIN), {})}
    built = {}
    for label, entry in chosen.items():
        if entry is not None and label.removeprefix("plugin ") not in ("static", *timed):
            continue
        sampler = DiversedRejectionSampler(Sampler(), None, cpu)
        weights = None if entry is None else RequestWeights(runner, entry[0], entry[1], capture, counts_owner=sampler)
        built[label] = sampler.bind(weights, cpu, exact_vllm=entry is None)
    return built


def interleaved_medians(functions: dict) -> dict:
    """Median seconds per call of each function, in interleaved rounds after warm-up; the round count fits
    ROUND_BUDGET_S from the warm-up's cost, between MIN_ROUNDS and MAX_ROUNDS."""
    started = time.perf_counter()
    for function in functions.values():
        for _ in range(WARMUP_CALLS):
            function()
    per_round = (time.perf_counter() - started) / WARMUP_CALLS
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(ROUND_BUDGET_S / max(per_round, 1e-6))))
    samples = {name: [] for name in functions}
    names = list(functions)
    for round_index in range(rounds):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            start = time.perf_counter()
            functions[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


@contextmanager
def quiet_stderr():
    """Kineto prints a line to file descriptor 2 whenever a profile starts and stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def allocations(function: Callable[[], object]) -> tuple:
    """(bytes allocated, peak bytes live) during one call, from the profiler's raw memory records."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        function()
    records = sorted((event.start_ns(), event.nbytes()) for event in prof.profiler.kineto_results.events()
                     if event.name() == "[memory]")
    allocated = sum(nbytes for _, nbytes in records if nbytes > 0)
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return allocated, peak


def memory_bandwidth() -> float:
    """Bytes per second torch.sum streams from a buffer far beyond the last-level cache (the fastest of several)."""
    buffer = torch.ones(STREAM_BUFFER_BYTES // 4, dtype=torch.float32)
    torch.sum(buffer)
    times = []
    for _ in range(STREAM_REPEATS):
        start = time.perf_counter()
        torch.sum(buffer)
        times.append(time.perf_counter() - start)
    return STREAM_BUFFER_BYTES / min(times)


def measure_shape(batch: int, width: int, vocab: int, mode: str, head, bandwidth: float,
                  weights: tuple = WEIGHT_ROWS) -> list:
    step = make_step(batch, width, vocab, probabilistic=mode == "probs")
    built = samplers(step, head, weights)
    calls = {label: (lambda sampler=sampler: sampler(step.metadata, step.draft_probs, step.logits,
                                                     step.sampling_metadata))
             for label, sampler in built.items()}
    medians = interleaved_medians(calls)
    memory = {label: allocations(call) for label, call in calls.items()}
    floor_s = step.logits.numel() * step.logits.element_size() / bandwidth
    exact_s = medians["vLLM exact"]
    rows = []
    for weights in ("static", *(row for row in weights if row != "static")):
        plugin = f"plugin {weights}"
        rows.append({
            "B": batch, "K": width, "V": vocab, "drafts": mode, "weights": weights,
            "vllm_ms": exact_s * 1e3, "plugin_ms": medians[plugin] * 1e3, "ratio": medians[plugin] / exact_s,
            "over_static": medians[plugin] / medians["plugin static"] if weights != "static" else "",
            "vllm_alloc_bytes": memory["vLLM exact"][0], "plugin_alloc_bytes": memory[plugin][0],
            "vllm_peak_bytes": memory["vLLM exact"][1], "plugin_peak_bytes": memory[plugin][1],
            "floor_ms": floor_s * 1e3,
        })
    return rows


def megabytes(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def table(rows: list) -> str:
    lines = ["| B | K | V | drafts | weights | vLLM exact ms | plugin ms | plugin / vLLM | adds to static | vLLM alloc "
             "(peak) | plugin alloc (peak) | floor ms |",
             "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        adds = f"{row['over_static'] - 1:+.0%}" if row["weights"] != "static" else ""
        lines.append(
            f"| {row['B']} | {row['K']} | {row['V']} | {row['drafts']} | {row['weights']} | {row['vllm_ms']:.2f} | "
            f"{row['plugin_ms']:.2f} | {row['ratio']:.2f}x | {adds} | {megabytes(row['vllm_alloc_bytes'])} "
            f"({megabytes(row['vllm_peak_bytes'])}) | {megabytes(row['plugin_alloc_bytes'])} "
            f"({megabytes(row['plugin_peak_bytes'])}) | {row['floor_ms']:.2f} |")
    return "\n".join(lines)


def targets(rows: list) -> str:
    """The targets, checked and printed (not asserted): timings on a shared machine are evidence, not a gate."""
    static = [row for row in rows if row["weights"] == "static"]
    missed = [f"B={row['B']} K={row['K']} V={row['V']} {row['drafts']} ({row['ratio']:.2f}x)"
              for row in static if row["ratio"] > TARGET_RATIO]
    lines = [f"target: plugin static <= {TARGET_RATIO}x vLLM exact at every shape: "
             f"{'met' if not missed else 'missed at ' + ', '.join(missed)} "
             f"({len(static) - len(missed)}/{len(static)} shapes)"]
    heads = [row for row in rows if row["weights"] == "head" and row["B"] == 64]
    if heads:
        over = [f"K={row['K']} V={row['V']} {row['drafts']} ({row['over_static'] - 1:+.0%})"
                for row in heads if row["over_static"] - 1 > TARGET_HEAD_COST]
        lines.append(f"target: the head adds <= {TARGET_HEAD_COST:.0%} over the static plugin step at B = 64: "
                     f"{'met' if not over else 'missed at ' + ', '.join(over)} "
                     f"({len(heads) - len(over)}/{len(heads)} shapes)")
    else:
        lines.append("target: the head at B = 64: not measured in this run")
    unused = [row for row in rows if row["weights"] == "head unused"]
    if not unused:
        return "\n".join(lines)
    # one-sided: the two run the same code (no request uses the head), so a step faster than static is noise
    over = [f"B={row['B']} K={row['K']} V={row['V']} {row['drafts']} ({row['over_static'] - 1:+.1%})"
            for row in unused if row["over_static"] - 1 > TARGET_UNUSED_HEAD_COST]
    lines.append(f"target: a head loaded but unused adds <= {TARGET_UNUSED_HEAD_COST:.0%} to the static plugin step at "
                 f"every shape: {'met' if not over else 'missed at ' + ', '.join(over)} "
                 f"({len(unused) - len(over)}/{len(unused)} shapes; range "
                 f"{min(row['over_static'] for row in unused) - 1:+.0%} to "
                 f"{max(row['over_static'] for row in unused) - 1:+.0%})")
    return "\n".join(lines)


def conditions() -> str:
    import vllm

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{time.strftime('%Y-%m-%d %H:%M')}, vLLM {vllm.__version__}, torch {torch.__version__}, {cpu}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f}")


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="B = 1, 8; K = 3; V = 49152; tokens-only drafts, in place of the grid options (under a "
                        "minute)")
    parser.add_argument("--batch", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--draft", nargs="+", type=int, default=list(DRAFT_LENGTHS), help="K, drafts per request")
    parser.add_argument("--vocab", nargs="+", type=int, default=list(VOCABS))
    parser.add_argument("--drafts", nargs="+", default=list(DRAFT_MODES), choices=DRAFT_MODES,
                        help="tokens: draft_probs None (vLLM's default); probs: the draft's distributions")
    parser.add_argument("--weights", nargs="+", default=list(WEIGHT_ROWS), choices=WEIGHT_ROWS,
                        help="the plugin's rows to time (static is always timed: the others are compared with it)")
    parser.add_argument("--csv", type=Path, help="CSV output (default bench/results/vllm-sampler-<time>.csv)")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if min(args.batch + args.draft + args.vocab) < 1:
        parser.error("--batch, --draft and --vocab must be at least 1")
    return args


def main(argv: Optional[list] = None) -> None:
    args = parse_args(argv)
    require_vllm("bench_vllm_sampler")
    from tqdm import tqdm

    from diversed_ext.head import load_head

    register_vllm_cpu_kernels()
    head = load_head(HEAD, draft_hidden=HIDDEN, target_hidden=HIDDEN)
    before = conditions()
    bandwidth = memory_bandwidth()
    shapes = list(itertools.product(args.drafts, args.batch, args.draft, args.vocab))
    rows = []
    for mode, batch, width, vocab in tqdm(shapes, desc="shapes", unit="shape", file=sys.stderr):
        rows.extend(measure_shape(batch, width, vocab, mode, head, bandwidth, tuple(args.weights)))
    print(f"{before}; streaming {bandwidth / 1e9:.1f} GB/s (torch.sum, 512 MiB); load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    print(f"V1 rejection-sampling step, temperature 1, float32 logits, static weight {WEIGHT}, head {HEAD!r}, "
          f"gate margin {GATE_MARGIN:g}; medians of interleaved rounds\n")
    print(table(rows))
    print()
    print(targets(rows))
    write_csv(rows, args.csv or Path(__file__).parent / "results"
              / f"vllm-sampler-{time.strftime('%Y%m%d-%H%M%S')}.csv")


if __name__ == "__main__":
    main()
