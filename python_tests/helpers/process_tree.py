"""Run a command whose whole process tree dies at its timeout, whatever sessions or groups its descendants join.

A process group or session is not enough to find every descendant: launchers such as torchrun start their workers in
sessions of their own, and a worker orphaned by its parent is re-parented outside the tree. An environment variable is
inherited by every descendant and survives both, so each run gets a unique marker in its environment, and the kill
sweeps /proc for every process carrying it (repeatedly, since a dying parent may still fork). Output goes to a file,
never a pipe, so no descendant can keep the caller blocked on an open pipe after the kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

MARKER_VARIABLE = "DIVERSED_TEST_PROCESS_TREE"
KILL_SWEEPS = 5
SWEEP_PAUSE_SECONDS = 0.1
REAP_TIMEOUT_SECONDS = 5.0


@dataclass
class TreeResult:
    returncode: Optional[int]  # None when the run was killed at its timeout
    output: str
    timed_out: bool
    seconds: float


def _processes_with_marker(marker: str) -> list[int]:
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def kill_marked_processes(marker: str) -> int:
    """SIGKILL every process whose environment carries the marker; returns how many were signalled."""
    killed = 0
    for _ in range(KILL_SWEEPS):
        pids = [pid for pid in _processes_with_marker(marker) if pid != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(SWEEP_PAUSE_SECONDS)
    return killed


def run_process_tree(command: Sequence[str], *, timeout: float, env: Optional[dict] = None) -> TreeResult:
    """Run ``command``; at ``timeout`` seconds kill it and every descendant. Returns within timeout + a few seconds."""
    marker = uuid.uuid4().hex
    environment = dict(os.environ if env is None else env)
    environment[MARKER_VARIABLE] = marker
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as output:
        process = subprocess.Popen(list(command), env=environment, stdin=subprocess.DEVNULL, stdout=output,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        timed_out = False
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        # Also after a normal exit: a descendant that outlived its parent is killed, never left running.
        kill_marked_processes(marker)
        try:
            process.wait(timeout=REAP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:  # only if the kernel could not kill it (e.g. stuck in D state)
            pass
        output.seek(0)
        text = output.read()
    return TreeResult(None if timed_out else process.returncode, text, timed_out, time.monotonic() - start)
