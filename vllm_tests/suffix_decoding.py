"""arctic_inference's suffix tree, which vLLM's ``suffix`` drafter imports, built here for the tests.

PyPI ships arctic_inference as source only, and installing it would register its own vLLM plugin (an entry point in
``vllm.general_plugins``) that changes every engine of the venv. So it is never installed: its suffix-decoding
module alone (pure Python around one C++ extension, ``arctic_inference.suffix_decoding._C``) is built from the
release's source with nanobind, CMake and a C++20 compiler against the Python that runs vLLM, once, into
``~/.cache/diversed_ext/arctic-inference-VERSION``, and the folder goes on the engine processes' path. Without a
distribution's metadata there is no entry point, so no other part of arctic_inference is loaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.0"
NANOBIND = "nanobind==2.9.2"  # the release's own build requirement
# what the suffix drafter imports, copied from the release's source beside the built extension
SOURCES = ("arctic_inference/__init__.py", "arctic_inference/suffix_decoding/__init__.py",
           "arctic_inference/suffix_decoding/cache.py")


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diversed_ext" / f"arctic-inference-{VERSION}"


def _run(*command, **kwargs) -> None:
    subprocess.run([str(part) for part in command], check=True, stdout=sys.stderr, **kwargs)


def build_suffix_decoding(dest: Path | None = None) -> Path:
    """A folder holding ``arctic_inference.suffix_decoding`` built for this Python (once; a complete build is
    reused), to put on ``sys.path``/``PYTHONPATH``."""
    dest = dest or cache_folder()
    marker = dest / ".complete"  # written last: an interrupted build is done again
    if marker.is_file():
        return dest
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        # the sdist (its source, even if a wheel appears); --no-build-isolation: its metadata step imports torch,
        # which this venv has (isolation would download torch for it)
        _run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation",
             "--no-binary", "arctic-inference", "--dest", scratch, f"arctic-inference=={VERSION}")
        _run(sys.executable, "-m", "pip", "install", "-q", "--target", scratch / "nanobind", NANOBIND)
        with tarfile.open(next(scratch.glob("arctic_inference-*.tar.gz"))) as sdist:
            sdist.extractall(scratch, filter="data")
        source = scratch / f"arctic_inference-{VERSION}"
        build = scratch / "build"
        env = dict(os.environ, PYTHONPATH=str(scratch / "nanobind"))
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run("cmake", "-S", source / "csrc" / "suffix_decoding", "-B", build, *generator,
             f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release", env=env)
        _run("cmake", "--build", build, "--parallel", "2", env=env)
        if dest.exists():
            shutil.rmtree(dest)
        for name in SOURCES:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, dest / name)
        for extension in build.glob("_C*.so"):
            shutil.copy2(extension, dest / "arctic_inference" / "suffix_decoding" / extension.name)
    marker.write_text(f"arctic_inference {VERSION} suffix_decoding\n")
    return dest


@contextlib.contextmanager
def suffix_decoding_on_path():
    """Within: the built suffix tree importable here (``sys.path``) and in the processes started from here
    (``PYTHONPATH``); both restored after."""
    folder = str(build_suffix_decoding())
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, saved]))
    sys.path.insert(0, folder)
    try:
        yield folder
    finally:
        sys.path.remove(folder)
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
