"""One rank of the 2-process DDP test (python_tests/test_trainer.py), launched by torchrun.

Trains the head of a tiny random Llama pair for two steps and saves its parameters and prompt shard, so the test can
check that ranks saw different prompts and still ended with identical heads (gradients all-reduced). The process group
comes from the trainer's own ``distributed_session`` and the trainer shuts DDP down itself, so this is the path a
``torchrun diversed train`` run takes, teardown included."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer import make_trainer, tiny_llama  # noqa: E402

from diversed_ext.research.trainer import distributed_session  # noqa: E402

# A rank that never arrives fails the run well inside the test's own timeout instead of hanging it.
GROUP_TIMEOUT_SECONDS = 60


def main(output_dir: str, result_path: str) -> None:
    with distributed_session(timeout_seconds=GROUP_TIMEOUT_SECONDS):
        rank = torch.distributed.get_rank()
        torch.set_num_threads(1)
        trainer = make_trainer((tiny_llama(0), tiny_llama(1)), output_dir, reward=lambda e, t: float(len(t) % 2),
                               steps=2, batch_size=2, checkpoint_every=1)
        trainer.train(progress=False)
        released = trainer._ddp is None  # train() must hand DDP back before the group goes
        flat = torch.cat([p.detach().flatten() for p in trainer.head.parameters()])
        torch.save({"rank": rank, "params": flat, "shard": trainer.shard, "released": released},
                   f"{result_path}.{rank}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
