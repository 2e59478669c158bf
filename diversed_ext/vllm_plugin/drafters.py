"""Which of vLLM's speculative methods DIVERSED verifies, on which model runner, and what each drafter hands over.

Every drafter below reaches the rejection sampler the same way: draft token ids per request, plus the draft's
probabilities (V1) or logits (V2) only when it samples probabilistically; without them the ops verify tokens only
(q one-hot at each draft). What differs between drafters, and decides what start-up refuses:

- whether the drafter has hidden states that a learned head can read (a draft model, EAGLE, EAGLE-3, MTP: V1 hands
  them to ``SpecDecodeBaseProposer._sample_draft_tokens``, V2 to its speculator's ``sample_draft``); n-gram, suffix
  and Medusa drafts have none of their own, so heads are refused with them;
- whether every drafted token is a real proposal. V1's n-gram and suffix drafters propose nothing where nothing
  matches, and V1 trims ngram_gpu's unmatched positions before verification. V2's n-gram speculator always drafts K
  tokens and fills the positions after a miss with the request's last token without marking them; relaxed
  verification would keep that filler and pull the output towards repeating itself, so the plugin counts each
  request's real drafts after every proposal (:class:`RealDraftCounts`, by the rule of V2's kernel) and its V2
  sampler verifies only those: the filler is never kept by a weight below 1, FLy or the gate;
- which runner runs it: vLLM runs suffix and Medusa on V1 only;
- model-specific variants (:func:`variant_problems`): V1 proposes Step-3.5's MTP layers outside the hook heads read.

A method not in :data:`DRAFTERS` (vLLM's dflash, dspark, mlp_speculator, custom_class and extract_hidden_states) lays
its drafts out in ways the plugin was not built for, and is refused at start-up with that reason. Model-specific MTP
names reach the plugin as "mtp"; of their proposers, only V1's for Step-3.5 drafts outside the hook heads read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Drafter:
    """What one speculative method gives the verifier."""

    hidden_states: bool  # the drafter computes hidden states per drafted token (heads can read them)
    v1: Optional[str] = None  # why DIVERSED cannot verify it on V1 (None: it can)
    v2: Optional[str] = None  # the same on V2
    tested: str = ""  # how it is tested (docs/vllm.md's table repeats it)


TOKENS_ONLY = ("its drafts are token ids without hidden states, which a head reads: use a static weight, FLy or "
               "the gate")
V1_ONLY = "vLLM runs it on the V1 model runner only"

DRAFTERS = {
    "draft_model": Drafter(hidden_states=True, tested="V1 and V2 engines"),
    "eagle": Drafter(hidden_states=True, tested="V1 engine, checkpoint built in the test; V2: the speculator of "
                                                "eagle3's V2 engine"),
    "eagle3": Drafter(hidden_states=True, tested="V1 and V2 engines, checkpoint built in the test; V1 engine with "
                                                 "the trained drafter"),
    # vLLM folds every model-specific MTP name (deepseek_mtp, qwen3_next_mtp, ...) into "mtp" before the plugin sees
    # it; V1 proposes MTP with the EAGLE proposer (same hidden-state path), V2 with its MTP speculators.
    "mtp": Drafter(hidden_states=True, tested="V2's MTP speculators at the sampler on synthetic rows; V1 through "
                                              "EAGLE's proposer (no model here has MTP layers)"),
    "ngram": Drafter(hidden_states=False, tested="V1 and V2 engines; V2's filler counted on its own kernels' output"),
    "ngram_gpu": Drafter(hidden_states=False, tested="V2 as ngram (the same speculator); V1 not run (needs Triton)"),
    "suffix": Drafter(hidden_states=False, v2=V1_ONLY,
                      tested="V1 engine, arctic_inference's suffix tree built from source by the test"),
    "medusa": Drafter(hidden_states=False, v2=V1_ONLY, tested="not in the suite: a V1 engine with random weights "
                                                              "ran once"),
}


def drafter_problems(method: Optional[str], *, v2: bool, heads: bool) -> list:
    """Why an engine drafting with ``method`` on the V1 or V2 runner (``v2``), with learned heads loaded or not,
    would not be verified by DIVERSED as asked (empty when it would)."""
    drafter = DRAFTERS.get(method)
    if drafter is None:
        return [f"speculative method {method!r} lays out its drafts in a way DIVERSED does not verify (supported: "
                f"{', '.join(DRAFTERS)})"]
    problems = []
    refusal = drafter.v2 if v2 else drafter.v1
    if refusal is not None:
        problems.append(f"speculative method {method!r} on the {'V2' if v2 else 'V1'} model runner: {refusal}")
    if heads and not drafter.hidden_states:
        problems.append(f"learned heads with speculative method {method!r}: {TOKENS_ONLY}")
    return problems


# vLLM's V1 runner proposes Step-3.5's MTP layers (method "mtp", a ``step3p5_mtp`` draft) with a proposer of their own
# that samples its drafts outside ``_sample_draft_tokens``, the hook where heads read the draft's hidden states.
STEP3P5_V1 = ("learned heads with Step-3.5's MTP layers on the V1 model runner: its proposer samples drafts where "
              "the plugin cannot read their hidden states; use the V2 runner or a static weight")


def variant_problems(speculative_config, *, v2: bool, heads: bool) -> list:
    """Why a model-specific variant of a supported method would not be verified as asked (empty when it would)."""
    use_step3p5_mtp = getattr(speculative_config, "use_step3p5_mtp", None)
    if heads and not v2 and callable(use_step3p5_mtp) and use_step3p5_mtp():
        return [STEP3P5_V1]
    return []


def ngram_real_drafts(scratch, num_blocks: int, seq_lens, num_sampled, max_model_len: int, num_positions: int):
    """[R] how many of each request's K drafts V2's n-gram speculator matched, from what its kernels leave behind:
    ``scratch`` [R, blocks] the best (n-gram length, position) score of each block (0: no match), ``seq_lens`` [R]
    the requests' token counts and ``num_sampled`` [R] the tokens each sampled this step (0: nothing drafted). The
    rule is ``_ngram_finalize_kernel``'s: a slot is a draft when its request matched and the slot lies within the
    tokens that follow the match; every other slot holds the last sampled token as filler."""
    import torch

    score = scratch[:, :num_blocks].amax(dim=1).to(torch.int64)
    stride = max_model_len + 1
    best = (score - 1).clamp(min=0)
    best_length = best // stride
    draft_start = best - best_length * stride + best_length
    available = (seq_lens.to(torch.int64) - draft_start).clamp(min=0, max=num_positions)
    return torch.where((score > 0) & (num_sampled.to(torch.int64) > 0), available, torch.zeros_like(available))


class RealDraftCounts:
    """How many of each request state's last drafts are real proposals, for a V2 speculator that pads with filler
    (V2's n-gram): refreshed after every proposal, read by the sampler, which verifies only those (the filler is
    not drafted: the token after the last real draft comes from the target, as after a rejection)."""

    def __init__(self, speculator, max_num_reqs: int, device):
        import torch

        self.by_state = torch.full((max_num_reqs,), speculator.num_speculative_steps, dtype=torch.int64,
                                   device=device)
        self._install(speculator)

    def _install(self, speculator) -> None:
        propose = speculator.propose

        def propose_and_count(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                              num_sampled, *args, dummy_run: bool = False, **kwargs):
            drafts = propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                             num_sampled, *args, dummy_run=dummy_run, **kwargs)
            if not dummy_run:
                states = input_batch.idx_mapping.to(self.by_state.device, dtype=self.by_state.dtype)
                rows = states.shape[0]
                self.by_state[states] = ngram_real_drafts(
                    speculator.scratch[:rows], speculator.n_blocks,
                    speculator.req_states.total_len.gpu[states], num_sampled[:rows], speculator.max_model_len,
                    speculator.num_speculative_steps)
            return drafts

        speculator.propose = propose_and_count


def real_draft_counts(runner) -> Optional[RealDraftCounts]:
    """The real-draft counts of a V2 runner whose speculator pads its drafts with filler, else None."""
    speculator = getattr(runner, "speculator", None)
    if type(speculator).__name__ != "NgramGPUSpeculator":
        return None
    return RealDraftCounts(speculator, runner.max_num_reqs, runner.device)
