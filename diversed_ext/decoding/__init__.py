"""The speculative decoding loop over Hugging Face model pairs (``ar``, ``sd``, ``static``, ``diversed``).

``loop`` holds :class:`SpeculativeDecoder`; ``batch`` one round for several requests; ``state`` one request in
flight; ``stats`` what a run measured; ``runners`` how a model is run (its own forward, or the lean Llama forward of
:mod:`diversed_ext.forward`); ``draft_lengths`` how many tokens each request drafts a round; ``drafters`` callable
drafters that give tokens only; ``eagle_drafting`` drafting with an EAGLE-3 head on the target's hidden states;
``prompts`` prompt encoding and EOS ids; ``checks`` the argument checks. Uses only the floors below it (``forward``,
``ops``).
"""

from .checks import DRAFT_MODES, METHODS
from .draft_lengths import (DEFAULT_DRAFT_LENGTH, DRAFT_LENGTHS, ConfidenceDraftLength, DraftLengthPolicy,
                            GainDraftLength, HeuristicDraftLength, RoundOutcome)
from .drafters import NgramDrafter
from .fly import Fly
from .gate import Gate
from .typical import Typical
from .loop import DEFAULT_MAX_DRAFT, SpeculativeDecoder
from .prompts import encode_prompt, eos_ids
from .state import DecodingState
from .stats import DecodingSummary, Generation, GenerationOutput, RoundStats, summarize

__all__ = ["SpeculativeDecoder", "Fly", "Gate", "Typical", "DEFAULT_MAX_DRAFT", "DecodingState", "METHODS", "DRAFT_MODES", "NgramDrafter", "RoundStats", "Generation",
           "DecodingSummary", "GenerationOutput", "summarize", "encode_prompt", "eos_ids", "DRAFT_LENGTHS",
           "DEFAULT_DRAFT_LENGTH", "DraftLengthPolicy", "HeuristicDraftLength", "ConfidenceDraftLength",
           "GainDraftLength", "RoundOutcome"]
