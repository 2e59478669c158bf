"""The EAGLE-3 head's inference step (preallocated cache, grouped products, views for grouped-query attention, no
mask for one query) against the plain layer written out below: one concatenating cache, separate q/k/v products,
keys repeated per query head and a causal mask, as vLLM's Llama EAGLE-3 layer computes it. Compared for one and
several positions, after crops, across the cache's capacity growth, in float64 (the torch products) and in float32
(the native packed products where they are built)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from diversed_ext.forward import Int8Linear, quantize_int8
from diversed_ext.models.eagle3 import Eagle3Config, Eagle3Head, rotate
from diversed_ext.models.eagle3_layers import INT8_GROUPS, Eagle3Cache, step_weights
from helpers import require_forward_ops

TARGET = dict(hidden_size=32, num_attention_heads=6, num_key_value_heads=2, head_dim=8, intermediate_size=48,
              rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
              max_position_embeddings=512, vocab_size=80, num_hidden_layers=30)


def make_head(dtype, seed=0, draft_vocab=50):
    torch.manual_seed(seed)
    config = Eagle3Config.from_target(TARGET, draft_vocab)
    head = Eagle3Head(config, torch.nn.Embedding(config.vocab_size, config.hidden_size).to(dtype)).to(dtype)
    with torch.no_grad():
        for p in head.parameters():  # norms away from 1 so that a swapped norm shows
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    return head.eval()


class ReferenceCache:
    """Keys and values concatenated step by step; crop slices."""

    def __init__(self):
        self.keys = self.values = None

    def crop(self, keep):
        self.keys, self.values = self.keys[:, :keep], self.values[:, :keep]


def reference_step(head, token_ids, features, cache):
    """The plain layer: ``project`` (separate q/k/v, rotary via ``rotate``), repeated keys, a causal mask."""
    c = head.config
    start = 0 if cache.keys is None else cache.keys.shape[1]
    positions = torch.arange(start, start + token_ids.shape[0])
    layer = head.midlayer
    embeds = head.embed_tokens(token_ids).to(features.dtype)
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
    q = layer.self_attn.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim)).transpose(0, 1)
    k = layer.self_attn.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(0, 1)
    v = layer.self_attn.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(0, 1)
    q, k = rotate(q, positions.unsqueeze(0), c.rope_theta), rotate(k, positions.unsqueeze(0), c.rope_theta)
    cache.keys = k if cache.keys is None else torch.cat([cache.keys, k], dim=1)
    cache.values = v if cache.values is None else torch.cat([cache.values, v], dim=1)
    group = c.num_attention_heads // c.num_key_value_heads
    keys, values = cache.keys.repeat_interleave(group, 0), cache.values.repeat_interleave(group, 0)
    visible = torch.arange(keys.shape[1]) <= positions.unsqueeze(-1)
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=1 / math.sqrt(c.head_dim))
    residual = features + layer.self_attn.o_proj(attended.transpose(0, 1).flatten(-2))
    prenorm = residual + layer.mlp(layer.post_attention_layernorm(residual))
    return head.lm_head(head.norm(prenorm)), prenorm


def tolerances(dtype):
    return dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)


DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_equal_the_plain_layer_across_crops_and_growth(dtype):
    """A prompt of 3, then rounds of one-token drafts and multi-position refeeds with crops, until the cache has
    grown twice past a capacity of 4: every step's logits and states equal the plain layer's."""
    head = make_head(dtype)
    g = torch.Generator().manual_seed(3)
    fast, reference = Eagle3Cache(capacity=4), ReferenceCache()
    assert fast.capacity == 4
    # (positions fed, length kept after the step); lengths 3, 4, 5 (capacity 8) .. 9 (16) .. 18 (32), then from 0
    pattern = [(3, None), (1, None), (1, None), (1, None), (1, 4), (3, None), (1, None), (1, None), (1, 7),
               (4, None), (1, None), (6, 15), (1, None), (1, 0), (2, None), (1, None)]
    capacities = set()
    with torch.no_grad():
        for count, crop_to in pattern:
            tokens = torch.randint(0, head.config.vocab_size, (count,), generator=g)
            features = torch.randn(count, head.config.hidden_size, generator=g, dtype=torch.float64).to(dtype)
            got = head.step(tokens, features, fast)
            want = reference_step(head, tokens, features, reference)
            torch.testing.assert_close(got[0], want[0], **tolerances(dtype))
            torch.testing.assert_close(got[1], want[1], **tolerances(dtype))
            assert fast.length == reference.keys.shape[1]
            torch.testing.assert_close(fast.keys, reference.keys, **tolerances(dtype))
            torch.testing.assert_close(fast.values, reference.values, **tolerances(dtype))
            capacities.add(fast._keys.shape[1])
            if crop_to is not None:
                fast.crop(crop_to)
                reference.crop(crop_to)
    assert {4, 8, 16, 32} <= capacities  # grew past the initial capacity, keeping the held positions


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_query_needs_no_mask_however_long_the_cache(dtype):
    """T = 1 at cache lengths on both sides of the default capacity: equal to the masked plain layer."""
    head = make_head(dtype, seed=1)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for length in (0, 1, 255, 256, 300):
            fast, reference = head.new_cache(), ReferenceCache()
            if length:
                tokens = torch.randint(0, head.config.vocab_size, (length,), generator=g)
                features = torch.randn(length, head.config.hidden_size, generator=g, dtype=dtype)
                head.step(tokens, features, fast)
                reference_step(head, tokens, features, reference)
            token = torch.randint(0, head.config.vocab_size, (1,), generator=g)
            feature = torch.randn(1, head.config.hidden_size, generator=g, dtype=dtype)
            got, want = head.step(token, feature, fast), reference_step(head, token, feature, reference)
            torch.testing.assert_close(got[0], want[0], **tolerances(dtype))
            torch.testing.assert_close(got[1], want[1], **tolerances(dtype))
            assert fast.length == length + 1


def test_float32_on_the_cpu_uses_the_packed_products_and_repacks_after_a_change():
    """The packed weights follow the parameters: after an in-place update (a training step, a load) the step reads
    the new weights, not the packed copy of the old ones."""
    require_forward_ops()
    head = make_head(torch.float32, seed=2)
    tokens, features = torch.tensor([3, 4, 5]), torch.randn(3, head.config.hidden_size)
    with torch.no_grad():
        head.step(tokens, features, head.new_cache())
        assert step_weights(head).native
        head.lm_head.weight.mul_(2.0)
        head.midlayer.self_attn.k_proj.weight.add_(0.1)
        got = head.step(tokens, features, head.new_cache())
        want = reference_step(head, tokens, features, ReferenceCache())
    torch.testing.assert_close(got[0], want[0], **tolerances(torch.float32))
    torch.testing.assert_close(got[1], want[1], **tolerances(torch.float32))


class RowsAlone(torch.nn.Module):
    """``layer`` applied to each row of its input alone: a dynamically quantised layer then quantises each row by
    itself."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1]).split(1)
        return torch.cat([self.layer(row) for row in rows]).reshape(*x.shape[:-1], -1)


def quantised_rows_alone(head):
    """``head`` with every linear layer but ``fc`` an :class:`Int8Linear` (the int8 draft model's quantisation, which
    is ``quantize_dynamic``'s: python_tests/forward/test_int8_linear.py) applied row by row; ``fc`` the float one."""
    quantized = quantize_int8(copy.deepcopy(head))
    for parent in (quantized.midlayer.self_attn, quantized.midlayer.mlp, quantized):
        for name, child in list(parent.named_children()):
            if name != "fc" and isinstance(child, Int8Linear):
                setattr(parent, name, RowsAlone(child))
    quantized.fc = head.fc
    return quantized


def test_int8_products_are_the_int8_draft_layers_and_switch_back():
    """With int8 products the step computes what the plain layer computes with its linear layers quantised as the
    int8 draft model's are (:func:`quantize_int8`), each row's input quantised alone (so a position's
    result does not depend on the positions fed with it), not the float layer; ``fc`` (the fusion, once per verified
    position) stays float; switched off, the float step again."""
    require_forward_ops()
    head = make_head(torch.float32, seed=3)
    quantized = quantised_rows_alone(head)
    tokens, features = torch.tensor([3, 4, 5, 6]), torch.randn(4, head.config.hidden_size)
    with torch.no_grad():
        got = head.use_int8_products().step(tokens, features, head.new_cache())
        assert step_weights(head).int8_groups == INT8_GROUPS
        want = reference_step(quantized, tokens, features, ReferenceCache())
        float_want = reference_step(head, tokens, features, ReferenceCache())
        fused, fused_want = head.fuse(features.repeat(1, 3)), head.fc(features.repeat(1, 3))  # fc stays float
        back = head.use_int8_products(False).step(tokens, features, head.new_cache())
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fused, fused_want, rtol=1e-4, atol=1e-4)
    assert (got[0] - float_want[0]).abs().max() > 1e-2  # int8 is not float: the comparison above can fail
    for mine, theirs in zip(back, float_want):
        torch.testing.assert_close(mine, theirs, **tolerances(torch.float32))


def test_with_gradients_the_step_is_the_plain_layer_and_differentiable():
    head = make_head(torch.float64, seed=4).train()
    tokens, features = torch.tensor([1, 2, 3, 4]), torch.randn(4, head.config.hidden_size, dtype=torch.float64)
    cache = head.new_cache()
    logits, _ = head.step(tokens, features, cache)
    logits.sum().backward()
    assert head.lm_head.weight.grad is not None and head.midlayer.self_attn.q_proj.weight.grad is not None
    with torch.no_grad():
        want = reference_step(head, tokens, features, ReferenceCache())[0]
    torch.testing.assert_close(logits.detach(), want, **tolerances(torch.float64))


def test_cache_capacity_and_crop_are_checked():
    with pytest.raises(ValueError, match="capacity"):
        Eagle3Cache(capacity=0)
    cache = Eagle3Cache(capacity=2)
    cache.append(torch.zeros(2, 3, 4), torch.ones(2, 3, 4))
    assert cache.length == 3 and cache.keys.shape == (2, 3, 4) and cache._keys.shape[1] == 4
    with pytest.raises(ValueError, match="keep"):
        cache.crop(4)
    cache.crop(1)
    assert cache.keys.shape == (2, 1, 4) and torch.equal(cache.values, torch.ones(2, 1, 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fuse_equals_fc(dtype):
    head = make_head(dtype, seed=5)
    aux = torch.randn(7, len(head.config.aux_layer_ids) * head.config.hidden_size, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(head.fuse(aux), head.fc(aux), **tolerances(dtype))
        torch.testing.assert_close(head.fuse(aux[2:3]), head.fc(aux)[2:3], **tolerances(dtype))
        assert head.fuse(aux[:0]).shape == (0, head.config.hidden_size)


def test_a_cache_filled_in_inference_mode_carries_on_outside_it():
    """Prefill under ``torch.inference_mode`` (as a serving loop may run it), then a step under ``no_grad``: the
    cache moves its positions to ordinary tensors and the step equals the plain layer's."""
    head = make_head(torch.float32, seed=6)
    tokens, features = torch.tensor([1, 5, 9, 2]), torch.randn(4, head.config.hidden_size)
    fast, reference = head.new_cache(), ReferenceCache()
    with torch.inference_mode():
        head.step(tokens[:3], features[:3], fast)
    with torch.no_grad():
        reference_step(head, tokens[:3], features[:3], reference)
        got = head.step(tokens[3:], features[3:], fast)
        want = reference_step(head, tokens[3:], features[3:], reference)
    torch.testing.assert_close(got[0], want[0], **tolerances(torch.float32))
    assert fast.length == 4


def test_a_head_made_in_inference_mode_steps():
    """A head built (loaded) under ``torch.inference_mode``: its parameters keep no version counter, which the
    prepared weights' key must not ask for."""
    with torch.inference_mode():
        head = make_head(torch.float32, seed=7)
        tokens, features = torch.tensor([2, 8]), torch.randn(2, head.config.hidden_size)
        got = head.step(tokens, features, head.new_cache())
        want = reference_step(head, tokens, features, ReferenceCache())
    torch.testing.assert_close(got[0], want[0], **tolerances(torch.float32))


STEP_ROWS_PRODUCTS = ["float64", "float32", "int8"]


@pytest.mark.parametrize("products", STEP_ROWS_PRODUCTS)
def test_sequences_stepped_together_get_what_each_gets_alone(products):
    """step_rows over sequences with caches of different lengths (one empty), feeding several positions (a round's
    first step) or one: each sequence's logits, states and cache equal stepping it alone, bit for bit where the
    products are the packed float32 or int8 ones (a row's sums do not depend on the rows beside it)."""
    if products == "int8":
        require_forward_ops()
    dtype = torch.float64 if products == "float64" else torch.float32
    head = make_head(dtype, seed=7).use_int8_products(products == "int8")
    g = torch.Generator().manual_seed(11)

    def inputs(count):
        return (torch.randint(0, head.config.vocab_size, (count,), generator=g),
                torch.randn(count, head.config.hidden_size, generator=g, dtype=torch.float64).to(dtype))

    together, alone = [head.new_cache() for _ in range(3)], [head.new_cache() for _ in range(3)]
    with torch.no_grad():
        for length, cache_a, cache_b in zip((5, 0, 2), together, alone):
            if length:
                tokens, features = inputs(length)
                head.step(tokens, features, cache_a)
                head.step(tokens, features, cache_b)
        for counts in ((3, 1, 4), (1, 1, 1)):
            fed = [inputs(count) for count in counts]
            got = head.step_rows([t for t, _ in fed], [f for _, f in fed], together)
            for index, (tokens, features) in enumerate(fed):
                want = head.step(tokens, features, alone[index])
                exact = products != "float64" and step_weights(head).native
                for mine, theirs in ((got[0][index], want[0]), (got[1][index], want[1]),
                                     (together[index].keys, alone[index].keys)):
                    if exact:
                        assert torch.equal(mine, theirs)
                    else:
                        torch.testing.assert_close(mine, theirs, **tolerances(dtype))


def test_step_rows_with_gradients_steps_each_sequence_and_checks_its_arguments():
    head = make_head(torch.float64, seed=8).train()
    tokens, features = torch.tensor([1, 2]), torch.randn(2, head.config.hidden_size, dtype=torch.float64)
    logits, states = head.step_rows([tokens, tokens[:1]], [features, features[:1]],
                                    [head.new_cache(), head.new_cache()])
    (logits[0].sum() + logits[1].sum()).backward()
    assert head.lm_head.weight.grad is not None and [s.shape[0] for s in states] == [2, 1]
    with pytest.raises(ValueError, match="one token_ids, features and cache per sequence"):
        head.step_rows([tokens], [features, features], [head.new_cache()])
    with pytest.raises(ValueError, match="token_ids must be"):
        head.step_rows([tokens], [features[:1]], [head.new_cache()])
