"""The aux hidden states both runners give an EAGLE-3 drafter (the residual streams entering chosen decoder layers, at
every fed position) against the model's own ``output_hidden_states``, through batched ragged feeds and crops."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from diversed_ext.decoding.runners import HFRunner  # noqa: E402
from diversed_ext.forward.llama_runner import LlamaRunner  # noqa: E402
from diversed_ext.forward import quantize_int8  # noqa: E402
from helpers import FORWARD_VOCAB, forward_llama  # noqa: E402

AUX = (3, 0, 2)  # out of order on purpose: the output follows the order asked for
# Per row, per pass: (cached positions dropped first, tokens fed), ragged as the decoding loop makes them.
ROW_SCHEDULES = ([(0, 5), (0, 1), (0, 3), (2, 1), (0, 2)], [(0, 2), (0, 4), (3, 1), (0, 1), (1, 3)])


def expected_aux(model, tokens, count):
    """The last ``count`` positions' hidden_states[l] for l in AUX from one full forward over ``tokens``."""
    with torch.inference_mode():
        states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[layer][0, -count:] for layer in AUX], dim=-1)


def run_batched_schedule(model, runner, tolerance):
    """Two rows fed together along ROW_SCHEDULES; after each step every row's aux states match a full forward."""
    generator = torch.Generator().manual_seed(5)
    caches, tokens = [None, None], [[], []]
    for steps in zip(*ROW_SCHEDULES):
        feeds = []
        for row, (drop, count) in enumerate(steps):
            if drop:
                caches[row].crop(-drop)
                del tokens[row][-drop:]
            feeds.append(torch.randint(0, FORWARD_VOCAB, (count,), generator=generator).tolist())
        logits, hidden, caches, aux = runner.run_rows(feeds, caches, [1, 1], True, aux_layers=AUX)
        assert aux.shape == (sum(map(len, feeds)), len(AUX) * model.config.hidden_size)
        offset = 0
        for row, feed in enumerate(feeds):
            tokens[row] += feed
            torch.testing.assert_close(aux[offset:offset + len(feed)], expected_aux(model, tokens[row], len(feed)),
                                       rtol=tolerance, atol=tolerance)
            offset += len(feed)


@pytest.mark.parametrize("kind", ["native float32", "op by op (float64)", "hf runner"])
def test_aux_hidden_states_match_output_hidden_states(kind):
    model = forward_llama(1, num_hidden_layers=4)
    if kind == "op by op (float64)":
        model = copy.deepcopy(model).double()
    runner = HFRunner(model, torch.device("cpu")) if kind == "hf runner" else LlamaRunner(model)
    run_batched_schedule(model, runner, 1e-9 if model.dtype == torch.float64 else 1e-4)


def test_aux_hidden_states_leave_the_logits_unchanged():
    """Running the native layers in segments gives the logits and caches of the one-call pass."""
    model = forward_llama(2, num_hidden_layers=4)
    feed = list(range(9))
    plain_logits, plain_hidden, plain_cache = LlamaRunner(model)(feed, None, 9)
    logits, hidden, caches, _ = LlamaRunner(model).run_rows([feed], [None], [9], True, aux_layers=AUX)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden, plain_hidden, rtol=1e-6, atol=1e-6)
    more_plain, _, _ = LlamaRunner(model)([3], plain_cache, 1)
    more, _, _ = LlamaRunner(model)([3], caches[0], 1)
    torch.testing.assert_close(more, more_plain, rtol=1e-6, atol=1e-6)


def test_int8_model_aux_states_follow_its_own_forward():
    """An int8 copy quantises each call's rows, so its reference is the same feeds through its own forward."""
    model = quantize_int8(forward_llama(3, num_hidden_layers=4))
    runner, reference = LlamaRunner(model), HFRunner(model, torch.device("cpu"))
    cache, reference_cache = None, None
    for feed in ([4, 1, 7, 7], [2], [5, 6]):
        _, _, caches, aux = runner.run_rows([feed], [cache], [1], False, aux_layers=AUX)
        _, _, reference_caches, expected = reference.run_rows([feed], [reference_cache], [1], False, aux_layers=AUX)
        cache, reference_cache = caches[0], reference_caches[0]
        torch.testing.assert_close(aux, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("aux_layers", [(), (4,), (-1,), (1.0,)])
def test_bad_aux_layers_name_the_argument(aux_layers):
    model = forward_llama(1, num_hidden_layers=4)
    for runner in (LlamaRunner(model), HFRunner(model, torch.device("cpu"))):
        with pytest.raises(ValueError, match="aux_layers"):
            runner.run_rows([[1, 2]], [None], [1], False, aux_layers=aux_layers)
