"""Self-distillation data for an EAGLE-3 draft head: the target's own continuations of task prompts, sampled at
temperature 1 with the target's KV cache, and at every position what the head learns from.

One pass of the target produces everything: the prompt's prefill and each sampled token's decode step return the aux
hidden states (Hugging Face ``output_hidden_states``, see :func:`diversed_ext.models.eagle3.aux_hidden_states`) and
the next-token logits, from which the token is sampled and whose top ``top_k`` log-probabilities are kept as the soft
label (the full distribution would be 49152 numbers a position). The records are written in shards of one batch each
(``shard-NNNNN.pt``, written whole and renamed), so an interrupted run resumes where it stopped.

A record (one prompt): ``tokens`` int32 [S] (prompt then continuation, EOS included when sampled), ``prompt_len`` P,
``label_from`` L, ``aux`` bf16 [S - 1, len(aux) * H] (every position but the last, whose successor is unknown),
``top_ids`` int32 [S - 1 - L, k] and ``top_logp`` float16 [S - 1 - L, k]: the target's distribution at positions
L .. S - 2, i.e. of the prompt's own tokens after the prompts' common head (teacher-forced) and of each continuation
token (sampled from it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..decoding.runners import cache_keyword
from ..models.eagle3 import aux_hidden_states

META_FILE = "meta.json"
SHARD_PATTERN = "shard-{:05d}.pt"


class _Bf16Linear(torch.nn.Module):
    """A Linear computing its matmul in bfloat16 (inputs rounded, output back in the input's dtype): the residual
    stream, norms and the LM head stay float32."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x):
        out = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return out if self.bias is None else out + self.bias


def bf16_matmul_copy(target):
    """A copy of ``target`` whose decoder layers' linear maps run in bfloat16 (several times faster on CPUs with
    bfloat16 dot products), for generating training data; the embeddings, norms, residual stream and LM head keep
    the target's dtype."""
    import copy

    fast = copy.deepcopy(target).eval()
    for layer in fast.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, _Bf16Linear(child))
    return fast


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _top(logits: torch.Tensor, top_k: int, temperature: float):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, indices = logp.topk(top_k, dim=-1)
    return logp, indices.to(torch.int32), values.to(torch.float16)


@torch.no_grad()
def sample_batch(target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, aux_layer_ids: Sequence[int],
                 eos_ids: Sequence[int], top_k: int, generator: torch.Generator, temperature: float = 1.0,
                 label_from: int = None) -> list:
    """Samples one continuation per prompt from ``target`` (batched, left-padded) and returns a record per prompt
    (see the module docstring). Prompt positions from ``label_from`` (default: the last prompt position) get soft
    labels too: the target's prediction of the prompt's own next token."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("sample_batch: prompts must be non-empty token lists")
    if temperature <= 0:
        raise ValueError(f"sample_batch: temperature must be positive, got {temperature}")
    shortest = min(len(p) for p in prompts)
    label_from = shortest - 1 if label_from is None else label_from
    if not 0 <= label_from <= shortest - 1:
        raise ValueError(f"sample_batch: label_from must be in [0, {shortest - 1}], got {label_from}")
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
    ids, mask = _left_padded(prompts, pad_id=int(eos[0]) if eos.numel() else 0)
    width, batch, lm_head = ids.shape[1], len(prompts), target.get_output_embeddings()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache_name = cache_keyword(target.model)
    out = target.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       output_hidden_states=True)
    cache = getattr(out, cache_name)
    aux_steps = [aux_hidden_states(out.hidden_states, aux_layer_ids).to(torch.bfloat16)]  # [B, Pmax, A]
    # prompt labels: from the column of position label_from in the longest row (shorter rows skip more)
    first = label_from
    _, prompt_ids, prompt_logp = _top(lm_head(out.last_hidden_state[:, first:-1]), top_k, temperature)
    sampled, top_ids, top_logp = [], [], []
    alive = torch.ones(batch, dtype=torch.bool)
    lengths = torch.zeros(batch, dtype=torch.long)  # continuation tokens kept per row
    last = out.last_hidden_state[:, -1]
    for step in range(max_new_tokens):
        logp, indices, values = _top(lm_head(last), top_k, temperature)
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        sampled.append(token)
        top_ids.append(indices)
        top_logp.append(values)
        lengths += alive.long()
        alive &= ~torch.isin(token, eos)
        if not bool(alive.any()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
        out = target.model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=positions,
                           use_cache=True, output_hidden_states=True, **{cache_name: cache})
        cache = getattr(out, cache_name)
        aux_steps.append(aux_hidden_states(out.hidden_states, aux_layer_ids).to(torch.bfloat16))
        last = out.last_hidden_state[:, -1]
    aux = torch.cat(aux_steps, dim=1)
    sampled, top_ids, top_logp = torch.stack(sampled, 1), torch.stack(top_ids, 1), torch.stack(top_logp, 1)
    records = []
    for row, prompt in enumerate(prompts):
        n, p = int(lengths[row]), len(prompt)
        tokens = torch.cat([torch.tensor(prompt, dtype=torch.int32), sampled[row, :n].to(torch.int32)])
        skip = width - p + label_from - first  # this row's column of position label_from, in the prompt labels
        records.append({"tokens": tokens, "prompt_len": p, "label_from": label_from,
                        "aux": aux[row, width - p: width - 1 + n].clone(),
                        "top_ids": torch.cat([prompt_ids[row, skip:], top_ids[row, :n]]).clone(),
                        "top_logp": torch.cat([prompt_logp[row, skip:], top_logp[row, :n]]).clone()})
    return records


def generate_dataset(target, prompts: Sequence[Sequence[int]], folder, *, max_new_tokens: int = 128,
                     aux_layer_ids: Sequence[int], eos_ids: Sequence[int], top_k: int = 32, batch_size: int = 32,
                     seed: int = 0, temperature: float = 1.0, progress: bool = True, meta: dict = None) -> Path:
    """Writes the records of ``prompts`` into ``folder`` shard by shard, skipping shards already there (resume).
    Each shard's sampling seed is ``seed`` + its index, so a resumed run writes what an uninterrupted one would."""
    from tqdm import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"max_new_tokens": max_new_tokens, "aux_layer_ids": list(aux_layer_ids),
                "top_k": top_k, "batch_size": batch_size, "seed": seed, "temperature": temperature, **(meta or {})}
    meta_path = folder / META_FILE
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != settings:
            raise ValueError(f"generate_dataset: {folder} holds data made with other settings ({old}); pick another "
                             f"folder or delete it")
    else:
        meta_path.write_text(json.dumps(settings, indent=2) + "\n")
    # The prompts' common head (the chat template's system turn and the instruction) teaches nothing new: labels
    # start at its last position, whose successor is the first token that differs.
    label_from = max(len(os.path.commonprefix([list(p) for p in prompts])) - 1, 0)
    shards = range(0, len(prompts), batch_size)
    for index, start in enumerate(tqdm(shards, desc="target continuations", unit="batch", disable=not progress)):
        path = folder / SHARD_PATTERN.format(index)
        batch = [list(map(int, p)) for p in prompts[start:start + batch_size]]
        if path.exists():
            _check_shard(path, batch)
            continue
        generator = torch.Generator().manual_seed(seed + index)
        records = sample_batch(target, batch, max_new_tokens=max_new_tokens,
                               aux_layer_ids=aux_layer_ids, eos_ids=eos_ids, top_k=top_k, generator=generator,
                               temperature=temperature, label_from=label_from)
        partial = path.with_suffix(".tmp")
        torch.save(records, partial)
        os.replace(partial, path)
        path.with_suffix(".json").write_text(json.dumps({"prompts": _digest(batch)}))
    return folder


def _digest(prompts) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def _check_shard(path: Path, prompts) -> None:
    """A shard already written must hold these prompts (else the folder was made from other problems)."""
    side = path.with_suffix(".json")
    if not side.exists():  # written before sidecars: read the prompts back from the records
        stored = [r["tokens"][:r["prompt_len"]].tolist() for r in torch.load(path, weights_only=True)]
        side.write_text(json.dumps({"prompts": _digest(stored)}))
    if json.loads(side.read_text())["prompts"] != _digest(prompts):
        raise ValueError(f"{path.name} holds other prompts than this run's; pick another folder or delete it")


def load_records(folder) -> list:
    """Every record of a dataset folder, shard order."""
    folder = Path(folder)
    paths = sorted(folder.glob("shard-*.pt"))
    if not paths:
        raise FileNotFoundError(f"load_records: no shard-*.pt in {folder}")
    return [record for path in paths for record in torch.load(path, weights_only=True)]


def iter_label_mass(records) -> Iterator[tuple]:
    """(ids, probabilities) of every stored soft label, for counting the draft vocabulary."""
    for record in records:
        yield record["top_ids"].long(), record["top_logp"].float().exp()


def draft_vocabulary(records, vocab_size: int, size: int) -> tuple:
    """The ``size`` target ids holding most of the target's probability mass over the data's continuation positions
    (ascending), and the share of that mass they cover (of the stored top-k mass)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocabulary: size must be in (0, {vocab_size}], got {size}")
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, probs in iter_label_mass(records):
        mass.index_add_(0, ids.flatten(), probs.flatten().double())
    chosen = torch.sort(torch.topk(mass, size).indices).values
    return chosen, float(mass[chosen].sum() / mass.sum().clamp(min=1e-30))


def coverage_curve(records, vocab_size: int, sizes: Sequence[int]) -> dict:
    """The share of the target's stored probability mass each draft vocabulary size covers: {size: share}."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, probs in iter_label_mass(records):
        mass.index_add_(0, ids.flatten(), probs.flatten().double())
    ordered = torch.sort(mass, descending=True).values.cumsum(0) / mass.sum().clamp(min=1e-30)
    return {int(size): float(ordered[min(size, vocab_size) - 1]) for size in sizes}


def gsm8k_prompts(tokenizer, path, *, limit: int, holdout: int, batch_size: int, chat: bool = True) -> tuple:
    """(prompts, holdout count): the held-out problems (the LAST ``holdout`` of the file) first, so that the first
    shards are the evaluation set even when generation stops early, then the first ``limit`` problems, sorted by
    length within blocks of eight batches (less padding; the order stays deterministic)."""
    from ..decoding import encode_prompt
    from .tasks import gsm8k_prompt, load_gsm8k

    examples = load_gsm8k(str(path))
    if holdout + limit > len(examples):
        raise ValueError(f"gsm8k_prompts: limit ({limit}) + holdout ({holdout}) exceed the {len(examples)} problems "
                         f"of {path}")
    encode = [encode_prompt(tokenizer, gsm8k_prompt(example), chat=chat) for example in examples[:limit]]
    held = [encode_prompt(tokenizer, gsm8k_prompt(example), chat=chat)
            for example in examples[len(examples) - holdout:]] if holdout else []
    block = 8 * batch_size
    ordered = [p for start in range(0, len(encode), block) for p in sorted(encode[start:start + block], key=len)]
    return sorted(held, key=len) + ordered, holdout
