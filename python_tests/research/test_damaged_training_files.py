"""Damaged files of training give one clear error naming the file, never a traceback or a silent wrong result:
checkpoints (a planted pickle payload never runs), the training log and a GSM8K file that is not what it says."""

import os
import pickle

import pytest
import torch

from diversed_ext.research.checkpoints import CheckpointError, TrainingLog, load_checkpoint
from diversed_ext.research.tasks import load_gsm8k


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PLANTED",))


def test_planted_pickle_payload_never_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "checkpoint.pt"
    torch.save({"head": Payload()}, str(path))
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(str(path))
    assert not (tmp_path / "PLANTED").exists()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04garbage", pickle.dumps({"not": "a checkpoint"})[:10]])
def test_unreadable_checkpoints_name_the_file(tmp_path, content):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="checkpoint.pt"):
        load_checkpoint(str(path))


def test_foreign_checkpoint_names_what_it_lacks(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"step": 3}, str(path))
    with pytest.raises(CheckpointError, match="lacks head"):
        load_checkpoint(str(path))


def test_torn_last_log_line_is_dropped_and_a_bad_middle_line_is_named(tmp_path):
    path = tmp_path / "train_log.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    log = TrainingLog(str(path))
    assert [record["step"] for record in log.read()] == [1, 2]
    log.truncate(1)
    assert [record["step"] for record in log.read()] == [1]
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(CheckpointError, match="train_log.jsonl:2"):
        log.read()


def test_gsm8k_loader_rejects_a_gzip_that_is_not_one(tmp_path):
    path = tmp_path / "fake.jsonl.gz"
    path.write_bytes(b"plain text, not gzip")
    with pytest.raises(ValueError, match="cannot be read"):
        load_gsm8k(str(path))
