"""The sandbox that runs untrusted completions: each limit it sets, and each way out of it it closes, has a test here.

Each test bounds its own waits (timeouts of 2-3 s, returns asserted within timeout + RETURN_SLACK_SECONDS) so that a
busy 2-core machine slows it down without making it hang or flake. Tests that need namespaces skip, with the reason,
only when the kernel refuses them; the fallback (namespaces=False) is tested for what it still enforces.
"""

import os
import resource
import secrets
import socket
import subprocess
import sys
import time

import pytest

from diversed_ext.research.sandbox import OUTPUT_LIMIT, run_sandboxed, sandbox_capabilities
from diversed_ext.research.tasks import humaneval_pass, humaneval_program

MODES = [pytest.param(True, id="namespaces"), pytest.param(False, id="fallback")]
# How long after its timeout the sandbox may return: starting and tearing down a jail takes over 0.1 s idle and
# seconds on a busy machine. The programs timed below would run 60 s or forever, and the failures seen returned after
# 15 s, so a timeout that is not enforced still shows.
RETURN_SLACK_SECONDS = 5.0


def require_namespaces():
    capabilities = sandbox_capabilities()
    if capabilities["isolation"] != "namespaces":
        pytest.skip(f"the kernel refuses the namespaces this test needs ({capabilities['isolation']})")
    return capabilities


def skip_unless_namespaces(namespaces):
    if namespaces:
        require_namespaces()


def processes_with(marker):
    """Host pids whose command line holds ``marker`` (the sandbox's descendants that outlived it)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            pass
    return found


# ---------------------------------------------------------------------------------------------------- sandbox

def test_sandbox_runs_a_program_and_reports_failure():
    assert run_sandboxed("print('hi')").passed
    result = run_sandboxed("raise SystemExit(3)")
    assert result.returncode == 3 and not result.passed


def test_sandbox_kills_an_infinite_loop_within_the_timeout():
    start = time.perf_counter()
    result = run_sandboxed("while True:\n    pass\n", timeout=1.0)
    assert result.timed_out and not result.passed
    assert time.perf_counter() - start < 5.0


def test_sandbox_kills_a_sleeping_program():
    # CPU limits do not stop a sleeper: only the wall-clock timeout does.
    start = time.perf_counter()
    assert run_sandboxed("import time\ntime.sleep(60)", timeout=1.0).timed_out
    assert time.perf_counter() - start < 5.0


def test_sandbox_writes_stay_in_its_temporary_directory(tmp_path, monkeypatch):
    """Relative paths, HOME and TMPDIR all point into a fresh directory that is deleted afterwards. (Absolute paths
    elsewhere: see test_writes_outside_the_jail_directory_are_refused.)"""
    program = ("import os, tempfile\n"
               "open('relative.txt', 'w').write('x')\n"
               "open(os.path.expanduser('~/home.txt'), 'w').write('x')\n"
               "open(os.path.join(tempfile.gettempdir(), 'tmp.txt'), 'w').write('x')\n"
               "print(os.getcwd())\n")
    directories = []
    monkeypatch.chdir(tmp_path)  # the caller's cwd: a relative write must not land here
    result = run_sandboxed(program, keep_dir=directories)
    assert result.passed, result.stderr
    assert result.stdout.strip() == directories[0]
    assert not os.path.exists(directories[0])  # removed afterwards, with everything written into it
    assert list(tmp_path.iterdir()) == []
    assert not os.path.exists(os.path.expanduser("~/home.txt"))


def test_sandbox_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:1")
    monkeypatch.setenv("DIVERSED_SECRET", "s3cret")
    result = run_sandboxed("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated)")
    assert "HTTPS_PROXY" not in result.stdout and "DIVERSED_SECRET" not in result.stdout
    assert result.stdout.split()[-1] == "1"


def test_sandbox_limits_file_size_and_memory():
    big_file = run_sandboxed("open('big', 'wb').write(b'0' * (64 << 20))", file_mb=1)
    assert not big_file.passed
    big_memory = run_sandboxed("x = bytearray(4 << 30)", memory_mb=512)
    assert not big_memory.passed and "MemoryError" in big_memory.stderr


def test_sandbox_has_no_network_when_namespaces_are_available():
    result = run_sandboxed("import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=2)\n", timeout=5)
    if not result.network_isolated:
        pytest.skip("this kernel refuses unprivileged network namespaces; the sandbox only scrubs proxies here")
    assert not result.passed


# ---------------------------------------------------------------------------------------------------- descendants

def _double_fork(marker, seconds):
    """A program whose setsid'd grandchild holds stdout/stderr and lives ``seconds`` (its argv carries ``marker``)."""
    return ("import os, sys\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep({seconds})', {marker!r}])\n"
            "    os._exit(0)\n"
            "os.wait()\n"
            "print('parent done', flush=True)\n")


@pytest.mark.parametrize("namespaces", MODES)
def test_setsid_grandchild_holding_stdout_does_not_block_and_dies(namespaces):
    """Seen: returned after 15 s with timeout=2 (and blocked past 40 s with a long sleep), the grandchild lived on."""
    skip_unless_namespaces(namespaces)
    marker = "diversed-marker-" + secrets.token_hex(8)
    start = time.monotonic()
    result = run_sandboxed(_double_fork(marker, 60), timeout=2.0, namespaces=namespaces)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0 + RETURN_SLACK_SECONDS, elapsed
    assert result.passed and "parent done" in result.stdout, result
    assert processes_with(marker) == []
    time.sleep(0.3)
    assert processes_with(marker) == []


@pytest.mark.parametrize("namespaces", MODES)
def test_timeout_kills_the_whole_tree_and_returns_in_time(namespaces):
    skip_unless_namespaces(namespaces)
    marker = "diversed-marker-" + secrets.token_hex(8)
    program = _double_fork(marker, 60) + "import time\ntime.sleep(60)\n"
    start = time.monotonic()
    result = run_sandboxed(program, timeout=2.0, namespaces=namespaces)
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.passed and result.returncode is None
    assert 1.5 < elapsed < 2.0 + RETURN_SLACK_SECONDS, elapsed
    assert processes_with(marker) == []


def test_pid_namespace_children_see_only_the_jail():
    require_namespaces()
    result = run_sandboxed("import os\nprint(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert result.passed, result.stderr
    pid, visible = result.stdout.split(" ", 1)
    assert pid == "2" and visible.strip() == "[1, 2]"


# ---------------------------------------------------------------------------------------------------- output

FLOOD = "import os\nchunk = b'x' * 65536\nwhile True:\n    os.write(1, chunk)\n    os.write(2, chunk)\n"


@pytest.mark.parametrize("namespaces", MODES)
def test_output_flood_is_capped_while_read(namespaces):
    """Seen: 20.6 s and 6.6 GB of the caller's memory with the default timeout; now the reader stops at the cap."""
    skip_unless_namespaces(namespaces)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, a high-water mark
    start = time.monotonic()
    result = run_sandboxed(FLOOD, timeout=3.0, namespaces=namespaces)
    elapsed = time.monotonic() - start
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert result.output_truncated and not result.passed
    assert len(result.stdout) <= OUTPUT_LIMIT and len(result.stderr) <= OUTPUT_LIMIT
    assert elapsed < 3.0 + RETURN_SLACK_SECONDS, elapsed
    assert grown_mib < 32, grown_mib


def test_output_below_the_cap_is_kept_whole():
    result = run_sandboxed("import sys\nsys.stdout.write('y' * 60000)\nsys.stderr.write('z' * 60000)\n")
    assert result.passed and result.stdout == "y" * 60000 and result.stderr == "z" * 60000


# ---------------------------------------------------------------------------------------------------- pass token

PROBLEM = {
    "task_id": "Toy/0", "entry_point": "add",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
}


@pytest.mark.parametrize("completion", [
    "    import os; os._exit(0)\n",  # exits inside the check, before the first assert
    "    import sys; sys.exit(0)\n",
    "    raise SystemExit(0)\n",
    "    import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n",
    "import os\nos._exit(0)\ndef add(a, b):\n    return a - b\n",  # exits at import time
    "import atexit, os\natexit.register(os._exit, 0)\ndef add(a, b):\n    return a - b\n",
    "import atexit, os\ndef add(a, b):\n    atexit.register(os._exit, 0)\n    return a - b\n",
    "import sys\nsys.excepthook = lambda *a: None\ndef add(a, b):\n    return a - b\n",
    "import sys, threading\nthreading.excepthook = sys.excepthook = lambda *a: sys.exit(0)\n"
    "def add(a, b):\n    return a - b\n",
], ids=["os._exit", "sys.exit", "SystemExit", "SIGKILL-self", "exit-at-import", "atexit-import", "atexit-call",
        "excepthook", "excepthook-exit"])
def test_exit_tricks_do_not_pass(completion):
    """Before, exit status 0 was a pass: each of these scored 1.0 with a wrong body."""
    assert humaneval_pass(PROBLEM, completion, timeout=3.0) == 0.0


def test_correct_completion_passes_and_token_is_printed_after_the_check():
    assert humaneval_pass(PROBLEM, "    return a + b\n", timeout=3.0) == 1.0
    program = humaneval_program(PROBLEM, "    return a + b\n", "feedbeef")
    assert program.rstrip().endswith("check(add)\nprint('feedbeef', flush=True)")
    assert "feedbeef" not in humaneval_program(PROBLEM, "    return a + b\n")


def test_program_cannot_read_its_own_source():
    """The pass token is in the program text; the text must not be readable as a file, argv, env or stdin."""
    require_namespaces()
    secret = "SECRET-" + secrets.token_hex(8)
    program = ("import os, sys\n"
               "seen = [sys.stdin.read(), repr(sys.argv), repr(dict(os.environ)), repr(globals().get('__file__'))]\n"
               "seen += [open('/proc/self/cmdline', 'rb').read().decode('latin-1')]\n"
               "for root, dirs, files in os.walk('/'):\n"
               "    if root.startswith(('/proc', '/usr', '/lib', '/etc', '/root', '/sys')): dirs[:] = []; continue\n"
               "    for name in files:\n"
               "        try: seen.append(open(os.path.join(root, name), errors='replace').read(1 << 20))\n"
               "        except OSError: pass\n"
               f"needle = {secret[::-1]!r}[::-1]\n"  # the source holds the secret only reversed, and in the comment
               "print('found' if any(needle in text for text in seen) else 'clean', len(seen))\n"
               f"# {secret}\n")
    result = run_sandboxed(program, timeout=5.0)
    assert result.passed, result.stderr
    assert result.stdout.startswith("clean "), result.stdout


# ---------------------------------------------------------------------------------------------------- signals

def test_cannot_signal_processes_outside_the_jail():
    """Seen: the program killed the caller (exit 137) and other processes of the same user."""
    require_namespaces()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    # The caller's parent too, unless it is the host's init (pytest started by PID 1, or orphaned): inside the jail PID 1
    # is the jail's own launcher, which a SIGKILL from its namespace leaves alone without an error.
    outside = [victim.pid, os.getpid()] + ([os.getppid()] if os.getppid() != 1 else [])
    try:
        program = ("import os, signal\n"
                   f"for pid in {tuple(outside)}:\n"
                   "    try:\n"
                   "        os.kill(pid, signal.SIGKILL)\n"
                   "        print('killed', pid)\n"
                   "    except OSError as error:\n"
                   "        print('refused', pid, type(error).__name__)\n"
                   f"os.killpg({os.getpgid(0)}, signal.SIGKILL) if False else None\n"
                   "os.kill(-1, signal.SIGKILL)\n")  # every process it may signal: only the jail's
        result = run_sandboxed(program, timeout=3.0)
        time.sleep(0.2)
        assert victim.poll() is None, "the victim outside the jail was killed"
        assert "killed" not in result.stdout and result.stdout.count("refused") == len(outside), result
    finally:
        victim.kill()
        victim.wait(5)


def test_jail_init_and_its_status_pipe_are_out_of_reach():
    """PID 1 of the jail reports the exit status on a pipe: the program must not forge it through /proc/1/fd."""
    require_namespaces()
    program = ("import os, sys\n"
               "for n in os.listdir('/proc/1/fd'):\n"
               "    try:\n"
               "        os.write(os.open('/proc/1/fd/' + n, os.O_WRONLY), b'exit 0\\n')\n"
               "        print('opened', n, flush=True)\n"
               "    except OSError as error:\n"
               "        print('refused', n, type(error).__name__, flush=True)\n"
               "os._exit(3)\n")
    result = run_sandboxed(program, timeout=3.0)
    assert result.returncode == 3 and "opened" not in result.stdout and "refused" in result.stdout, result


# ---------------------------------------------------------------------------------------------------- sockets

def test_cannot_connect_to_host_unix_sockets(tmp_path):
    """Seen: the program connected to a Unix socket at a filesystem path served by another process."""
    require_namespaces()
    path = str(tmp_path / "host.sock")
    abstract = "\0diversed-" + secrets.token_hex(6)
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(4)
        server.setblocking(False)
        servers.append(server)
    try:
        program = ("import socket\n"
                   f"for address in ({path!r}, {abstract!r}):\n"
                   "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                   "    try:\n"
                   "        s.connect(address)\n"
                   "        print('connected')\n"
                   "    except OSError as error:\n"
                   "        print('refused', type(error).__name__)\n")
        result = run_sandboxed(program, timeout=3.0)
        assert result.passed and result.stdout.count("refused") == 2, result
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in servers:
            server.close()


def test_host_runtime_directories_are_hidden():
    require_namespaces()
    directories = []
    result = run_sandboxed("import os\nprint([p for p in ('/run', '/var/run', '/dev/shm', '/home', '/work')"
                           " if os.path.exists(p) and os.listdir(p)])\nprint(os.listdir('/tmp'))\n",
                           keep_dir=directories)
    assert result.passed, result
    others, tmp = result.stdout.splitlines()
    assert others == "[]" and tmp == repr([os.path.basename(directories[0])])  # /tmp holds only the jail's own


# ---------------------------------------------------------------------------------------------------- filesystem

def test_writes_outside_the_jail_directory_are_refused(tmp_path):
    """Seen: the program could write anywhere the user may write."""
    require_namespaces()
    here = os.path.dirname(os.path.abspath(__file__))
    targets = [str(tmp_path / "outside.txt"), f"/tmp/diversed-escape-{secrets.token_hex(6)}",
               os.path.join(here, f"diversed-escape-{secrets.token_hex(6)}"),
               os.path.join(os.path.dirname(os.path.realpath(sys.executable)), f"escape-{secrets.token_hex(6)}"),
               "/etc/diversed-escape", "/usr/diversed-escape"]
    program = ("import ctypes, os\n"
               f"for target in {targets!r}:\n"
               "    try:\n"
               "        os.makedirs(os.path.dirname(target), exist_ok=True)\n"
               "        open(target, 'w').write('x')\n"
               "        print('wrote', target)\n"
               "    except OSError as error:\n"
               "        print('refused', type(error).__name__)\n"
               "open('inside.txt', 'w').write('fine')\n"
               "libc = ctypes.CDLL(None, use_errno=True)\n"
               "print('remount', libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())\n"
               "print('umount', libc.umount2(os.getcwd().encode(), 2), ctypes.get_errno())\n"
               "print([line for line in open('/proc/self/status') if line.startswith('CapEff')])\n")
    try:
        result = run_sandboxed(program, timeout=3.0)
        assert result.passed, result.stderr
        assert "wrote" not in result.stdout and result.stdout.count("refused") == len(targets), result.stdout
        assert "remount -1 1\n" in result.stdout and "umount -1 1\n" in result.stdout  # EPERM: no capabilities
        assert "CapEff:\\t0000000000000000" in result.stdout
        assert not any(os.path.exists(target) for target in targets)
    finally:
        for target in targets:
            if os.path.isfile(target):
                os.remove(target)


def test_fallback_reports_what_it_does_not_enforce():
    result = run_sandboxed("print('hi')", namespaces=False)
    assert result.passed and result.isolation.startswith("fallback") and not result.network_isolated
    capabilities = sandbox_capabilities()
    assert set(capabilities) == {"isolation", "network_isolated", "pid_namespace", "read_only_root"}
    assert capabilities["pid_namespace"] == capabilities["read_only_root"] == (capabilities["isolation"] == "namespaces")
