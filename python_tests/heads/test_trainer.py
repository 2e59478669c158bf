"""Trainer: the head moves the right way on synthetic pairs, resume is exact, a step runs on each device (CUDA where a
GPU is visible), and 2-process DDP runs on CPU."""

import math
import os

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.head import EnsembleHead  # noqa: E402
from diversed_ext.research.objective import KL_GRID_POINTS  # noqa: E402
from diversed_ext.research.teacher_forcing import fidelity_gap, mixture_divergence, teacher_forced_tokens  # noqa: E402
from diversed_ext.research.trainer import TrainerConfig, warmup_cosine  # noqa: E402
from helpers import (TESTS_ROOT, make_trainer, models_on_device, prompts_and_examples,  # noqa: E402
                     trainer_llama)


@pytest.fixture(scope="module")
def pair():
    return trainer_llama(0), trainer_llama(1)


def test_teacher_forced_tokens_match_a_fresh_forward(pair):
    target, draft = pair
    prompts, completions = [[1, 2, 3], [4]], [[5, 6], []]
    batch = teacher_forced_tokens(target, draft, prompts, completions)
    assert batch.mask.tolist() == [[True, True], [False, False]]
    logits = target(torch.tensor([[1, 2, 3, 5]])).logits[0, 2:4].float()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor([[5], [6]])).squeeze(-1)
    torch.testing.assert_close(batch.target_logprob[0], expected, rtol=1e-4, atol=1e-4)


def test_fidelity_gap_against_float64(pair):
    target, draft = pair
    batch = teacher_forced_tokens(target, draft, [[1, 2, 3]], [[5, 6, 7]], temperature=0.7)
    input_ids = torch.tensor([[1, 2, 3, 5, 6]])
    target_logits = target(input_ids).logits[0, 2:5].double() / 0.7
    draft_logits = draft(input_ids).logits[0, 2:5].double() / 0.7
    log_p, q = target_logits.log_softmax(-1), draft_logits.softmax(-1)
    expected = (q * log_p).sum(-1) - (log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(batch.fidelity_gap[0].double(), expected, rtol=1e-4, atol=1e-4)
    assert torch.all(fidelity_gap(target_logits, target_logits).abs() < 1e-5)  # q = p: mixing costs nothing
    masked = torch.tensor([[0.0, float("-inf"), 1.0]])
    assert torch.isfinite(fidelity_gap(torch.zeros(1, 3), masked)).all()  # a ruled-out token costs a bounded amount


def test_mixture_divergence_against_float64(pair):
    target, draft = pair
    batch = teacher_forced_tokens(target, draft, [[1, 2, 3]], [[5, 6, 7]], temperature=0.7)
    input_ids = torch.tensor([[1, 2, 3, 5, 6]])
    log_p = (target(input_ids).logits[0, 2:5].double() / 0.7).log_softmax(-1)
    q = (draft(input_ids).logits[0, 2:5].double() / 0.7).softmax(-1)
    for index, weight in enumerate(torch.linspace(0, 1, KL_GRID_POINTS, dtype=torch.float64)):
        mixture = weight * log_p.exp() + (1 - weight) * q
        expected = (mixture * (mixture.log() - log_p)).sum(-1)
        torch.testing.assert_close(batch.kl_table[0, :, index].double(), expected, rtol=1e-3, atol=2e-5)
    assert torch.all(batch.kl_table[0, :, -1].abs() < 2e-5)  # w = 1: the target itself
    assert torch.all(batch.kl_table[0, :, :-1] > batch.kl_table[0, :, 1:])  # less draft, less divergence
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    assert torch.all(mixture_divergence(logits, logits).abs() < 1e-5)  # q = p: mixing costs nothing
    masked = torch.tensor([[0.0, float("-inf"), 1.0]])
    table = mixture_divergence(torch.zeros(1, 3), masked)
    assert torch.isfinite(table).all() and table[0, 0] > 10  # a ruled-out token costs a bounded, large amount
    assert mixture_divergence(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, KL_GRID_POINTS)
    # Only the expected-divergence term and validate read the table: without it the pass leaves it empty.
    without = teacher_forced_tokens(target, draft, [[1, 2, 3], [4]], [[5, 6, 7], []], temperature=0.7,
                                    divergence=False)
    assert without.kl_table.shape == (2, 3, 0)
    torch.testing.assert_close(without.fidelity_gap[0], batch.fidelity_gap[0])


def test_expected_kl_term_moves_the_weight_towards_the_target(pair, tmp_path):
    # No reward, no acceptance term: KL(nu || p) is least at w = 1, so w must rise from 0.5.
    trainer = make_trainer(pair, tmp_path, reward=lambda example, text: 0.0, acceptance_coef=0.0, fidelity_coef=0.0,
                           expected_kl_coef=1.0)
    history = trainer.train(progress=False)
    assert history[0]["expected_kl"] > 0
    assert history[-1]["mean_weight"] > history[0]["mean_weight"] + 0.05
    assert history[-1]["expected_kl"] < history[0]["expected_kl"]
    with pytest.raises(ValueError, match="closed_form='linear'"):
        TrainerConfig(output_dir=str(tmp_path), expected_kl_coef=1.0, closed_form="logistic").validate()


def test_expected_fidelity_term_raises_the_weight(pair, tmp_path):
    # No sampled reward, only mu: the draft costs fidelity on this pair (G < 0), so w must rise from 0.5.
    trainer = make_trainer(pair, tmp_path, reward=lambda example, text: 0.0, acceptance_coef=0.0, fidelity_coef=0.0,
                           expected_fidelity_coef=1.0)
    history = trainer.train(progress=False)
    assert history[0]["expected_fidelity_change"] < 0
    assert "expected_kl" not in history[0]  # not tabulated without the divergence term
    assert history[-1]["mean_weight"] > history[0]["mean_weight"] + 0.05


def test_epochs_reuse_each_batch_of_rollouts(pair, tmp_path):
    # Same rollouts (same seed), more updates on them: the weight moves further in the same direction.
    moves = []
    for epochs in (1, 4):
        trainer = make_trainer(pair, tmp_path / str(epochs), reward=lambda example, text: 0.0, acceptance_coef=1.0,
                               steps=1, epochs=epochs)
        record = trainer.train(progress=False)[0]
        prompts, _ = prompts_and_examples()
        batch = teacher_forced_tokens(*pair, prompts, [[1, 2, 3]] * len(prompts))
        with torch.no_grad():
            moves.append(record["mean_weight"] - trainer.head(batch.draft_hidden, batch.target_hidden).mean().item())
    assert 0 < moves[0] < moves[1]  # the acceptance term lowers w; four updates lower it more than one


def test_acceptance_regulariser_lowers_the_weight(pair, tmp_path):
    trainer = make_trainer(pair, tmp_path, reward=lambda example, text: 0.0, acceptance_coef=1.0)
    history = trainer.train(progress=False)
    assert history[-1]["mean_weight"] < history[0]["mean_weight"] - 0.05
    assert os.path.isfile(tmp_path / "training_curve.png")
    assert os.path.isfile(tmp_path / "head" / "head.safetensors")


def test_fidelity_reward_raises_the_weight(pair, tmp_path):
    # Reward = target log-likelihood only: the best weight is 1 (sample the target), so w must rise from 0.5.
    trainer = make_trainer(pair, tmp_path, reward=lambda example, text: 0.0, acceptance_coef=0.0, fidelity_coef=1.0,
                           steps=6, batch_size=8)
    history = trainer.train(progress=False)
    assert history[-1]["mean_weight"] > history[0]["mean_weight"] + 0.02


def test_resume_equals_uninterrupted_training(pair, tmp_path):
    reward = lambda example, text: float(len(text) % 3)  # noqa: E731
    straight = make_trainer(pair, tmp_path / "straight", reward, steps=4)
    straight.train(progress=False)
    interrupted = make_trainer(pair, tmp_path / "split", reward, steps=4)
    interrupted.train(progress=False, stop_after=2)
    resumed = make_trainer(pair, tmp_path / "split", reward, steps=4)
    resumed.train(resume=True, progress=False)
    assert resumed.step == 4
    for name, value in straight.head.state_dict().items():
        torch.testing.assert_close(resumed.head.state_dict()[name], value, rtol=0, atol=0)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]


@pytest.mark.parametrize("rollout", ["speculative", "mixture"])
def test_a_training_step_on_the_device_and_its_checkpoint(pair, device, rollout, tmp_path):
    """One step of a head on the device, rolled out through the loop or token by token: the loss is finite, the head
    moved and stayed on the device, and its checkpoint and the saved head reload to the same weights."""
    pair = models_on_device(pair, device)
    reward = lambda example, text: float(len(text) % 3)  # noqa: E731
    trainer = make_trainer(pair, tmp_path, reward, steps=1, rollout=rollout, checkpoint_every=1)
    initial = {name: value.clone() for name, value in trainer.head.state_dict().items()}
    record = trainer.train(progress=False)[0]
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]) and record["tokens"] == 4 * 6
    trained = trainer.head.state_dict()
    assert {value.device.type for value in trained.values()} == {torch.device(device).type}
    assert any(not torch.equal(trained[name], initial[name]) for name in trained)
    resumed = make_trainer(pair, tmp_path, reward, steps=1, rollout=rollout, checkpoint_every=1)
    assert resumed.load_checkpoint() and resumed.step == 1
    saved = EnsembleHead.load(str(tmp_path / "head"), map_location=str(device))
    for name, value in trained.items():
        torch.testing.assert_close(resumed.head.state_dict()[name], value, rtol=0, atol=0)
        torch.testing.assert_close(saved.state_dict()[name], value, rtol=0, atol=0)


def test_a_head_off_the_target_device_is_refused(pair, tmp_path):
    from diversed_ext.research.trainer import Trainer

    trainer = make_trainer(pair, tmp_path, reward=lambda example, text: 0.0, steps=1)
    head = trainer.head.to("meta")
    with pytest.raises(ValueError, match="head is on meta and the target on cpu"):
        Trainer(*pair, head, trainer.prompts, trainer.examples, trainer.reward, trainer.decode, trainer.rollout,
                trainer.config)


def test_schedule_and_config_checks(tmp_path):
    assert warmup_cosine(0, 4, 10) == 0.25 and warmup_cosine(3, 4, 10) == 1.0
    assert abs(warmup_cosine(10, 4, 10)) < 1e-12
    with pytest.raises(ValueError, match="batch_size"):
        TrainerConfig(output_dir=str(tmp_path), batch_size=0).validate()
    with pytest.raises(ValueError, match="acceptance_coef"):
        TrainerConfig(output_dir=str(tmp_path), acceptance_coef=-1).validate()


# Alone the run takes about 15 s; on a machine busy with other test suites it can take several times that.
DDP_TIMEOUT_SECONDS = 240
# Whatever the ranks do, the test returns this soon after the timeout: the kill and every wait after it are bounded.
KILL_GRACE_SECONDS = 15


def test_two_process_ddp_on_cpu(tmp_path):
    """Two ranks under torchrun (gloo on loopback). At the timeout every process of the run dies, whatever session it
    started for itself, and the test fails with the run's output instead of hanging."""
    import sys

    from helpers.process_tree import run_process_tree

    worker = str(TESTS_ROOT / "helpers" / "ddp_worker.py")
    result_path = str(tmp_path / "result")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker,
               str(tmp_path / "run"), result_path]
    # TMPDIR: torchrun's agent leaves a folder of its own in the temporary folder; it goes to the test's.
    environment = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    run = run_process_tree(command, timeout=DDP_TIMEOUT_SECONDS, env=environment)
    assert run.seconds < DDP_TIMEOUT_SECONDS + KILL_GRACE_SECONDS
    assert not run.timed_out, f"torchrun did not finish within {DDP_TIMEOUT_SECONDS} s:\n{run.output[-4000:]}"
    assert run.returncode == 0, run.output[-4000:]
    results = [torch.load(f"{result_path}.{rank}") for rank in range(2)]
    assert all(result["released"] for result in results)  # the trainer dropped DDP before the group went
    assert results[0]["shard"] != results[1]["shard"]  # prompts are sharded over ranks
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)  # gradients all-reduced


def test_process_tree_kill_reaches_descendants_in_other_sessions(tmp_path):
    """The timeout kill reaches a grandchild that left the session and holds the output open, and returns on time."""
    import signal
    import sys
    import time

    from helpers.process_tree import run_process_tree

    def running(pid):  # a zombie has been killed; only its parent has not reaped it yet
        try:
            with open(f"/proc/{pid}/stat") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    started = tmp_path / "grandchild_started"
    # Once in a session of its own, the grandchild writes its pid; through a rename, so a kill in the middle of the
    # write leaves no half-written file.
    grandchild = ("import os, sys, time; os.setsid(); open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
                  "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(60)")
    parent = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
              "time.sleep(60)")
    # The kill proves something only once the grandchild runs, and a busy machine may take longer than a short
    # timeout to start two interpreters: a run whose grandchild had not started is repeated with a longer timeout.
    for timeout in (1.0, 4.0, 16.0):
        run = run_process_tree([sys.executable, "-c", parent, grandchild, str(started)], timeout=timeout)
        assert run.timed_out and run.seconds < timeout + KILL_GRACE_SECONDS
        if started.exists():
            break
    else:
        pytest.fail(f"the grandchild never started within {timeout} s: the kill was not tested")
    pid = int(started.read_text())
    try:
        deadline = time.monotonic() + KILL_GRACE_SECONDS  # SIGKILL is delivered, not awaited
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(pid), "the grandchild outlived the timeout kill"
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)
