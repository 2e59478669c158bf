"""Running untrusted Python (model completions) in a jail, for the HumanEval reward.

Design (see :func:`run_sandboxed` for what is and is not enforced):

    caller ──spawn──▶ launcher (trusted; ``python -I -S`` running this file)
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

import ctypes
import errno
import json
import os
import resource
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


OUTPUT_LIMIT = 64 * 1024  # bytes of stdout and of stderr kept; more kills the jail
_KILL_GRACE = 0.4  # seconds between asking the launcher to kill the jail and killing the launcher's group

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 1, 2, 4
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP = 1, 4, 24
_PR_SET_SECUREBITS, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 28, 36, 38
_SECUREBITS_LOCKED_NOROOT = 0xEF  # NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE (+ locks), KEEP_CAPS locked off
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_MOUNT_SETATTR = 442  # the same on every architecture
_STATVFS_KEEP = {os.ST_NOSUID: _MS_NOSUID, os.ST_NODEV: _MS_NODEV, os.ST_NOEXEC: _MS_NOEXEC,
                 os.ST_NOATIME: 1024, os.ST_NODIRATIME: 2048, os.ST_RELATIME: 1 << 21}


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
            [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), "--diversed-launch", json.dumps(config)],
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


# ------------------------------------------------------------------------------------------- the launcher (trusted)
# Runs as ``python -I -S -B sandbox.py --diversed-launch CONFIG``: only the standard library, no package imports.

def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.syscall.restype = ctypes.c_long
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    encode = lambda value: value.encode() if isinstance(value, str) else value  # noqa: E731
    _check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def _bind_read_only(libc, source: str, target: str) -> None:
    _mount(libc, source, target, None, _MS_BIND | _MS_REC)

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                    ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, 0, 0)
    if libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, target.encode(), _AT_RECURSIVE, ctypes.byref(attr),
                    ctypes.sizeof(attr)) == 0:
        return
    # Older kernel: read-only remount of the top mount only, keeping the flags a user namespace may not clear.
    kept = os.statvfs(target).f_flag
    flags = sum(ms for st, ms in _STATVFS_KEEP.items() if kept & st)
    _mount(libc, None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | flags)


def _build_root(libc, config: dict) -> None:
    """In the new mount namespace: a tmpfs root holding read-only binds of what Python needs, the jail's writable
    tmpfs at the host directory's path, a fresh /proc; pivot into it and drop the old root."""
    new_root = config["dir"]
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount(libc, "diversed-root", new_root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    inside = lambda path: os.path.join(new_root, path.lstrip("/"))  # noqa: E731
    bound = []
    for path in ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc", *config["prefixes"],
                 os.path.dirname(config["python"])]:
        if not os.path.lexists(path) or any(path == b or path.startswith(b + "/") for b in bound):
            continue
        if os.path.islink(path) and os.path.dirname(path) == "/":
            os.symlink(os.readlink(path), inside(path))
            continue
        path = os.path.realpath(path)
        if any(path == b or path.startswith(b + "/") for b in bound):
            continue
        os.makedirs(inside(path), exist_ok=True)
        _bind_read_only(libc, path, inside(path))
        bound.append(path)
    os.makedirs(inside("/dev"))
    for device in ("null", "zero", "random", "urandom"):
        open(inside("/dev/" + device), "w").close()
        _mount(libc, "/dev/" + device, inside("/dev/" + device), None, _MS_BIND)
    os.makedirs(inside("/proc"))
    _mount(libc, "proc", inside("/proc"), "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY)
    os.makedirs(inside("/tmp"), mode=0o755)
    work = inside(config["dir"])
    os.makedirs(work, mode=0o755)
    size = max(4 * config["file"], 16 << 20)
    _mount(libc, "diversed-work", work, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},nr_inodes=4096,mode=0755")
    os.chdir(new_root)
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, "pivot_root: unknown architecture")
    _check(libc.syscall(number, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", _MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(libc, None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _drop_privileges(libc) -> None:
    """No capabilities now or after exec (also for uid 0), no way to gain any."""
    libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS_LOCKED_NOROOT, 0, 0, 0)  # fails without CAP_SETPCAP: then no caps
    for cap in range(64):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _exec_program(libc, config: dict, source_fd: int) -> None:
    """In the forked child that becomes the untrusted program: limits, no privileges, exec Python on the pipe."""
    try:
        os.dup2(source_fd, 0)
        os.close(source_fd)
        if not os.path.isdir(config["dir"]):  # fallback mode: the host directory itself
            raise OSError(errno.ENOENT, config["dir"])
        os.chdir(config["dir"])
        cpu = max(1, int(config["timeout"]) + 1)
        for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, config["memory"]),
                             (resource.RLIMIT_FSIZE, config["file"]), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_NPROC, 0)):
            resource.setrlimit(limit, (value, value))
        _drop_privileges(libc)
        env = {"PATH": "/usr/bin:/bin", "HOME": config["dir"], "TMPDIR": config["dir"], "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        os.execve(config["python"], [config["python"], "-I", "-B", "-"], env)
    except BaseException as error:  # noqa: BLE001 - report and never return into the launcher's code
        os.write(2, f"diversed sandbox: could not start the program: {error}\n".encode())
    os._exit(127)


def _kill_children(deadline: float) -> None:
    """Fallback mode: SIGKILL every child (orphans reparent to us, the subreaper) until none is left."""
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/self/task/{os.getpid()}/children") as handle:
                children = [int(pid) for pid in handle.read().split()]
        except OSError:
            children = []
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.002)


def _launch(config: dict) -> int:
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != config["parent"]:
        return 1
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)  # the untrusted program never gets it
    report = lambda line: os.write(status_fd, (line + "\n").encode())  # noqa: E731
    source = sys.stdin.buffer.read()
    mode = "namespaces"
    if config["ns"]:
        flags = _CLONE_NEWNS | _CLONE_NEWPID | (_CLONE_NEWNET if config["net"] else 0)
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(_CLONE_NEWUSER | flags) == 0:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as handle:
                    handle.write(text)
        elif libc.unshare(flags) != 0:  # no user namespaces, but maybe CAP_SYS_ADMIN
            mode = f"fallback: the kernel refuses namespaces ({os.strerror(ctypes.get_errno())})"
    else:
        mode = "fallback: namespaces=False"
    report(f"mode {mode}")
    if mode != "namespaces":
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(write_end)
        if mode != "namespaces":
            os.setsid()
            _exec_program(libc, config, read_end)
        # PID 1 of the jail.
        try:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
            _build_root(libc, config)
            program = os.fork()
            if program == 0:
                _exec_program(libc, config, read_end)
            os.close(read_end)
            while True:
                pid, status = os.waitpid(-1, 0)
                if pid == program:
                    report(f"exit {status}")
                    os._exit(0)  # the kernel now kills everything else in the namespace
        except BaseException as error:  # noqa: BLE001
            report(f"error {type(error).__name__}: {error}")
            os._exit(125)
    os.close(read_end)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    try:
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(source)
    except BrokenPipeError:
        pass
    if mode == "namespaces":
        while True:
            try:
                _, status = os.waitpid(child, 0)
                return 0
            except InterruptedError:
                continue
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            report(f"exit {status}")
            break
    _kill_children(time.monotonic() + 0.3)
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--diversed-launch":
    sys.exit(_launch(json.loads(sys.argv[2])))
