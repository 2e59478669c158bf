"""One rank of the 2-process DDP test (test_trainer.py), launched by torchrun.

Trains the head of a tiny random Llama pair for two steps and saves its parameters and prompt shard, so the test can
check that ranks saw different prompts and still ended with identical heads (gradients all-reduced). The process group
comes from the trainer's own ``distributed_session`` and the trainer shuts DDP down itself, so this is the path a
``torchrun diversed train`` run takes, teardown included."""

import os
import sys

# Run as a script, this file's own folder heads sys.path; the suite's root takes its place, so `helpers` imports as the
# package it is and its modules (models, stats, ...) cannot shadow top-level modules of the same names.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [entry for entry in sys.path if os.path.abspath(entry) != _HERE]

import torch  # noqa: E402

from helpers import make_trainer, trainer_llama  # noqa: E402

from diversed_ext.research.trainer import distributed_session  # noqa: E402

# A rank that never arrives fails the run well inside the test's own timeout instead of hanging it.
GROUP_TIMEOUT_SECONDS = 60


def main(output_dir: str, result_path: str) -> None:
    with distributed_session(timeout_seconds=GROUP_TIMEOUT_SECONDS):
        rank = torch.distributed.get_rank()
        torch.set_num_threads(1)
        trainer = make_trainer((trainer_llama(0), trainer_llama(1)), output_dir,
                               reward=lambda e, t: float(len(t) % 2), steps=2, batch_size=2, checkpoint_every=1)
        trainer.train(progress=False)
        released = trainer._ddp is None  # train() must hand DDP back before the group goes
        flat = torch.cat([p.detach().flatten() for p in trainer.head.parameters()])
        torch.save({"rank": rank, "params": flat, "shard": trainer.shard, "released": released},
                   f"{result_path}.{rank}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
