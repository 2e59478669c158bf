"""The plugin under tensor parallelism: the default pair's target has 9 attention heads and 3 key-value heads, so
three ranks split it. Every rank runs the verification on the same (all-gathered) logits, so every rank must report
the plugin's sampler with the same counts, and the engine must emit what one rank emits: greedy rows at w = 1 and
seeded sampled rows at w = 0.5, token for token, with the same acceptance.

Starting three ranks on a machine with fewer NUMA nodes (or cores) than ranks needs an explicit thread binding:
vLLM's default ``VLLM_CPU_OMP_THREADS_BIND=auto`` binds rank i to NUMA node i and asserts there are enough nodes
(vllm/utils/ompmultiprocessing.py, ``_get_autobind_cpu_ids``), and ``nobind`` lets every rank start as many OpenMP
threads as there are cores, which oversubscribes a small machine many times over. A list with one CPU per rank,
reusing CPUs round-robin, works on any machine."""

from __future__ import annotations

import os

import pytest
from engines import PROMPTS, chat, start_engine, stop_engine, worker_status

TP = 3
ENGINE_WEIGHT = 0.5
MAX_TOKENS = 16
SEEDS = (0, 1)
# An explicit KV cache per rank: the default share of host memory (gpu_memory_utilization) would be reserved by each
# of the three ranks, and with an explicit size vLLM also skips the warm-up pass of eager engines.
KV_CACHE_BYTES = 256 << 20


def _thread_binding(ranks: int) -> str:
    """One CPU per rank, round-robin over the CPUs this process may use ("0|1|0" on two cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[rank % len(cpus)]) for rank in range(ranks))


def _requests():
    """One batch: greedy rows at w = 1 and seeded sampled rows at the engine's weight (0.5)."""
    from vllm import SamplingParams

    greedy = [(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args={"diversed_weight": 1.0}))
              for prompt in PROMPTS[:2]]
    sampled = [(prompt, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed))
               for prompt, seed in zip(PROMPTS[2:], SEEDS)]
    return greedy + sampled


def _run(pair, tensor_parallel_size: int) -> dict:
    """Start an engine, serve the batch once, read every worker's status, stop the engine."""
    binding = {"VLLM_CPU_OMP_THREADS_BIND": _thread_binding(tensor_parallel_size)} if tensor_parallel_size > 1 else {}
    with pytest.MonkeyPatch.context() as patch:  # only this engine's processes see the binding (they inherit it)
        for name, value in binding.items():
            patch.setenv(name, value)
        llm = start_engine(pair, diversed={"weight": ENGINE_WEIGHT}, tensor_parallel_size=tensor_parallel_size,
                           kv_cache_memory_bytes=KV_CACHE_BYTES)
    try:
        requests = _requests()
        outputs = llm.chat([chat(prompt) for prompt, _ in requests], [params for _, params in requests],
                           use_tqdm=False)
        return {"tokens": [list(output.outputs[0].token_ids) for output in outputs],
                "metrics": [output.outputs[0].spec_decode_metrics.to_dict() for output in outputs],
                "statuses": worker_status(llm)}
    finally:
        stop_engine(llm)


@pytest.fixture(scope="module")
def runs(pair):
    return {size: _run(pair, size) for size in (TP, 1)}  # one engine at a time


def test_every_rank_verifies_with_the_plugin_and_counts_the_same(runs):
    statuses = runs[TP]["statuses"]
    assert len(statuses) == TP
    for status in statuses:
        assert status["sampler"] == "DiversedRejectionSampler"
        assert status["verifier"] == "diversed" and status["weight"] == ENGINE_WEIGHT
    assert all(status == statuses[0] for status in statuses), statuses
    assert statuses[0]["drafted"] > 0


def test_counts_equal_one_rank(runs):
    fields = ("drafted", "accepted", "weight_sum")
    assert {field: runs[TP]["statuses"][0][field] for field in fields} == \
        {field: runs[1]["statuses"][0][field] for field in fields}


def test_greedy_rows_at_weight_one_equal_one_rank(runs):
    assert runs[TP]["tokens"][:2] == runs[1]["tokens"][:2]


def test_seeded_sampled_rows_equal_one_rank(runs):
    assert runs[TP]["tokens"][2:] == runs[1]["tokens"][2:]
    assert runs[TP]["metrics"] == runs[1]["metrics"]
    sampled = runs[1]["metrics"][2:]
    # The comparison exercises rejections, not only acceptances (at w = 0.5 some drafted tokens are still refused).
    assert sum(m["num_accepted_draft_tokens"] for m in sampled) < sum(m["num_draft_tokens"] for m in sampled)
