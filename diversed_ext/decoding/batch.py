"""One decoding round for several requests at once: batched draft passes, one batched target pass, the head on every
drafted token, one verify call, then per-row commits and cache crops.

Rows are ragged: row r drafts ``min(K, remaining_r - 1)`` tokens (a round emits at most k + 1) and stops after an EOS
draft, so a draft pass carries only the rows still drafting. Each row keeps its own caches (no token of one request
attends to another's, nothing is padded inside a model), its own generator for draft sampling, and its own verifier
uniforms: row r draws Philox uniforms for (its seed, its round index), its final sample taking the uniform of position
k_r, exactly what a call with that row alone would draw. A request's tokens therefore depend only on its prompt and
seed, whatever its neighbours, up to the float rounding of products over more rows. An int8 draft's activations are
quantised token by token, so its int8 products are exact whatever the batch; a draft quantised by torch's
``quantize_dynamic`` and run through its own forward (``fast_forward=False``) quantises each call's rows with one
scale, so there a neighbour can move a row's draft distribution by one quantisation step.

Padding exists only between the models and the verifier: drafts, logits and weights of short rows are padded to the
longest row, and ``num_draft`` tells the verifier where each row ends.

On CUDA a round waits on the device only where the host reads a result: once per draft pass (the drafted tokens
feed the next pass and the caches) and once for the verifier's results; the rows' counts, seeds and slots reach the
device without a wait (:mod:`.transfers`). The head, the gate and the verify call never wait on it.

Drafts without distributions (``draft_mode`` "tokens" or "sampled_tokens", or a callable ``drafter``): the verifier
gets ``None`` for the draft logits, so q is one-hot at each drafted token. A draft model still runs as above (its
hidden states and logits still feed a head); a callable drafter is called once per row with the row's tokens so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..head import wants_distributions
from ..ops import distribution_features, is_greedy_temperature, philox_uniforms, verify_logits
from .checks import DrafterLike, HeadLike, check_drafted
from .draft_lengths import DraftLengthPolicy, RoundOutcome
from .eagle_drafting import EagleDrafter
from .fly import Fly
from .gate import Gate, gated_weights, require_sampling
from .typical import Typical, typical_verify_arguments
from .runners import RowRunner, crop_cache
from .state import DecodingState, commit_tokens
from .stats import RoundStats
from .transfers import device_tensor, read_back


@dataclass(frozen=True)
class RoundConfig:
    """What one round needs of its decoder (SpeculativeDecoder.round_config builds it), so a round reads explicit
    arguments, not the decoder's private fields."""

    max_draft: int  # K: the most tokens a row drafts this round
    draft_length: DraftLengthPolicy  # how many of those K each row drafts
    temperature: float
    draft_mode: str  # "distributions", "tokens" or "sampled_tokens": what the verifier sees of the drafts
    weight: float  # the static weight on the target (1 for sd; a head, when there is one, weighs each draft)
    head: Optional[HeadLike]
    drafter: Optional[DrafterLike]  # a callable drafter in place of the draft model
    vocab_size: Optional[int]  # the target's, for checking a drafter's ids
    check_inputs: bool  # the verifier's
    fly: Optional[Fly]  # the verifier's FLy settings, or None
    gate: Optional[Gate]  # the log-probability gate (lossy: the weight reads the drafted token), or None
    device: torch.device  # the target's: drafts, logits and weights meet there
    clock: Callable[[], float]  # seconds, synchronised with the device when the decoder times for real
    target_runner: RowRunner
    draft_runner: Optional[RowRunner]  # None without a draft model
    typical: Optional[Typical] = None  # Medusa's typical acceptance in place of the exact test (lossy), or None
    eagle: Optional[EagleDrafter] = None  # an EAGLE-3 head drafting from the target's hidden states, or None

    @property
    def proposes(self) -> bool:
        """Whether anything drafts (a draft model, an EAGLE-3 head, a drafter); else a round is one target step."""
        return self.draft_runner is not None or self.drafter is not None or self.eagle is not None


@dataclass
class _Drafts:
    """What the draft phase of a round produced, rows in order."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]  # [n, V] per draft pass, for the rows that drafted in it
    slots: list[tuple[int, int]]  # (row, position) of every logits row above, in the same order
    hidden: list[torch.Tensor]  # [n, Hd] per draft pass (only when the head needs them)
    seconds: float
    draft_probs: list[list[float]]  # q_i(x_i) of each row's drafts, when the draft-length policy reads them

    @property
    def width(self) -> int:
        """K of this round's verify call: the most drafts of any row."""
        return max(len(tokens) for tokens in self.tokens)

    def flat_slots(self) -> list[int]:
        """Where each logits row goes in a [B, K] layout, flattened."""
        width = self.width
        return [row * width + position for row, position in self.slots]


def sample_drafts(logits: torch.Tensor, temperature: float, generators: list[torch.Generator]) -> list[int]:
    """One draft token per row of ``logits`` [n, V]: the argmax at temperature 0, else a sample of
    softmax(logits / T) by inverse CDF with one uniform drawn from that row's generator (so a row's draw ignores the
    others). All rows are sampled in one call of the verifier's final-sample path with no drafts (a fused softmax and
    inverse CDF over the logits: about 0.1 ms a row where ``torch.multinomial`` over the probabilities takes 1 ms)."""
    if is_greedy_temperature(temperature):
        return logits.argmax(-1).tolist()
    rows = logits.shape[0]
    uniforms = torch.cat([torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)
                          for generator in generators]).to(logits.device).view(rows, 1)
    logits = logits if logits.dtype in (torch.float32, torch.bfloat16, torch.float16) else logits.float()
    no_drafts = torch.zeros(rows, 0, dtype=torch.int64, device=logits.device)
    result = verify_logits(no_drafts, logits.new_zeros(rows, 0, logits.shape[-1]), logits.unsqueeze(1), 1.0,
                           temperature=temperature, uniforms=uniforms, check_inputs=False)
    return result.tokens[:, 0].tolist()


def _padded(rows: torch.Tensor, slots: list[int], shape: tuple[int, ...], fill: float = 0.0) -> torch.Tensor:
    """``rows`` [n, ...] scattered to the flat slots of a new tensor of ``shape``; the rest is ``fill``."""
    out = rows.new_full((shape[0] * shape[1], *shape[2:]), fill)
    if slots:
        out[device_tensor(slots, torch.int64, rows.device)] = rows
    return out.view(shape)


def _rows(tensor: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """``tensor[indices]`` for a list of row indices, without the wait of indexing a CUDA tensor by a host list."""
    return tensor.index_select(0, device_tensor(indices, torch.int64, tensor.device))


def run_round(config: RoundConfig, states: list[DecodingState]) -> list[RoundStats]:
    """One round for every state (none finished); returns each row's statistics, the round's times shared."""
    clock = config.clock
    round_start = clock()
    remaining = [state.remaining for state in states]
    policy = config.draft_length
    memories = [policy_memory(state, policy) for state in states]
    budgets = [min(policy.budget(memory), left - 1) if config.proposes else 0
               for memory, left in zip(memories, remaining)]
    run_draft = _run_draft if config.drafter is None else _call_drafter
    drafts = (config.eagle.draft if config.eagle is not None else run_draft)(config, states, budgets)
    drafted = [len(tokens) for tokens in drafts.tokens]

    target_start, target_cached = clock(), [state.target_cached for state in states]
    target_logits, target_hidden, fed, aux = _run_target(config, states, drafts.tokens)
    target_end = clock()
    keep_draft = config.draft_mode == "distributions" or (config.head is not None
                                                         and wants_distributions(config.head))
    draft_logits, target_logits = _shared_vocab_logits(drafts, target_logits, keep_draft)
    weight = _weights(config, drafts, target_hidden, draft_logits, target_logits)
    draft_tokens = _draft_tensor(drafts, target_logits.shape[1] - 1, target_logits.device)
    verifier_weight = _gated(config, draft_tokens, draft_logits, target_logits, weight)
    head_end = clock()
    result = _verify(config, states, drafts, draft_tokens, draft_logits, target_logits, verifier_weight)
    verify_end = clock()

    # The round's one wait for the device: the verifier's results and the head's weights [B, K] (what it handed the
    # verifier), read back together.
    head_weight = [weight] if torch.is_tensor(weight) else []
    accepted, tokens, accept_probs, *head_chose = read_back(result.num_accepted, result.tokens, result.accept_prob,
                                                            *head_weight)
    head_chose = head_chose[0] if head_chose else None
    all_stats = []
    for row, state in enumerate(states):
        row_weights = head_chose[row][:drafted[row]] if head_chose else [config.weight] * drafted[row]
        policy.update(memories[row], RoundOutcome(drafted[row], accepted[row], accept_probs[row][:drafted[row]],
                                                  drafts.draft_probs[row], row_weights))
        emitted = commit_tokens(state, tokens[row][:accepted[row] + 1], remaining[row])
        keep = len(state.tokens) - 1
        state.target_cached = crop_cache(state.target_cache, state.target_cached, keep)
        if config.eagle is None:  # an EAGLE-3 head's cache is cropped with its features, below
            state.draft_cached = crop_cache(state.draft_cache, state.draft_cached, keep)
        state.round_index += 1
        all_stats.append(RoundStats(drafted=drafted[row], accepted=accepted[row], emitted=emitted,
                                    draft_seconds=drafts.seconds, target_seconds=target_end - target_start,
                                    head_seconds=head_end - target_end, verify_seconds=verify_end - head_end,
                                    draft_tokens=tuple(drafts.tokens[row]),
                                    weights=tuple(row_weights) if head_chose else ()))
    if config.eagle is not None:
        config.eagle.commit(states, aux, fed, target_cached)
    round_seconds = clock() - round_start
    for state, stats in zip(states, all_stats):
        stats.round_seconds = round_seconds
        state.rounds.append(stats)
    return all_stats


def policy_memory(state: DecodingState, policy: DraftLengthPolicy):
    """The request's memory for ``policy`` (a new one when the request starts, or when the decoder's policy changed)."""
    if state.draft_length_policy is not policy:
        state.draft_length_policy, state.draft_length_memory = policy, policy.start()
    return state.draft_length_memory


def _run_draft(config: RoundConfig, states: list[DecodingState], budgets: list[int]) -> _Drafts:
    """Up to ``budgets[r]`` drafts for row r, one batched draft pass per position over the rows still drafting; the
    draft-length policy may stop a row earlier, after any of its drafts."""
    drafts = _Drafts(tokens=[[] for _ in states], logits=[], slots=[], hidden=[], seconds=0.0,
                     draft_probs=[[] for _ in states])
    want_hidden = config.head is not None
    active = [row for row, budget in enumerate(budgets) if budget > 0]
    position = 0
    while active:
        # A row's first pass reads whatever its draft has not seen (the prompt, or the last token or two); later
        # passes read its previous draft.
        feeds = [drafts.tokens[row][-1:] if position else states[row].tokens[states[row].draft_cached:]
                 for row in active]
        start = config.clock()
        logits, hidden, caches = config.draft_runner.run_rows(
            feeds, [states[row].draft_cache for row in active], [1] * len(active), want_hidden)
        drafts.seconds += config.clock() - start
        for row, feed, cache in zip(active, feeds, caches):
            states[row].draft_cache = cache
            states[row].draft_cached += len(feed)
        logits = logits.to(config.device)
        # A draft verified on its tokens alone proposes its argmax by default, as vLLM's draft models do: x is kept
        # with probability w p(x) + 1 - w, so the draft's best guess at the target's likeliest token is the proposal
        # kept most often. A sampled proposal ("sampled_tokens") is as valid (tokens follow nu for whatever x is
        # proposed), only kept less often.
        temperature = 0.0 if config.draft_mode == "tokens" else config.temperature
        new_tokens = sample_drafts(logits, temperature, [states[row].generator for row in active])
        drafts.logits.append(logits)
        active = record_position(config, states, drafts, active, budgets, position, new_tokens,
                                 hidden if want_hidden else None, logits, new_tokens)
        position += 1
    return drafts


def record_position(config: RoundConfig, states: list[DecodingState], drafts: _Drafts, active: list[int],
                    budgets: list[int], position: int, new_tokens: list[int], hidden: Optional[torch.Tensor],
                    logits: torch.Tensor, sampled: list[int]) -> list[int]:
    """Record one draft position of the ``active`` rows (their tokens, slots, hidden states and, for the draft-length
    policy, q of each draft: ``sampled`` indexes ``logits``' columns) and return the rows that draft on.

    A row stops at its budget and after an EOS draft (tokens after an accepted EOS would be thrown away), or where
    its policy stops it, from this round's drafts so far."""
    policy = config.draft_length
    drafts.slots += [(row, position) for row in active]
    if hidden is not None:
        drafts.hidden.append(hidden.to(config.device))
    for row, token in zip(active, new_tokens):
        drafts.tokens[row].append(token)
    if policy.reads_draft_probs:
        for row, prob in zip(active, token_probs(logits, sampled, config.temperature)):
            drafts.draft_probs[row].append(prob)
    return [row for row, token in zip(active, new_tokens)
            if position + 1 < budgets[row] and token not in states[row].eos_token_ids
            and policy.keep_drafting(states[row].draft_length_memory, drafts.draft_probs[row])]


def token_probs(logits: torch.Tensor, tokens: list[int], temperature: float) -> list[float]:
    """q(x) of each row's drafted token: softmax(logits / T) at the token (T = 1 for greedy decoding, whose drafts
    are argmaxes)."""
    scale = 1.0 if is_greedy_temperature(temperature) else 1.0 / temperature
    index = device_tensor(tokens, torch.int64, logits.device).unsqueeze(1)
    return torch.log_softmax(logits.float() * scale, dim=-1).gather(1, index).exp().squeeze(1).tolist()


def _call_drafter(config: RoundConfig, states: list[DecodingState], budgets: list[int]) -> _Drafts:
    """Up to ``budgets[r]`` drafts for row r from the callable drafter (tokens only: no logits, no hidden states),
    cut after an EOS draft as a draft model's are."""
    drafts = _Drafts(tokens=[[] for _ in states], logits=[], slots=[], hidden=[], seconds=0.0,
                     draft_probs=[[] for _ in states])
    start = config.clock()
    for row, (state, budget) in enumerate(zip(states, budgets)):
        if budget <= 0:
            continue
        proposed = check_drafted(config.drafter(list(state.tokens), budget), budget, config.vocab_size)
        ends = [position for position, token in enumerate(proposed) if token in state.eos_token_ids]
        drafts.tokens[row] = proposed[:ends[0] + 1] if ends else proposed
    drafts.seconds = config.clock() - start
    return drafts


def _run_target(config: RoundConfig, states: list[DecodingState], draft_tokens: list[list[int]]):
    """One target pass over every row's unseen tokens and drafts: logits [B, K + 1, V] padded past each row's
    k_r + 1 positions; for the head, the last hidden states [N, Ht] at the positions that predicted each draft
    (N drafts over all rows, row by row); each row's count of fed positions; for an EAGLE-3 head the aux hidden
    states of every fed position (else None)."""
    feeds = [state.tokens[state.target_cached:] + tokens for state, tokens in zip(states, draft_tokens)]
    num_logits = [len(tokens) + 1 for tokens in draft_tokens]
    want_hidden = config.head is not None and any(draft_tokens)
    aux = {} if config.eagle is None else {"aux_layers": config.eagle.aux_layers}
    logits, hidden, caches, *aux = config.target_runner.run_rows(
        feeds, [state.target_cache for state in states], num_logits, want_hidden, **aux)
    for state, feed, cache in zip(states, feeds, caches):
        state.target_cache = cache
        state.target_cached += len(feed)
    width = max(num_logits)
    slots, drafted_rows, first = [], [], 0
    for row, count in enumerate(num_logits):
        slots += range(row * width, row * width + count)
        drafted_rows += range(first, first + count - 1)  # every position but the last predicted a draft
        first += count
    padded = _padded(logits, slots, (len(states), width, logits.shape[-1]))
    hidden = _rows(hidden, drafted_rows) if want_hidden else None
    return padded, hidden, [len(feed) for feed in feeds], aux[0] if aux else None


def _shared_vocab_logits(drafts: _Drafts, target_logits: torch.Tensor,
                         keep_draft: bool = True) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Both models' logits over the ids they share, in one dtype the verifier reads: the drafts [B, K, V'] (zero past
    each row's k_r; None when ``keep_draft`` is false or no draft model ran while some row drafted) and the target's
    [B, K + 1, V']. The head's features and the verifier read these same tensors."""
    rows, width = target_logits.shape[0], target_logits.shape[1] - 1
    vocab = target_logits.shape[-1]
    draft_logits = None
    if drafts.logits:
        # Pairs whose LM heads are padded to different widths share the first min(V) ids.
        vocab = min(vocab, drafts.logits[0].shape[-1])
        if keep_draft:
            draft_logits = _padded(torch.cat(drafts.logits)[:, :vocab], drafts.flat_slots(), (rows, width, vocab))
    elif width == 0 and keep_draft:
        draft_logits = target_logits.new_zeros(rows, 0, vocab)
    target_logits = target_logits[..., :vocab]
    # The verifier reads float32, bfloat16 or float16 and both in one dtype: a bfloat16 target next to a float32 int8
    # draft, or a float64 model, is verified in float32.
    if target_logits.dtype == torch.float64 or (draft_logits is not None and draft_logits.dtype != target_logits.dtype):
        target_logits = target_logits.float()
        draft_logits = None if draft_logits is None else draft_logits.float()
    return draft_logits, target_logits


def _weights(config: RoundConfig, drafts: _Drafts, target_hidden, draft_logits: torch.Tensor,
             target_logits: torch.Tensor) -> Union[float, torch.Tensor]:
    """The static weight, or the head's weight for every drafted token, padded to [B, K] with 1. ``draft_logits``
    [B, K, V] and ``target_logits`` [B, K + 1, V] come from :func:`_shared_vocab_logits`."""
    if config.head is None or not drafts.slots:
        return config.weight
    slots = drafts.flat_slots()
    order = sorted(range(len(slots)), key=slots.__getitem__)  # drafts go position by position, the head row by row
    head_slots = sorted(slots)  # the drafted positions in the head's row-by-row order, in the [B, K] layout
    distributions = None
    if wants_distributions(config.head):
        # The drafted rows read in place; (row, position) is row * (K + 1) + position of the target's logits.
        rows = [head_slots, [row * target_logits.shape[1] + position for row, position in sorted(drafts.slots)]]
        draft_rows, target_rows = device_tensor(rows, torch.int64, target_logits.device).unsqueeze(1)
        distributions = distribution_features(draft_logits.flatten(0, 1), target_logits.flatten(0, 1),
                                              temperature=config.temperature, draft_rows=draft_rows,
                                              target_rows=target_rows, check_inputs=False)[0]
    weight = head_weights(config.head, _rows(torch.cat(drafts.hidden), order), target_hidden, config.device,
                          distributions)
    return _padded(weight.reshape(-1), head_slots, (len(drafts.tokens), drafts.width), fill=1.0)


def head_weights(head, draft_hidden: torch.Tensor, target_hidden: torch.Tensor, device: torch.device,
                 distributions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The head's weights [1, N] for N drafted tokens, from both models' hidden states [N, H] (and, for a head that
    reads them, the distribution features [N, F] of those positions). The rows' drafts are handed over as one
    sequence: the head weighs each token from its own inputs."""
    extra = () if distributions is None else (distributions.unsqueeze(0),)
    weight = torch.as_tensor(head(draft_hidden.unsqueeze(0), target_hidden.unsqueeze(0), *extra), device=device).float()
    num_drafted = draft_hidden.shape[0]
    if weight.numel() != num_drafted:
        raise ValueError(f"head must return one weight per drafted token, shape [1, {num_drafted}], got "
                         f"{tuple(weight.shape)}")
    return weight.reshape(1, num_drafted)


def _gated(config: RoundConfig, draft_tokens: torch.Tensor, draft_logits: Optional[torch.Tensor],
           target_logits: torch.Tensor, weight):
    """``weight`` with the gate applied to every drafted token of ``draft_tokens`` [B, K] (see :mod:`.gate`), or
    ``weight`` itself without a gate or without drafts."""
    if config.gate is None or draft_tokens.shape[1] == 0:
        return weight
    require_sampling(config.temperature)  # the decoder's temperature may have been set to 0 after construction
    seen_draft = draft_logits if config.draft_mode == "distributions" else None
    return gated_weights(config.gate, weight, draft_tokens, seen_draft, target_logits, config.temperature)


def _draft_tensor(drafts: _Drafts, width: int, device) -> torch.Tensor:
    """The drafted tokens [B, K], each row padded with id 0 past its own drafts."""
    return device_tensor([tokens + [0] * (width - len(tokens)) for tokens in drafts.tokens],
                         torch.int64, device).reshape(len(drafts.tokens), width)


def _verify(config: RoundConfig, states: list[DecodingState], drafts: _Drafts, draft_tokens: torch.Tensor,
            draft_logits: Optional[torch.Tensor], target_logits: torch.Tensor, weight):
    """One verify call for the whole batch, straight from both models' logits (no [B, K, V] probabilities), or from
    the drafted tokens [B, K] and the target's logits when the verifier goes without the draft's distributions."""
    width = draft_tokens.shape[1]
    if config.draft_mode != "distributions":
        draft_logits = None
    device = target_logits.device
    num_draft = device_tensor([len(tokens) for tokens in drafts.tokens], torch.int64, device)
    if config.typical is not None and width > 0:  # Medusa's test in place of the exact one (see .typical)
        num_draft, weight = typical_verify_arguments(config.typical, draft_tokens, num_draft, target_logits,
                                                     config.temperature)
        draft_logits = None
    fly = {} if config.fly is None else config.fly.verify_arguments(width)
    return verify_logits(draft_tokens, draft_logits, target_logits, weight, temperature=config.temperature,
                         num_draft=num_draft, uniforms=row_uniforms(states, num_draft, width, device),
                         check_inputs=config.check_inputs, **fly)


def row_uniforms(states: list[DecodingState], num_draft: torch.Tensor, width: int, device) -> torch.Tensor:
    """The verifier's uniforms [B, K + 1]: row r's Philox draws for its own seed at offset = its round index, its final
    sample's uniform (that of position k_r, as a call with the row alone would use) moved to column K."""
    seeds = device_tensor([state.seed for state in states], torch.int64, device)
    offsets = device_tensor([state.round_index for state in states], torch.int64, device)
    uniforms = philox_uniforms(seeds, offsets, width + 1, per_row_seed=True)
    uniforms[:, width] = uniforms.gather(1, num_draft.unsqueeze(1)).squeeze(1)
    return uniforms
