"""Tiny random Llama pairs (no downloads) for the speculative decoding loop tests (test_decoding_*.py).

The target is a random one-layer Llama with a sharpened LM head; the draft is the same model with noise added to every
weight, so the two agree often but not always (total variation about 0.4) and every verifier path runs.

Import this module only after `pytest.importorskip("transformers")`: it needs transformers.
"""

import copy

import torch
import transformers

WIDE_VOCAB = 32
PROMPT = [1, 3, 0, 2]


def tiny_llama(seed, vocab, sharpness=20.0, layers=1):
    """A random Llama with peaked next-token distributions (the LM head scaled up)."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def noisy_copy(model, seed, scale=0.5):
    """The model with Gaussian noise of ``scale`` times each weight's spread added: a related but different draft."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.numel() > 1:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return draft


def wide_pair_models():
    """(target, draft) with a 32-token vocabulary and two layers: the pair most decoding tests share."""
    target = tiny_llama(2, WIDE_VOCAB, sharpness=30.0, layers=2)
    return target, noisy_copy(target, 3)


def sequences(output):
    """A GenerationOutput's new tokens as lists of ints."""
    return [tokens.tolist() for tokens in output.sequences]


def assert_prompts_decode_as_alone(decoder, prompts, *, seed=40, max_new_tokens=14, eos=(5, 9)):
    """Prompt i decoded alone with seed + i gives the tokens it gets among all the prompts and two at a time (other
    neighbours, refilled slots); returns the tokens decoded alone."""
    alone = [sequences(decoder.generate(prompt, max_new_tokens=max_new_tokens, eos_token_id=list(eos),
                                        seed=seed + index))[0]
             for index, prompt in enumerate(prompts)]
    for batch_size in (None, 2):
        output = decoder.generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=list(eos), seed=seed,
                                  batch_size=batch_size)
        assert sequences(output) == alone, f"batch_size={batch_size}"
    return alone
