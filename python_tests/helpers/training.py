"""A trainer on a tiny random Llama pair: what the trainer tests and the DDP worker (ddp_worker.py) both build.

diversed_ext's research modules (and transformers) are imported when a trainer is built.
"""

import torch

from .models import random_llama

TRAINER_VOCAB = 24


def trainer_llama(seed):
    """A one-layer random Llama with a sharpened head, so a pair of them disagrees clearly."""
    return random_llama(seed, sharpness=8, vocab_size=TRAINER_VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                        max_position_embeddings=64)


def prompts_and_examples(count=6):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TRAINER_VOCAB, (3,), generator=generator).tolist() for _ in range(count)]
    return prompts, list(range(count))


def make_trainer(pair, tmp_path, reward, steps=4, rollout="mixture", **overrides):
    """A trainer of a fresh head on ``pair`` (the head on the target's device), rolling out token by token
    (``rollout="mixture"``) or through the speculative loop (``"speculative"``)."""
    from diversed_ext.head import EnsembleHead
    from diversed_ext.research.rollouts import mixture_rollout, speculative_rollout
    from diversed_ext.research.trainer import Trainer, TrainerConfig

    target, draft = pair
    head = EnsembleHead(16, 16, init_weight=0.5).to(target.device)
    prompts, examples = prompts_and_examples()
    settings = dict(output_dir=str(tmp_path), steps=steps, batch_size=4, learning_rate=0.05, warmup_steps=1,
                    checkpoint_every=2, seed=7)
    settings.update(overrides)
    rollouts = {"mixture": mixture_rollout, "speculative": speculative_rollout}
    rollout = rollouts[rollout](target, draft, head, max_new_tokens=6)
    return Trainer(target, draft, head, prompts, examples, reward, decode=lambda ids: " ".join(map(str, ids)),
                   rollout=rollout, config=TrainerConfig(**settings))
