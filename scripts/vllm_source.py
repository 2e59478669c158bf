"""Unpacks a vLLM release's Python source (``vllm/**.py``, about 50 MB) from its PyPI wheel, for the seam check and
its record (``diversed_ext/vllm_plugin/seams.py``), without installing it; prints the folder holding ``vllm/``.

    python scripts/vllm_source.py VERSION [DEST]     (default DEST: ~/.cache/diversed_ext/vllm-VERSION)

The wheel (hundreds of MB, ``pip download --no-deps`` with this Python's pip) is deleted once unpacked; a complete
copy is reused. Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

# The whole download: hundreds of MB at 1 MB/s, and less than the tests' pytest-timeout of 900 s (pyproject.toml), so
# a stalled download fails here, saying what to do, rather than as a bare test timeout.
DOWNLOAD_TIMEOUT_SECONDS = 600
# pip's own limit on one stalled connection (its default: 15 s), retried by pip.
SOCKET_TIMEOUT_SECONDS = 60


def source_cache(version: str) -> str:
    """Where :func:`fetch_source` keeps a release's source by default: ``$XDG_CACHE_HOME/diversed_ext/vllm-VERSION``
    (``~/.cache`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "diversed_ext", f"vllm-{version}")


def fetch_source(version: str, dest: str | None = None) -> str:
    """vLLM ``version``'s Python source unpacked into ``dest`` (default :func:`source_cache`), once. Returns the
    folder, a root for ``seams.compare``."""
    dest = dest or source_cache(version)
    marker = os.path.join(dest, ".complete")  # written last: an interrupted unpacking is done again
    if os.path.isfile(marker):
        return dest
    wheels = os.path.join(dest, "wheel")
    os.makedirs(wheels, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--timeout", str(SOCKET_TIMEOUT_SECONDS),
               "--dest", wheels, f"vllm=={version}"]
    try:
        subprocess.run(command, check=True, stdout=sys.stderr, timeout=DOWNLOAD_TIMEOUT_SECONDS)  # stdout: the folder
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        failure = (f"exited with status {error.returncode}" if isinstance(error, subprocess.CalledProcessError)
                   else f"did not finish within {DOWNLOAD_TIMEOUT_SECONDS} s")
        raise RuntimeError(
            f"pip download vllm=={version} {failure} (pip's messages are on stderr). Fetching the wheel needs PyPI, or "
            f"an index set by PIP_INDEX_URL; or unpack the wheel's vllm/**.py under {dest} yourself and create the "
            f"file {marker}. Then run again.") from error
    wheel_path = next(os.path.join(wheels, name) for name in sorted(os.listdir(wheels)) if name.endswith(".whl"))
    with zipfile.ZipFile(wheel_path) as wheel:
        wheel.extractall(dest, [name for name in wheel.namelist()
                                if name.startswith("vllm/") and name.endswith(".py")])
    for name in os.listdir(wheels):
        os.remove(os.path.join(wheels, name))
    os.rmdir(wheels)
    with open(marker, "w", encoding="utf-8") as out:
        out.write(f"vllm {version}\n")
    return dest


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 3:
        sys.exit("usage: python scripts/vllm_source.py VERSION [DEST]")
    print(fetch_source(*sys.argv[1:]))
