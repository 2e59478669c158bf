"""Training an EAGLE-3 draft head by self-distillation with EAGLE-3's training-time test.

Each batch unrolls the head ``ttt_steps`` times at every anchor position ``i``: step 0 reads the fused target
features of position ``i`` and the token ``i + 1``; step ``j`` reads step ``j - 1``'s pre-norm output and the token
``i + j + 1`` (the data's token: the target's own sample), sits at rotary position ``i + j``, and attends to the
target-fed entries at positions ``0 .. i`` plus its own anchor's steps ``1 .. j`` -- the cache the head sees when it
drafts ``j + 1`` tokens ahead after a verified prefix ending at ``i + 1``. Step ``j`` learns the target's
distribution of token ``i + j + 2`` (stored top-k, restricted to the draft vocabulary and renormalised) by
cross-entropy.

Metrics (per step, on held-out problems): top-1 agreement of the head's argmax with the target's, and the expected
acceptance ``sum_x min(p(x), q(x))`` of one drafted token at temperature 1; p is known on its stored top-k only, so
the figure is a lower bound, and ``..._upper`` adds the most the missing tail could contribute.
"""

from __future__ import annotations

import functools
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..models.eagle3 import Eagle3Head
from .eagle_unrolled import unrolled_logits
from .trainer import warmup_cosine

LOG_FILE = "train_log.jsonl"
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class DrafterTrainConfig:
    """Optimisation settings of :func:`train_drafter`."""

    output_dir: str
    steps: int = 200
    batch_size: int = 8             # sequences per optimiser step
    learning_rate: float = 2e-3
    warmup_steps: int = 5
    weight_decay: float = 0.0
    ttt_steps: int = 3              # unrolled draft steps per anchor
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    checkpoint_every: int = 50
    autocast_bf16: bool = True      # matmuls in bfloat16 (weights and optimiser stay float32): several times faster
    # on CPUs with bfloat16 dot products

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting."""
        for name in ("steps", "batch_size", "ttt_steps", "eval_every", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DrafterTrainConfig.{name} must be positive, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ValueError(f"DrafterTrainConfig.learning_rate must be positive, got {self.learning_rate}")


def prepare(records, draft_ids: torch.Tensor, vocab_size: int) -> list:
    """Per record, the labels in the draft vocabulary: ``draft`` int64 [S - 1 - L, k] (-1 outside it) beside the
    stored target ids and probabilities ``prob`` (labels of positions L = ``label_from`` .. S - 2)."""
    to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(draft_ids.numel())
    out = []
    for record in records:
        if record["tokens"].numel() - record["prompt_len"] < 1:
            continue
        label_from = int(record.get("label_from", record["prompt_len"] - 1))
        out.append({"tokens": record["tokens"].long(), "prompt_len": int(record["prompt_len"]),
                    "label_from": label_from, "aux": record["aux"], "draft": to_draft[record["top_ids"].long()],
                    "target": record["top_ids"].long(), "prob": record["top_logp"].float().exp()})
    return out


def collate(examples: Sequence[dict], extra: int, continuation_only: bool = False) -> dict:
    """Right-padded batch: ``tokens`` [B, W + extra] (W = longest sequence), ``aux`` [B, W - 1, A], and labels by
    position ``q`` (the target's distribution at q, of token q + 1): ``draft``/``target`` [B, W + extra, k],
    ``prob`` [B, W + extra, k] (0 where no label; with ``continuation_only``, none on the prompt's own tokens)."""
    width = max(e["tokens"].numel() for e in examples)
    k = examples[0]["prob"].shape[1]
    batch, full = len(examples), width + extra
    tokens = torch.zeros(batch, full, dtype=torch.long)
    aux = torch.zeros(batch, width - 1, examples[0]["aux"].shape[1])
    draft = torch.full((batch, full, k), -1, dtype=torch.long)
    target = torch.zeros(batch, full, k, dtype=torch.long)
    prob = torch.zeros(batch, full, k)
    first = width
    for row, e in enumerate(examples):
        s, p, lab = e["tokens"].numel(), e["prompt_len"], e["label_from"]
        tokens[row, :s] = e["tokens"]
        aux[row, :s - 1] = e["aux"].float()
        begin = p - 1 if continuation_only else lab
        sl = slice(begin - lab, None)
        draft[row, begin:s - 1], target[row, begin:s - 1], prob[row, begin:s - 1] = \
            e["draft"][sl], e["target"][sl], e["prob"][sl]
        first = min(first, begin)
    return {"tokens": tokens, "aux": aux, "draft": draft, "target": target, "prob": prob, "first_label": first}


def _labels(batch, start, j, n):
    sl = slice(start + j + 1, start + j + 1 + n)
    return batch["draft"][:, sl], batch["target"][:, sl], batch["prob"][:, sl]


def distillation_loss(outputs, start, batch) -> tuple:
    """Mean over steps of the soft cross-entropy to the target's distribution within the draft vocabulary; and the
    number of labelled positions of each step."""
    losses, counts = [], []
    for j, logits in enumerate(outputs):
        draft, _, prob = _labels(batch, start, j, logits.shape[1])
        p = prob * (draft >= 0)
        total = p.sum(-1)
        valid = total > 0
        logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, draft.clamp(min=0))
        ce = -(p * logq).sum(-1) / total.clamp(min=1e-12)
        losses.append((ce * valid).sum() / valid.sum().clamp(min=1))
        counts.append(int(valid.sum()))
    return torch.stack(losses).mean(), counts


@torch.no_grad()
def step_metrics(head: Eagle3Head, outputs, start, batch) -> list:
    """Per step sums over labelled positions: count, top-1 agreement, expected acceptance (lower, upper bound)."""
    rows = []
    for j, logits in enumerate(outputs):
        draft, target, prob = _labels(batch, start, j, logits.shape[1])
        valid = prob.sum(-1) > 0
        q = torch.softmax(logits.float(), dim=-1)
        q_at = q.gather(-1, draft.clamp(min=0)) * (draft >= 0)
        lower = torch.minimum(prob, q_at).sum(-1)
        upper = lower + torch.minimum(1 - prob.sum(-1), 1 - q_at.sum(-1)).clamp(min=0)
        agree = head.draft_to_target[logits.argmax(-1)] == target[..., 0]
        rows.append({"count": int(valid.sum()), "top1": float((agree & valid).sum()),
                     "accept": float((lower * valid).sum()), "accept_upper": float((upper * valid).sum())})
    return rows


def evaluate(head: Eagle3Head, examples: Sequence[dict], steps: int, batch_size: int = 8,
             autocast_bf16: bool = False) -> dict:
    """Held-out metrics per draft step (1-based keys), on the continuation positions only: top-1 agreement and
    expected acceptance bounds (``autocast_bf16``: matmuls in bfloat16); and the
    expected acceptance rate of K = ``steps`` drafts, (a1 + a1 a2 + a1 a2 a3 ...) / K, from the lower bounds."""
    head.eval()
    sums = [dict(count=0, top1=0.0, accept=0.0, accept_upper=0.0) for _ in range(steps)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        for begin in range(0, len(examples), batch_size):
            batch = collate(examples[begin:begin + batch_size], steps + 1, continuation_only=True)
            outputs, start = unrolled_logits(head, batch, steps)
            for total, row in zip(sums, step_metrics(head, outputs, start, batch)):
                for key in total:
                    total[key] += row[key]
    result, chain, accepted = {}, 1.0, 0.0
    for j, total in enumerate(sums, 1):
        count = max(total["count"], 1)
        result[f"top1_step{j}"] = total["top1"] / count
        result[f"accept_step{j}"] = total["accept"] / count
        result[f"accept_upper_step{j}"] = total["accept_upper"] / count
        chain *= result[f"accept_step{j}"]
        accepted += chain
    result[f"acceptance_rate_k{steps}"] = accepted / steps
    return result


def init_from_target(head: Eagle3Head, target) -> None:
    """Starts the LM head from the target's output rows of the draft vocabulary and the final norm from the target's
    (the target ties them to its embeddings; the head's own copy is trained)."""
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[head.draft_to_target])
        head.norm.weight.copy_(target.model.norm.weight)


def plot_drafter_curve(records: list, path: str) -> Optional[str]:
    """Loss against the step, and the held-out metrics per draft step at each evaluation."""
    from .plots import new_figure, save_figure

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "top1_step1" in r]
    if not train:
        return None
    figure, axes = new_figure(2, (11, 3.8))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8)
    axes[0].set_title("distillation loss (mean over unrolled steps)")
    for j in range(1, 10):
        if evals and f"top1_step{j}" in evals[0]:
            steps = [r["step"] for r in evals]
            axes[1].plot(steps, [r[f"accept_step{j}"] for r in evals], marker="o", label=f"accept, step {j}")
            axes[1].plot(steps, [r[f"top1_step{j}"] for r in evals], ls="--", marker=".", label=f"top-1, step {j}")
    axes[1].set_title("held-out: expected acceptance and top-1 agreement")
    axes[1].set_ylim(0, 1)
    if evals:
        axes[1].legend(fontsize=7)
    for axis in axes:
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    return save_figure(figure, path)


def train_drafter(head: Eagle3Head, examples: Sequence[dict], holdout: Sequence[dict], config: DrafterTrainConfig,
                  *, resume: bool = False, progress: bool = True, stop_after: Optional[int] = None) -> list:
    """Trains ``head`` in place (AdamW, warmup + cosine), logging to ``output_dir/train_log.jsonl``, evaluating on
    ``holdout`` every ``eval_every`` steps and at the end, checkpointing every ``checkpoint_every`` steps
    (``resume`` continues from it; ``stop_after`` ends the run after that step, as an interruption would).
    Returns the log records."""
    from tqdm import tqdm

    config.validate()
    if not examples:
        raise ValueError("train_drafter: no training examples")
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, config.warmup_steps, config.steps))
    log_path, checkpoint = out / LOG_FILE, out / CHECKPOINT_FILE
    done, records = 0, []
    if resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        done, records = state["step"], state["records"]
    log_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    def log(record):
        records.append(record)
        with open(log_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    bar = tqdm(total=config.steps, initial=done, desc="drafter", unit="step", disable=not progress)
    started = time.time()
    for step in range(done + 1, config.steps + 1):
        head.train()
        first = (step - 1) * config.batch_size  # sample g is epoch g // N's shuffle at g % N: resumable
        chosen = [examples[_epoch_order(config.seed, g // len(examples), len(examples))[g % len(examples)]]
                  for g in range(first, first + config.batch_size)]
        batch = collate(chosen, config.ttt_steps + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast_bf16):
            outputs, start = unrolled_logits(head, batch, config.ttt_steps)
        loss, counts = distillation_loss(outputs, start, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.grad_clip))
        optimizer.step()
        schedule.step()
        metrics = step_metrics(head, [o.detach() for o in outputs], start, batch)
        record = {"step": step, "loss": float(loss.detach()), "grad_norm": grad_norm,
                  "learning_rate": schedule.get_last_lr()[0], "positions": counts[0],
                  "top1_train_step1": metrics[0]["top1"] / max(metrics[0]["count"], 1),
                  "seconds": round(time.time() - started, 1)}
        if step % config.eval_every == 0 or step == config.steps:
            record.update(evaluate(head, holdout, config.ttt_steps, autocast_bf16=config.autocast_bf16))
        log(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", top1=f"{record['top1_train_step1']:.2f}")
        bar.update(1)
        if step % config.checkpoint_every == 0 or step == config.steps:
            partial = checkpoint.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(), "step": step, "records": records,
                        "config": asdict(config)}, partial)
            os.replace(partial, checkpoint)
        if stop_after is not None and step >= stop_after:
            break
    bar.close()
    plot_drafter_curve(records, str(out / "training_curve.png"))
    return records


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, count: int) -> list:
    order = list(range(count))
    random.Random(seed * 100003 + epoch).shuffle(order)
    return order
