"""Tiny random Llama models (no downloads) and the decoding loop's shared checks.

Every builder is random_llama with its own settings; they differ on purpose (sizes, sharpened heads, biases), since
each test's exact numbers depend on them, so each keeps its own name. transformers is imported when a model is built:
a test file that builds one calls pytest.importorskip("transformers") first.

The decoding pairs: the target is a random Llama with a sharpened LM head; the draft is the same model with noise
added to every weight, so the two agree often but not always (total variation about 0.4) and every verifier path runs.
"""

import copy

import torch

from .stats import SMALL_VOCAB

WIDE_VOCAB = 32
PROMPT = [1, 3, 0, 2]


def random_llama(seed, *, sharpness=None, **config):
    """LlamaForCausalLM(LlamaConfig(**config)) in eval mode, its weights drawn after torch.manual_seed(seed); with
    `sharpness`, the LM head is scaled by it (peaked next-token distributions)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    if sharpness is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpness)
    return model


# ---- decoding loop -----------------------------------------------------------------------------------------------


def decoding_llama(seed, vocab, sharpness=20.0, layers=1):
    """A random Llama with peaked next-token distributions (the LM head scaled up), for the decoding loop tests."""
    return random_llama(seed, sharpness=sharpness, vocab_size=vocab, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
                        eos_token_id=None, pad_token_id=None)


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
    target = decoding_llama(2, WIDE_VOCAB, sharpness=30.0, layers=2)
    return target, noisy_copy(target, 3)


def small_pair_models():
    """(target, draft) with a 4-token vocabulary, whose output laws are small enough to compute exactly."""
    target = decoding_llama(0, SMALL_VOCAB)
    return target, noisy_copy(target, 1)


def double_pair_models():
    """The wide pair in float64, where a batched product differs from a one-row product only in the last bits of a
    double, so decisions can be compared token for token."""
    target, draft = wide_pair_models()
    return copy.deepcopy(target).double(), copy.deepcopy(draft).double()


def models_on_device(models, device):
    """The models themselves on the CPU, else copies of them on ``device`` (the suite's fixtures are shared by many
    tests and stay where they are)."""
    if torch.device(device).type == "cpu":
        return tuple(models)
    return tuple(copy.deepcopy(model).to(device) for model in models)


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


# ---- lean forward ------------------------------------------------------------------------------------------------

FORWARD_VOCAB = 37  # not a multiple of any vector width
# Feeds appended one after another, with crops (negative numbers: positions dropped) as the decoding loop makes them.
FORWARD_SCHEDULE = [7, 1, 3, -2, 4, 1, -4, 5, 1, 1, 2]
# The Llama variants the lean forward must follow: forward_llama's overrides.
FORWARD_CONFIGS = {
    "gqa": {},
    "multi-head": {"num_key_value_heads": 4},
    "tied-head": {"tie_word_embeddings": True},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "rope-linear-scaling": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "head-dim-16": {"head_dim": 16},
}


def forward_llama(seed, **overrides):
    """A random two-layer Llama for the lean forward's tests (LlamaConfig settings overridden by `overrides`)."""
    settings = dict(vocab_size=FORWARD_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    settings.update(overrides)
    model = random_llama(seed, sharpness=5.0, **settings)  # peaked logits, so a wrong position or mask shows
    with torch.no_grad():
        for module in model.modules():  # transformers initialises biases to zero, which would hide a dropped bias
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
    return model


# ---- experiments -------------------------------------------------------------------------------------------------

EXPERIMENT_VOCAB = 32


def experiment_llama(seed):
    """A one-layer random Llama with an unscaled head, for the experiment functions (train / eval / validate)."""
    return random_llama(seed, vocab_size=EXPERIMENT_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)


class CharTokenizer:
    """Enough of a tokenizer for the experiment functions: one id per character, no chat template."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [ord(char) % EXPERIMENT_VOCAB for char in text[-12:]]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(token) for token in ids)


def experiment_pair_models():
    """(target, draft, tokenizer) the experiment functions run on end to end."""
    return experiment_llama(0), experiment_llama(1), CharTokenizer()


def gsm8k_examples(count=3):
    return [{"question": f"What is {index} + 1?", "answer": f"{index} + 1 = {index + 1}\n#### {index + 1}"}
            for index in range(count)]
