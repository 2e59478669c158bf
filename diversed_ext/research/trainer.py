"""Training the DIVERSED ensemble head with sequence-level reinforcement learning (REINFORCE++ style).

One step:
  1. take a batch of prompts from this rank's shard (deterministic in the seed and the step);
  2. roll out completions by speculative decoding with the current head, as in deployment: a token where a draft was
     verified follows nu, a round's bonus token (all its drafts kept) the target p, and each completion flags which;
  3. reward each completion: the task reward plus ``fidelity_coef`` times its fidelity (mean target log-probability
     per generated token);
  4. one teacher-forced pass of both models gives hidden states, log p(y), log q(y), TV, the fidelity gap
     E_q[log p] - E_p[log p] and the table of KL(nu_w || p) over w per token;
  5. loss = diversed_objective(...) (diversed_ext/research/objective.py): policy gradient with batch-normalised
     advantages plus the acceptance regulariser, plus (``expected_fidelity_coef`` > 0) the closed-form expected
     next-token fidelity and (``expected_kl_coef`` > 0) the expected divergence KL(nu || p); only the head trains
     (AdamW, gradient clipping, linear warm-up then cosine decay). These terms count the tokens drawn from nu alone
     (:func:`head_objective`): a bonus token's log-probability is log p, whatever w, so it adds nothing to the
     policy gradient, and no draft was verified there for w to change its acceptance, fidelity or divergence.

Checkpoints (head, optimiser, scheduler, step, RNG states) are written atomically; ``resume=True`` continues exactly
where the last one stopped. Under ``torchrun`` the head is wrapped in DistributedDataParallel (gloo on CPU, nccl on
GPU) and prompts are sharded over ranks. Progress goes to a tqdm bar, a jsonl log and a training-curve PNG.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from tqdm import tqdm

from ..decoding.checks import check_head_device
from ..decoding.runners import model_device
from ..head import EnsembleHead
from .checkpoints import (CHECKPOINT_NAME, LOG_NAME, CheckpointError, TrainingLog, load_checkpoint,
                          resume_conflicts, save_checkpoint)
from .objective import CLOSED_FORMS, ObjectiveTerms, check_kl_options, diversed_objective
from .plots import plot_training_curve
from .rollouts import Rollout, nu_mask
from .teacher_forcing import TokenBatch, teacher_forced_tokens

CURVE_NAME = "training_curve.png"

# (example, completion text) -> task reward
RewardFn = Callable[[Any, str], float]


@dataclass
class TrainerConfig:
    """Hyper-parameters of a training run (saved inside every checkpoint)."""

    output_dir: str
    steps: int = 50
    batch_size: int = 8
    learning_rate: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 5
    grad_clip: float = 1.0
    acceptance_coef: float = 0.05
    fidelity_coef: float = 0.0
    expected_fidelity_coef: float = 0.0  # mu of the closed-form next-token fidelity term (objective.py)
    closed_form: str = "linear"  # "logistic": the surrogate of the closed-form terms (objective.py)
    expected_kl_coef: float = 0.0  # kappa of the expected divergence KL(nu || p) (objective.py; linear closed form)
    epochs: int = 1  # optimiser updates per batch of rollouts (see Trainer)
    temperature: float = 1.0
    seed: int = 0
    checkpoint_every: int = 10

    def validate(self) -> None:
        positive = {"steps": self.steps, "batch_size": self.batch_size, "learning_rate": self.learning_rate,
                    "epochs": self.epochs,
                    "checkpoint_every": self.checkpoint_every, "grad_clip": self.grad_clip}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("warmup_steps", "acceptance_coef", "fidelity_coef", "expected_fidelity_coef", "weight_decay",
                     "temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.closed_form not in CLOSED_FORMS:
            raise ValueError(f"closed_form must be one of {', '.join(CLOSED_FORMS)}, got {self.closed_form!r}")
        check_kl_options(self.expected_kl_coef, self.closed_form)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to 0 at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@contextlib.contextmanager
def distributed_session(timeout_seconds: float = 600.0):
    """Join the ``torchrun`` job this process was launched in (``WORLD_SIZE`` > 1), and leave it cleanly.

    Outside torchrun, or when a process group already exists, this does nothing. Otherwise it starts gloo on the CPU
    (nccl when CUDA is available) with a bounded timeout, so a rank that never arrives fails the run instead of
    hanging it, and destroys the group at the end. Close every :class:`Trainer` (``train`` does it) before leaving.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or not torch.distributed.is_available() or torch.distributed.is_initialized():
        yield
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds))
    clean = False
    try:
        yield
        clean = True
    finally:
        _leave_process_group(synchronize=clean)


# How long the main thread gives gloo's worker threads, without the GIL, to finish releasing their last work items.
GLOO_DRAIN_SECONDS = 0.2


def _leave_process_group(synchronize: bool) -> None:
    """Destroy the process group without the teardown deadlock.

    The group's destructor joins gloo's worker threads while this thread holds the GIL, and a worker that is still
    releasing a finished work item needs the GIL for it (the item carries the thread-local state of the caller). So:
    a barrier, after which no collective work is left to start; a short sleep, which releases the GIL while the
    workers finish releasing their items; then the group goes.
    """
    if synchronize:
        torch.distributed.barrier()
        gc.collect()
        time.sleep(GLOO_DRAIN_SECONDS)
    torch.distributed.destroy_process_group()


class Trainer:
    """Trains an :class:`EnsembleHead` for a draft/target pair on a list of prompts.

    Args:
        target, draft: the Hugging Face causal LMs (frozen).
        head: the head to train, on the target's device (its parameters are the only ones updated).
        prompts: token ids of every training prompt (all ranks pass the same list; each takes its shard).
        examples: the task examples the prompts came from, passed to ``reward``.
        reward: (example, completion text) -> task reward.
        decode: completion token ids -> text (the tokenizer's decode).
        rollout: (prompts' ids, seeds) -> one :class:`.rollouts.Completion` per prompt, sampled with the current
            head: through the speculative loop, all prompts of a step decoded together, its bonus tokens flagged
            (:func:`.rollouts.speculative_rollout`), or token by token (:func:`.rollouts.mixture_rollout`).
        config: :class:`TrainerConfig`.

    With ``config.epochs`` > 1 every batch of rollouts feeds that many optimiser updates (rollouts are the expensive
    part). The closed-form terms (acceptance, expected fidelity) stay exact for the batch's contexts; the policy term
    becomes off-policy after the first update (no importance ratio), so keep epochs small when it carries the signal.
    The learning-rate schedule advances once per step, not per update.
    """

    def __init__(self, target, draft, head: EnsembleHead, prompts: Sequence[Sequence[int]], examples: Sequence[Any],
                 reward: RewardFn, decode: Callable[[Sequence[int]], str], rollout: Rollout, config: TrainerConfig):
        config.validate()
        if len(prompts) != len(examples) or not prompts:
            raise ValueError(f"prompts ({len(prompts)}) and examples ({len(examples)}) must be equal and non-empty")
        check_head_device(head, model_device(target))
        self.target, self.draft, self.head = target, draft, head
        self.examples, self.reward, self.decode, self.rollout, self.config = examples, reward, decode, rollout, config
        self.prompts = [list(prompt) for prompt in prompts]
        self.rank, self.world_size = _distributed()
        self.shard = list(range(self.rank, len(self.prompts), self.world_size))
        if not self.shard:
            raise ValueError(f"rank {self.rank} has no prompts: {len(self.prompts)} prompts for {self.world_size} "
                             "ranks")
        for parameter in list(target.parameters()) + list(draft.parameters()):
            parameter.requires_grad_(False)
        self._ddp: Optional[torch.nn.parallel.DistributedDataParallel] = None
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: warmup_cosine(step, config.warmup_steps, config.steps))
        self.step = 0
        self.history: list[dict] = []
        self.log = TrainingLog(os.path.join(config.output_dir, LOG_NAME))

    # ------------------------------------------------------------------------------------ DDP wrapper lifetime
    @property
    def model(self) -> torch.nn.Module:
        """The head, wrapped in DistributedDataParallel when there are several ranks (created on first use)."""
        if self.world_size == 1:
            return self.head
        if self._ddp is None:
            self._ddp = torch.nn.parallel.DistributedDataParallel(self.head)
        return self._ddp

    def close(self, *, synchronize: bool = True) -> None:
        """Release the DDP wrapper while the process group is still alive; ``train`` calls this when it ends.

        The wrapper's gradient reducer holds the process group and its gloo work. Left to die at interpreter exit
        (or with ``destroy_process_group`` while the wrapper lives), the group's destructor joins gloo's worker
        threads while holding the GIL, and a worker that needs the GIL to finish its last work item never returns:
        the rank hangs at exit after all its output is written. So: a barrier, so that no rank still has collective
        work in flight; then the wrapper goes, and is collected now, on this thread. The trainer stays usable: the
        next step wraps the head again. ``synchronize=False`` skips the barrier (after an error on this rank only,
        where waiting for the others could hang).
        """
        if self._ddp is None:
            return
        if synchronize:
            torch.distributed.barrier()
        self._ddp = None
        gc.collect()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        self.close(synchronize=error_type is None)

    # ----------------------------------------------------------------------------------------------- one step
    def _batch_indices(self) -> list[int]:
        generator = random.Random(hash((self.config.seed, self.step, self.rank)) & 0xFFFFFFFF)
        return [self.shard[generator.randrange(len(self.shard))] for _ in range(self.config.batch_size)]

    def _rollout_seed(self, slot: int) -> int:
        return (self.config.seed * 1_000_003 + self.step * 10_007 + self.rank * 101 + slot) & 0x7FFFFFFF

    def train_step(self) -> dict:
        """Roll out, reward, and update the head once; returns the logged metrics."""
        indices = self._batch_indices()
        self.head.eval()
        with torch.no_grad():
            # One call for the whole batch: the speculative rollout decodes the prompts together.
            rollouts = self.rollout([self.prompts[index] for index in indices],
                                    [self._rollout_seed(slot) for slot in range(len(indices))])
        completions = [list(rollout.tokens) for rollout in rollouts]
        with_divergence = self.config.expected_kl_coef > 0
        tokens = teacher_forced_tokens(self.target, self.draft, [self.prompts[i] for i in indices], completions,
                                       self.config.temperature, [rollout.draft_steps for rollout in rollouts],
                                       divergence=with_divergence)
        task_rewards = torch.tensor([float(self.reward(self.examples[index], self.decode(completion)))
                                     for index, completion in zip(indices, completions)], dtype=torch.float64,
                                    device=tokens.mask.device)
        # The reward is the whole completion's, bonus tokens included: they are part of the text the head produced.
        fidelity = _masked_mean(tokens.target_logprob, tokens.mask)
        rewards = task_rewards + self.config.fidelity_coef * fidelity
        drawn = nu_mask(rollouts, tokens.mask)

        self.head.train()
        first = None  # the terms before this step's first update: they describe the policy that rolled out
        for _ in range(self.config.epochs):
            weights, terms = head_objective(self.model, self.head, tokens, drawn, rewards, self.config)
            self.optimizer.zero_grad(set_to_none=True)
            terms.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.config.grad_clip)
            self.optimizer.step()
            if first is None:
                fidelity_change = _masked_mean(((1 - weights) * tokens.fidelity_gap).detach(), drawn)
                first = terms, fidelity_change, float(grad_norm)
        terms, fidelity_change, grad_norm = first
        self.scheduler.step()
        self.step += 1
        record = {"step": self.step, "loss": terms.loss.item(), "task_reward": task_rewards.mean().item(),
                  "fidelity": fidelity.mean().item(), "mean_weight": terms.mean_weight.item(),
                  "expected_acceptance": terms.expected_acceptance.item(),
                  "expected_fidelity_change": fidelity_change.mean().item(), "grad_norm": grad_norm,
                  "learning_rate": self.scheduler.get_last_lr()[0],
                  "tokens": int(tokens.mask.sum()), "verified_tokens": int(drawn.sum())}
        if with_divergence:
            record["expected_kl"] = terms.expected_kl.item()
        self.history.append(record)
        return record

    # ------------------------------------------------------------------------------------------------ the run
    def train(self, *, resume: bool = False, progress: bool = True, stop_after: Optional[int] = None) -> list[dict]:
        """Run until ``config.steps``, checkpointing every ``checkpoint_every`` steps and at the end.

        Args:
            resume: continue from the checkpoint in ``output_dir`` if there is one.
            progress: show a progress bar (rank 0).
            stop_after: stop (with a checkpoint) once this step is reached, as an interrupted run would; the
                learning-rate schedule still spans ``config.steps``.
        """
        try:
            self._train(resume, progress, stop_after)
        except BaseException:
            self.close(synchronize=False)
            raise
        self.close()
        return self.history

    def _train(self, resume: bool, progress: bool, stop_after: Optional[int]) -> None:
        if resume:
            self.load_checkpoint()
        last_step = self.config.steps if stop_after is None else min(self.config.steps, stop_after)
        is_main = self.rank == 0
        bar = tqdm(total=self.config.steps, initial=self.step, desc="train head", unit="step",
                   disable=not (progress and is_main))
        while self.step < last_step:
            record = self.train_step()
            if is_main:
                self.log.append(record)
            bar.set_postfix(w=f"{record['mean_weight']:.3f}", acc=f"{record['expected_acceptance']:.3f}",
                            reward=f"{record['task_reward']:.2f}")
            bar.update(1)
            if self.step % self.config.checkpoint_every == 0 or self.step == last_step:
                self.save_checkpoint()
        bar.close()
        if is_main and self.step == self.config.steps:
            self.head.save(os.path.join(self.config.output_dir, "head"))
            plot_training_curve(self.log.read(), os.path.join(self.config.output_dir, CURVE_NAME))

    # ---------------------------------------------------------------------------------------------- persistence
    def checkpoint_path(self) -> str:
        return os.path.join(self.config.output_dir, CHECKPOINT_NAME)

    def save_checkpoint(self) -> None:
        """Write head, optimiser, scheduler, step and RNG states atomically (rank 0 only)."""
        if self.rank != 0:
            return
        save_checkpoint(self.checkpoint_path(), {
            "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "step": self.step, "history": self.history,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "config": asdict(self.config),
            "recipe": dict(self.head.config.recipe)})

    def load_checkpoint(self) -> bool:
        """Restore the last checkpoint if there is one; returns whether one was found. A checkpoint of another
        configuration (:func:`~.checkpoints.resume_conflicts`: only the output folder, the checkpoint interval and a
        larger step count may change) is refused: its optimiser and schedule would carry on the old one's."""
        state = load_checkpoint(self.checkpoint_path())
        if state is None:
            return False
        changed = resume_conflicts(state["config"], asdict(self.config)) if isinstance(state["config"], dict) else []
        if changed:
            raise CheckpointError(f"{self.checkpoint_path()}: made under another configuration ("
                                  + ", ".join(f"{name} {state['config'].get(name)}, now {getattr(self.config, name)}"
                                              for name in changed) + "); resume under that one")
        try:
            self.head.load_state_dict(state["head"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step, self.history = int(state["step"]), list(state["history"])
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{self.checkpoint_path()}: does not fit this run ({error})") from None
        if self.rank == 0:
            self.log.truncate(self.step)
        return True


def head_objective(model: torch.nn.Module, head: EnsembleHead, tokens: TokenBatch, drawn: torch.Tensor,
                   rewards: torch.Tensor, config: TrainerConfig) -> tuple[torch.Tensor, ObjectiveTerms]:
    """(weights [N, T], terms): ``model`` (the head, or its DDP wrapper) at every position of ``tokens``, and the
    DIVERSED objective over the tokens ``drawn`` marks ([N, T] bool: those drawn from nu, :func:`.rollouts.nu_mask`).

    A bonus token of the speculative loop is drawn from p: its log-probability under the rollout is log p whatever
    the head says, so it contributes no policy gradient, and as no draft was verified there the closed-form
    acceptance, fidelity and divergence of w do not apply. Leaving it out of the mask drops it from every term.
    """
    weights = model(*tokens.head_inputs(head))
    with_divergence = config.expected_kl_coef > 0
    terms = diversed_objective(weights, tokens.target_logprob, tokens.draft_logprob, tokens.total_variation,
                               rewards.to(weights.dtype), drawn, config.acceptance_coef, tokens.fidelity_gap,
                               config.expected_fidelity_coef, config.closed_form,
                               tokens.kl_table if with_divergence else None, config.expected_kl_coef)
    return weights, terms


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    counts = mask.sum(-1).clamp_min(1)
    return torch.where(mask, values, torch.zeros_like(values)).sum(-1).double() / counts
