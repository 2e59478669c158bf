"""The decoding loop's KV caches: cropped caches give fresh logits, and the prefix is never recomputed
(tiny random Llama pairs from helpers/models.py)."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.decoding import SpeculativeDecoder  # noqa: E402
from helpers import PROMPT  # noqa: E402


# ---- caches ----------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def _logits_from_cache(runner, cache, tokens, cached):
    """The next-token logits after feeding the uncached tokens to a copy of the cache, with the decoder's runner (the
    model's own forward, or the fast Llama path)."""
    logits, _, _ = runner(tokens[cached:], copy.deepcopy(cache), 1, False)
    return logits[-1]


@pytest.mark.parametrize("fast_forward", [False, True], ids=["hf-forward", "fast-forward"])
@pytest.mark.parametrize("method,weight", [("sd", None), ("static", 0.5)])
def test_cropped_caches_give_the_logits_of_a_fresh_forward(wide_pair, method, weight, fast_forward):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method=method, weight=weight, max_draft=4, temperature=1.0,
                                 fast_forward=fast_forward)
    state = decoder.start(PROMPT, max_new_tokens=40, seed=1)
    rejections = 0
    while not state.finished:
        stats = decoder.step(state)
        rejections += stats.accepted < stats.drafted
        if state.finished:
            break
        assert state.target_cached == len(state.tokens) - 1
        assert state.target_cache.get_seq_length() == state.target_cached
        assert len(state.tokens) - 2 <= state.draft_cached <= len(state.tokens) - 1
        assert state.draft_cache.get_seq_length() == state.draft_cached
        with torch.inference_mode():
            fresh_target = target(torch.tensor([state.tokens])).logits[0, -1]
            fresh_draft = draft(torch.tensor([state.tokens])).logits[0, -1]
        cached_target = _logits_from_cache(decoder._target_runner, state.target_cache, state.tokens,
                                           state.target_cached)
        cached_draft = _logits_from_cache(decoder._draft_runner, state.draft_cache, state.tokens, state.draft_cached)
        torch.testing.assert_close(cached_target, fresh_target, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cached_draft, fresh_draft, rtol=1e-4, atol=1e-4)
    assert rejections > 0  # the crop after a rejection ran


class ForwardCounter:
    """Counts the token positions a model reads, through a forward pre-hook."""

    def __init__(self, model):
        self.tokens_read = []
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        self.tokens_read.append(input_ids.shape[1])

    def remove(self):
        self.handle.remove()


class RunnerCounter:
    """Counts the token positions a decoder's runner feeds its model (the fast Llama path runs no module hooks)."""

    def __init__(self, decoder, attribute):
        self.tokens_read = []
        self.decoder, self.attribute = decoder, attribute
        self.runner = getattr(decoder, attribute)
        setattr(decoder, attribute, self)

    def run_rows(self, feeds, caches, num_logits, want_hidden):
        self.tokens_read += [len(feed) for feed in feeds]
        return self.runner.run_rows(feeds, caches, num_logits, want_hidden)

    def remove(self):
        setattr(self.decoder, self.attribute, self.runner)


@pytest.mark.parametrize("fast_forward", [False, True], ids=["hf-forward", "fast-forward"])
def test_the_prefix_is_never_recomputed(wide_pair, fast_forward):
    target, draft = wide_pair
    decoder = SpeculativeDecoder(target, draft, method="sd", max_draft=3, fast_forward=fast_forward)
    if fast_forward:
        target_counter = RunnerCounter(decoder, "_target_runner")
        draft_counter = RunnerCounter(decoder, "_draft_runner")
    else:
        target_counter, draft_counter = ForwardCounter(target), ForwardCounter(draft)
    try:
        output = decoder.generate(PROMPT, max_new_tokens=30, seed=2)
    finally:
        target_counter.remove()
        draft_counter.remove()
    rounds = output.rounds[0]
    drafted = [stats.drafted for stats in rounds]
    # Round 0 reads the prompt and its drafts; every later round reads the one pending token and its drafts.
    assert target_counter.tokens_read == [len(PROMPT) + drafted[0]] + [1 + k for k in drafted[1:]]
    # The draft's first pass of a round reads what it has not seen: the prompt, the pending token, or (after a fully
    # accepted block, whose last draft it never read) two tokens; every later pass reads the previous draft.
    expected_reads = []
    for index, stats in enumerate(rounds):
        if stats.drafted == 0:
            continue
        previous = rounds[index - 1] if index else None
        first = len(PROMPT) if previous is None else 2 if previous.accepted == previous.drafted > 0 else 1
        expected_reads += [first] + [1] * (stats.drafted - 1)
    assert draft_counter.tokens_read == expected_reads
    assert any(stats.accepted < stats.drafted for stats in rounds)
    assert any(stats.accepted == stats.drafted for stats in rounds)


# ---- the cache's keyword -----------------------------------------------------------------------------------------


class _RecordingLM(torch.nn.Module):
    """A causal LM stub whose forward declares its cache as ``cache`` (transformers 5.2x) or ``past_key_values``
    (earlier releases), and records what it was given."""

    def __init__(self, keyword):
        super().__init__()
        self.keyword, self.given = keyword, None
        self.forward = self._forward_taking_cache if keyword == "cache" else self._forward_taking_past_key_values

    def _reply(self, input_ids, kwargs):
        from transformers.modeling_outputs import ModelOutput

        self.given = kwargs
        return ModelOutput(logits=torch.zeros(1, input_ids.shape[1], 3), **{self.keyword: "the cache out"})

    def _forward_taking_cache(self, input_ids, cache=None, use_cache=None):
        return self._reply(input_ids, {"cache": cache, "use_cache": use_cache})

    def _forward_taking_past_key_values(self, input_ids, past_key_values=None, use_cache=None):
        return self._reply(input_ids, {"past_key_values": past_key_values, "use_cache": use_cache})


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_the_cache_goes_by_the_name_the_forward_declares(keyword):
    from diversed_ext.decoding.runners import HFRunner

    model = _RecordingLM(keyword)
    _, _, cache = HFRunner(model, torch.device("cpu"))([1, 2], "the cache in", 1, False)
    assert model.given == {keyword: "the cache in", "use_cache": True}
    assert cache == "the cache out"
