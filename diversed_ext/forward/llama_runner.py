"""A lean incremental forward pass for Hugging Face Llama models, used by the decoding loop.

Why: on a CPU, a decoding round is almost all forward passes, and much of ``LlamaForCausalLM.forward``'s time is not
the model's arithmetic: (1) the generic machinery around the layers (output capturing, mask building for every
attention backend, a dynamic cache that concatenates keys and values each step), (2) skinny matrix products (a
verify pass multiplies K + 1 rows by each weight; ``F.linear`` hands MKL a transposed weight that it repacks on every
call, and MKL's products of a few rows are compute-bound well above the time it takes to stream the weights), and
(3) a few dozen small ops per layer, each a dispatch of several microseconds.

What it runs: the model's own modules (embedding, RMSNorms, the rotary embedding with whatever RoPE scaling the
config asks for, the projections, the MLP activation, the final norm, the LM head weight) in Llama's order, with

- a preallocated key/value cache per layer (:class:`StaticKVCache`) that grows by doubling and is cropped by moving
  its length, so no step copies the prefix;
- several sequences per pass (:meth:`LlamaRunner.run_rows`): every product over all rows' new tokens stacked,
  attention row by row over each row's own cache, so no token sees another row and nothing is padded;
- the products grouped by the input they read (q/k/v, o, gate/up, down, the LM head; :mod:`.projections`), each
  group one native call over weights packed once: ``diversed::float_linear`` for float32 weights (every output
  summed in the same order whatever the row count, so a row's result never depends on its neighbours), and
  ``diversed::int8_linear`` for the int8 draft (the quantised layers' arithmetic, every token's row quantised on
  its own, so a token's result does not depend on the tokens fed with it either); any other module is called as it
  is;
- for a float32 or int8 Llama with SiLU MLPs on the CPU (both models of the default pair), every decoder layer in
  one native call (``diversed::float_llama_layers`` / ``int8_llama_layers``, :mod:`diversed_ext.forward.llama_layers`:
  RMSNorm, the products, the rotation, attention over each row's cache with keys in tiles of ``KEY_TILE`` positions,
  SiLU, with no op dispatch in between); other models run the layers op by op: scaled-dot-product attention with
  grouped-query heads and an explicit causal mask, one rotary rotation over queries and keys together, and RMSNorm
  in six ops (the module's own forward runs seven for the norm and fourteen for the two rotations).

Measured on the default pair (2-core AVX-512 CPU, 2 threads, about 100 cached positions): the target's 1-token pass
went from about 37 ms to about 18 ms and the draft's from about 11 ms to about 5-6 ms, each within 1.1-1.5x of
streaming its weights (540 MB float32, 135 MB int8) from memory (``bench/pass_costs.py``, docs/RESULTS.md).

The outputs equal the model's forward up to float rounding (products summed in another order, RMSNorm's squares
summed in float64 and exp evaluated by a polynomial in the native layers; tests check it on random Llamas with
grouped-query attention, biases, RoPE scaling, tied and untied heads, and int8 copies).

Which models: exactly ``transformers.LlamaForCausalLM`` (not subclasses, which may change the forward), in eval
mode, with ``pretraining_tp`` 1 and no hooks on the model, its decoder or its layers (a forward hook would expect to
run), and only in a build of the extension that carries the lean forward's native ops. Everything else goes through
the model's own forward: see :func:`supports_fast_forward`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ._native import forward_ops_built, require_forward_ops
from .llama_layers import llama_layers
from .projections import LayerProjections, Projections, layer_projections, native_layers

INITIAL_CAPACITY = 256  # cached positions allocated up front; the cache doubles when a sequence outgrows it
KEY_TILE = 16  # positions per tile of keys in the native layers' layout; capacities are multiples of it


class StaticKVCache:
    """Keys and values of every layer in preallocated tensors ``[layers, kv_heads, capacity, head_dim]``.

    It answers the two calls the decoding loop makes of a transformers cache: ``get_seq_length()`` and
    ``crop(-n)`` (drop the last n positions), so the loop crops both kinds of cache the same way.

    The runner that fills a cache owns its layout: the op-by-op layers store position p's key at ``keys[l, h, p]``;
    the native layers store keys in tiles of ``KEY_TILE`` positions (tile t's ``[head_dim, KEY_TILE]`` block holds
    positions ``t * KEY_TILE`` onwards, at an offset that does not depend on the capacity), so their scores need no
    sum across vector lanes. Capacities are multiples of ``KEY_TILE`` either way, and growing the cache copies whole
    tiles. Values are ``values[l, h, p]`` in both.
    """

    def __init__(self, capacity: int = INITIAL_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.length = 0
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def get_seq_length(self) -> int:
        """Positions cached."""
        return self.length

    def crop(self, count: int) -> None:
        """Keep the first ``count`` positions, or drop the last ``-count`` when negative (transformers' convention)."""
        keep = self.length + count if count < 0 else count
        if not 0 <= keep <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {keep}")
        self.length = keep

    def reserve(self, length: int, layers: int, kv_heads: int, head_dim: int, like: torch.Tensor) -> None:
        """Room for ``length`` positions, allocated like ``like`` (dtype and device), keeping what is cached."""
        if self.keys is not None and length <= self.keys.shape[2]:
            return
        capacity = self.capacity if self.keys is None else self.keys.shape[2]
        while capacity < length:
            capacity *= 2
        capacity = -(-capacity // KEY_TILE) * KEY_TILE
        shape = (layers, kv_heads, capacity, head_dim)
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self.keys is not None:
            # Whole tiles: in either layout the first `kept` rows of the [capacity, head_dim] view hold every
            # cached position.
            kept = min(-(-self.length // KEY_TILE) * KEY_TILE, self.keys.shape[2])
            keys[:, :, :kept] = self.keys[:, :, :kept]
            values[:, :, :kept] = self.values[:, :, :kept]
        self.keys, self.values = keys, values


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"))


def supports_fast_forward(model: torch.nn.Module) -> bool:
    """Whether :class:`LlamaRunner` can stand in for ``model``'s forward (see the module docstring)."""
    if not forward_ops_built():
        return False
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return False
    if type(model) is not LlamaForCausalLM or model.training:
        return False
    if getattr(model.config, "pretraining_tp", 1) not in (None, 1):
        return False
    modules = [model, model.model, *model.model.layers, *(layer.self_attn for layer in model.model.layers)]
    return not any(_has_hooks(module) for module in modules)


def _rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """cos, sin [1, n, d] of the model's rotary embedding -> (cos, signed sin) [1, n, 1, d] for :func:`_rotate`:
    ``rotate_half(x) * sin`` equals ``halves_swapped(x) * cat(-sin_low, sin_high)`` exactly (negation is exact)."""
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(2), signed_sin.unsqueeze(2)


def _rotate(states: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding ``x * cos + rotate_half(x) * sin`` of ``states`` [1, n, heads, d] in three ops
    (queries and keys together), instead of seven per tensor."""
    *lead, dim = states.shape
    swapped = states.reshape(*lead, 2, dim // 2).flip(-2).reshape(*lead, dim)
    return torch.addcmul(states * cos, swapped, signed_sin)


def _rms_norm(norm: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """``norm(states)`` for a float32 LlamaRMSNorm in six ops, bit for bit (the same operations in the same order,
    without the module's casts and temporaries; ``F.rms_norm`` runs about fifteen on the CPU)."""
    if type(norm).__name__ != "LlamaRMSNorm" or states.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return norm(states)
    inverse_rms = states.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()
    return (states * inverse_rms).mul_(norm.weight)


class LlamaRunner:
    """Incremental forward passes of one ``LlamaForCausalLM`` over a :class:`StaticKVCache`.

    ``runner(feed, cache, num_logits, want_hidden)`` appends the token ids ``feed`` to ``cache`` (a new one when
    None) and returns ``(logits [num_logits, V], hidden [num_logits, H], cache)`` for the last ``num_logits``
    positions, ``hidden`` being the final-norm output the LM head reads (``output_hidden_states[-1]``).

    With ``aux_layers`` (layer ids l in [0, layers)), :meth:`run_rows` also returns, fourth, the residual streams
    entering those decoder layers (``output_hidden_states[l]``; what an EAGLE-3 drafter reads) at every fed position,
    concatenated in the order given: [tokens fed, len(aux_layers) * H]. The native layers then run in segments
    split at those layers; without ``aux_layers`` nothing changes.
    """

    def __init__(self, model: torch.nn.Module):
        require_forward_ops("LlamaRunner")
        if not supports_fast_forward(model):
            raise ValueError(f"LlamaRunner needs a transformers LlamaForCausalLM in eval mode without hooks, got "
                             f"{type(model).__name__}")
        config = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.projections = [layer_projections(layer, _linear) for layer in self.layers]
        self.head = Projections((model.lm_head,), _linear)
        # A float32 or int8 Llama on the CPU runs every decoder layer in one native call (see the module docstring).
        self.native = native_layers(self.layers, self.projections, num_heads=self.num_heads, head_dim=self.head_dim)
        self._segments: dict = {}  # aux layer ids -> the native layers cut at them (built on first use)

    @torch.no_grad()
    def __call__(self, feed: list[int], cache: Optional[StaticKVCache], num_logits: int, want_hidden: bool = True):
        logits, hidden, caches = self.run_rows([feed], [cache], [num_logits], want_hidden)
        return logits, hidden, caches[0]

    @torch.no_grad()
    def run_rows(self, feeds: list[list[int]], caches: list, num_logits: list[int], want_hidden: bool = True,
                 aux_layers: Optional[Sequence[int]] = None):
        """Several sequences in one pass: row r appends ``feeds[r]`` to ``caches[r]`` (a new cache when None).

        Every product runs once over all rows' new tokens stacked (``[sum of feeds, H] @ W``); attention runs row by
        row over the row's own cache, so no token sees another row and nothing is padded. Returns ``(logits, hidden,
        caches)`` with the last ``num_logits[r]`` positions of each row stacked in row order, and with
        ``aux_layers`` the aux hidden states of every fed position fourth (see the class docstring).
        """
        if not feeds or any(not feed for feed in feeds):
            raise ValueError("feed must hold at least one token id")
        aux_layers = None if aux_layers is None else check_aux_layers(aux_layers, len(self.layers))
        base = self.model.model
        embed = base.embed_tokens
        caches = [StaticKVCache() if cache is None else cache for cache in caches]
        input_ids = torch.tensor([[token for feed in feeds for token in feed]], dtype=torch.int64,
                                 device=embed.weight.device)
        states = embed(input_ids)  # [1, n, H]: every row's new tokens, one after another
        spans = _row_spans(feeds, caches, states.device)
        row_counts = [span.count for span in spans]
        positions = torch.cat([torch.arange(span.start, span.end, device=states.device) for span in spans])
        cos, sin = base.rotary_emb(states, positions.unsqueeze(0))  # [1, n, head_dim]
        for span in spans:
            span.cache.reserve(span.end, len(self.layers), self.num_kv_heads, self.head_dim, states)
        entering: dict = {}  # aux layer id -> the residual stream entering it [1, n, H]
        if self.native is not None and states.dtype == torch.float32 and states.device.type == "cpu":
            cos, sin = cos[0].contiguous(), sin[0].contiguous()
            for first, end, layers in self._native_segments(aux_layers):
                entering[first] = states
                states = llama_layers(states[0], layers, cos, sin,
                                      [(span.cache.keys[first:end], span.cache.values[first:end]) for span in spans],
                                      [span.start for span in spans], row_counts).unsqueeze(0)
        else:
            states = self._layers(states, *_rotary_tables(cos, sin), spans, entering if aux_layers else None)
        for span in spans:
            span.cache.length = span.end
        last = [span.offset + span.count - wanted + position for span, wanted in zip(spans, num_logits)
                for position in range(wanted)]
        hidden = _rms_norm(base.norm, states[0, last])
        if aux_layers is None:
            return self.head(hidden), hidden, caches
        aux = torch.cat([entering[layer][0] for layer in aux_layers], dim=-1)
        return self.head(hidden), hidden, caches, aux

    def _native_segments(self, aux_layers: Optional[tuple]) -> list:
        """(first layer, end, LlamaLayers of layers first..end-1) covering every layer, cut where an aux layer
        starts (one segment without aux layers)."""
        key = tuple(sorted(set(aux_layers or ())))
        if key not in self._segments:
            cuts = sorted({0, *key, len(self.layers)})
            self._segments[key] = [(first, end, self.native._replace(norms=self.native.norms[2 * first:2 * end],
                                                                     products=self.native.products[4 * first:4 * end]))
                                   for first, end in zip(cuts, cuts[1:])]
        return self._segments[key]

    def _layers(self, states, cos, sin, spans: list["_RowSpan"], entering: Optional[dict] = None) -> torch.Tensor:
        """Every decoder layer, op by op: ``cos``, ``sin`` [1, n, 1, head_dim] from :func:`_rotary_tables`; with
        ``entering``, the states entering each layer are recorded there by layer id."""
        for index, layer in enumerate(self.layers):
            if entering is not None:
                entering[index] = states
            products = self.projections[index]
            states = states + self._attention(layer.self_attn, _rms_norm(layer.input_layernorm, states), cos, sin,
                                              spans, index)
            states = states + self._mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, states), products)
        return states

    def _attention(self, attention, states, cos, sin, spans: list["_RowSpan"], index: int) -> torch.Tensor:
        count = states.shape[1]
        products = self.projections[index]
        query, key, value = self._qkv(states, products, cos, sin)
        output = self._attend_rows(attention, query, key, value, spans, index)
        return products.o(output.transpose(1, 2).reshape(1, count, -1))

    def _qkv(self, states: torch.Tensor, products: LayerProjections, cos, signed_sin) -> tuple:
        """Rotated query [1, heads, n, d], rotated key and value [1, kv_heads, n, d] of ``states`` [1, n, H], from
        one product over q/k/v and one rotation over queries and keys together."""
        count, rotated_heads = states.shape[1], self.num_heads + self.num_kv_heads
        fused = products.qkv(states).view(1, count, rotated_heads + self.num_kv_heads, self.head_dim)
        rotated = _rotate(fused[:, :, :rotated_heads], cos, signed_sin).transpose(1, 2)
        return rotated[:, :self.num_heads], rotated[:, self.num_heads:], fused[:, :, rotated_heads:].transpose(1, 2)

    def _attend_rows(self, attention, query, key, value, spans: list["_RowSpan"], index: int) -> torch.Tensor:
        """Each row's queries against its own cache (its new keys and values written there first): [1, heads, n, d]."""
        outputs = []
        for span in spans:
            rows = slice(span.offset, span.offset + span.count)
            span.cache.keys[index, :, span.start:span.end] = key[0, :, rows]
            span.cache.values[index, :, span.start:span.end] = value[0, :, rows]
            keys = span.cache.keys[index, :, :span.end].unsqueeze(0)
            values = span.cache.values[index, :, :span.end].unsqueeze(0)
            outputs.append(F.scaled_dot_product_attention(query[:, :, rows], keys, values, attn_mask=span.mask,
                                                          scale=attention.scaling,
                                                          enable_gqa=self.num_kv_heads != self.num_heads))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)

    @staticmethod
    def _mlp(mlp, states: torch.Tensor, products: LayerProjections) -> torch.Tensor:
        gate, up = products.gate_up(states).split(products.gate_up.out_features, dim=-1)
        return products.down(mlp.act_fn(gate) * up)


class _RowSpan:
    """Where one row's new tokens sit in a batched pass: ``count`` tokens from ``offset`` in the stacked states,
    cache positions ``start..end``, and the causal mask over them (None for one token, which sees everything)."""

    def __init__(self, cache: StaticKVCache, offset: int, count: int, device: torch.device):
        self.cache, self.offset, self.count = cache, offset, count
        self.start, self.end = cache.length, cache.length + count
        self.device = device

    @property
    def mask(self) -> Optional[torch.Tensor]:
        """New token i sees the prefix and new tokens 0..i (built only by the op-by-op layers, which read it)."""
        if self.count == 1:
            return None
        return torch.ones(self.count, self.end, dtype=torch.bool, device=self.device).tril(self.start)


def check_aux_layers(aux_layers, num_layers: int) -> tuple:
    """``aux_layers`` as a tuple of layer ids in [0, num_layers), at least one, or a ValueError naming it."""
    layers = tuple(aux_layers)
    if not layers or any(isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers
                         for layer in layers):
        raise ValueError(f"aux_layers must be one or more layer ids in [0, {num_layers}), got {list(layers)}")
    return layers


def _row_spans(feeds: list[list[int]], caches: list[StaticKVCache], device: torch.device) -> list[_RowSpan]:
    spans, offset = [], 0
    for feed, cache in zip(feeds, caches):
        spans.append(_RowSpan(cache, offset, len(feed), device))
        offset += len(feed)
    return spans


def _linear(states: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """``module(states)`` for the modules the packed products do not take (:mod:`.projections`: float64 or bfloat16
    weights, CUDA); an ``nn.Linear`` on the CPU as ``(W @ x^T)^T`` with at least two rows: MKL streams W once in this
    layout instead of packing it on every call, and its one-row path (gemv) streams W about three times slower than
    its two-row product on this CPU, so a single row is doubled."""
    if type(module) is not torch.nn.Linear or states.device.type != "cpu":
        return module(states)
    rows = states.reshape(-1, states.shape[-1])
    count = rows.shape[0]
    if count == 1:
        rows = rows.repeat(2, 1)  # a real copy: a stride-0 view takes a slow path again
    output = torch.mm(module.weight, rows.t())[:, :count].t()
    if module.bias is not None:
        output = output + module.bias
    return output.reshape(*states.shape[:-1], module.out_features)
