"""The tokens an int8 draft is calibrated on: a few short exchanges, encoded as the pair's tokenizer encodes a chat.

Smoothing (:mod:`diversed_ext.forward.smoothing`) needs each layer's largest activation per channel. Those come from
the first tokens of a sequence and from outlier channels that any text lights up, so a handful of exchanges of
everyday kinds (arithmetic, code, facts, advice) is enough, and nothing has to be downloaded. Each is encoded with the
tokenizer's chat template when it has one, so the draft also sees the template's own tokens, which every prompt the
decoding loop sends starts with; else as plain text.
"""

from __future__ import annotations

import torch

# (user, assistant) exchanges; changing them changes every int8 draft quantised afterwards (CALIBRATION_NAME names
# this set in the draft cache's metadata, so a changed set is quantised afresh).
CALIBRATION_NAME = "exchanges-1"
CALIBRATION_EXCHANGES = (
    ("A baker makes 12 trays of 18 muffins and sells all but 25. How many muffins does she sell?",
     "She makes 12 x 18 = 216 muffins. She sells all but 25, so she sells 216 - 25 = 191 muffins.\n#### 191"),
    ("Write a Python function that returns the largest even number in a list, or None if there is none.",
     "```python\ndef largest_even(numbers):\n    evens = [n for n in numbers if n % 2 == 0]\n"
     "    return max(evens) if evens else None\n```\nIt keeps the even numbers and returns the largest one."),
    ("Why do leaves change colour in autumn?",
     "As days shorten, trees stop making chlorophyll, the green pigment. It breaks down, and the yellow and orange "
     "pigments that were there all along show through; some trees also make red pigments from trapped sugars."),
    ("How do I boil an egg so the yolk stays soft?",
     "Lower the egg into boiling water, cook it for six minutes, then put it in cold water for a minute. Peel it "
     "under running water."),
    ("Tom has 3 times as many marbles as Ann, and together they have 64. How many does Ann have?",
     "Let Ann have x marbles. Then Tom has 3x, and x + 3x = 64, so 4x = 64 and x = 16. Ann has 16 marbles.\n#### 16"),
    ("Translate 'Where is the train station?' into French and Spanish.",
     "French: \"Où est la gare ?\"\nSpanish: \"¿Dónde está la estación de tren?\""),
)


def calibration_batches(tokenizer) -> list:
    """Token ids [T] (long) of every exchange of :data:`CALIBRATION_EXCHANGES`, as ``tokenizer`` encodes the chat."""
    batches = []
    for user, assistant in CALIBRATION_EXCHANGES:
        if getattr(tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            text = tokenizer.apply_chat_template(chat, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(f"{user}\n{assistant}")["input_ids"]
        batches.append(torch.tensor(ids, dtype=torch.long))
    return batches
