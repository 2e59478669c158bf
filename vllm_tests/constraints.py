"""Hard constraints in one batch beside unconstrained requests, for the engine tests on both runners: each kind of
constrained request (``allowed_token_ids``, ``bad_words``, ``min_tokens`` and structured outputs: a JSON schema, a
regex, a choice) at w = 0, where the draft alone would decide every token, beside unconstrained requests at w = 0 and
w = 1, with the engine's head, with the gate and greedy; then, per kind, the emitted tokens (or, for structured outputs,
the requests) that break what the request asked, and the acceptance vLLM reports. (``logit_bias`` and ``min_p`` never
reach a speculative engine's sampler: vLLM refuses such requests when speculative decoding is on, which
:func:`refused_with_speculation` checks.)"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import jsonschema

from engines import PROMPTS, chat

# Tokens allowed to allowed_token_ids requests: digits, spaces, arithmetic and the words of an answer.
ALLOWED_TEXT = " 0123456789+-=*/.,:\n The answer is"
BAD_WORDS = ["the", "The"]
# Questions with a one-word answer: the draft proposes the end of the turn early and often.
SHORT_PROMPTS = ["Reply with one word only: what colour is the sky on a clear day?",
                 "Reply with one number only: how many legs does a spider have?",
                 "Reply with one word only: what is the opposite of hot?",
                 "Reply with one word only: which animal says moo?"]
# Structured outputs, each a finite language short enough to finish well within the tests' token budgets.
UNITS = ["rolls", "marbles", "miles", "days", "dollars", "people", "boxes", "weeks"]
MAX_ANSWER = 9999
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "unit"],
                 "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": MAX_ANSWER},
                                "unit": {"enum": UNITS}}}
ANSWER_REGEX = r"The answer is [0-9]{1,4}\."
CHOICES = ["yes", "no", "it depends"]
# What engines serving this batch set: JSON without free whitespace, whose runs could outlast a token budget (vLLM
# offers that with its xgrammar backend, the one it picks for these grammars by default).
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}

HARD_CONSTRAINTS = ("allowed_token_ids", "bad_words", "min_tokens")
STRUCTURED = ("json", "regex", "choice")
CONSTRAINED = HARD_CONSTRAINTS + STRUCTURED
FREE_DIVERSED, FREE_EXACT = "free, w = 0", "free, w = 1"
HEAD = "default"  # the head the batch's engines load
# The drafters the batch runs with: the default pair's draft model, and the trained EAGLE-3 head for its target
# (a reduced draft vocabulary; drafts sampled greedily).
DRAFTERS = ("draft_model", "eagle3")
FREE = (FREE_DIVERSED, FREE_EXACT, "free, head", "free, gate", "free, greedy")


def _valid_answer_json(text: str) -> bool:
    """Whether ``text`` is a JSON document that ANSWER_SCHEMA accepts (jsonschema, which vLLM depends on)."""
    try:
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@dataclass
class Kind:
    """One kind of request: what it asks, and what breaking it means (token ids it must not emit, sequences, or a
    text that must be whole and valid)."""

    name: str
    extra_args: dict  # the request's diversed_* fields
    constraint: dict = field(default_factory=dict)  # SamplingParams fields
    allowed: frozenset | None = None
    banned_sequences: tuple = ()
    stop_ids: frozenset = frozenset()  # must not appear among the first min_tokens tokens
    valid_text: Optional[Callable[[str], bool]] = None  # structured outputs: the finished text's check
    temperature: float = 1.0


def _ids(tokenizer, text: str) -> list:
    return tokenizer.encode(text, add_special_tokens=False)


def _structured(**params) -> dict:
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(**params)}


def kinds(tokenizer, num_tokens: int) -> list:
    """Every kind of request of the batch, the constraints as ``tokenizer`` spells them."""
    allowed = sorted(set(_ids(tokenizer, ALLOWED_TEXT)) | {_ids(tokenizer, digit)[0] for digit in "0123456789"})
    # vLLM bans each bad word as written and with a leading space (a sequence's last token, after its prefix).
    banned = tuple(tuple(_ids(tokenizer, prefix + word)) for word in BAD_WORDS for prefix in ("", " "))
    diversed = {"diversed_weight": 0.0}
    return [
        Kind("allowed_token_ids", diversed, {"allowed_token_ids": allowed}, allowed=frozenset(allowed)),
        Kind("bad_words", diversed, {"bad_words": list(BAD_WORDS)}, banned_sequences=banned),
        Kind("min_tokens", diversed, {"min_tokens": num_tokens}, stop_ids=frozenset({tokenizer.eos_token_id})),
        Kind("json", diversed, _structured(json=ANSWER_SCHEMA), valid_text=_valid_answer_json),
        Kind("regex", diversed, _structured(regex=ANSWER_REGEX),
             valid_text=lambda text: re.fullmatch(ANSWER_REGEX, text) is not None),
        Kind("choice", diversed, _structured(choice=CHOICES), valid_text=lambda text: text in CHOICES),
        Kind(FREE_DIVERSED, diversed), Kind(FREE_EXACT, {"diversed_weight": 1.0}),
        Kind("free, head", {"diversed_head": HEAD}),
        Kind("free, gate", {"diversed_weight": 0.5, "diversed_gate_margin": 1.0}),
        Kind("free, greedy", {"diversed_weight": 0.3}, temperature=0.0),
    ]


def requests(tokenizer, num_prompts: int, num_tokens: int) -> list:
    """(kind, messages, SamplingParams) of the whole batch: ``num_prompts`` seeded requests of each kind (temperature
    1 but for the greedy kind); min_tokens requests ask short questions and at least ``num_tokens`` tokens."""
    from vllm import SamplingParams

    batch = []
    for kind in kinds(tokenizer, num_tokens):
        prompts = SHORT_PROMPTS if kind.name == "min_tokens" else PROMPTS
        for index in range(num_prompts):
            params = SamplingParams(temperature=kind.temperature, seed=100 + index, max_tokens=num_tokens,
                                    extra_args=dict(kind.extra_args), **kind.constraint)
            batch.append((kind, chat(prompts[index % len(prompts)]), params))
    return batch


def _occurrences(tokens: list, sequence: tuple) -> int:
    width = len(sequence)
    return sum(tuple(tokens[start:start + width]) == sequence for start in range(len(tokens) - width + 1))


def violations(kind: Kind, completion) -> int:
    """How many of the tokens of ``completion`` (vLLM's CompletionOutput) break what ``kind`` asked; for structured
    outputs 1 unless the text finished and is what the grammar describes."""
    if kind.valid_text is not None:
        return int(not (completion.finish_reason == "stop" and kind.valid_text(completion.text)))
    tokens = list(completion.token_ids)
    count = sum(_occurrences(tokens, sequence) for sequence in kind.banned_sequences)
    if kind.allowed is not None:
        count += sum(token not in kind.allowed for token in tokens)
    if kind.stop_ids:
        count += sum(token in kind.stop_ids for token in tokens[:kind.constraint["min_tokens"]])
    return count


@dataclass
class BatchOutcome:
    """What one run of the batch gave: per kind {"tokens", "violations", "accepted", "drafted"}, and each request's
    (kind name, emitted token ids) in batch order."""

    tallies: dict
    emitted: list


def tally(batch: list, outputs: list) -> BatchOutcome:
    totals, emitted = {}, []
    for (kind, _, _), output in zip(batch, outputs):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        emitted.append((kind.name, tokens))
        entry = totals.setdefault(kind.name, dict(tokens=0, violations=0, accepted=0, drafted=0))
        entry["tokens"] += len(tokens)
        entry["violations"] += violations(kind, completion)
        metrics = completion.spec_decode_metrics.to_dict()
        entry["accepted"] += metrics["num_accepted_draft_tokens"]
        entry["drafted"] += metrics["num_draft_tokens"]
    return BatchOutcome(totals, emitted)


def speculative(drafter: str):
    """What :func:`engines.start_engine` drafts with for a name of ``DRAFTERS``."""
    if drafter == "draft_model":
        return "draft"
    from drafters import trained_eagle3

    return {"method": "eagle3", "model": str(trained_eagle3())}  # greedy drafts: vLLM's default


def start_batch_engine(pair, drafter: str = "draft_model", **engine_args):
    """An engine for this batch on the default pair's target, drafting with ``drafter`` (one of ``DRAFTERS``),
    DIVERSED at w = 1 unless a request says otherwise, the batch's head loaded (with EAGLE-3, the one trained on its
    states), compact JSON."""
    from engines import start_engine

    return start_engine(pair, speculative=speculative(drafter), diversed={"weight": 1.0, "heads": [HEAD]},
                        structured_outputs_config=STRUCTURED_OUTPUTS_CONFIG, **engine_args)


def run_batch(llm, num_prompts: int, num_tokens: int) -> BatchOutcome:
    """The whole batch in one call of ``llm.chat``, tallied by kind."""
    batch = requests(llm.get_tokenizer(), num_prompts, num_tokens)
    outputs = llm.chat([messages for _, messages, _ in batch], [params for _, _, params in batch], use_tqdm=False)
    return tally(batch, outputs)


def rate(entry: dict) -> float:
    return entry["accepted"] / entry["drafted"]


def check_kind_kept(tallies: dict, kind: str, least_tokens: int, least_drafted: int) -> None:
    """No request of ``kind`` broke its constraint; a hard constraint's requests also emitted at least
    ``least_tokens`` and drafted more than ``least_drafted`` (so the test had drafts to reject)."""
    entry = tallies[kind]
    assert entry["violations"] == 0, tallies
    if kind in HARD_CONSTRAINTS:
        assert entry["tokens"] >= least_tokens and entry["drafted"] > least_drafted, entry


def check_gain_kept(tallies: dict, least_drafted: int) -> None:
    """The unconstrained requests at w = 0 keep more drafts than those at w = 1, and so do the constraints that rule
    out only a few tokens (most drafts stay allowed)."""
    free, exact = tallies[FREE_DIVERSED], tallies[FREE_EXACT]
    assert exact["drafted"] > least_drafted and free["drafted"] > least_drafted, tallies
    assert rate(free) > rate(exact), tallies
    for kind in ("bad_words", "min_tokens"):
        assert rate(tallies[kind]) > rate(exact), (kind, tallies)


def summary(tallies: dict) -> dict:
    """The tallies with each kind's acceptance (None where nothing was drafted), as the tests print them."""
    return {kind: dict(entry, acceptance=round(rate(entry), 3) if entry["drafted"] else None)
            for kind, entry in tallies.items()}


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
