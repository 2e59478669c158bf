"""Speculative decoding loop over a pair of Hugging Face causal LMs that share a tokenizer.

One round: the draft proposes up to K tokens one at a time, the target scores them all in one forward pass, an
optional head turns both models' last hidden states into per-token weights, :func:`diversed_ext.verify_logits` keeps a prefix
and emits one more token, and both KV caches are cropped to what was kept. The prompt and every kept token are fed to
each model exactly once: nothing is ever recomputed.

Methods:
    ``ar``        the target alone, one token per forward pass (the baseline; sampled through the same verifier, K = 0)
    ``sd``        standard speculative decoding, w = 1: the output follows the target exactly
    ``static``    static ensemble, one fixed w in [0, 1] on the target (w = 0 accepts every draft)
    ``diversed``  dynamic ensemble: w_i = head(draft_hidden_i, target_hidden_i) for every drafted position

Rows are not batched: several prompts run one after another, each with its own caches, seed and statistics.

Forward passes: ``LlamaForCausalLM`` models run through :mod:`diversed_ext.fast_llama` (their own modules and
weights, a preallocated KV cache, skinny products laid out for the CPU's BLAS); any other causal LM, or any model with
``fast_forward=False``, runs through its own forward with a transformers cache. Both give the same outputs up to float
rounding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from tqdm.auto import tqdm

from ..ops import SEED_RANGE, distribution_temperature, is_greedy_temperature, verify_logits
from .checks import (HeadLike, PromptLike, check_head, check_max_new_tokens, check_method, check_num_draft,
                     check_prompt, check_seed, check_temperature, check_weight)
from .prompts import normalise_eos, split_prompts
from .runners import Clock, crop_cache, make_runner, model_device
from .stats import Generation, GenerationOutput, RoundStats


@dataclass
class DecodingState:
    """One prompt in flight: the tokens so far, both models' caches and the statistics. Built by
    :meth:`SpeculativeDecoder.start`, advanced by :meth:`SpeculativeDecoder.step`.

    Invariant between rounds: each cache holds a prefix of ``tokens`` and never its last token, which is fed in the
    next round. ``target_cached == len(tokens) - 1`` after the first round; the draft may lag by one token (the last
    draft of a fully accepted block, which the draft never had to read).
    """

    tokens: list[int]
    prompt_length: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    seed: int
    generator: torch.Generator
    target_cache: object = None
    draft_cache: object = None
    target_cached: int = 0
    draft_cached: int = 0
    round_index: int = 0
    finish_reason: Optional[str] = None
    rounds: list[RoundStats] = field(default_factory=list)
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def new_tokens(self) -> list[int]:
        """Tokens generated so far (the prompt excluded)."""
        return self.tokens[self.prompt_length:]

    @property
    def finished(self) -> bool:
        """True once EOS was emitted or max_new_tokens reached."""
        return self.finish_reason is not None

    def generation(self) -> Generation:
        """The new tokens and statistics so far, as a :class:`Generation`."""
        return Generation(prompt_length=self.prompt_length, tokens=torch.tensor(self.new_tokens, dtype=torch.int64),
                          rounds=list(self.rounds), seconds=time.perf_counter() - self.started_at,
                          finish_reason=self.finish_reason or "unfinished", seed=self.seed)


@dataclass
class _Draft:
    """What the draft phase of a round produced."""

    tokens: list[int]
    logits: list[torch.Tensor]  # one [V] row per drafted token
    hidden: list[torch.Tensor]  # one [Hd] row per drafted token (only when the head needs them)
    seconds: float


def _as_probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32 (the draft's sampling distribution); T = 0 gives the T = 1 distribution."""
    logits = logits.float()
    scale = distribution_temperature(temperature)
    return (logits / scale if scale != 1.0 else logits).softmax(-1)


def _verify_block(draft_tokens, draft_logits, target_logits, weight, *, temperature, seed, offset, check_inputs):
    """Verification of one block straight from raw logits, with the fused online softmax of
    :func:`diversed_ext.verify_logits` (no [K, V] probabilities are materialised).

    temperature 0 makes the row greedy: a draft is kept while it is the argmax of nu = w p + (1 - w) q with p and q
    the temperature-1 softmax, the same rule ``verify(..., greedy=True)`` applied to untempered probabilities.
    Both logits must share a dtype: a pair that differs (a bfloat16 target, a float32 int8 draft) is compared in
    float32.
    """
    if draft_logits.dtype != target_logits.dtype:
        draft_logits, target_logits = draft_logits.float(), target_logits.float()
    return verify_logits(draft_tokens, draft_logits, target_logits, weight, temperature=temperature, seed=seed,
                         offset=offset, check_inputs=check_inputs)


def sample_draft(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """The draft's token: its argmax at temperature 0, else a sample of softmax(logits / temperature)."""
    if is_greedy_temperature(temperature):
        return int(logits.argmax())
    probs = _as_probabilities(logits, temperature)
    if probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def commit_tokens(state: DecodingState, new_tokens: list[int], remaining: int) -> int:
    """Append the round's tokens, cut at the first EOS and at max_new_tokens; returns how many were kept."""
    kept = new_tokens[:remaining]
    for position, token in enumerate(kept):
        if token in state.eos_token_ids:
            kept = kept[:position + 1]
            state.finish_reason = "eos"
            break
    state.tokens.extend(kept)
    if state.finish_reason is None and len(state.new_tokens) >= state.max_new_tokens:
        state.finish_reason = "length"
    return len(kept)


def head_weights(head: HeadLike, draft_hidden: torch.Tensor, target_hidden: torch.Tensor,
                 device: torch.device) -> torch.Tensor:
    """The head's weights [1, k] for k drafted positions, from both models' hidden states [k, H]."""
    weight = torch.as_tensor(head(draft_hidden.unsqueeze(0), target_hidden.unsqueeze(0)), device=device).float()
    num_drafted = draft_hidden.shape[0]
    if weight.numel() != num_drafted:
        raise ValueError(f"head must return one weight per drafted token, shape [1, {num_drafted}], got "
                         f"{tuple(weight.shape)}")
    return weight.reshape(1, num_drafted)


class SpeculativeDecoder:
    """Speculative decoding with the DIVERSED verifier over a target and a draft causal LM sharing a tokenizer.

    Args:
        target: Hugging Face causal LM (``model(input_ids, past_key_values=..., use_cache=True)`` returning logits).
        draft: the draft causal LM; may be None for ``method="ar"``. It may live on another device (an int8 CPU draft
            next to a GPU target): its outputs are moved to the target's device.
        method: ``"ar"``, ``"sd"``, ``"static"`` or ``"diversed"`` (see the module docstring).
        weight: w on the target for ``static`` (required, in [0, 1]); must be None or 1 for ``sd``.
        head: for ``diversed``: a callable ``head(draft_hidden [1, k, Hd], target_hidden [1, k, Ht]) -> w`` with w of
            shape [1, k] (or [1, k, 1]) in [0, 1], e.g. :class:`diversed_ext.head.EnsembleHead`. The hidden states are
            the models' last hidden states (the input of the LM head) at the positions that predicted each draft,
            taken from the forward passes the loop already runs.
        num_draft: K, the most tokens drafted per round (>= 1). Fewer are drafted when fewer tokens are left, and the
            draft stops early after proposing an EOS token.
        temperature: >= 0; both models' logits are divided by it before the softmax. 0 is greedy decoding: drafts are
            the draft's argmax and a draft is kept while it is the argmax of nu = w p + (1 - w) q, with p and q taken
            at temperature 1.
        check_inputs: forwarded to :func:`diversed_ext.verify_logits` (also checks the head's weights). Off by default: the
            loop's own probabilities are valid by construction and checking forces a device sync.
        synchronize_timing: wait for the device before every clock read, so CUDA timings are real (default True).
        fast_forward: run ``LlamaForCausalLM`` models through :mod:`diversed_ext.fast_llama` (their own modules and
            weights, a preallocated KV cache, CPU-friendly skinny products; outputs equal up to float rounding).
            Other models, and every model when False, run through their own forward with a transformers cache.

    Raises:
        ValueError / TypeError naming the offending argument.
    """

    def __init__(self, target: torch.nn.Module, draft: Optional[torch.nn.Module] = None, *, method: str = "sd",
                 weight: Optional[float] = None, head: Optional[HeadLike] = None, num_draft: int = 4,
                 temperature: float = 1.0, check_inputs: bool = False, synchronize_timing: bool = True,
                 fast_forward: bool = True):
        self.method = check_method(method)
        self.weight = check_weight(method, weight)
        self.head = check_head(method, head)
        self.num_draft = check_num_draft(num_draft)
        self.temperature = check_temperature(temperature)
        if target is None:
            raise ValueError("target must be a causal LM, got None")
        if draft is None and method != "ar":
            raise ValueError(f"method {method!r} needs a draft model; pass draft=... (only 'ar' runs without one)")
        self.target = target
        self.draft = draft if method != "ar" else None
        self.check_inputs = bool(check_inputs)
        self.device = model_device(target)
        self.draft_device = model_device(draft) if self.draft is not None else self.device
        self._clock = Clock(self.device, synchronize_timing)
        self._target_runner = make_runner(target, self.device, fast_forward)
        self._draft_runner = make_runner(self.draft, self.draft_device, fast_forward) if self.draft is not None else None

    # ---- public API ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int = 128, eos_token_id=None, seed: Optional[int] = None,
                 progress: bool = False) -> GenerationOutput:
        """Generate continuations of one or more prompts, one prompt after another (rows are not batched).

        Args:
            input_ids: one prompt (int tensor [T] or [1, T], or a list of ints) or several (tensor [B, T], or a list
                of 1-D tensors / lists of ints of any lengths). No padding: every id is part of its prompt.
            max_new_tokens: the most tokens generated per prompt (>= 0).
            eos_token_id: an id or a list of ids ending a generation (the EOS is kept in the output); None: no EOS.
            seed: prompt i runs with seed + i (draft sampling and the verifier's uniforms), so a prompt's output does
                not depend on the others. None draws a seed from torch's default generator (``torch.manual_seed``
                repeats runs).
            progress: show a tqdm bar over the new tokens.

        Returns:
            :class:`GenerationOutput` with one :class:`Generation` (new tokens, per-round statistics) per prompt.
        """
        prompts, _ = split_prompts(input_ids)
        base_seed = check_seed(seed)
        bar = tqdm(total=max_new_tokens * len(prompts), desc=f"generate ({self.method})", unit="tok",
                   disable=not progress, leave=False)
        generations = []
        with bar:
            for index, prompt in enumerate(prompts):
                state = self.start(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                   seed=(base_seed + index) % SEED_RANGE)
                while not state.finished:
                    bar.update(self.step(state).emitted)
                bar.update(max_new_tokens - len(state.new_tokens))  # the unused budget of an early EOS
                generations.append(self.finish(state))
        return GenerationOutput(generations)

    def start(self, prompt: PromptLike, *, max_new_tokens: int, eos_token_id=None, seed: Optional[int] = None
              ) -> DecodingState:
        """A :class:`DecodingState` for one prompt (no model runs yet: the first round reads the prompt)."""
        if isinstance(prompt, (list, tuple)) and not prompt:
            tokens = []  # an empty prompt from generate(): rejected below with the reason
        else:
            prompt_ids, single = split_prompts(prompt)
            if not single:
                raise ValueError("start() takes one prompt; use generate() for several")
            tokens = prompt_ids[0]
        check_prompt(tokens, getattr(getattr(self.target, "config", None), "vocab_size", None))
        check_max_new_tokens(max_new_tokens)
        seed = check_seed(seed)
        generator = torch.Generator(device=self.draft_device).manual_seed(seed)
        state = DecodingState(tokens=list(tokens), prompt_length=len(tokens), max_new_tokens=int(max_new_tokens),
                              eos_token_ids=normalise_eos(eos_token_id), seed=seed, generator=generator)
        if max_new_tokens == 0:
            state.finish_reason = "length"
        return state

    @torch.no_grad()
    def step(self, state: DecodingState) -> RoundStats:
        """Run one round (draft, one target pass, head, verify, crop) on ``state``; returns its statistics."""
        if state.finished:
            raise RuntimeError(f"this generation has finished ({state.finish_reason}); start a new one")
        clock = self._clock
        round_start = clock()
        remaining = state.max_new_tokens - len(state.new_tokens)
        # A round emits at most k + 1 tokens, so drafting more than remaining - 1 is wasted work.
        draft = self._run_draft(state, min(self.num_draft, remaining - 1) if self.draft is not None else 0)
        num_drafted = len(draft.tokens)

        target_start = clock()
        target_logits, target_hidden = self._run_target(state, draft.tokens)
        target_end = clock()

        weight = self._weights(draft, target_hidden)
        head_end = clock()

        result = self._verify(state, draft, target_logits, weight)
        verify_end = clock()

        num_accepted = int(result.num_accepted[0])
        emitted = commit_tokens(state, result.tokens[0, :num_accepted + 1].tolist(), remaining)
        keep = len(state.tokens) - 1
        state.target_cached = crop_cache(state.target_cache, state.target_cached, keep)
        state.draft_cached = crop_cache(state.draft_cache, state.draft_cached, keep)
        state.round_index += 1
        stats = RoundStats(drafted=num_drafted, accepted=num_accepted, emitted=emitted,
                           draft_seconds=draft.seconds, target_seconds=target_end - target_start,
                           head_seconds=head_end - target_end, verify_seconds=verify_end - head_end,
                           draft_tokens=tuple(draft.tokens),
                           weights=tuple(weight.flatten().tolist()) if torch.is_tensor(weight) else ())
        stats.round_seconds = clock() - round_start
        state.rounds.append(stats)
        return stats

    def finish(self, state: DecodingState) -> Generation:
        """The :class:`Generation` of a state (its new tokens and statistics)."""
        return state.generation()

    # ---- one round -------------------------------------------------------------------------------------------------

    def _run_draft(self, state: DecodingState, max_tokens: int) -> _Draft:
        """Sample up to ``max_tokens`` drafts, one draft forward pass each; stops after an EOS draft."""
        drafted = _Draft(tokens=[], logits=[], hidden=[], seconds=0.0)
        want_hidden = self.head is not None
        for _ in range(max_tokens):
            # The first pass reads whatever the draft has not seen (the prompt, or the last token or two); later
            # passes read the previous draft.
            feed = drafted.tokens[-1:] if drafted.tokens else state.tokens[state.draft_cached:]
            start = self._clock()
            logits, hidden, state.draft_cache = self._draft_runner(feed, state.draft_cache, 1, want_hidden)
            drafted.seconds += self._clock() - start
            state.draft_cached += len(feed)
            logits = logits[-1].to(self.device)
            token = sample_draft(logits, self.temperature, state.generator)
            drafted.tokens.append(token)
            drafted.logits.append(logits)
            if want_hidden:
                drafted.hidden.append(hidden[-1].to(self.device))
            if token in state.eos_token_ids:
                break  # tokens after an accepted EOS would be thrown away
        return drafted

    def _run_target(self, state: DecodingState, draft_tokens: list[int]):
        """One target pass over the unseen tokens and the drafts: logits [k + 1, V] and, for the head, the last hidden
        states [k, Ht] at the positions that predicted each draft."""
        feed = state.tokens[state.target_cached:] + draft_tokens
        num_logits = len(draft_tokens) + 1
        want_hidden = self.head is not None and bool(draft_tokens)
        logits, hidden, state.target_cache = self._target_runner(feed, state.target_cache, num_logits, want_hidden)
        state.target_cached += len(feed)
        return logits, hidden[:-1] if want_hidden else None

    def _weights(self, draft: _Draft, target_hidden) -> Union[float, torch.Tensor]:
        if self.head is None or not draft.tokens:
            return self.weight
        return head_weights(self.head, torch.stack(draft.hidden), target_hidden, self.device)

    def _verify(self, state: DecodingState, draft: _Draft, target_logits: torch.Tensor, weight):
        vocab = target_logits.shape[-1]
        if draft.logits:
            # Pairs whose LM heads are padded to different widths share the first min(V) ids.
            vocab = min(vocab, draft.logits[0].shape[-1])
            draft_logits = torch.stack(draft.logits)[:, :vocab].unsqueeze(0)
        else:
            draft_logits = target_logits.new_zeros(1, 0, vocab)
        draft_tokens = torch.tensor([draft.tokens], dtype=torch.int64, device=self.device)
        return _verify_block(draft_tokens, draft_logits, target_logits[:, :vocab].unsqueeze(0), weight,
                             temperature=self.temperature, seed=state.seed, offset=state.round_index,
                             check_inputs=self.check_inputs)
