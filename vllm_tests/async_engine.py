"""The batch of :mod:`constraints` in an engine scheduled as vLLM schedules on a GPU, asynchronously, in a process of
its own. vLLM's engine process checks its config again when it starts, and on the CPU that check turns asynchronous
scheduling off, so the engine runs inside the process that makes it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where
:func:`engines.scheduled_as_on_a_gpu` keeps the setting; a process of its own, because an engine in a test's process
would leave vLLM's state there. :func:`run_async_batch` is what the tests call; run as a script, this file writes
the batch's outcome and the workers' status as JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from constraints import DRAFTERS, BatchOutcome, run_batch, start_batch_engine
from engines import stop_engine, worker_status

HERE = Path(__file__).resolve().parent


def run_async_batch(pair, num_prompts: int, num_tokens: int, folder: Path, *, timeout: float,
                    drafter: str = "draft_model", **engine_args) -> tuple[BatchOutcome, list]:
    """(the batch's outcome, the workers' status) from an engine on ``pair`` drafting with ``drafter`` (one of
    ``constraints.DRAFTERS``) scheduled asynchronously, with ``engine_args`` on top of the tests' own; its JSON is
    left in ``folder``. The process inherits this one's environment (V2's Triton interpreter, the tests' socket
    folder)."""
    result = folder / "async_batch.json"
    command = [sys.executable, str(HERE / "async_engine.py"), str(pair.target), str(pair.draft), str(result),
               "--prompts", str(num_prompts), "--tokens", str(num_tokens), "--drafter", drafter,
               "--engine-args", json.dumps(engine_args)]
    subprocess.run(command, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"), check=True, timeout=timeout)
    data = json.loads(result.read_text())
    return BatchOutcome(data["tallies"], [tuple(entry) for entry in data["emitted"]]), data["status"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("result", type=Path)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--drafter", choices=DRAFTERS, default="draft_model")
    parser.add_argument("--engine-args", type=json.loads, default={})
    args = parser.parse_args()
    pair = SimpleNamespace(target=Path(args.target), draft=Path(args.draft))
    llm = start_batch_engine(pair, args.drafter, async_scheduling=True, **args.engine_args)
    try:
        outcome = run_batch(llm, args.prompts, args.tokens)
        status = worker_status(llm)
    finally:
        stop_engine(llm)
    args.result.write_text(json.dumps({"tallies": outcome.tallies, "emitted": outcome.emitted, "status": status}))


if __name__ == "__main__":
    main()
