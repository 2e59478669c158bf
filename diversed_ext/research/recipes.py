"""Ready-made training runs: a :class:`~.trainer.Trainer` for a task, a model pair and a rollout kind."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..decoding import DEFAULT_MAX_DRAFT
from ..decoding.runners import model_device
from ..head import HEAD_INPUTS, EnsembleHead, hidden_size
from .harness import encode_examples
from .rollouts import mixture_rollout, speculative_rollout
from .tasks import Task
from .trainer import Trainer, TrainerConfig


def build_trainer(task: Task, examples: Sequence[dict], target, draft, tokenizer, config: TrainerConfig, *,
                  head: Optional[EnsembleHead] = None, head_hidden: Optional[int] = None, init_weight: float = 0.5,
                  head_inputs: str = "hidden",
                  max_draft: int = DEFAULT_MAX_DRAFT, max_new_tokens: int = 48, rollout: str = "speculative",
                  eos_token_id=None, pair: Optional[dict] = None, chat: bool = True,
                  recipe: Optional[dict] = None, mixed_in: Sequence[tuple[Task, Sequence[dict]]] = ()) -> Trainer:
    """A Trainer for ``task``: reward = the task reward (+ ``config.fidelity_coef`` x fidelity, added by the Trainer).

    Args:
        rollout: ``"speculative"`` (the decoding loop with the current head) or ``"mixture"`` (token by token).
        head: a head to keep training (on the target's device); otherwise a new one there with ``head_hidden``,
            ``init_weight`` and ``head_inputs`` (a key of :data:`~diversed_ext.head.HEAD_INPUTS`: hidden states,
            distribution features, or both), its hidden layer's initial weights drawn from ``config.seed``.
        recipe: the ``diversed train`` options of this run, recorded in the new head's head.json.
        mixed_in: (task, examples) of other tasks whose prompts join ``examples``' in the pool batches are drawn
            from, each prompted (chat template or plain text) and rewarded by its own task: a head that meets more
            kinds of text than one task's.
    """
    if head is None:
        if head_inputs not in HEAD_INPUTS:
            raise ValueError(f"head_inputs must be one of {', '.join(HEAD_INPUTS)}, got {head_inputs!r}")
        features, use_hidden = HEAD_INPUTS[head_inputs]
        # A hidden layer starts from random weights: drawn from the run's seed, so that a recipe (which records the
        # seed) reproduces its head, and in a forked RNG, so that building the head leaves the caller's draws alone.
        # The head is built on the CPU and then moved, so the CPU generator alone is seeded and restored.
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(config.seed)
            head = EnsembleHead(hidden_size(draft), hidden_size(target), hidden=head_hidden, init_weight=init_weight,
                                pair=pair, features=features, use_hidden=use_hidden, recipe=recipe)
        head = head.to(model_device(target))
    parts = [(task, examples), *mixed_in]
    prompts = [prompt for part_task, part in parts for prompt in encode_examples(part_task, part, tokenizer, chat)]
    tagged = [(part_task, example) for part_task, part in parts for example in part]
    if rollout == "speculative":
        sampler = speculative_rollout(target, draft, head, max_draft=max_draft, max_new_tokens=max_new_tokens,
                                      temperature=config.temperature, eos_token_id=eos_token_id)
    elif rollout == "mixture":
        eos = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) and eos_token_id else eos_token_id
        sampler = mixture_rollout(target, draft, head, max_new_tokens=max_new_tokens,
                                  temperature=config.temperature, eos_token_id=eos)
    else:
        raise ValueError(f"rollout must be 'speculative' or 'mixture', got {rollout!r}")
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    reward = lambda tagged_example, text: tagged_example[0].reward(tagged_example[1], text)  # noqa: E731
    return Trainer(target, draft, head, prompts, tagged, reward, decode, sampler, config)
