"""Drafting with an EAGLE-3 head (:class:`diversed_ext.models.eagle3.Eagle3Head`) in place of a draft model.

The head is one decoder layer over the target's own hidden states: it reads, at position i, the target's residual
streams entering a low, a middle and a late layer (fused into one feature) next to the embedding of token i + 1, and
predicts token i + 2. So it drafts from what the target pass of the previous round already computed, at a fraction of
a draft model's bytes per token.

Per request (a :class:`~.state.DecodingState`): ``draft_cache`` is the head's own KV cache and ``draft_cached`` the
number of *real* entries in it, pair i = (fused target feature of position i, token i + 1) for i < draft_cached;
``draft_features`` holds the fused features of the verified positions the head has not read yet (positions
draft_cached .. target_cached - 1, whose next tokens are known). A round:

1. draft: the first step feeds the pending pairs (features, ``tokens[draft_cached + 1:]``); its last output predicts
   d_1. Each further step feeds (the head's own output state of the previous step, the previous draft). Each step
   runs for every row still drafting at once (:meth:`~diversed_ext.models.eagle3.Eagle3Head.step_rows`). The head's
   logits over its draft vocabulary give q (zero outside that vocabulary): drafts are sampled from q (argmax in
   ``"tokens"`` mode, or at temperature 0), and the verifier reads q in ``"distributions"`` mode;
2. the target pass returns, besides its logits, the aux hidden states of every position it read;
3. after verification keeps a drafts and one target token, the head's cache is cropped to its real entries, and the
   fused features of the newly verified positions (the target read them this round) become the pending ones.

The first round of a request drafts nothing: the head has no target features yet, and the target's pass over the
prompt gives them (as vLLM's EAGLE prefill does). A request's drafts depend only on its own tokens, caches and
generator, so a batch gives each row what it would get alone.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..head import wants_distributions
from .state import DecodingState
from .transfers import device_tensor


def is_eagle_head(draft) -> bool:
    """Whether ``draft`` is an EAGLE-3 head (what :class:`~diversed_ext.models.eagle3.Eagle3Head` offers: ``step_rows``,
    ``fuse``, ``new_cache``, ``full_vocab_logits`` and the aux layer ids in its config) rather than a causal LM."""
    offered = ("step_rows", "fuse", "new_cache", "full_vocab_logits")
    return (all(callable(getattr(draft, name, None)) for name in offered)
            and hasattr(getattr(draft, "config", None), "aux_layer_ids"))


class EagleDrafter:
    """An EAGLE-3 head checked against its target, and what a round asks of it (see the module docstring).

    Raises ValueError naming ``draft`` when the head does not fit the target: another hidden size or vocabulary,
    aux layers the target does not have, or another device than the target's."""

    def __init__(self, head: torch.nn.Module, target: torch.nn.Module, device: torch.device):
        config, target_config = head.config, getattr(target, "config", None)
        hidden = getattr(target_config, "hidden_size", None)
        layers = getattr(target_config, "num_hidden_layers", None)
        vocab = getattr(target_config, "vocab_size", None)
        if hidden is not None and config.hidden_size != hidden:
            raise ValueError(f"draft: the EAGLE-3 head reads hidden size {config.hidden_size}, the target has {hidden}")
        if vocab is not None and config.vocab_size != vocab:
            raise ValueError(f"draft: the EAGLE-3 head maps to a vocabulary of {config.vocab_size}, the target's "
                             f"has {vocab}")
        if layers is not None and not all(0 <= layer < layers for layer in config.aux_layer_ids):
            raise ValueError(f"draft: the EAGLE-3 head reads target layers {list(config.aux_layer_ids)}, the target "
                             f"has {layers} (ids in [0, {layers}))")
        parameter = next(head.parameters(), None)
        if parameter is not None and parameter.device != torch.device(device):
            raise ValueError(f"draft: the EAGLE-3 head is on {parameter.device} and the target on {device}: it reads "
                             f"the target's hidden states, so move it there (head.to({str(device)!r}))")
        self.head = head
        self.aux_layers = tuple(config.aux_layer_ids)
        self.device = torch.device(device)

    def ready(self, state: DecodingState) -> bool:
        """Whether the head can draft for ``state``: it has pending target features to start from."""
        return state.draft_features is not None

    def draft(self, config, states: list[DecodingState], budgets: list[int]):
        """Up to ``budgets[r]`` drafts for each row (a :class:`~.batch._Drafts`), one head step per position for
        all the rows still drafting; a row stops after an EOS draft or where the draft-length policy stops it. The
        full-vocabulary logits are kept where the verifier or the ``diversed`` head reads them."""
        from .batch import _Drafts, record_position, sample_drafts  # batch imports this module

        drafts = _Drafts(tokens=[[] for _ in states], logits=[], slots=[], hidden=[], seconds=0.0,
                         draft_probs=[[] for _ in states])
        head = self.head
        keep_logits = config.draft_mode == "distributions" or (config.head is not None
                                                               and wants_distributions(config.head))
        active = [row for row, budget in enumerate(budgets) if budget > 0 and self.ready(states[row])]
        features: dict = {}  # row -> the head's output state of its last step, the next step's feature [1, H]
        position = 0
        while active:
            start = config.clock()
            fed_ids, fed_features = [], []
            for row in active:
                state = states[row]
                if position == 0:
                    if state.draft_cache is None:
                        state.draft_cache = head.new_cache()
                    fed_features.append(state.draft_features)
                    token_ids = state.tokens[state.draft_cached + 1:]
                    state.draft_cached += len(token_ids)
                    state.draft_features = None
                else:
                    fed_features.append(features[row])
                    token_ids = drafts.tokens[row][-1:]
                fed_ids.append(device_tensor(token_ids, torch.int64, self.device))
            # One step for every active row: the head's weights are read once for the whole batch.
            row_logits, row_hidden = head.step_rows(fed_ids, fed_features, [states[row].draft_cache for row in active])
            logits = torch.cat([values[-1:] for values in row_logits])
            hidden = torch.cat([values[-1:] for values in row_hidden])
            features = {row: hidden[index:index + 1] for index, row in enumerate(active)}
            # Drafts are drawn over the draft vocabulary and mapped to target ids: the same law as sampling the full
            # vocabulary with q zero outside it (the map is ascending, so even the inverse CDF picks the same token).
            temperature = 0.0 if config.draft_mode == "tokens" else config.temperature
            chosen = sample_drafts(logits, temperature, [states[row].generator for row in active])
            new_tokens = head.draft_to_target[device_tensor(chosen, torch.int64, logits.device)].tolist()
            drafts.seconds += config.clock() - start
            if keep_logits:
                drafts.logits.append(head.full_vocab_logits(logits).to(config.device))
            active = record_position(config, states, drafts, active, budgets, position, new_tokens,
                                     hidden if config.head is not None else None, logits, chosen)
            position += 1
        return drafts

    def commit(self, states: list[DecodingState], aux: Optional[torch.Tensor], fed: list[int],
               target_cached_before: list[int]) -> None:
        """After the round's verification and crops: each unfinished row's cache cropped to its real entries, and
        the fused features of its newly verified positions appended to its pending ones. ``aux`` [sum of fed, A]:
        the target pass's aux hidden states, row after row (``fed[r]`` positions each)."""
        offset = 0
        for state, count, before in zip(states, fed, target_cached_before):
            if not state.finished:
                if state.draft_cache is not None:
                    state.draft_cache.crop(state.draft_cached)
                kept = state.target_cached - before  # the positions of this pass the target keeps
                # Fused row by row: a product over one row's positions gives the same floats whatever the batch.
                new = self.head.fuse(aux[offset:offset + kept])
                state.draft_features = new if state.draft_features is None else torch.cat([state.draft_features, new])
            offset += count
