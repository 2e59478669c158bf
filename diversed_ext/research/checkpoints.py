"""What a training run leaves on disk: the checkpoint it resumes from and its JSONL log, both written so that a run
killed at any moment leaves a readable file behind."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

CHECKPOINT_NAME = "checkpoint.pt"
LOG_NAME = "train_log.jsonl"


def _write_atomically(path: str, write) -> None:
    """``write(handle)`` into a temporary file beside ``path``, flushed to disk, then renamed over ``path``: a reader
    sees the old file or the new one, never a torn one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def save_checkpoint(path: str, state: dict) -> None:
    """Write a checkpoint (tensors and plain data) atomically."""
    _write_atomically(path, lambda handle: torch.save(state, handle))


def load_checkpoint(path: str) -> Optional[dict]:
    """The checkpoint at ``path``, or None when there is none."""
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


class TrainingLog:
    """One JSON record per training step, appended as the run goes."""

    def __init__(self, path: str):
        self.path = path

    def append(self, record: dict) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def truncate(self, step: int) -> None:
        """After a resume, drop the records written past the checkpoint's step (they will be written again)."""
        kept = [record for record in self.read() if record["step"] <= step]
        _write_atomically(self.path, lambda handle: handle.writelines((json.dumps(r) + "\n").encode() for r in kept))
