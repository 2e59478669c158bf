"""Hard constraints in one batch beside unconstrained requests, for the engine tests on both runners: each kind of
request (``allowed_token_ids``, ``bad_words``, ``min_tokens``) at w = 0, where the draft alone would decide every
token, and unconstrained requests at w = 0 and w = 1; then, per kind, the emitted tokens that break what the request
asked and the acceptance vLLM reports. (``logit_bias`` and ``min_p`` never reach a speculative engine's sampler:
vLLM refuses such requests when speculative decoding is on, which :func:`refused_with_speculation` checks.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines import PROMPTS, chat

# Tokens allowed to allowed_token_ids requests: digits, spaces, arithmetic and the words of an answer.
ALLOWED_TEXT = " 0123456789+-=*/.,:\n The answer is"
BAD_WORDS = ["the", "The"]
# Questions with a one-word answer: the draft proposes the end of the turn early and often.
SHORT_PROMPTS = ["Reply with one word only: what colour is the sky on a clear day?",
                 "Reply with one number only: how many legs does a spider have?",
                 "Reply with one word only: what is the opposite of hot?",
                 "Reply with one word only: which animal says moo?"]
CONSTRAINED = ("allowed_token_ids", "bad_words", "min_tokens")
FREE_DIVERSED, FREE_EXACT = "free, w = 0", "free, w = 1"


@dataclass
class Kind:
    """One kind of request: what it asks, and what breaking it means (token ids it must not emit, or sequences)."""

    name: str
    weight: float
    constraint: dict = field(default_factory=dict)  # SamplingParams fields
    allowed: frozenset | None = None
    banned_sequences: tuple = ()
    stop_ids: frozenset = frozenset()  # must not appear among the first min_tokens tokens


def _ids(tokenizer, text: str) -> list:
    return tokenizer.encode(text, add_special_tokens=False)


def kinds(tokenizer, num_tokens: int) -> list:
    """Every kind of request of the batch, the constraints as ``tokenizer`` spells them."""
    allowed = sorted(set(_ids(tokenizer, ALLOWED_TEXT)) | {_ids(tokenizer, digit)[0] for digit in "0123456789"})
    # vLLM bans each bad word as written and with a leading space (a sequence's last token, after its prefix).
    banned = tuple(tuple(_ids(tokenizer, prefix + word)) for word in BAD_WORDS for prefix in ("", " "))
    return [
        Kind("allowed_token_ids", 0.0, {"allowed_token_ids": allowed}, allowed=frozenset(allowed)),
        Kind("bad_words", 0.0, {"bad_words": list(BAD_WORDS)}, banned_sequences=banned),
        Kind("min_tokens", 0.0, {"min_tokens": num_tokens}, stop_ids=frozenset({tokenizer.eos_token_id})),
        Kind(FREE_DIVERSED, 0.0), Kind(FREE_EXACT, 1.0),
    ]


def requests(tokenizer, num_prompts: int, num_tokens: int) -> list:
    """(kind, messages, SamplingParams) of the whole batch: ``num_prompts`` seeded requests of each kind at
    temperature 1; min_tokens requests ask short questions and at least ``num_tokens`` tokens."""
    from vllm import SamplingParams

    batch = []
    for kind in kinds(tokenizer, num_tokens):
        prompts = SHORT_PROMPTS if kind.name == "min_tokens" else PROMPTS
        for index in range(num_prompts):
            params = SamplingParams(temperature=1.0, seed=100 + index, max_tokens=num_tokens,
                                    extra_args={"diversed_weight": kind.weight}, **kind.constraint)
            batch.append((kind, chat(prompts[index % len(prompts)]), params))
    return batch


def _occurrences(tokens: list, sequence: tuple) -> int:
    width = len(sequence)
    return sum(tuple(tokens[start:start + width]) == sequence for start in range(len(tokens) - width + 1))


def violations(kind: Kind, tokens: list) -> int:
    """How many of ``tokens`` break what ``kind`` asked."""
    count = sum(_occurrences(tokens, sequence) for sequence in kind.banned_sequences)
    if kind.allowed is not None:
        count += sum(token not in kind.allowed for token in tokens)
    if kind.stop_ids:
        count += sum(token in kind.stop_ids for token in tokens[:kind.constraint["min_tokens"]])
    return count


def tally(batch: list, outputs: list) -> dict:
    """{kind name: {"tokens", "violations", "accepted", "drafted"}} over the batch's outputs."""
    totals = {}
    for (kind, _, _), output in zip(batch, outputs):
        tokens = list(output.outputs[0].token_ids)
        entry = totals.setdefault(kind.name, dict(tokens=0, violations=0, accepted=0, drafted=0))
        entry["tokens"] += len(tokens)
        entry["violations"] += violations(kind, tokens)
        metrics = output.outputs[0].spec_decode_metrics.to_dict()
        entry["accepted"] += metrics["num_accepted_draft_tokens"]
        entry["drafted"] += metrics["num_draft_tokens"]
    return totals


def run_batch(llm, num_prompts: int, num_tokens: int) -> dict:
    """The whole batch in one call of ``llm.chat``, tallied by kind."""
    batch = requests(llm.get_tokenizer(), num_prompts, num_tokens)
    outputs = llm.chat([messages for _, messages, _ in batch], [params for _, _, params in batch], use_tqdm=False)
    return tally(batch, outputs)


def rate(entry: dict) -> float:
    return entry["accepted"] / entry["drafted"]


def refused_with_speculation(llm) -> list:
    """The error of each request with a ``logit_bias`` of -100 or a ``min_p``, which vLLM refuses when speculative
    decoding is on (its own request validation, before the plugin's); a request it served would be missing here."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    errors = []
    for constraint in ({"logit_bias": {_ids(llm.get_tokenizer(), " the")[0]: -100.0}}, {"min_p": 0.1}):
        try:
            llm.chat([chat(PROMPTS[0])], [SamplingParams(max_tokens=4, extra_args={"diversed_weight": 0.0},
                                                         **constraint)], use_tqdm=False)
        except VLLMValidationError as error:
            errors.append(str(error))
    return errors
