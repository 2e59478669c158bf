"""A lean incremental forward pass for Hugging Face Llama models, used by the decoding loop.

Why: on a CPU, a decoding round is almost all forward passes, and two costs in ``LlamaForCausalLM.forward`` are not
the model's arithmetic: (1) the generic machinery around the layers (output capturing, mask building for every
attention backend, a dynamic cache that concatenates keys and values each step), and (2) skinny matrix products.
A verify pass multiplies only K + 1 rows by each weight, and ``F.linear`` hands MKL ``x @ W^T`` with W transposed,
a layout MKL packs on every call; the same product as ``(W @ x^T)^T`` streams W once. On the default pair (2 cores)
this takes the target's 4-token pass from about 110 ms to about 75 ms, and the draft's 1-token pass from about 36 ms
to about 32 ms (``bench/bench_e2e.py`` measures the end-to-end effect).

What it runs: the model's own modules (embedding, RMSNorms, the rotary embedding with whatever RoPE scaling the
config asks for, the projections, the MLP activation, the final norm, the LM head weight) in Llama's order, with

- a preallocated key/value cache per layer (:class:`StaticKVCache`) that grows by doubling and is cropped by moving
  its length, so no step copies the prefix;
- scaled-dot-product attention with grouped-query heads and an explicit causal mask over [prefix + new tokens];
- several sequences per pass (:meth:`LlamaRunner.run_rows`): every product over all rows' new tokens stacked, attention
  row by row over each row's own cache, so no token sees another row and nothing is padded;
- float ``nn.Linear`` layers on the CPU as ``(W @ x^T)^T`` when more than one row is multiplied; any other linear
  module (int8 ``DynamicQuantizedLinear`` of the draft, CUDA) is called as it is.

The outputs equal the model's forward up to float rounding (products summed in another order; tests check it on
random Llamas with grouped-query attention, biases, RoPE scaling, tied and untied heads, and int8 copies).

Which models: exactly ``transformers.LlamaForCausalLM`` (not subclasses, which may change the forward), in eval
mode, with ``pretraining_tp`` 1 and no hooks on the model, its decoder or its layers (a forward hook would expect to
run). Everything else goes through the model's own forward: see :func:`supports_fast_forward`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

INITIAL_CAPACITY = 256  # cached positions allocated up front; the cache doubles when a sequence outgrows it


class StaticKVCache:
    """Keys and values of every layer in preallocated tensors ``[layers, kv_heads, capacity, head_dim]``.

    It answers the two calls the decoding loop makes of a transformers cache: ``get_seq_length()`` and
    ``crop(-n)`` (drop the last n positions), so the loop crops both kinds of cache the same way.
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
        shape = (layers, kv_heads, capacity, head_dim)
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self.keys is not None:
            keys[:, :, :self.length] = self.keys[:, :, :self.length]
            values[:, :, :self.length] = self.values[:, :, :self.length]
        self.keys, self.values = keys, values


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"))


def supports_fast_forward(model: torch.nn.Module) -> bool:
    """Whether :class:`LlamaRunner` can stand in for ``model``'s forward (see the module docstring)."""
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


def _rotate_half(states: torch.Tensor) -> torch.Tensor:
    half = states.shape[-1] // 2
    return torch.cat((-states[..., half:], states[..., :half]), dim=-1)


class LlamaRunner:
    """Incremental forward passes of one ``LlamaForCausalLM`` over a :class:`StaticKVCache`.

    ``runner(feed, cache, num_logits, want_hidden)`` appends the token ids ``feed`` to ``cache`` (a new one when
    None) and returns ``(logits [num_logits, V], hidden [num_logits, H], cache)`` for the last ``num_logits``
    positions, ``hidden`` being the final-norm output the LM head reads (``output_hidden_states[-1]``).
    """

    def __init__(self, model: torch.nn.Module):
        if not supports_fast_forward(model):
            raise ValueError(f"LlamaRunner needs a transformers LlamaForCausalLM in eval mode without hooks, got "
                             f"{type(model).__name__}")
        config = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @torch.no_grad()
    def __call__(self, feed: list[int], cache: Optional[StaticKVCache], num_logits: int, want_hidden: bool = True):
        logits, hidden, caches = self.run_rows([feed], [cache], [num_logits], want_hidden)
        return logits, hidden, caches[0]

    @torch.no_grad()
    def run_rows(self, feeds: list[list[int]], caches: list, num_logits: list[int], want_hidden: bool = True):
        """Several sequences in one pass: row r appends ``feeds[r]`` to ``caches[r]`` (a new cache when None).

        Every product runs once over all rows' new tokens stacked (``[sum of feeds, H] @ W``); attention runs row by
        row over the row's own cache, so no token sees another row and nothing is padded. Returns ``(logits, hidden,
        caches)`` with the last ``num_logits[r]`` positions of each row stacked in row order.
        """
        if not feeds or any(not feed for feed in feeds):
            raise ValueError("feed must hold at least one token id")
        base = self.model.model
        embed = base.embed_tokens
        caches = [StaticKVCache() if cache is None else cache for cache in caches]
        input_ids = torch.tensor([[token for feed in feeds for token in feed]], dtype=torch.int64,
                                 device=embed.weight.device)
        states = embed(input_ids)  # [1, n, H]: every row's new tokens, one after another
        spans = _row_spans(feeds, caches, states.device)
        positions = torch.cat([torch.arange(span.start, span.end, device=states.device) for span in spans])
        cos, sin = (part.unsqueeze(1) for part in base.rotary_emb(states, positions.unsqueeze(0)))
        for span in spans:
            span.cache.reserve(span.end, len(self.layers), self.num_kv_heads, self.head_dim, states)
        for index, layer in enumerate(self.layers):
            states = states + self._attention(layer.self_attn, layer.input_layernorm(states), cos, sin, spans, index)
            states = states + self._mlp(layer.mlp, layer.post_attention_layernorm(states))
        for span in spans:
            span.cache.length = span.end
        last = [span.offset + span.count - wanted + position for span, wanted in zip(spans, num_logits)
                for position in range(wanted)]
        hidden = base.norm(states[0, last])
        return _linear(hidden, self.model.lm_head), hidden, caches

    def _attention(self, attention, states, cos, sin, spans: list["_RowSpan"], index: int) -> torch.Tensor:
        count = states.shape[1]
        query = _linear(states, attention.q_proj).view(1, count, self.num_heads, self.head_dim).transpose(1, 2)
        key = _linear(states, attention.k_proj).view(1, count, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value = _linear(states, attention.v_proj).view(1, count, self.num_kv_heads, self.head_dim).transpose(1, 2)
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        output = self._attend_rows(attention, query, key, value, spans, index)
        return _linear(output.transpose(1, 2).reshape(1, count, -1), attention.o_proj)

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
    def _mlp(mlp, states: torch.Tensor) -> torch.Tensor:
        gate = mlp.act_fn(_linear(states, mlp.gate_proj))
        return _linear(gate * _linear(states, mlp.up_proj), mlp.down_proj)


class _RowSpan:
    """Where one row's new tokens sit in a batched pass: ``count`` tokens from ``offset`` in the stacked states,
    cache positions ``start..end``, and the causal mask over them (None for one token, which sees everything)."""

    def __init__(self, cache: StaticKVCache, offset: int, count: int, device: torch.device):
        self.cache, self.offset, self.count = cache, offset, count
        self.start, self.end = cache.length, cache.length + count
        # New token i sees the prefix and new tokens 0..i.
        self.mask = None if count == 1 else torch.ones(count, self.end, dtype=torch.bool, device=device).tril(self.start)


def _row_spans(feeds: list[list[int]], caches: list[StaticKVCache], device: torch.device) -> list[_RowSpan]:
    spans, offset = [], 0
    for feed, cache in zip(feeds, caches):
        spans.append(_RowSpan(cache, offset, len(feed), device))
        offset += len(feed)
    return spans


def _linear(states: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """``module(states)``; for a float ``nn.Linear`` on the CPU with more than one row, as ``(W @ x^T)^T`` (see the
    module docstring: MKL streams W once in this layout instead of packing it on every call)."""
    if type(module) is not torch.nn.Linear or states.device.type != "cpu":
        return module(states)
    rows = states.reshape(-1, states.shape[-1])
    if rows.shape[0] == 1:
        return module(states)
    output = torch.mm(module.weight, rows.t()).t()
    if module.bias is not None:
        output = output + module.bias
    return output.reshape(*states.shape[:-1], module.out_features)
