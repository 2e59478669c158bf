"""Drafters other than a draft model, for the default pair: vLLM's n-gram lookup, and EAGLE and EAGLE-3 heads built
here as checkpoints (a folder with ``config.json`` and safetensors that vLLM loads) with small random weights, enough
to run the plumbing; the engines the drafter tests start with them."""

from __future__ import annotations

import json
from pathlib import Path

from engines import start_engine

SEED = 0
WEIGHT_SCALE = 0.02  # a Llama initialiser's spread: random drafts, finite logits
# EAGLE-3's reduced draft vocabulary: the first REDUCED_HEAD ids and the last REDUCED_TAIL ids of the target's, so
# that d2t maps some draft ids by a non-zero offset and the rows vLLM hands over are -inf on the ids in between.
REDUCED_HEAD = 12288
REDUCED_TAIL = 4096
EAGLE3_AUX_LAYERS = [2, 15, 27]  # the target layers whose hidden states EAGLE-3 reads (vLLM's default for 30 layers)
# n-gram lookup: the longest and shortest suffix it matches in the request's own tokens
NGRAM_CONFIG = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 2}

# Prompts whose answers repeat what came before, so that n-gram lookup finds matches.
REPEATING_PROMPTS = [
    "Repeat this list three times: apple, banana, cherry, date, elderberry, fig, grape.",
    "Write the numbers from 1 to 40 separated by commas.",
    "Copy this sentence twice: The quick brown fox jumps over the lazy dog near the river bank.",
    "Write the word 'hello' ten times, each on its own line.",
    "List the days of the week twice, separated by commas.",
    "Count from 10 to 30 in words.",
    "Write the alphabet in capital letters twice, separated by spaces.",
    "Repeat after me three times: red, green, blue, yellow.",
]


def _target_config(pair) -> dict:
    return json.loads((Path(pair.target) / "config.json").read_text())


def _llama_layer(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 qkv_input: int, generator) -> dict:
    import torch

    def random(*shape):
        return torch.randn(*shape, generator=generator) * WEIGHT_SCALE

    return {f"{prefix}self_attn.q_proj.weight": random(heads * head_dim, qkv_input),
            f"{prefix}self_attn.k_proj.weight": random(kv_heads * head_dim, qkv_input),
            f"{prefix}self_attn.v_proj.weight": random(kv_heads * head_dim, qkv_input),
            f"{prefix}self_attn.o_proj.weight": random(hidden, heads * head_dim),
            f"{prefix}mlp.gate_proj.weight": random(intermediate, hidden),
            f"{prefix}mlp.up_proj.weight": random(intermediate, hidden),
            f"{prefix}mlp.down_proj.weight": random(hidden, intermediate),
            f"{prefix}post_attention_layernorm.weight": torch.ones(hidden)}


def _head_config(target: dict, architectures: list, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters", "bos_token_id",
            "eos_token_id", "model_type")
    config = {key: target[key] for key in keys if key in target}
    config.update(architectures=architectures, num_hidden_layers=1, tie_word_embeddings=False, dtype="float32",
                  **extra)
    return config


def _write(folder: Path, config: dict, tensors: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def build_eagle(pair, folder: Path) -> Path:
    """An EAGLE head for the default pair's target: one Llama layer fed ``fc([token embedding, target hidden])``,
    sharing the target's embeddings and LM head (the checkpoint has neither, so vLLM shares them)."""
    import torch

    target = _target_config(pair)
    hidden = target["hidden_size"]
    generator = torch.Generator().manual_seed(SEED)
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * WEIGHT_SCALE}
    # EAGLE's first layer has no input norm: vLLM replaces it by the identity
    tensors.update(_llama_layer("layers.0.", hidden, target["num_attention_heads"], target["num_key_value_heads"],
                                target["head_dim"], target["intermediate_size"], hidden, generator))
    return _write(folder, _head_config(target, ["LlamaForCausalLM"]), tensors)


def reduced_vocabulary(vocab_size: int):
    """EAGLE-3's draft vocabulary as target ids (ascending), and d2t (target id = draft id + d2t[draft id])."""
    import torch

    ids = torch.cat([torch.arange(REDUCED_HEAD), torch.arange(vocab_size - REDUCED_TAIL, vocab_size)])
    return ids, ids - torch.arange(ids.shape[0])


def build_eagle3(pair, folder: Path) -> Path:
    """An EAGLE-3 head (``LlamaForCausalLMEagle3``) for the default pair's target: ``fc`` over three auxiliary
    target layers' hidden states, one layer whose attention reads [embedding, hidden], its own LM head over a reduced
    draft vocabulary with ``d2t``/``t2d``, and the target's embeddings (shared, not in the checkpoint)."""
    import torch

    target = _target_config(pair)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    ids, d2t = reduced_vocabulary(vocab)
    generator = torch.Generator().manual_seed(SEED + 1)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {"fc.weight": torch.randn(hidden, len(EAGLE3_AUX_LAYERS) * hidden, generator=generator) * WEIGHT_SCALE,
               "norm.weight": torch.ones(hidden),
               "lm_head.weight": torch.randn(ids.shape[0], hidden, generator=generator) * WEIGHT_SCALE,
               "d2t": d2t.to(torch.int64), "t2d": t2d,
               "midlayer.input_layernorm.weight": torch.ones(hidden),
               "midlayer.hidden_norm.weight": torch.ones(hidden)}
    tensors.update(_llama_layer("midlayer.", hidden, target["num_attention_heads"], target["num_key_value_heads"],
                                target["head_dim"], target["intermediate_size"], 2 * hidden, generator))
    config = _head_config(target, ["LlamaForCausalLMEagle3"], draft_vocab_size=int(ids.shape[0]),
                          target_hidden_size=hidden,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYERS,
                                        "use_aux_hidden_state": True})
    return _write(folder, config, tensors)


TRAINED_EAGLE3 = "smollm2-135m-eagle3"  # the trained EAGLE-3 drafter's folder under diversed_ext/drafters/


def trained_eagle3() -> Path:
    """The trained EAGLE-3 drafter for the default pair, as the package ships it (``config.json`` and
    ``model.safetensors`` in vLLM's eagle3 layout); FileNotFoundError naming the folder where it is missing."""
    import diversed_ext

    folder = Path(diversed_ext.__file__).resolve().parent / "drafters" / TRAINED_EAGLE3
    missing = [name for name in ("config.json", "model.safetensors") if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"the trained EAGLE-3 drafter lacks {', '.join(missing)} in {folder}")
    return folder


def start_drafter_engine(pair, speculative_config: dict, diversed, **extra):
    """An LLM on the default pair's target, drafting with ``speculative_config`` (K = NUM_DRAFT unless given)."""
    return start_engine(pair, speculative=speculative_config, diversed=diversed, **extra)


# K by batch size, vLLM's num_speculative_tokens_per_batch_size (inclusive ranges of batch sizes from 1): 3 for a
# request alone, 1 each for two or three together, nothing from four on
DRAFT_SCHEDULE = [[1, 1, 3], [2, 3, 1], [4, 64, 0]]


def start_scheduled_engine(pair, diversed, **extra):
    """An LLM drafting with the trained EAGLE-3 drafter (probabilistic drafts) as many tokens as DRAFT_SCHEDULE gives
    each step's batch size."""
    return start_drafter_engine(pair, {"method": "eagle3", "model": str(trained_eagle3()),
                                       "draft_sample_method": "probabilistic",
                                       "num_speculative_tokens_per_batch_size": DRAFT_SCHEDULE}, diversed, **extra)
