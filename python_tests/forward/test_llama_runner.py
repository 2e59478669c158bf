"""The lean Llama forward (diversed_ext.forward.llama_runner) against the model's own forward, on tiny random Llamas."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from diversed_ext.decoding import SpeculativeDecoder  # noqa: E402
from diversed_ext.decoding.runners import HFRunner  # noqa: E402
from diversed_ext.forward.llama_runner import LlamaRunner, StaticKVCache, supports_fast_forward  # noqa: E402
from diversed_ext.forward import quantize_int8  # noqa: E402
from diversed_ext.forward import int8 as int8_module  # noqa: E402
from helpers import FORWARD_CONFIGS, FORWARD_SCHEDULE, FORWARD_VOCAB, forward_llama  # noqa: E402

# An int8 model's inputs are quantised, so a float rounding difference (the native layers sum RMSNorm's squares in
# float64, and evaluate exp by a polynomial) now and then moves one input across a rounding boundary: a step of that
# input, which moves the outputs of that token, and through its key and value later ones, by up to about 1e-2 on
# these models. Everywhere else the outputs agree to float rounding, so at least half of them must; quantising a
# call's tokens with one scale moves the median difference to 6e-4 or more.
INT8_MEDIAN_DIFFERENCE = 1e-5
INT8_BOUNDARY_STEP = 0.05


@torch.inference_mode()
def run_schedule(model, runner, cache=None, seed=0, incremental=False, quantised=False):
    """Feed random tokens along FORWARD_SCHEDULE; after every feed compare the runner's logits and hidden states at
    the fed positions with the model's own forward: over the whole sequence, or (``incremental``) over the same
    feeds with a transformers cache. ``quantised`` (an int8 model) allows the rounding boundaries' steps above."""
    generator = torch.Generator().manual_seed(seed)
    reference_runner, reference_cache = HFRunner(model, torch.device("cpu")), None
    tokens, differences = [], []
    for step in FORWARD_SCHEDULE:
        if step < 0:
            cache.crop(step)
            if incremental:
                reference_cache.crop(step)
            del tokens[step:]
            continue
        feed = torch.randint(0, FORWARD_VOCAB, (step,), generator=generator).tolist()
        logits, hidden, cache = runner(feed, cache, step, True)
        tokens += feed
        assert cache.get_seq_length() == len(tokens)
        if incremental:
            expected_logits, expected_hidden, reference_cache = reference_runner(feed, reference_cache, step, True)
        else:
            expected_logits, expected_hidden, _ = reference_runner(tokens, None, step, True)
        if quantised:
            differences += [(logits - expected_logits).abs().flatten(), (hidden - expected_hidden).abs().flatten()]
        else:
            torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hidden, expected_hidden, rtol=1e-4, atol=1e-4)
    if quantised:
        differences = torch.cat(differences)
        assert float(differences.median()) <= INT8_MEDIAN_DIFFERENCE
        assert float(differences.max()) <= INT8_BOUNDARY_STEP
    return cache


@pytest.mark.parametrize("name", list(FORWARD_CONFIGS))
def test_runner_matches_the_model_forward(name):
    model = forward_llama(1, **FORWARD_CONFIGS[name])
    assert supports_fast_forward(model)
    run_schedule(model, LlamaRunner(model))


def test_rope_scaling_is_taken_from_the_model():
    """The test above could pass with any RoPE if the scaling did nothing; check that it changes the outputs."""
    plain, scaled = forward_llama(1), forward_llama(1, **FORWARD_CONFIGS["rope-linear-scaling"])
    feed = list(range(12))
    plain_logits, _, _ = LlamaRunner(plain)(feed, None, 12)
    scaled_logits, _, _ = LlamaRunner(scaled)(feed, None, 12)
    assert (plain_logits - scaled_logits).abs().max() > 1e-3


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("name", list(FORWARD_CONFIGS))
def test_runner_matches_an_int8_copy(name, incremental):
    """The lean int8 draft (fused int8_linear products over packed weights) against the copy's own forward through
    its quantised layers: the same int32 sums, so float rounding apart (and its rare steps across a rounding
    boundary, see run_schedule). Both quantise every token's input on its own, so the runner's feeds of a few tokens
    match one pass of the copy over the whole sequence too: a token's result does not depend on what it was fed with
    (one scale per call would fail this, the first feeds' outliers coarsening later tokens)."""
    draft = quantize_int8(forward_llama(2, **FORWARD_CONFIGS[name]))
    assert supports_fast_forward(draft)
    runner = LlamaRunner(draft)
    assert all(group.int8 is not None for products in runner.projections for group in products)
    assert runner.head.int8 is not None
    run_schedule(draft, runner, seed=3, incremental=incremental, quantised=True)


def test_int8_weights_are_packed_again_when_they_change(monkeypatch):
    """Runners share packed weights per module group; int8 weights changed in place (a single layer: the LM head; a
    fused group: q/k/v) must not reuse the old packing. The expected logits come from the layers' plain-torch
    arithmetic, which packs nothing."""
    draft = quantize_int8(forward_llama(2))
    feed = list(range(6))
    before, _, _ = LlamaRunner(draft)(feed, None, 6)
    with torch.no_grad():
        draft.lm_head.weight.copy_(-draft.lm_head.weight.clamp(min=-127))
        draft.model.layers[0].self_attn.k_proj.scale.mul_(2.0)
    after, _, _ = LlamaRunner(draft)(feed, None, 6)
    monkeypatch.setattr(int8_module, "forward_ops_built", lambda: False)
    with torch.inference_mode():
        expected = draft(torch.tensor([feed])).logits[0]
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_models_made_under_inference_mode_run(kind):
    """Tensors made under torch.inference_mode() keep no version counter (asking raises): a model loaded or quantised
    there must still run, and replacing one of its weights must still be seen."""
    with torch.inference_mode():
        model = forward_llama(2)
        model = quantize_int8(model) if kind == "int8" else model
    feed = list(range(6))
    logits, _, _ = LlamaRunner(model)(feed, None, 6)
    with torch.inference_mode():
        expected = model(torch.tensor([feed])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        head = model.lm_head
        if kind == "int8":
            head.weight = -head.weight.clamp(min=-127)
        else:
            head.weight = torch.nn.Parameter(-head.weight)
        replaced, _, _ = LlamaRunner(model)(feed, None, 6)
        torch.testing.assert_close(replaced, model(torch.tensor([feed])).logits[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(replaced, logits)


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_cache_grows_past_its_capacity_and_keeps_the_prefix(capacity):
    model = forward_llama(3)
    cache = run_schedule(model, LlamaRunner(model), cache=StaticKVCache(capacity), seed=4)
    assert cache.keys.shape[2] >= cache.get_seq_length() > capacity


def test_lm_head_reads_only_the_requested_positions():
    model = forward_llama(4)
    logits, hidden, cache = LlamaRunner(model)(list(range(9)), None, 2)
    assert logits.shape == (2, FORWARD_VOCAB) and hidden.shape == (2, 32) and cache.get_seq_length() == 9


def test_bfloat16_model_stays_close():
    model = forward_llama(5).to(torch.bfloat16)
    feed = list(range(10))
    logits, _, _ = LlamaRunner(model)(feed, None, 10)
    with torch.inference_mode():
        reference = model(torch.tensor([feed])).logits[0]
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference.float(), rtol=0.05, atol=0.1)


def test_cache_crop_checks_its_argument():
    cache = StaticKVCache(4)
    with pytest.raises(ValueError, match="capacity"):
        StaticKVCache(0)
    cache.length = 3
    cache.crop(-1)
    assert cache.get_seq_length() == 2
    cache.crop(1)
    assert cache.get_seq_length() == 1
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-2)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(5)


def test_empty_feed_is_an_error():
    with pytest.raises(ValueError, match="feed"):
        LlamaRunner(forward_llama(6))([], None, 1)


def test_other_models_fall_back_to_their_own_forward():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=FORWARD_VOCAB, n_embd=16, n_layer=1,
                                                                n_head=2)).eval()
    llama = forward_llama(7)
    training = copy.deepcopy(llama).train()
    hooked = copy.deepcopy(llama)
    hooked.model.layers[0].register_forward_hook(lambda module, args, output: None)
    for model in (gpt2, training, hooked):
        assert not supports_fast_forward(model)
        with pytest.raises(ValueError, match="LlamaForCausalLM"):
            LlamaRunner(model)
        decoder = SpeculativeDecoder(model, model, method="sd", max_draft=2)
        assert isinstance(decoder._target_runner, HFRunner)
        assert len(decoder.generate([1, 2, 3], max_new_tokens=5, seed=0).sequences[0]) == 5
    decoder = SpeculativeDecoder(llama, llama, method="sd", max_draft=2, fast_forward=False)
    assert isinstance(decoder._target_runner, HFRunner)
    assert isinstance(SpeculativeDecoder(llama, llama, method="sd")._target_runner, LlamaRunner)


@pytest.mark.parametrize("method,weight", [("sd", None), ("static", 0.4)])
def test_decoder_output_is_the_same_with_either_forward(method, weight):
    target, draft = forward_llama(8), forward_llama(9)
    outputs = []
    for fast_forward in (False, True):
        decoder = SpeculativeDecoder(target, draft, method=method, weight=weight, max_draft=3, temperature=0.0,
                                     fast_forward=fast_forward)
        outputs.append(decoder.generate([[1, 2, 3], [4, 5]], max_new_tokens=24, seed=0).sequences)
    for hf_tokens, fast_tokens in zip(*outputs):
        assert hf_tokens.tolist() == fast_tokens.tolist()
