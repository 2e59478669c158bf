"""V2's n-gram speculator pads every request to K drafts with its last token where nothing matched: its own kernels
run here (under Triton's interpreter), the plugin counts the real drafts from what they leave behind, and its V2
sampler verifies only those, so no weight keeps filler; then the same in a V2 engine drafting with n-gram lookup."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from engines import V2_ARGS
from v2_problems import emitted, make_problem, samplers


MAX_MODEL_LEN = 64
NUM_POSITIONS = 3
MIN_N, MAX_N = 2, 3
# (the request's tokens, the drafts that follow its longest, rightmost suffix match)
SEQUENCES = [
    ([5, 6, 7, 8, 9, 5, 6, 7], [8, 9, 5]),     # "5 6 7" matched: three real drafts
    ([4, 1, 2, 3, 1, 2], [3, 1, 2]),           # "1 2" matched, followed by "3 1 2"
    ([9, 1, 2, 1, 2], [1, 2]),                 # "1 2" matched near the end: two real drafts, then filler
    ([1, 2, 3, 4, 9, 9, 10], []),              # nothing matches: filler only
]


def _run_ngram_kernels(sequences, num_sampled):
    """V2's own n-gram kernels on these requests: (drafts [R, K], scratch, blocks, seq_lens)."""
    from vllm.triton_utils import triton
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import _ngram_finalize_kernel, _ngram_scan_kernel

    rows = len(sequences)
    tokens = torch.zeros(rows, MAX_MODEL_LEN, dtype=torch.int32)
    seq_lens = torch.zeros(rows, dtype=torch.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        seq_lens[row] = len(sequence)
    states = torch.arange(rows, dtype=torch.int64)
    last = torch.tensor([sequence[-1] for sequence in sequences], dtype=torch.int64)
    block = 64
    blocks = triton.cdiv(MAX_MODEL_LEN, block)
    scratch = torch.zeros(rows, blocks, dtype=torch.int64)
    drafts = torch.zeros(rows, NUM_POSITIONS, dtype=torch.int64)
    _ngram_scan_kernel[(rows, blocks)](tokens, tokens.stride(0), states, seq_lens, num_sampled, scratch,
                                       scratch.stride(0), MAX_MODEL_LEN, MIN_N, MAX_N,
                                       triton.next_power_of_2(MAX_N), block)
    _ngram_finalize_kernel[(rows,)](tokens, tokens.stride(0), states, seq_lens, num_sampled, last, scratch,
                                    scratch.stride(0), drafts, MAX_MODEL_LEN, blocks, NUM_POSITIONS,
                                    triton.next_power_of_2(NUM_POSITIONS), max(1, triton.next_power_of_2(blocks)))
    return drafts, scratch, blocks, seq_lens


def test_the_real_drafts_are_counted_by_the_kernels_own_rule():
    from diversed_ext.vllm_plugin.drafters import ngram_real_drafts

    sequences = [sequence for sequence, _ in SEQUENCES] + [SEQUENCES[0][0]]
    num_sampled = torch.tensor([1] * len(SEQUENCES) + [0], dtype=torch.int32)  # the last sampled nothing
    drafts, scratch, blocks, seq_lens = _run_ngram_kernels(sequences, num_sampled)
    counts = ngram_real_drafts(scratch, blocks, seq_lens, num_sampled, MAX_MODEL_LEN, NUM_POSITIONS)
    assert counts.tolist() == [len(real) for _, real in SEQUENCES] + [0]
    for row, sequence in enumerate(sequences):
        real = SEQUENCES[row][1] if row < len(SEQUENCES) else []
        assert drafts[row, :len(real)].tolist() == real
        assert drafts[row, len(real):].tolist() == [sequence[-1]] * (NUM_POSITIONS - len(real)), "filler"


def test_the_sampler_never_keeps_filler_at_weight_zero():
    """At w = 0 every real draft is kept and nothing after it: a request emits its real drafts and one token from
    the target, whatever its filler; V2's own sampler at w = 1 sees the same rows."""
    from diversed_ext.vllm_plugin.drafters import ngram_real_drafts

    num_sampled = torch.ones(len(SEQUENCES), dtype=torch.int32)
    drafts, scratch, blocks, seq_lens = _run_ngram_kernels([sequence for sequence, _ in SEQUENCES], num_sampled)
    counts = ngram_real_drafts(scratch, blocks, seq_lens, num_sampled, MAX_MODEL_LEN, NUM_POSITIONS)
    problem = make_problem([NUM_POSITIONS] * len(SEQUENCES), 16, num_positions=NUM_POSITIONS, draft_logits=False)
    for request in range(len(SEQUENCES)):  # row j + 1 of a request holds its draft j
        start = request * (NUM_POSITIONS + 1)
        problem.draft_sampled[start + 1:start + 1 + NUM_POSITIONS] = drafts[request]
    states = len(SEQUENCES)
    tables = (torch.ones(states), torch.arange(states, dtype=torch.int64) + 1, torch.zeros(states))
    _, padded = samplers(NUM_POSITIONS, *tables)
    _, marked = samplers(NUM_POSITIONS, *tables)
    marked.real_drafts = SimpleNamespace(by_state=counts)
    assert [len(tokens) for tokens in emitted(padded, problem)] == [NUM_POSITIONS + 1] * len(SEQUENCES)
    tokens = emitted(marked, problem)
    assert [len(row) for row in tokens] == [len(real) + 1 for _, real in SEQUENCES]
    assert [row[:-1] for row in tokens] == [real for _, real in SEQUENCES]
    status = marked.status()
    assert status["drafted"] == status["accepted"] == sum(len(real) for _, real in SEQUENCES)


def test_a_v2_ngram_engine_verifies_real_drafts_only(pair):
    """At w = 0 every draft the plugin verifies is kept, and it verifies fewer than V2 drafted: the filler."""
    from drafters import NGRAM_CONFIG, REPEATING_PROMPTS, start_drafter_engine
    from engines import acceptance, chat, stop_engine, worker_status
    from vllm import SamplingParams

    llm = start_drafter_engine(pair, NGRAM_CONFIG, {"weight": 1.0}, **V2_ARGS)
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=16, seed=index, extra_args={"diversed_weight": 0.0})
                  for index in range(2)]
        _, drafted_by_vllm = acceptance(llm.chat([chat(prompt) for prompt in REPEATING_PROMPTS[:2]], params,
                                                 use_tqdm=False))
        status = worker_status(llm)[0]
    finally:
        stop_engine(llm)
    assert status["sampler"] == "DiversedV2RejectionSampler" and status["verifier"] == "diversed", status
    assert status["verified_without_head"] == 0
    assert 0 < status["drafted"] < drafted_by_vllm and status["accepted"] == status["drafted"], \
        (status, drafted_by_vllm)
