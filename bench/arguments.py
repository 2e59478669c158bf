"""Argument types and checks the benchmark scripts share: a mistake on their command lines is one line from argparse
(exit 2) before any model loads or any timing starts, never a traceback at the end of a run."""

from __future__ import annotations

import argparse
import os
import tempfile

import torch


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def torch_device(text: str) -> str:
    """An argparse type: cpu, or cuda[:N] when this torch sees that GPU."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {text!r}")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise argparse.ArgumentTypeError(f"{text}: this torch sees no such GPU")
    return text


def check_writable_file(parser: argparse.ArgumentParser, flag: str, path) -> None:
    """``path``'s folder created and writable, and ``path`` not a folder: checked before the run, not after it."""
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: a folder, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):  # permissions alone do not tell (root, read-only mounts)
            pass
    except OSError as error:
        parser.error(f"{flag} {path}: its folder is not writable ({error.strerror or error})")
