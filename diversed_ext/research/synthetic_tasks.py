"""A generated task suite small models can do: short completions scored by exact match.

Every prompt is plain text (never wrapped in the chat template: an instruct model of 135M parameters asked in a
chat turn answers in prose, and the bare answer then gets about 2% of its probability at T = 1) whose natural
continuation is the answer. Families (:data:`FAMILY_NAMES`, taken in turn, so any run of five consecutive examples
holds one of each):

    add       3 solved lines "a + b = c" (one-digit a, b), then "a + b ="
    sequence  five terms of an arithmetic sequence (start 1..40, step 1 or 2) and a comma: the sixth
    days      three consecutive days of the week and a comma: the fourth
    copy      3 solved lines "Copy: w1 w2 w3 -> w1 w2 w3", then a new "Copy: ... ->"
    lookup    a passage "Tom has a red hat. ..." on four people, one answered line "Sam's hat: blue", then
              another person's "Mia's hat:"

Families tried and dropped because exact sampling at T = 1 scored 20% or less on them: subtraction, the next letter
of the alphabet, the same questions asked in a chat turn. The solved lines of a prompt never repeat its question.

Splits: example ``i`` of a split is drawn from ``random.Random(SPLIT_SEEDS[split] + i)``; the ``train`` split uses
seeds 0 .. 999,999,999 and the held-out ``test`` split seeds from 1,000,000,000 on, so the two never share a seed.
The large families (add, copy, lookup) thus hold problems training has almost surely not seen; the small ones cannot
(days has seven questions, sequence 80) and repeat within and across splits.

Scoring (:func:`synthetic_exact_match`): the answer is the first item of the completion's first line (leading white
space skipped; items end at a comma, since a list's continuation goes on after one), with surrounding quotes, a
final "." and a leading "and" dropped and white space collapsed; it must equal the reference ignoring case, and
numbers compare as decimals ("07" and "7.0" are 7). So " 9\n...", " 9, 10, 11" and " and Friday" are credited; " 9
+ 1", " 9 10", " 10, 9" and " 19" are not.
"""

from __future__ import annotations

import random
import re
from decimal import Decimal
from typing import Callable, Optional

SHOTS = 3
DEFAULT_COUNT = 200  # examples generated when no limit is given
SPLIT_SEEDS = {"train": 0, "test": 1_000_000_000}
SPLIT_SIZE = 1_000_000_000  # seeds a split may use from its start

_WORDS = ("apple", "dog", "cat", "house", "tree", "car", "book", "fish", "bird", "chair", "lamp", "ship", "cake",
          "shoe", "ring")
_NAMES = ("Tom", "Anna", "Sam", "Lily", "Max", "Emma", "Ben", "Mia")
_COLOURS = ("red", "blue", "green", "yellow", "black", "white", "pink", "brown")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a} + {b} =", str(a + b)


def _copy(rng: random.Random) -> tuple[str, str]:
    words = " ".join(rng.sample(_WORDS, 3))
    return f"Copy: {words} ->", words


# Families asked after SHOTS solved lines of their own kind (the rest are lists or passages that need none).
FEW_SHOT: dict[str, Callable[[random.Random], tuple[str, str]]] = {"add": _add, "copy": _copy}


def _sequence(rng: random.Random) -> tuple[str, str]:
    start, step = rng.randint(1, 40), rng.randint(1, 2)
    return ", ".join(str(start + step * k) for k in range(5)) + ",", str(start + 5 * step)


def _days(rng: random.Random) -> tuple[str, str]:
    day = rng.randrange(7)
    return ", ".join(_DAYS[(day + k) % 7] for k in range(3)) + ",", _DAYS[(day + 3) % 7]


def _few_shot(rng: random.Random, family: Callable[[random.Random], tuple[str, str]]) -> tuple[str, str]:
    """SHOTS solved lines and the question (drawn first, so the shots are redrawn, never the question)."""
    question, answer = family(rng)
    shots: list[tuple[str, str]] = []
    while len(shots) < SHOTS:
        shot = family(rng)
        if shot[0] != question and shot not in shots:
            shots.append(shot)
    return "".join(f"{line} {solution}\n" for line, solution in shots) + question, answer


def _lookup(rng: random.Random) -> tuple[str, str]:
    """A passage on four people's hats, one of them answered as the worked line, then another one asked."""
    names, colours = rng.sample(_NAMES, 4), rng.sample(_COLOURS, 4)
    asked, shown = rng.sample(range(4), 2)
    passage = " ".join(f"{name} has a {colour} hat." for name, colour in zip(names, colours))
    return f"{passage}\n{names[shown]}'s hat: {colours[shown]}\n{names[asked]}'s hat:", colours[asked]


# Families whose prompt is complete as drawn: a list to continue, or a passage with its one worked line.
LISTS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "sequence": _sequence, "days": _days, "lookup": _lookup}
FAMILY_NAMES = ("add", "sequence", "days", "copy", "lookup")  # example i is of family FAMILY_NAMES[i % 5]


def make_example(split: str, index: int) -> dict:
    """Example ``index`` of ``split``: {"split", "index", "seed", "family", "prompt", "answer"}."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r} of the synthetic task; known: {', '.join(SPLIT_SEEDS)}")
    if not 0 <= index < SPLIT_SIZE:
        raise ValueError(f"index {index} is outside the synthetic split (0 .. {SPLIT_SIZE - 1})")
    seed = SPLIT_SEEDS[split] + index
    rng = random.Random(seed)
    family = FAMILY_NAMES[index % len(FAMILY_NAMES)]
    prompt, answer = _few_shot(rng, FEW_SHOT[family]) if family in FEW_SHOT else LISTS[family](rng)
    return {"split": split, "index": index, "seed": seed, "family": family, "prompt": prompt, "answer": answer}


def load_synthetic(split: Optional[str] = None, limit: Optional[int] = None) -> list[dict]:
    """The first ``limit`` (None: :data:`DEFAULT_COUNT`) examples of ``split`` ("test", the default, or "train"),
    generated: the task's stand-in for a data file, so ``--data`` names the split."""
    split = split or "test"
    if split not in SPLIT_SEEDS:
        raise ValueError(f"the synthetic task's --data names a split, {' or '.join(SPLIT_SEEDS)}; got {split!r}")
    count = DEFAULT_COUNT if limit is None else limit
    if count < 0:
        raise ValueError(f"limit must be >= 0, got {count}")
    return [make_example(split, index) for index in range(count)]


def synthetic_prompt(example: dict) -> str:
    """The example's prompt as generated: plain text to be continued (no instruction around it)."""
    return example["prompt"]


_QUOTES = "\"'`"


def extract_synthetic_answer(completion: str) -> str:
    """The completion's answer: the first item (up to a comma) of its first line after leading white space, with
    surrounding quotes and a final "." dropped and white space collapsed (see the module's scoring rule)."""
    item = completion.lstrip().split("\n", 1)[0].split(",", 1)[0].strip()
    item = item.rstrip(".").strip().strip(_QUOTES).strip().rstrip(".")
    words = item.split()
    return " ".join(words[1:] if words[:1] == ["and"] else words)  # a list's last item is often "and X"


def _as_number(text: str) -> Optional[Decimal]:
    return Decimal(text) if re.fullmatch(r"-?\d+(?:\.\d+)?", text) else None


def synthetic_exact_match(example: dict, completion: str) -> float:
    """1.0 when the completion's answer (:func:`extract_synthetic_answer`) equals the example's, else 0.0."""
    predicted, gold = extract_synthetic_answer(completion), example["answer"]
    number, gold_number = _as_number(predicted), _as_number(gold)
    if gold_number is not None:
        return float(number is not None and number == gold_number)
    return float(predicted.casefold() == " ".join(gold.split()).casefold())
