"""Resuming a training run continues it under the configuration it was started with: a checkpoint made under
another one is refused (the trainer for its TrainerConfig, `diversed train --resume` for every option of the run's
recipe, before any model loads), but for a larger step count, another output folder and another checkpoint interval."""

import shutil

import pytest

pytest.importorskip("transformers")

from diversed_ext import cli  # noqa: E402
from diversed_ext.research.checkpoints import CheckpointError, resume_conflicts  # noqa: E402
from helpers import commands_use, gsm8k_file, make_trainer, refuse_models, trainer_llama  # noqa: E402


def reward(example, text):
    return float(len(text) % 3)


def test_the_trainer_refuses_a_checkpoint_of_another_configuration(tmp_path):
    pair = trainer_llama(0), trainer_llama(1)
    run, moved = tmp_path / "run", tmp_path / "moved"
    make_trainer(pair, run, reward, steps=4).train(progress=False, stop_after=2)
    for changed in ({"learning_rate": 0.1}, {"seed": 8}, {"acceptance_coef": 0.5}, {"steps": 3}):
        with pytest.raises(CheckpointError, match=f"made under another configuration \\({next(iter(changed))} "):
            make_trainer(pair, run, reward, **{"steps": 4, **changed}).load_checkpoint()
    shutil.copytree(run, moved)
    longer = make_trainer(pair, moved, reward, steps=6, checkpoint_every=3)
    assert longer.train(resume=True, progress=False)[-1]["step"] == 6


def test_resume_conflicts_allow_only_more_steps_and_where_and_how_often_to_save():
    recorded = {"steps": 4, "lr": 0.1, "output_dir": "a", "checkpoint_every": 2, "threads": 2}
    assert resume_conflicts(recorded, {**recorded, "steps": 9, "output_dir": "b", "checkpoint_every": 1}) == []
    assert resume_conflicts(recorded, {**recorded, "steps": 3, "lr": 0.2}) == ["lr", "steps"]
    assert resume_conflicts(recorded, {key: value for key, value in recorded.items() if key != "threads"}) == [
        "threads"]


def test_train_resume_refuses_other_options_before_any_model_loads(experiment_pair, tmp_path, monkeypatch, capsys):
    commands_use(monkeypatch, experiment_pair)
    run = tmp_path / "run"
    argv = ["train", "--data", gsm8k_file(tmp_path / "gsm8k.jsonl"), "--steps", "2", "--batch-size", "2", "--max-new-tokens", "4",
            "--acceptance-coef", "4", "--seed", "0", "--output-dir", str(run)]
    assert cli.main(argv) == 0
    refuse_models(monkeypatch)
    capsys.readouterr()
    changed = ["--steps", "4", "--acceptance-coef", "0.5", "--lr", "0.1", "--temperature", "0.5", "--seed", "7",
               "--max-draft", "2", "--limit", "3"]
    assert cli.main([*argv, *changed, "--resume"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"diversed: --resume: the checkpoint in {run} was made with --acceptance-coef 4.0 (now "
                            "0.5), --limit unset (now 3), --lr 0.003 (now 0.1), --max-draft 3 (now 2), --seed 0 (now "
                            "7), --temperature 1.0 (now 0.5); "), error
    assert "--steps 2" not in error and "\n" not in error
    assert cli.main([*argv, "--steps", "1", "--resume"]) == 2
    assert "--steps 2 (now 1)" in capsys.readouterr().err
    commands_use(monkeypatch, experiment_pair)
    assert cli.main([*argv, "--steps", "3", "--checkpoint-every", "5", "--resume"]) == 0  # more steps: resumed
    assert "step 3:" in capsys.readouterr().out
