"""Speculative decoding loop over a pair of Hugging Face causal LMs that share a tokenizer.

One round: the draft proposes up to K tokens one at a time, the target scores them all in one forward pass, an
optional head turns both models' last hidden states into per-token weights, :func:`diversed_ext.verify_logits` keeps a
prefix and emits one more token, and both KV caches are cropped to what was kept. The prompt and every kept token are
fed to each model exactly once: nothing is ever recomputed.

Methods:
    ``ar``        the target alone, one token per forward pass (the baseline; sampled through the same verifier, K = 0)
    ``sd``        standard speculative decoding, w = 1: the output follows the target exactly
    ``static``    static ensemble, one fixed w in [0, 1] on the target (w = 0 accepts every draft)
    ``diversed``  dynamic ensemble: w_i = head(draft_hidden_i, target_hidden_i) for every drafted position
    ``fly``       ``sd`` with FLy (vLLM's entropy-gated deferral, :mod:`.fly`); every method but ``ar`` takes FLy
                  settings (``fly=Fly(...)``). Lossy: the output no longer follows nu.

Drafts with or without distributions (``draft_mode``): the verifier reads the draft's distributions q, or only its
tokens (q one-hot at each drafted token, what drafters like EAGLE, MTP or an n-gram lookup give), and a callable
``drafter`` can stand in for the draft model. Tokens follow nu = w p + (1 - w) q for the q the verifier saw, so ``sd``
follows the target either way.

Batched: ``generate`` decodes up to ``batch_size`` prompts together, one round for all of them per target pass
(:mod:`.batch`: ragged drafts, per-row caches, one verify call), and a finished row's slot takes the next waiting
prompt at the next round. Each prompt keeps its own caches, seed and statistics, so its tokens do not depend on its
neighbours (up to the float rounding of products over more rows).

Forward passes: ``LlamaForCausalLM`` models run through :mod:`diversed_ext.forward` (their own modules and
weights, a preallocated KV cache, skinny products laid out for the CPU's BLAS); any other causal LM, or any model with
``fast_forward=False``, runs through its own forward with a transformers cache. Both give the same outputs up to float
rounding.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

import torch
from tqdm.auto import tqdm

from .. import rules
from .batch import RoundConfig, run_round
from .checks import (DrafterLike, HeadLike, PromptLike, check_batch_size, check_draft_mode, check_gate, check_head,
                     check_head_device, check_max_new_tokens, check_method, check_prompt, check_seed, check_weight)
from .draft_lengths import DEFAULT_DRAFT_LENGTH, PolicyLike, check_draft_length
from .eagle_drafting import EagleDrafter, is_eagle_head
from .fly import Fly
from .gate import Gate
from .typical import Typical, check_typical
from .prompts import normalise_eos, split_prompts
from .runners import Clock, make_runner, model_device
from .state import DecodingState
from .stats import Generation, GenerationOutput, RoundStats

# K, the most tokens drafted a round, wherever none is given (the decoder, the harness, the trainer, the command line).
# On the default pair (a draft pass costs a third of a target pass on a 2-core CPU) K = 3 gives diversed and the static
# ensembles their most tokens/s, and the shipped heads were trained at it; sd alone does best at K = 2
# (docs/benchmarks.md).
DEFAULT_MAX_DRAFT = 3


class SpeculativeDecoder:
    """Speculative decoding with the DIVERSED verifier over a target and a draft causal LM sharing a tokenizer.

    Args:
        target: Hugging Face causal LM (``model(input_ids, cache=..., use_cache=True)`` returning logits).
        draft: the draft causal LM; may be None for ``method="ar"`` or with ``drafter``. It may live on another device
            (an int8 CPU draft next to a GPU target): its outputs are moved to the target's device. Or an EAGLE-3
            head (:class:`diversed_ext.models.eagle3.Eagle3Head`, on the target's device) in place of a draft model:
            it drafts from the target's own hidden states (the aux layers its config names) with its own KV cache,
            one decoder layer per draft token (:mod:`diversed_ext.decoding.eagle_drafting`). Its drafts have
            distributions (q zero outside its draft vocabulary), so every method, ``draft_mode``, ``fly`` and
            ``gate`` apply; a ``diversed`` head reads the EAGLE head's output state as the draft hidden state. A
            request's first round drafts nothing (the head needs the target's pass over the prompt first).
        method: ``"ar"``, ``"sd"``, ``"static"``, ``"diversed"`` or ``"fly"`` (``sd`` with FLy; see the module
            docstring).
        weight: w on the target for ``static`` (required, in [0, 1]); must be None or 1 for ``sd``.
        head: for ``diversed``: a callable ``head(draft_hidden [1, k, Hd], target_hidden [1, k, Ht]) -> w`` with w of
            shape [1, k] (or [1, k, 1]) in [0, 1], e.g. :class:`diversed_ext.head.EnsembleHead` (a module sits on
            the target's device, where its inputs meet). The hidden states are
            the models' last hidden states (the input of the LM head) at the positions that predicted each draft,
            taken from the forward passes the loop already runs. A head whose ``wants_distributions`` is true also
            gets, third, the :func:`~diversed_ext.head.distribution_features` [1, k, 5] of those positions.
        max_draft: K, the most tokens drafted per round (>= 1): every round's count with ``draft_length="fixed"``,
            the cap of the adaptive policies. Fewer are drafted when fewer tokens are left, and the draft stops early
            after proposing an EOS token.
        draft_length: how many tokens each request drafts each round, by name (see
            :mod:`diversed_ext.decoding.draft_lengths`): ``"fixed"`` (``max_draft`` every round), transformers'
            ``"heuristic"`` schedule and ``"confidence"`` threshold, or ``"gain"`` (ours: draft while one more draft
            raises the round's expected tokens per unit of time); or a
            :class:`~diversed_ext.decoding.DraftLengthPolicy` object (whose own ``max_draft`` is then the cap).
            Every policy decides per request, so a request's tokens do not depend on its neighbours, and from what
            is known before the draft it stops at is verified, so the output law is the fixed K's.
            ``"confidence"`` and ``"gain"`` read the draft's probabilities, so they need a draft model (not a
            callable ``drafter``).
        draft_cost: for ``draft_length="gain"``: one draft pass over one target pass (default 0.33, the default
            pair's on a 2-core CPU; a small draft next to a large GPU target costs about 0.05-0.2).
        temperature: >= 0; both models' logits are divided by it before the softmax. 0 is greedy decoding: drafts are
            the draft's argmax and a draft is kept while it is the argmax of nu = w p + (1 - w) q, with p and q taken
            at temperature 1.
        draft_mode: what the verifier sees of the drafts. ``"distributions"`` (the default with a draft model): the
            draft samples each token from its q and the verifier reads q. ``"tokens"``: the draft model proposes its
            argmax and the verifier gets the tokens alone (``verify_logits(tokens, None, ...)``: q one-hot at the
            drafted x, so x is kept with probability w p(x) + 1 - w and a rejection draws from p without x; with
            w = 1 this is vLLM's verification of drafts without probabilities). ``"sampled_tokens"``: tokens alone,
            sampled from q. A ``diversed`` head still reads the draft model's hidden states and distributions; only
            the verifier goes without them. None: ``"tokens"`` with ``drafter``, else ``"distributions"``.
        drafter: instead of a draft model, a callable ``drafter(context_token_ids: list[int], k: int) -> list[int]``
            proposing up to k next tokens (ids in [0, V)) for a request's tokens so far, prompt included (e.g.
            :class:`~diversed_ext.decoding.NgramDrafter`); it may propose fewer, or none. Tokens only, so for ``sd``
            and ``static`` (a ``diversed`` head needs a draft model's hidden states). Called once per request and
            round; its proposals are cut after an EOS token, as a draft model's are.
        check_inputs: forwarded to :func:`diversed_ext.verify_logits` (also checks the head's weights). Off by default:
            the loop's own probabilities are valid by construction and checking forces a device sync.
        synchronize_timing: wait for the device before every clock read, so CUDA timings are real (default True).
        fly: FLy settings (:class:`~diversed_ext.decoding.fly.Fly`) for the verifier of ``sd``, ``static`` or
            ``diversed``; ``method="fly"`` is ``sd`` with ``fly`` (default ``Fly()``: vLLM's window min(6, K - 1),
            tau 0.3, top 3). A rejected draft is then kept when the next W drafts pass and the target's top-k
            entropy there is at least tau: more tokens per round, and the output no longer follows nu.
        gate: the log-probability gate (:class:`~diversed_ext.decoding.gate.Gate`) for ``sd``, ``static`` or
            ``diversed``: a drafted token is kept outright when its target log-probability is within ``margin``
            nats of what a rejection would give in expectation, and verified with the method's weight otherwise.
            Lossy, as FLy is (the weight reads the drafted token); needs a temperature > 0. Composes with ``fly``.
        typical: Medusa's typical acceptance (:class:`~diversed_ext.decoding.typical.Typical`) in place of ``sd``'s
            exact test: a draft passes when p(x) > min(eps, delta exp(-H(p))), and the first that fails is replaced
            by a sample of the target. Lossy; needs a temperature > 0; not with ``fly`` or ``gate``.
        fast_forward: run ``LlamaForCausalLM`` models through :mod:`diversed_ext.forward` (their own modules and
            weights, a preallocated KV cache, CPU-friendly skinny products; outputs equal up to float rounding).
            Other models, and every model when False, run through their own forward with a transformers cache.

    Raises:
        ValueError / TypeError naming the offending argument.
    """

    def __init__(self, target: torch.nn.Module, draft: Optional[torch.nn.Module] = None, *, method: str = "sd",
                 weight: Optional[float] = None, head: Optional[HeadLike] = None, max_draft: int = DEFAULT_MAX_DRAFT,
                 temperature: float = 1.0, draft_mode: Optional[str] = None, drafter: Optional[DrafterLike] = None,
                 check_inputs: bool = False, synchronize_timing: bool = True, fast_forward: bool = True,
                 draft_length: PolicyLike = DEFAULT_DRAFT_LENGTH,
                 draft_cost: Optional[float] = None, fly: Optional[Fly] = None, gate: Optional[Gate] = None,
                 typical: Optional[Typical] = None):
        if method == "fly":
            method, fly = "sd", fly if fly is not None else Fly()
        self.method = check_method(method)
        self.weight = check_weight(method, weight)
        self.head = check_head(method, head)
        self.max_draft = rules.draft_length(max_draft)
        if fly is not None and not isinstance(fly, Fly):
            raise TypeError(f"fly must be a diversed_ext.decoding.Fly or None, got {type(fly).__name__}")
        if fly is not None and method == "ar":
            raise ValueError("fly applies to methods that draft (sd, static, diversed), not to 'ar'")
        self.fly = None if fly is None else fly.for_max_draft(self.max_draft)
        self.temperature = rules.temperature(temperature)
        self.gate = check_gate(gate, method, self.temperature)
        self.typical = check_typical(typical, method, self.temperature, self.fly, self.gate)
        self.draft_mode = check_draft_mode(method, draft_mode, drafter)
        self.draft_length = check_draft_length(draft_length, self.max_draft, method=method, weight=self.weight,
                                               drafter=drafter, draft_cost=draft_cost)
        if target is None:
            raise ValueError("target must be a causal LM, got None")
        if drafter is not None and draft is not None:
            raise ValueError("pass a draft model (draft=) or a callable drafter (drafter=), not both")
        if draft is None and drafter is None and method != "ar":
            raise ValueError(f"method {method!r} needs a draft model (draft=...) or a callable drafter (drafter=...); "
                             "only 'ar' runs without one")
        self.target = target
        self.vocab_size = getattr(getattr(target, "config", None), "vocab_size", None)
        self.draft = draft if method != "ar" else None
        self.drafter = drafter
        self.check_inputs = bool(check_inputs)
        self.device = model_device(target)
        if self.head is not None:
            check_head_device(self.head, self.device)
        self.draft_device = model_device(draft) if self.draft is not None else self.device
        self._eagle = EagleDrafter(self.draft, target, self.device) if is_eagle_head(self.draft) else None
        self._clock = Clock(self.device, synchronize_timing)
        self._target_runner = make_runner(target, self.device, fast_forward)
        self._draft_runner = (make_runner(self.draft, self.draft_device, fast_forward)
                              if self.draft is not None and self._eagle is None
                              else None)

    def round_config(self) -> RoundConfig:
        """What a decoding round needs of this decoder, read when the round starts (so a changed attribute, say
        the temperature, takes effect at the next round)."""
        return RoundConfig(max_draft=self.max_draft, draft_length=self.draft_length, temperature=self.temperature,
                           draft_mode=self.draft_mode, weight=self.weight, head=self.head, drafter=self.drafter,
                           vocab_size=self.vocab_size, check_inputs=self.check_inputs, fly=self.fly,
                           gate=self.gate, typical=self.typical,
                           device=self.device,
                           clock=self._clock, target_runner=self._target_runner, draft_runner=self._draft_runner,
                           eagle=self._eagle)

    # ---- public API ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int = 128, eos_token_id=None, seed: Optional[int] = None,
                 progress: bool = False, batch_size: Optional[int] = None) -> GenerationOutput:
        """Generate continuations of one or more prompts, up to ``batch_size`` of them in the same forward passes.

        Args:
            input_ids: one prompt (int tensor [T] or [1, T], or a list of ints) or several (tensor [B, T], or a list
                of 1-D tensors / lists of ints of any lengths). No padding: every id is part of its prompt.
            max_new_tokens: the most tokens generated per prompt (>= 0).
            eos_token_id: an id or a list of ids ending a generation (the EOS is kept in the output); None: no EOS.
            seed: prompt i runs with seed + i (draft sampling and the verifier's uniforms), so a prompt's output does
                not depend on the others; or a list of one seed per prompt. None draws a seed from torch's default
                generator (``torch.manual_seed`` repeats runs).
            progress: show a tqdm bar over the new tokens.
            batch_size: the most prompts decoded together (>= 1; None: all). Prompts enter in order; when one
                finishes (EOS or its budget), the next waiting prompt takes its slot in the next round. Prompt i's
                tokens are the same for every batch_size, up to the float rounding of batched products.

        Returns:
            :class:`GenerationOutput` with one :class:`Generation` (new tokens, per-round statistics) per prompt.
            A generation's ``seconds`` runs from the round it entered to the round it finished, neighbours' work
            included (its latency); every round's times are those of the whole batched round.
        """
        started = time.perf_counter()
        prompts, _ = split_prompts(input_ids)
        for prompt in prompts:  # every prompt before any work, so a bad one late in the list wastes none
            check_prompt(prompt, self.vocab_size)
        check_max_new_tokens(max_new_tokens)
        size = check_batch_size(batch_size, len(prompts))
        seeds = self._prompt_seeds(seed, len(prompts))
        waiting = deque(enumerate(prompts))
        live: list[tuple[int, DecodingState]] = []
        generations: list[Optional[Generation]] = [None] * len(prompts)
        bar = tqdm(total=max_new_tokens * len(prompts), desc=f"generate ({self.method})", unit="tok",
                   disable=not progress, leave=False)
        with bar:
            while waiting or live:
                while waiting and len(live) < size:
                    index, prompt = waiting.popleft()
                    live.append((index, self.start(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                                   seed=seeds[index])))
                running = [(index, state) for index, state in live if not state.finished]
                if running:
                    bar.update(sum(stats.emitted for stats in self.step_batch([state for _, state in running])))
                for index, state in live:
                    if state.finished:
                        bar.update(max_new_tokens - len(state.new_tokens))  # the unused budget of an early EOS
                        generations[index] = self.finish(state)
                live = [(index, state) for index, state in live if not state.finished]
        return GenerationOutput(generations, seconds=time.perf_counter() - started)

    @staticmethod
    def _prompt_seeds(seed, num_prompts: int) -> list[int]:
        if isinstance(seed, (list, tuple)):
            if len(seed) != num_prompts:
                raise ValueError(f"seed: a list needs one seed per prompt ({num_prompts}), got {len(seed)}")
            return [check_seed(value) for value in seed]
        base_seed = check_seed(seed)
        return [(base_seed + index) % rules.SEED_RANGE for index in range(num_prompts)]

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
        check_prompt(tokens, self.vocab_size)
        check_max_new_tokens(max_new_tokens)
        seed = check_seed(seed)
        generator = torch.Generator(device=self.draft_device).manual_seed(seed)
        state = DecodingState(tokens=list(tokens), prompt_length=len(tokens), max_new_tokens=int(max_new_tokens),
                              eos_token_ids=normalise_eos(eos_token_id), seed=seed, generator=generator)
        if max_new_tokens == 0:
            state.finish_reason = "length"
        return state

    def step(self, state: DecodingState) -> RoundStats:
        """Run one round (draft, one target pass, head, verify, crop) on ``state``; returns its statistics."""
        return self.step_batch([state])[0]

    @torch.no_grad()
    def step_batch(self, states: list[DecodingState]) -> list[RoundStats]:
        """Run one round for several requests in the same passes (see :mod:`.batch`); returns each one's statistics
        (the round's times are shared). A request's tokens are those :meth:`step` would give it alone."""
        for state in states:
            if state.finished:
                raise RuntimeError(f"this generation has finished ({state.finish_reason}); start a new one")
        if len({id(state) for state in states}) != len(states):
            raise ValueError("step_batch: a state appears twice in the batch")
        return run_round(self.round_config(), states) if states else []

    def finish(self, state: DecodingState) -> Generation:
        """The :class:`Generation` of a state (its new tokens and statistics)."""
        return state.generation()
