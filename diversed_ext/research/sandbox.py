"""Running untrusted Python (model completions) in a sandboxed subprocess, for the HumanEval reward."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional


@dataclass
class SandboxResult:
    """What a sandboxed program did."""

    returncode: Optional[int]  # None when it was killed for the timeout
    stdout: str
    stderr: str
    timed_out: bool
    network_isolated: bool  # True when it ran in its own (empty) network namespace

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_OUTPUT_LIMIT = 64 * 1024  # characters of stdout/stderr kept


def _sandbox_limits(timeout: float, memory_bytes: int, file_bytes: int, isolate_network: bool):
    """preexec_fn of the sandboxed child (runs after fork, before exec): resource limits and, when the kernel allows
    unprivileged user namespaces, a private network namespace with no interfaces but loopback."""

    def apply() -> None:
        cpu = max(1, int(timeout) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no fork/threads (not enforced for root)
        if isolate_network:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
                os.write(2, b"diversed sandbox: no network namespace (unshare failed)\n")

    return apply


def run_sandboxed(program: str, *, timeout: float = 5.0, memory_mb: int = 1024, file_mb: int = 16,
                  isolate_network: bool = True, keep_dir: Optional[list] = None) -> SandboxResult:
    """Run a Python program in a child process that can do as little harm as this module can arrange.

    What it does:
      - a fresh temporary directory is the working directory, HOME and TMPDIR, and it is deleted afterwards, so
        files written through relative paths, ``~`` or ``tempfile`` land there and vanish;
      - the environment is replaced by a minimal one (no proxies, no PYTHONPATH, no credentials), and Python runs
        in isolated mode (``-I``: no user site, no environment variables, the script's folder not on sys.path);
      - resource limits: CPU seconds, address space, size of any file written, no core dumps, no new processes;
      - the wall-clock ``timeout`` kills its whole process group;
      - when the kernel allows it, a new user and network namespace: no network at all (``network_isolated``).

    What it does NOT do (the honest limits): absolute paths elsewhere remain readable, and writable wherever this
    process's user may write (there is no filesystem jail or seccomp filter), and RLIMIT_NPROC is not enforced
    for root. Run untrusted code as an unprivileged user, or inside a container, when that matters.

    Args:
        program: Python source.
        timeout: wall-clock seconds before the process group is killed (the CPU limit is one second more).
        memory_mb: address-space limit.
        file_mb: largest file the program may write.
        isolate_network: try the network namespace (harmless when unavailable).
        keep_dir: when a list is passed, the sandbox directory's path is appended to it (for tests).
    """
    directory = tempfile.mkdtemp(prefix="diversed-sandbox-")
    if keep_dir is not None:
        keep_dir.append(directory)
    try:
        script = os.path.join(directory, "program.py")
        with open(script, "w", encoding="utf-8") as handle:
            handle.write(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": directory, "TMPDIR": directory, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", "program.py"], cwd=directory, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
            preexec_fn=_sandbox_limits(timeout, memory_mb << 20, file_mb << 20, isolate_network))
        timed_out = False
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process)
            stdout, stderr = process.communicate()
        stdout = stdout.decode("utf-8", "replace")[:_OUTPUT_LIMIT]
        stderr = stderr.decode("utf-8", "replace")[:_OUTPUT_LIMIT]
        isolated = isolate_network and "no network namespace" not in stderr
        return SandboxResult(None if timed_out else process.returncode, stdout, stderr, timed_out, isolated)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
