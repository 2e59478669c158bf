"""Running untrusted Python (model completions) in a jail, for the HumanEval reward.

Design (see :func:`run_sandboxed` for what is and is not enforced):

    caller ──spawn──▶ launcher (trusted; ``python -I -S jail_launcher.py``)
                        │ unshare(user + mount + PID + network namespaces)
                        └─fork─▶ PID 1 of the new PID namespace (trusted): builds a read-only root, reaps orphans
                                   └─fork+exec─▶ the untrusted program (PID 2): no capabilities, rlimits,
                                                 source read from a pipe on stdin (no file holds it)

When PID 1 exits, the kernel kills every process left in the namespace (setsid, double-forked, anything), and the
launcher only exits after PID 1 is reaped, so the launcher's exit means the whole tree is gone. The caller reads
stdout/stderr with ``poll`` under a wall-clock deadline and a byte cap, and on the deadline or the cap it asks the
launcher to SIGKILL PID 1 (then SIGKILLs the launcher's process group as a backstop); every wait is bounded, so
:func:`run_sandboxed` returns within ``timeout`` + about half a second whatever the program does.

Where the kernel refuses namespaces, the launcher falls back to a child subreaper that kills the whole tree when the
program ends or the deadline passes, plus the same rlimits, bounded reader and capability drop; the result's
``isolation`` says which mode ran (:func:`sandbox_capabilities` probes it once).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

__all__ = ["SandboxResult", "run_sandboxed", "sandbox_capabilities", "OUTPUT_LIMIT"]


@dataclass
class SandboxResult:
    """What a sandboxed program did."""

    returncode: Optional[int]  # exit code, -N when killed by signal N, None when killed for the timeout / output cap
    stdout: str
    stderr: str
    timed_out: bool
    network_isolated: bool  # True when it ran in its own (empty) network namespace
    isolation: str = "namespaces"  # "namespaces", or "fallback: <why>" (subreaper + rlimits only), or "error: <why>"
    output_truncated: bool = False  # stdout or stderr passed OUTPUT_LIMIT bytes: the jail was killed there
    seconds: float = 0.0  # wall-clock time run_sandboxed took

    @property
    def passed(self) -> bool:
        """Exit status 0 without timeout or output overflow. This alone is NOT proof that a test ran to its end
        (``os._exit(0)`` gives it): callers that score code check a per-run token too, see ``tasks.humaneval_pass``."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


# The trusted launcher, run as a script: it imports nothing from this package.
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail_launcher.py")
OUTPUT_LIMIT = 64 * 1024  # bytes of stdout and of stderr kept; more kills the jail
_KILL_GRACE = 0.4  # seconds between asking the launcher to kill the jail and killing the launcher's group

def run_sandboxed(program: str, *, timeout: float = 5.0, memory_mb: int = 1024, file_mb: int = 16,
                  isolate_network: bool = True, keep_dir: Optional[list] = None,
                  namespaces: bool = True) -> SandboxResult:
    """Run a Python program in a jail that can do as little harm as this module can arrange.

    Enforced with namespaces (the kernel allows unprivileged user namespaces, or the caller has CAP_SYS_ADMIN):
      - its own PID namespace: it cannot signal (or see) any process outside the jail, the caller included; every
        descendant dies when the program ends and at the timeout;
      - its own mount namespace with a fresh read-only root that holds only /usr, /lib*, /bin, /sbin, /etc, the
        Python installation (read-only binds), /dev/{null,zero,random,urandom} and a read-only /proc of the jail;
        the only writable place is the temporary directory (a size-limited tmpfs at the path of a fresh host
        directory, which is the working directory, HOME and TMPDIR). The host's /tmp, /run, /dev/shm, home
        directories and checkouts are not visible, so neither are Unix socket files there;
      - its own network namespace (``isolate_network``): no interfaces but a down loopback, no abstract sockets
        of the host;
      - no capabilities (bounding set cleared, securebits NOROOT locked, no_new_privs), so it cannot remount,
        unmount or ptrace its way out; PID 1 of the jail is not dumpable;
      - rlimits: CPU seconds, address space, size of any file written, no core dumps, 256 open files;
      - the source comes through a pipe on stdin, so no file in the jail holds it.
    Always enforced (fallback included): the wall-clock ``timeout``; at most ``OUTPUT_LIMIT`` bytes of stdout and
    of stderr are read (more kills the program); the environment is replaced by a minimal one and Python runs in
    isolated mode (``-I``); the rlimits and capability drop above; every descendant is killed when the program
    ends or times out (fallback: a child subreaper kills its whole tree).

    NOT enforced: in the fallback (namespaces refused) the program can read and write wherever the user may,
    reach Unix sockets and the network, and signal other processes of the same user (the launcher included,
    which then cannot clean up setsid'd descendants). In both modes: files under /usr, /lib*, /etc and the Python
    installation are readable; there is no seccomp filter (the whole kernel syscall surface is reachable, and
    only the kernel's namespace checks stand between it and the host); RLIMIT_NPROC is not enforced for root, so
    a fork bomb is bounded only by the timeout (and the host's pid limit); memory is bounded per process by
    RLIMIT_AS, not per jail (no cgroup); CPU time is bounded per process.

    Args:
        program: Python source.
        timeout: wall-clock seconds before the jail is killed (the CPU limit is one second more).
        memory_mb: address-space limit per process.
        file_mb: largest file the program may write (the writable tmpfs holds 4x this, at least 16 MiB).
        isolate_network: give it its own network namespace.
        keep_dir: when a list is passed, the sandbox directory's path is appended to it (for tests).
        namespaces: False forces the fallback (for tests and comparison).
    """
    start = time.monotonic()
    deadline = start + timeout
    directory = tempfile.mkdtemp(prefix="diversed-sandbox-")
    if keep_dir is not None:
        keep_dir.append(directory)
    status_read, status_write = os.pipe()
    config = {"dir": directory, "timeout": timeout, "memory": memory_mb << 20, "file": file_mb << 20,
              "net": isolate_network, "ns": namespaces, "status_fd": status_write, "parent": os.getpid(),
              "python": os.path.realpath(sys._base_executable if hasattr(sys, "_base_executable") else
                                         sys.executable),
              "prefixes": sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)})}
    process = None
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", LAUNCHER, "--diversed-launch", json.dumps(config)],
            cwd=directory, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
            pass_fds=(status_write,))
        os.close(status_write)
        status_write = -1
        return _collect(process, program.encode("utf-8"), status_read, start, deadline, isolate_network)
    finally:
        if status_write >= 0:
            os.close(status_write)
        os.close(status_read)
        if process is not None:
            _kill_launcher(process, time.monotonic() + _KILL_GRACE)
        shutil.rmtree(directory, ignore_errors=True)


def _collect(process: subprocess.Popen, source: bytes, status_fd: int, start: float, deadline: float,
             isolate_network: bool) -> SandboxResult:
    """Feed the source, read stdout/stderr/status with a byte cap until the launcher exits or the deadline."""
    out_fd, err_fd = process.stdout.fileno(), process.stderr.fileno()
    streams = {out_fd: bytearray(), err_fd: bytearray(), status_fd: bytearray()}
    limits = {out_fd: OUTPUT_LIMIT, err_fd: OUTPUT_LIMIT, status_fd: 4096}
    stdin_fd = process.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    pending = memoryview(source)
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    poller.register(stdin_fd, select.POLLOUT)
    open_fds = set(streams) | {stdin_fd}
    timed_out = truncated = killed = False
    kill_deadline = None
    while True:
        now = time.monotonic()
        if not killed and now >= deadline:
            timed_out = killed = True
        if killed and kill_deadline is None:
            kill_deadline = now + _KILL_GRACE
            _ask_launcher_to_kill(process)
        if _exited(process) and not (open_fds & set(streams)):
            break
        if kill_deadline is not None and now >= kill_deadline:
            break  # run_sandboxed's finally SIGKILLs the launcher's group (PID 1 included)
        if _exited(process) and kill_deadline is None:
            kill_deadline = now + _KILL_GRACE  # launcher gone: everything is dead, only drain what is buffered
        wait_until = kill_deadline if kill_deadline is not None else deadline
        for fd, event in poller.poll(max(0, min(wait_until - now, 0.1)) * 1000):
            if fd == stdin_fd:
                try:
                    pending = pending[os.write(fd, pending[:65536]):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    process.stdin.close()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                poller.unregister(fd)
                open_fds.discard(fd)
                continue
            room = limits[fd] - len(streams[fd])
            streams[fd] += chunk[:max(room, 0)]
            if len(chunk) > room and fd != status_fd and not killed:
                truncated = killed = True
    if stdin_fd in open_fds:
        process.stdin.close()
    process.stdout.close()
    process.stderr.close()
    status = _parse_status(bytes(streams[status_fd]))
    mode = status.get("mode", "error: the launcher gave no status")
    returncode = os.waitstatus_to_exitcode(int(status["exit"])) if "exit" in status and not killed else None
    stderr = bytes(streams[err_fd]).decode("utf-8", "replace")
    if "error" in status:
        mode = "error: " + status["error"]
        stderr = f"diversed sandbox: {status['error']}\n" + stderr
    return SandboxResult(returncode, bytes(streams[out_fd]).decode("utf-8", "replace"), stderr,
                         timed_out, mode == "namespaces" and isolate_network, mode, truncated,
                         time.monotonic() - start)


def _parse_status(data: bytes) -> dict:
    status = {}
    for line in data.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        status.setdefault(key, value)
    return status


def _ask_launcher_to_kill(process: subprocess.Popen) -> None:
    """SIGTERM to the launcher: it SIGKILLs PID 1 of the jail (its own unreaped child, so no pid reuse), which
    takes the whole PID namespace down, reaps it and exits."""
    if process.returncode is None:  # never reaped before _kill_launcher: the pid is still the launcher's
        os.kill(process.pid, signal.SIGTERM)


def _exited(process: subprocess.Popen) -> bool:
    """Whether the launcher has exited, without reaping it: while it is an unreaped zombie its pid (= its process
    group id) cannot be reused, so the final killpg cannot hit anyone else."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_launcher(process: subprocess.Popen, until: float) -> None:
    """SIGKILL whatever is left of the launcher's process group (PID 1 of the jail is in it, and the program unless it
    called setsid; everything in the jail dies with PID 1), then reap the launcher, waiting at most until ``until``."""
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    while process.poll() is None and time.monotonic() < until:
        time.sleep(0.002)


_CAPABILITIES: Optional[dict] = None


def sandbox_capabilities() -> dict:
    """What this machine's kernel lets the jail enforce (probed once by running an empty program):
    ``{"isolation": "namespaces" | "fallback: ...", "network_isolated": bool, "pid_namespace": bool,
    "read_only_root": bool}``."""
    global _CAPABILITIES
    if _CAPABILITIES is None:
        result = run_sandboxed("import os\nprint(os.getpid(), os.access('/', os.W_OK))\n", timeout=10)
        namespaces = result.isolation == "namespaces"
        _CAPABILITIES = {"isolation": result.isolation, "network_isolated": result.network_isolated,
                         "pid_namespace": namespaces and result.stdout.split()[:1] == ["2"],
                         "read_only_root": namespaces and result.stdout.split()[1:] == ["False"]}
    return dict(_CAPABILITIES)
