"""The trusted half of the code sandbox (see sandbox.py): the launcher that builds the jail and runs the program.

Run as ``python -I -S -B jail_launcher.py --diversed-launch CONFIG`` by
:func:`diversed_ext.research.sandbox.run_sandboxed`, never imported by the package: only the standard library, so
nothing outside the interpreter can change what it does. It unshares user, mount, PID and network namespaces, forks
PID 1 of the new PID namespace, which builds a read-only root, drops every capability and forks the untrusted
program; when PID 1 exits the kernel kills the rest.
"""

import ctypes
import errno
import json
import os
import resource
import signal
import sys
import time

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
