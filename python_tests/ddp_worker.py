"""One rank of the 2-process DDP test (python_tests/test_trainer.py), launched by torchrun.

Trains the head of a tiny random Llama pair for two steps and saves its parameters and prompt shard, so the test can
check that ranks saw different prompts and still ended with identical heads (gradients all-reduced)."""

import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer import make_trainer, tiny_llama  # noqa: E402


def main(output_dir: str, result_path: str) -> None:
    # A bounded timeout: a rank that never arrives fails the run instead of hanging it.
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = torch.distributed.get_rank()
    try:
        torch.set_num_threads(1)
        trainer = make_trainer((tiny_llama(0), tiny_llama(1)), output_dir, reward=lambda e, t: float(len(t) % 2),
                               steps=2, batch_size=2, checkpoint_every=1)
        trainer.train(progress=False)
        flat = torch.cat([p.detach().flatten() for p in trainer.head.parameters()])
        torch.save({"rank": rank, "params": flat, "shard": trainer.shard}, f"{result_path}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
