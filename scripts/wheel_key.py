"""Prints the key of the extension's wheel that this environment's Python would build: its interpreter tag, torch's
build (version and commit), the build's settings (DIVERSED_CUDA, DIVERSED_FORWARD, the compilers and their flags) and
a digest of every file the wheel is built from. Environments whose keys match can install one wheel, so
``scripts/setup.sh`` builds each key once (the cpu and vllm flavours share CPython 3.11 and torch 2.13.0+cpu)."""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["setup.py", "pyproject.toml", "README.md", "csrc", "diversed_ext"]  # README.md: the wheel's description
BUILT_HERE = {".so", ".pyc"}  # what a build or an import leaves beside the sources
SETTINGS = ["DIVERSED_CUDA", "DIVERSED_FORWARD", "CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS", "CUDA_HOME",
            "TORCH_CUDA_ARCH_LIST"]


def source_files():
    for entry in SOURCES:
        path = ROOT / entry
        if path.is_file():
            yield path
            continue
        yield from sorted(file for file in path.rglob("*") if file.is_file() and file.suffix not in BUILT_HERE
                          and "__pycache__" not in file.parts)


def wheel_key() -> str:
    digest = hashlib.sha256()
    for file in source_files():
        content = file.read_bytes()
        digest.update(f"{file.relative_to(ROOT)}\0{len(content)}\0".encode())
        digest.update(content)
    for name in SETTINGS:
        digest.update(f"{name}={os.environ.get(name)}\0".encode())
    interpreter = f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"
    return f"{interpreter}-torch{torch.__version__}-{torch.version.git_version[:12]}-{digest.hexdigest()[:16]}"


if __name__ == "__main__":
    print(wheel_key())
