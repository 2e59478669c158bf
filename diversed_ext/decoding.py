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

import inspect
import math
import time
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from .fast_llama import LlamaRunner, supports_fast_forward
from .logits import verify_logits

METHODS = ("ar", "sd", "static", "diversed")
SEED_MODULUS = 2**63  # seeds are int64 for the verifier's counter-based generator

PromptLike = Union[torch.Tensor, Sequence[int]]
HeadLike = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RoundStats:
    """What one round (one target forward pass) did and how long each part took.

    Attributes:
        drafted: tokens the draft proposed (0 for ``ar`` and when one token is left to emit).
        accepted: drafts the verifier accepted (before any cut at EOS or max_new_tokens).
        emitted: tokens appended to the output this round (after that cut).
        draft_seconds: the draft's forward passes.
        target_seconds: the target's forward pass.
        head_seconds: the weight head (``diversed`` only).
        verify_seconds: the verification call (fused softmax of both models' logits, accept tests, final sample).
        round_seconds: wall time of the whole round; the rest is sampling, bookkeeping and cache cropping.
    """

    drafted: int
    accepted: int
    emitted: int
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    head_seconds: float = 0.0
    verify_seconds: float = 0.0
    round_seconds: float = 0.0

    @property
    def overhead_seconds(self) -> float:
        """Time of the round spent outside the two models' forward passes."""
        return self.round_seconds - self.draft_seconds - self.target_seconds


@dataclass
class Generation:
    """One prompt's continuation and the rounds that produced it.

    Attributes:
        prompt_length: tokens in the prompt.
        tokens: int64 [N] new tokens only (N <= max_new_tokens; ends with EOS when ``finish_reason == "eos"``).
        rounds: one :class:`RoundStats` per target forward pass.
        seconds: wall time of the whole generation.
        finish_reason: ``"eos"`` or ``"length"``.
        seed: the seed this prompt ran with (draft sampling and verification).
    """

    prompt_length: int
    tokens: torch.Tensor
    rounds: list[RoundStats]
    seconds: float
    finish_reason: str
    seed: int


@dataclass
class DecodingSummary:
    """Totals over one or more generations (see :func:`summarize`)."""

    prompts: int
    new_tokens: int
    target_passes: int
    drafted: int
    accepted: int
    seconds: float
    draft_seconds: float
    target_seconds: float
    head_seconds: float
    verify_seconds: float
    round_seconds: float

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens (NaN when nothing was drafted, as for ``ar``)."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens emitted per target forward pass (1 for ``ar``, up to K + 1)."""
        return self.new_tokens / self.target_passes if self.target_passes else math.nan

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the wall time of the generations."""
        return self.new_tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def overhead_fraction(self) -> float:
        """Share of the rounds' time spent outside the two models' forward passes."""
        if self.round_seconds <= 0:
            return math.nan
        return (self.round_seconds - self.draft_seconds - self.target_seconds) / self.round_seconds


@dataclass
class GenerationOutput:
    """What :meth:`SpeculativeDecoder.generate` returns: one :class:`Generation` per prompt, in order."""

    generations: list[Generation]

    @property
    def sequences(self) -> list[torch.Tensor]:
        """New tokens of every prompt (int64 1-D tensors of possibly different lengths)."""
        return [generation.tokens for generation in self.generations]

    @property
    def rounds(self) -> list[list[RoundStats]]:
        """Per-round statistics of every prompt."""
        return [generation.rounds for generation in self.generations]

    def padded(self, pad_value: int = -1) -> torch.Tensor:
        """New tokens as one int64 [num_prompts, longest] tensor, shorter rows filled with ``pad_value``."""
        longest = max((len(tokens) for tokens in self.sequences), default=0)
        out = torch.full((len(self.generations), longest), pad_value, dtype=torch.int64)
        for row, tokens in enumerate(self.sequences):
            out[row, :len(tokens)] = tokens.cpu()
        return out

    def summary(self) -> DecodingSummary:
        """Totals over all prompts (acceptance rate, tokens per pass, tokens/s, time split)."""
        return summarize(self.generations)


def summarize(generations: Iterable[Generation]) -> DecodingSummary:
    """Add up the statistics of several generations (for example one method over many prompts and seeds)."""
    generations = list(generations)
    rounds = [stats for generation in generations for stats in generation.rounds]
    return DecodingSummary(
        prompts=len(generations),
        new_tokens=sum(len(generation.tokens) for generation in generations),
        target_passes=len(rounds),
        drafted=sum(stats.drafted for stats in rounds),
        accepted=sum(stats.accepted for stats in rounds),
        seconds=sum(generation.seconds for generation in generations),
        draft_seconds=sum(stats.draft_seconds for stats in rounds),
        target_seconds=sum(stats.target_seconds for stats in rounds),
        head_seconds=sum(stats.head_seconds for stats in rounds),
        verify_seconds=sum(stats.verify_seconds for stats in rounds),
        round_seconds=sum(stats.round_seconds for stats in rounds),
    )


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


@dataclass
class _Draft:
    """What the draft phase of a round produced."""

    tokens: list[int]
    logits: list[torch.Tensor]  # one [V] row per drafted token
    hidden: list[torch.Tensor]  # one [Hd] row per drafted token (only when the head needs them)
    seconds: float


class _Clock:
    """perf_counter that first waits for the device, so CUDA times are not just launch times."""

    def __init__(self, device: torch.device, synchronize: bool):
        self.synchronize = synchronize and device.type == "cuda"
        self.device = device

    def __call__(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    # int8 dynamically quantised models keep their weights in packed params: they run on the CPU
    return torch.device("cpu")


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


class _HFRunner:
    """Incremental forward passes through the model's own forward and a transformers cache; the same call as
    :class:`diversed_ext.fast_llama.LlamaRunner`: ``(feed, cache, num_logits, want_hidden) -> (logits [num_logits, V],
    hidden [num_logits, H] or None, cache)``."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.keeps_logits = _accepts_logits_to_keep(model)

    def __call__(self, feed: list[int], cache, num_logits: int, want_hidden: bool):
        kwargs = {"past_key_values": cache, "use_cache": True}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = num_logits  # skip the LM head on positions nobody reads
        if want_hidden:
            kwargs["output_hidden_states"] = True
        output = self.model(torch.tensor([feed], dtype=torch.int64, device=self.device), **kwargs)
        hidden = output.hidden_states[-1][0, -num_logits:] if want_hidden else None
        return output.logits[0, -num_logits:], hidden, output.past_key_values


def _runner(model: torch.nn.Module, device: torch.device, fast_forward: bool):
    if fast_forward and supports_fast_forward(model):
        return LlamaRunner(model)
    return _HFRunner(model, device)


def _crop_cache(cache, cached_length: int, keep: int) -> int:
    """Drop cache entries past ``keep`` tokens; returns the new cached length.

    transformers 5 crops by a negative count (tokens to remove); 4.x accepts the same form."""
    if cache is not None and cached_length > keep:
        cache.crop(keep - cached_length)
        return keep
    return cached_length


def _as_probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32 (the draft's sampling distribution); T = 0 gives the T = 1 distribution."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits.softmax(-1)


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


def _normalise_eos(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    if isinstance(eos_token_id, Integral):
        eos_token_id = [eos_token_id]
    ids = list(eos_token_id)
    if not all(isinstance(token, Integral) and not isinstance(token, bool) for token in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    return frozenset(int(token) for token in ids)


def _split_prompts(input_ids) -> tuple[list[list[int]], bool]:
    """Prompts as lists of ints, and whether a single prompt was given (1-D tensor or flat list)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 1:
            return [input_ids.tolist()], True
        if input_ids.dim() == 2:
            return [row.tolist() for row in input_ids], input_ids.shape[0] == 1
        raise ValueError(f"input_ids must be 1-D [T] or 2-D [B, T], got shape {tuple(input_ids.shape)}")
    if isinstance(input_ids, (list, tuple)) and input_ids:
        if all(isinstance(token, Integral) for token in input_ids):
            return [list(input_ids)], True
        prompts = [row.tolist() if isinstance(row, torch.Tensor) else list(row) for row in input_ids]
        return prompts, False
    raise TypeError("input_ids must be a tensor [T] or [B, T], a list of ints, or a list of prompts")


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
        self.method = self._check_method(method)
        self.weight = self._check_weight(method, weight)
        self.head = self._check_head(method, head)
        self.num_draft = self._check_num_draft(num_draft)
        self.temperature = self._check_temperature(temperature)
        if target is None:
            raise ValueError("target must be a causal LM, got None")
        if draft is None and method != "ar":
            raise ValueError(f"method {method!r} needs a draft model; pass draft=... (only 'ar' runs without one)")
        self.target = target
        self.draft = draft if method != "ar" else None
        self.check_inputs = bool(check_inputs)
        self.device = _model_device(target)
        self.draft_device = _model_device(draft) if self.draft is not None else self.device
        self._clock = _Clock(self.device, synchronize_timing)
        self._target_runner = _runner(target, self.device, fast_forward)
        self._draft_runner = _runner(self.draft, self.draft_device, fast_forward) if self.draft is not None else None

    # ---- argument checks -------------------------------------------------------------------------------------------

    @staticmethod
    def _check_method(method) -> str:
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
        return method

    @staticmethod
    def _check_weight(method: str, weight) -> float:
        if weight is not None:
            if isinstance(weight, bool) or not isinstance(weight, Real):
                raise TypeError(f"weight must be a float in [0, 1], got {type(weight).__name__}")
            weight = float(weight)
            if not 0.0 <= weight <= 1.0:  # also rejects NaN
                raise ValueError(f"weight must be in [0, 1] (the weight on the target), got {weight}")
        if method == "static" and weight is None:
            raise ValueError("method 'static' needs weight=w in [0, 1] (the weight on the target)")
        if method == "sd" and weight not in (None, 1.0):
            raise ValueError(f"method 'sd' is the w = 1 case; got weight={weight} (use method='static')")
        if method in ("ar", "diversed") and weight is not None:
            raise ValueError(f"weight applies to 'static' (and 'sd' with w = 1), not to method {method!r}")
        return 1.0 if weight is None else weight

    @staticmethod
    def _check_head(method: str, head):
        if method == "diversed":
            if head is None:
                raise ValueError("method 'diversed' needs head=..., a callable (draft_hidden, target_hidden) -> w")
            if not callable(head):
                raise TypeError(f"head must be callable (draft_hidden, target_hidden) -> w, got {type(head).__name__}")
        elif head is not None:
            raise ValueError(f"head applies only to method 'diversed', not {method!r}")
        return head

    @staticmethod
    def _check_num_draft(num_draft) -> int:
        if isinstance(num_draft, bool) or not isinstance(num_draft, Integral):
            raise TypeError(f"num_draft must be an int >= 1, got {type(num_draft).__name__}")
        if num_draft < 1:
            raise ValueError(f"num_draft (K) must be >= 1, got {num_draft}")
        return int(num_draft)

    @staticmethod
    def _check_temperature(temperature) -> float:
        if isinstance(temperature, bool) or not isinstance(temperature, Real):
            raise TypeError(f"temperature must be a float >= 0, got {type(temperature).__name__}")
        temperature = float(temperature)
        if not temperature >= 0.0 or math.isinf(temperature):  # also rejects NaN
            raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {temperature}")
        return temperature

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
        prompts, _ = _split_prompts(input_ids)
        base_seed = self._base_seed(seed)
        bar = tqdm(total=max_new_tokens * len(prompts), desc=f"generate ({self.method})", unit="tok",
                   disable=not progress, leave=False)
        generations = []
        with bar:
            for index, prompt in enumerate(prompts):
                state = self.start(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                   seed=(base_seed + index) % SEED_MODULUS)
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
            prompt_ids, single = _split_prompts(prompt)
            if not single:
                raise ValueError("start() takes one prompt; use generate() for several")
            tokens = prompt_ids[0]
        self._check_prompt(tokens)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        seed = self._base_seed(seed)
        generator = torch.Generator(device=self.draft_device).manual_seed(seed)
        state = DecodingState(tokens=list(tokens), prompt_length=len(tokens), max_new_tokens=int(max_new_tokens),
                              eos_token_ids=_normalise_eos(eos_token_id), seed=seed, generator=generator)
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
        emitted = self._commit(state, result.tokens[0, :num_accepted + 1].tolist(), remaining)
        keep = len(state.tokens) - 1
        state.target_cached = _crop_cache(state.target_cache, state.target_cached, keep)
        state.draft_cached = _crop_cache(state.draft_cache, state.draft_cached, keep)
        state.round_index += 1
        stats = RoundStats(drafted=num_drafted, accepted=num_accepted, emitted=emitted,
                           draft_seconds=draft.seconds, target_seconds=target_end - target_start,
                           head_seconds=head_end - target_end, verify_seconds=verify_end - head_end)
        stats.round_seconds = clock() - round_start
        state.rounds.append(stats)
        return stats

    def finish(self, state: DecodingState) -> Generation:
        """The :class:`Generation` of a state (its new tokens and statistics)."""
        return Generation(prompt_length=state.prompt_length,
                          tokens=torch.tensor(state.new_tokens, dtype=torch.int64),
                          rounds=list(state.rounds), seconds=time.perf_counter() - state.started_at,
                          finish_reason=state.finish_reason or "unfinished", seed=state.seed)

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
            token = self._sample_draft(logits, state.generator)
            drafted.tokens.append(token)
            drafted.logits.append(logits)
            if want_hidden:
                drafted.hidden.append(hidden[-1].to(self.device))
            if token in state.eos_token_ids:
                break  # tokens after an accepted EOS would be thrown away
        return drafted

    def _sample_draft(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        if self.temperature == 0:
            return int(logits.argmax())
        probs = _as_probabilities(logits, self.temperature)
        if probs.device != generator.device:
            probs = probs.to(generator.device)
        return int(torch.multinomial(probs, 1, generator=generator))

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
        draft_hidden = torch.stack(draft.hidden).unsqueeze(0)
        weight = self.head(draft_hidden, target_hidden.unsqueeze(0))
        weight = torch.as_tensor(weight, device=self.device).float()
        num_drafted = len(draft.tokens)
        if weight.numel() != num_drafted:
            raise ValueError(f"head must return one weight per drafted token, shape [1, {num_drafted}], got "
                             f"{tuple(weight.shape)}")
        return weight.reshape(1, num_drafted)

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

    @staticmethod
    def _commit(state: DecodingState, new_tokens: list[int], remaining: int) -> int:
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

    # ---- helpers ---------------------------------------------------------------------------------------------------

    def _check_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise ValueError("input_ids: a prompt must hold at least one token")
        vocab = getattr(getattr(self.target, "config", None), "vocab_size", None)
        low, high = min(tokens), max(tokens)
        if low < 0 or (vocab is not None and high >= vocab):
            raise ValueError(f"input_ids: token ids must be in [0, {vocab}), got values in [{low}, {high}]")

    @staticmethod
    def _base_seed(seed) -> int:
        if seed is None:
            return int(torch.randint(0, 2**62, (1,)))
        if isinstance(seed, bool) or not isinstance(seed, Integral):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        return int(seed) % SEED_MODULUS
