"""What a training run leaves on disk: the checkpoint it resumes from and its JSONL log, both written so that a run
killed at any moment leaves a readable file behind."""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zipfile
from typing import Optional

import torch

from .._atomic import atomic_path

CHECKPOINT_NAME = "checkpoint.pt"
LOG_NAME = "train_log.jsonl"
CHECKPOINT_KEYS = ("head", "optimizer", "scheduler", "step", "history", "rng", "config")
# What a resumed run may change: where it writes and how often it saves (nothing of the head it trains). Its steps
# may grow, the schedule then spanning the new count; everything else stays as the checkpoint's run had it.
FREE_ON_RESUME = ("output_dir", "checkpoint_every")
GROWS_ON_RESUME = "steps"


class CheckpointError(ValueError):
    """A checkpoint or log that cannot be resumed from; the message names the file and what is wrong."""


def save_checkpoint(path: str, state: dict) -> None:
    """Write a checkpoint (tensors and plain data) atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path) as staging:
        torch.save(state, staging)


def load_checkpoint(path: str) -> Optional[dict]:
    """The checkpoint at ``path``, or None when there is none.

    Only tensors and plain data are read (``weights_only``): a file that would run code when unpickled is refused,
    like a truncated, empty or foreign one, with a :class:`CheckpointError` naming it."""
    if not os.path.isfile(path):
        return None
    try:
        with warnings.catch_warnings():
            # torch.save writes protocol 2; a file in another protocol is foreign, and torch's note that its
            # weights-only reader may not know every instruction adds nothing: what it cannot read is refused below.
            warnings.filterwarnings("ignore", message=r"Detected pickle protocol", category=UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError, ValueError, zipfile.BadZipFile) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({reason})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a training checkpoint (holds a {type(state).__name__})")
    missing = [key for key in CHECKPOINT_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{path}: not a training checkpoint (lacks {', '.join(missing)})")
    return state


def resume_conflicts(recorded: dict, current: dict) -> list[str]:
    """The names whose value in ``current`` (a resumed run's settings) differs from ``recorded`` (those of the run
    that wrote the checkpoint), but for :data:`FREE_ON_RESUME` and a larger :data:`GROWS_ON_RESUME`."""
    changed = []
    for name in sorted(set(recorded) | set(current)):
        before, now = recorded.get(name), current.get(name)
        if name in FREE_ON_RESUME or before == now:
            continue
        if name == GROWS_ON_RESUME and isinstance(before, int) and isinstance(now, int) and now > before:
            continue
        changed.append(name)
    return changed


class TrainingLog:
    """One JSON record per training step, appended as the run goes."""

    def __init__(self, path: str):
        self.path = path

    def append(self, record: dict) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        """The records so far. A torn last line (a run killed mid-write) is dropped; a bad line before it is a
        :class:`CheckpointError` naming the file and line."""
        if not os.path.isfile(self.path):
            return []
        with open(self.path, encoding="utf-8", errors="replace") as handle:
            lines = [(number, line) for number, line in enumerate(handle, 1) if line.strip()]
        records = []
        for index, (number, line) in enumerate(lines):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    raise ValueError("not a step record")
            except ValueError as error:
                if index == len(lines) - 1:
                    break  # torn by a kill during the append: that step will be logged again
                raise CheckpointError(f"{self.path}:{number}: not a training-log record ({error})") from None
            records.append(record)
        return records

    def truncate(self, step: int) -> None:
        """After a resume, drop the records written past the checkpoint's step (they will be written again)."""
        kept = [record for record in self.read() if record["step"] <= step]
        with atomic_path(self.path) as staging, open(staging, "w") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in kept)
