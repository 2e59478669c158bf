"""Engines for the vLLM tests: the default pair exported once, engines started with the arguments a 2-core CPU
needs, and the few numbers the tests read back from them."""

from __future__ import annotations

import contextlib
import gc
import os

ENGINE_ARGS = dict(
    enforce_eager=True,  # no graph capture on the CPU backend
    dtype="float32",
    max_model_len=1024,
    seed=0,
    # A KV cache of a set size: vLLM's CPU default reserves a share of its NUMA node's memory for the models and the
    # cache together, which on a machine whose node holds 10 GiB leaves a draft-model pair nothing for the cache.
    kv_cache_memory_bytes=1 << 30,
    # Blocks of 32 tokens (the CPU attention's least) rather than its default 128: a short request holds one block of
    # the cache, so 128-token blocks let a 1 GiB cache run 90 of the law tests' 400 requests at a time, and a shared
    # prompt shorter than a block is never served from the prefix cache.
    block_size=32,
    # Seeded requests crash vLLM 0.32.0's CPU runner when a prefill is chunked (a CPU generator has no offset).
    enable_chunked_prefill=False,
    max_num_batched_tokens=8192,
    disable_log_stats=False,
)
SPECULATIVE_ARGS = dict(per_request_spec_decode_metrics="summary")  # acceptance per request, in each output
# What V2 under Triton's interpreter needs of an engine here: a KV cache of a set size (profiling it takes 40 s); the
# V2 tests' conftest gives every process one thread (matrix products run several times slower with more on 2 cores).
V2_ARGS = dict(kv_cache_memory_bytes=256 * 2**20)
# What V2 engines' greedy checks compare with V2 without speculation: few, short continuations (the interpreter is slow)
V2_GREEDY = dict(prompts=2, tokens=12)
NUM_DRAFT = 3

# Word problems written for these tests, in the style of GSM8K (no data set is read).
PROMPTS = [
    "A baker makes 24 rolls in the morning and twice as many in the afternoon. How many rolls does he make in all?",
    "Tom has 15 marbles. He gives 4 to his sister and buys 9 more. How many marbles does Tom have now?",
    "A train travels 60 miles per hour for 3 hours. How far does it travel?",
    "Sara reads 12 pages a day. How many days does she need to read a book of 180 pages?",
    "A shop sells pens at 3 dollars each. Maria buys 7 pens and pays with a 50 dollar bill. What is her change?",
    "There are 5 rows of chairs with 8 chairs in each row. 6 chairs are empty. How many people are sitting?",
    "A farmer has 36 eggs and packs them in boxes of 6. How many boxes does he fill?",
    "Lena saves 20 dollars a week. How many weeks until she has 260 dollars?",
]


def chat(prompt: str) -> list:
    return [{"role": "user", "content": prompt}]


@contextlib.contextmanager
def scheduled_as_on_a_gpu():
    """Engines made inside schedule asynchronously, as vLLM's do by default on a GPU wherever the drafter allows it
    (draft models, EAGLE, MTP): the engine schedules step t + 1 while step t runs, with placeholders for the drafts
    step t proposes (they stay on the device), and a draft the request's grammar rejects arrives marked -1 instead of
    being trimmed. vLLM's CPU platform turns this off ("not required on CPU") whenever it checks a config; here its
    check runs and then the setting is put back. vLLM's engine process checks the config again when it starts, so
    such an engine must run in the process that makes it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the tests run it in
    a process of its own (:mod:`async_engine`)."""
    from vllm.platforms.cpu import CpuPlatform

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("an engine scheduled as on a GPU runs in this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    original = vars(CpuPlatform)["check_and_update_config"]  # a classmethod

    def check_keeping_async(cls, vllm_config) -> None:
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_keeping_async)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original


def start_engine(pair, *, speculative: str | dict | None = "draft", diversed=None, probabilistic: bool = False,
                 async_scheduling: bool = False, **extra):
    """An LLM on the exported pair: ``speculative`` is None (no speculation), "draft" (the dequantised draft),
    "target" (the target as its own draft) or a speculative_config of another drafter (K = NUM_DRAFT unless it says);
    ``diversed`` is the additional_config entry, or None; ``async_scheduling`` schedules as vLLM does on a GPU
    (:func:`scheduled_as_on_a_gpu`)."""
    from vllm import LLM

    kwargs = dict(ENGINE_ARGS, **extra)
    if isinstance(speculative, dict):
        kwargs.update(SPECULATIVE_ARGS, speculative_config={"num_speculative_tokens": NUM_DRAFT, **speculative})
    elif speculative is not None:
        kwargs.update(SPECULATIVE_ARGS)
        draft = pair.draft if speculative == "draft" else pair.target
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft),
                                        "num_speculative_tokens": NUM_DRAFT,
                                        "draft_sample_method": "probabilistic" if probabilistic else "greedy"}
    if diversed is not None:
        kwargs["additional_config"] = {"diversed": diversed}
    with scheduled_as_on_a_gpu() if async_scheduling else contextlib.nullcontext():
        return LLM(str(pair.target), **kwargs)


SHUTDOWN_TRIES = 5  # vLLM's force-kill races its own processes' exits; each try finds fewer of them left


def stop_engine(llm) -> None:
    """Shut the engine's processes down now, so the next engine has the memory. vLLM's force-kill of a stopping
    engine asks each child process its name and raises psutil.NoSuchProcess when one has just exited (seen with a
    tensor-parallel engine's workers), leaving the rest of its shutdown undone: that child is gone, so the engine's
    processes are shut down again (vLLM's own process shutdown, which skips those already stopped), then the client's
    sockets closed."""
    import psutil
    from vllm.v1.utils import shutdown

    core = llm.llm_engine.engine_core
    try:
        core.shutdown()
    except psutil.NoSuchProcess:
        for attempt in range(SHUTDOWN_TRIES if core.resources.engine_manager is not None else 0):
            try:
                shutdown(core.resources.engine_manager.processes)
                break
            except psutil.NoSuchProcess:
                if attempt == SHUTDOWN_TRIES - 1:
                    raise
        core.resources()
    del llm
    gc.collect()


def worker_status(llm) -> list:
    """The plugin's status in every worker (one dict each)."""
    return llm.collective_rpc("diversed_status")


# What the plugin counts in each worker, summed since the engine started
PLUGIN_COUNTS = ("drafted", "accepted", "weight_sum", "verified_without_head")


def counts_during(llm, run) -> dict:
    """What the plugin counted in the first worker while ``run()`` ran: drafts verified and accepted, the sum of
    their weights, and drafts of head requests verified without their hidden states."""
    before = worker_status(llm)[0]
    run()
    after = worker_status(llm)[0]
    return {key: after[key] - before[key] for key in PLUGIN_COUNTS}


def sampled_at_once(llm, tokens: int, count: int, extra_args=None, prompt: int = 0) -> tuple:
    """PROMPTS[prompt:prompt + count] submitted together at temperature 1, ``tokens`` each (no early stop): (drafted
    per request, speculative steps per request, what the plugin counted meanwhile), drafts from vLLM's own count."""
    from vllm import SamplingParams

    chosen = range(prompt, prompt + count)
    params = [SamplingParams(temperature=1.0, max_tokens=tokens, seed=index, ignore_eos=True, extra_args=extra_args)
              for index in chosen]
    outputs = []
    counts = counts_during(llm, lambda: outputs.extend(
        llm.chat([chat(PROMPTS[index]) for index in chosen], params, use_tqdm=False)))
    assert [len(output.outputs[0].token_ids) for output in outputs] == [tokens] * count
    summaries = [output.outputs[0].spec_decode_metrics for output in outputs]
    summaries = [summary.to_dict() if summary is not None else {"num_draft_tokens": 0, "num_spec_steps": 0}
                 for summary in summaries]
    drafted = [summary["num_draft_tokens"] for summary in summaries]
    return drafted, [summary["num_spec_steps"] for summary in summaries], counts


def acceptance(outputs) -> tuple[int, int]:
    """(accepted, drafted) summed over finished requests, from vLLM's own per-request metrics."""
    accepted = drafted = 0
    for output in outputs:
        metrics = output.outputs[0].spec_decode_metrics
        if metrics is not None:
            summary = metrics.to_dict()
            accepted += summary["num_accepted_draft_tokens"]
            drafted += summary["num_draft_tokens"]
    return accepted, drafted


def per_request_acceptance(outputs) -> list:
    """Acceptance rate of each request that drafted anything."""
    rates = []
    for output in outputs:
        summary = output.outputs[0].spec_decode_metrics.to_dict()
        if summary["num_draft_tokens"]:
            rates.append(summary["num_accepted_draft_tokens"] / summary["num_draft_tokens"])
    return rates
