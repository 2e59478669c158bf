"""Prompts in and out of the loop: token ids from text, the ids that end a turn, and prompt/EOS argument parsing."""

from __future__ import annotations

from numbers import Integral

import torch


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user prompt: through the chat template (with the assistant turn opened) when there is one."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
        ids = encoded["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    return [int(token) for token in ids]


def eos_ids(tokenizer, model) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS and the model's generation_config EOS ids."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if config_eos is not None:
        ids.update(int(token) for token in (config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]))
    return sorted(ids)


def normalise_eos(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    if isinstance(eos_token_id, Integral):
        eos_token_id = [eos_token_id]
    ids = list(eos_token_id)
    if not all(isinstance(token, Integral) and not isinstance(token, bool) for token in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    return frozenset(int(token) for token in ids)


def split_prompts(input_ids) -> tuple[list[list[int]], bool]:
    """Prompts as lists of ints, and whether a single prompt was given (1-D tensor or flat list)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 1:
            return [input_ids.tolist()], True
        if input_ids.dim() == 2:
            return [row.tolist() for row in input_ids], input_ids.shape[0] == 1
        raise ValueError(f"input_ids must be 1-D [T] or 2-D [B, T], got shape {tuple(input_ids.shape)}")
    if isinstance(input_ids, (list, tuple)) and input_ids:
        if all(isinstance(token, Integral) for token in input_ids):
            return [list(input_ids)], True
        prompts = [row.tolist() if isinstance(row, torch.Tensor) else list(row) for row in input_ids]
        return prompts, False
    raise TypeError("input_ids must be a tensor [T] or [B, T], a list of ints, or a list of prompts")
