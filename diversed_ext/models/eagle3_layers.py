"""The EAGLE-3 head's inference step: its key/value cache and one decoder-layer pass over the cached positions.

Drafting calls the head one token at a time per sequence, so a step's cost is its weight reads plus a fixed count of
small operations; a batch's sequences step together (:func:`fast_steps`), so the weights are read once per step for all
of them. Here both costs are kept down: the cache is preallocated and grows by doubling (a step writes its positions in
place; a rollback only moves the length), grouped-query attention reads the cached keys through views (no per-head
copies), a single query needs no mask, rotary angles come from a table, and the products are grouped by the input they
read (q/k/v, o, gate/up, down, the LM head, and ``fc``, which fuses the target's aux states). On the CPU in float32 each
group is one ``diversed::float_linear`` call over weights packed once: it streams the weights once per call, where
``F.linear`` of one row runs well above that (the default pair's 16384-row LM head, one thread: about 1.0 ms against 2.4
ms; bfloat16 weights through ``F.linear`` are no faster, about 1.0-1.3 ms). Elsewhere each group is one ``F.linear``
over the concatenated weights. The prepared weights are rebuilt when a parameter changes (training steps it in place,
loading copies into it). The results equal the plain layer's up to float rounding.

With int8 products (:meth:`~diversed_ext.models.eagle3.Eagle3Head.use_int8_products`, CPU, float32 parameters) each
group of a draft step (:data:`INT8_GROUPS`) is one ``diversed::int8_linear`` call over the weights quantised as the int8
draft model's are (a symmetric scale per output feature), each row's input quantised alone: a quarter of the bytes. The
drafts then differ slightly from the float checkpoint's (which vLLM runs); the loop stays exact, since the verifier
reads the distribution the drafts were sampled from.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..forward import forward_ops_built
from ..forward.llama_runner import INITIAL_CAPACITY  # a new cache's room; it doubles when a step needs more
from ..forward.tensor_versions import tensor_version

# The products int8 products quantise: a draft step's. Not ``fc``, which runs once per verified position (no step
# cost to save) and reads the target's raw residual streams, whose few huge entries would leave the rest of a
# row's quantised input with almost no levels.
INT8_GROUPS = frozenset({"qkv", "o", "gate_up", "down", "lm_head"})


class Eagle3Cache:
    """The head's own key/value cache for ONE sequence: keys and values of every position fed so far, in
    preallocated tensors ``[kv_heads, capacity, head_dim]`` of which the first ``length`` positions are held."""

    def __init__(self, capacity: int = INITIAL_CAPACITY):
        if int(capacity) < 1:
            raise ValueError(f"Eagle3Cache: capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.length = 0
        self._keys: Optional[torch.Tensor] = None
        self._values: Optional[torch.Tensor] = None

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """The held keys [kv_heads, length, head_dim] (a view), None before the first step."""
        return None if self._keys is None else self._keys[:, :self.length]

    @property
    def values(self) -> Optional[torch.Tensor]:
        """The held values [kv_heads, length, head_dim] (a view), None before the first step."""
        return None if self._values is None else self._values[:, :self.length]

    def reserve(self, length: int, like: torch.Tensor) -> None:
        """Room for ``length`` positions of ``like``'s shape [kv_heads, *, head_dim], dtype and device, keeping what
        is held."""
        held = self._keys
        stale = held is not None and (held.dtype != like.dtype or held.device != like.device
                                      or (held.is_inference() and not torch.is_inference_mode_enabled()))
        if held is not None and not stale and length <= held.shape[1]:
            return
        capacity = self.capacity if held is None else held.shape[1]
        while capacity < length:
            capacity *= 2
        shape = (like.shape[0], capacity, like.shape[-1])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if held is not None and self.length:
            keys[:, :self.length] = held[:, :self.length]
            values[:, :self.length] = self._values[:, :self.length]
        self._keys, self._values = keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Adds ``keys``/``values`` [kv_heads, T, head_dim] after the held positions."""
        end = self.length + keys.shape[1]
        self.reserve(end, keys)
        self._keys[:, self.length:end] = keys
        self._values[:, self.length:end] = values
        self.length = end

    def crop(self, keep: int) -> None:
        """Keeps the first ``keep`` positions (rollback after rejected drafts)."""
        if not 0 <= keep <= self.length:
            raise ValueError(f"Eagle3Cache.crop: keep must be in [0, {self.length}], got {keep}")
        self.length = keep


def rotary_inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Llama's default rotary inverse frequencies [head_dim // 2] (float32)."""
    half = head_dim // 2
    return 1.0 / theta ** (torch.arange(half, dtype=torch.float32, device=device) / half)


class StepWeights:
    """What a step reads, prepared from the parameters: each product group's weights (packed for ``float_linear``,
    or concatenated for ``F.linear``), the norms' weights in float32 (both input norms stacked), the rotary table."""

    def __init__(self, head, key: tuple):
        self.key = key
        layer = head.midlayer
        attention, mlp = layer.self_attn, layer.mlp
        modules = {"fc": (head.fc,), "qkv": (attention.q_proj, attention.k_proj, attention.v_proj),
                   "o": (attention.o_proj,), "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,),
                   "lm_head": (head.lm_head,)}
        weight = head.lm_head.weight
        self.native = weight.device.type == "cpu" and weight.dtype == torch.float32 and forward_ops_built()
        self.int8_groups = INT8_GROUPS if self.native and int8_products(head) else frozenset()
        self.products = {}
        with torch.no_grad():
            for name, group in modules.items():
                if name in self.int8_groups:
                    from ..forward.int8 import pack_int8, quantize_weight

                    self.products[name] = pack_int8([(*quantize_weight(module.weight), None) for module in group])
                elif self.native:
                    from ..forward.float_linear import pack_float

                    self.products[name] = pack_float([(module.weight, None) for module in group])
                else:
                    self.products[name] = torch.cat([module.weight.detach() for module in group])
            self.input_norms = torch.stack([layer.input_layernorm.weight.detach().float(),
                                            layer.hidden_norm.weight.detach().float()])
            self.post_attention_norm = layer.post_attention_layernorm.weight.detach().float()
            self.final_norm = head.norm.weight.detach().float()
        self.inverse_frequencies = rotary_inverse_frequencies(head.config.head_dim, head.config.rope_theta,
                                                              weight.device)
        self.cos = self.sin = weight.new_empty(0, head.config.head_dim // 2)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The products of group ``name`` for ``x`` [..., K], concatenated: [..., sum of out features]. int8 products
        quantise each row's input alone, so a position's result does not depend on the positions computed with it
        (a round's first step feeds several; teacher forcing feeds whole sequences)."""
        product = self.products[name]
        if name in self.int8_groups:
            from ..forward.int8 import int8_linear, token_rows

            return int8_linear(x.contiguous(), product, row_groups=token_rows(x))
        if self.native:
            from ..forward.float_linear import float_linear

            return float_linear(x, product)
        return F.linear(x, product)

    def rotary(self, start: int, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [count, head_dim // 2] of positions ``start .. start + count`` (the table grows by
        doubling; angles are formed as :func:`~diversed_ext.models.eagle3.rotate` forms them)."""
        end = start + count
        if end > self.cos.shape[0]:
            size = max(end, 2 * self.cos.shape[0], INITIAL_CAPACITY)
            positions = torch.arange(size, device=self.inverse_frequencies.device).to(torch.float32)
            angles = positions.unsqueeze(-1) * self.inverse_frequencies
            self.cos, self.sin = angles.cos().to(self.cos.dtype), angles.sin().to(self.sin.dtype)
        return self.cos[start:end], self.sin[start:end]


def int8_products(head) -> bool:
    """Whether ``head``'s inference steps run int8 products (:meth:`Eagle3Head.use_int8_products`)."""
    return bool(head.__dict__.get("_int8_products", False))


def step_weights(head) -> StepWeights:
    """The head's :class:`StepWeights`, rebuilt when any parameter was changed, moved or cast since, or the choice of
    int8 products changed."""
    key = (int8_products(head),
           *((p.data_ptr(), tensor_version(p), p.dtype, p.device) for p in head.parameters()))
    prepared = head.__dict__.get("_step_weights")
    if prepared is None or prepared.key != key:
        prepared = StepWeights(head, key)
        head.__dict__["_step_weights"] = prepared
    return prepared


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, d]; cos, sin [T, d / 2]
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _attend(qkv: torch.Tensor, cache: Eagle3Cache, weights: StepWeights, config) -> torch.Tensor:
    """One sequence's attention: its T new positions' q/k/v [T, heads + 2 kv_heads, d] rotated, the keys and values
    appended to ``cache``, and the queries read against every cached position up to their own: [T, heads * d]."""
    T, start = qkv.shape[0], cache.length
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    group = heads // kv_heads
    cos, sin = weights.rotary(start, T)
    qk = _rotate(qkv[:, :heads + kv_heads], cos, sin)  # [T, heads + kv_heads, d]
    cache.append(qk[:, heads:].transpose(0, 1), qkv[:, heads + kv_heads:].transpose(0, 1))
    keys, values = cache.keys, cache.values  # [kv_heads, L, d] views
    # Query head h reads kv head h // group (repeat_interleave's order): queries grouped per kv head.
    q = qk[:, :heads] * (1.0 / d ** 0.5)
    q = q.view(T, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * T, d)
    scores = torch.bmm(q, keys.transpose(1, 2))  # [kv_heads, group * T, L]
    if T > 1:  # query t (position start + t) sees the cached positions up to its own
        hidden = torch.arange(cache.length, device=q.device) > torch.arange(start, start + T,
                                                                            device=q.device).unsqueeze(-1)
        scores = scores.masked_fill(hidden.repeat(group, 1), float("-inf"))
    attended = torch.bmm(torch.softmax(scores, dim=-1), values)  # [kv_heads, group * T, d]
    return attended.view(kv_heads, group, T, d).permute(2, 0, 1, 3).reshape(T, heads * d)


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sequences' rows one after another (one sequence's as they are: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def fast_steps(head, token_ids: Sequence[torch.Tensor], features: Sequence[torch.Tensor],
               caches: Sequence[Eagle3Cache]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """:meth:`Eagle3Head.step` for inference (no gradients flow through the caches) of several sequences at once:
    sequence r feeds ``token_ids[r]`` [T_r] and ``features[r]`` [T_r, H] after what ``caches[r]`` holds. Returns each
    sequence's logits [T_r, Vd] and pre-norm states [T_r, H]; appends to each cache.

    Every product group runs once over all the sequences' rows (a batch of drafting requests reads the weights once
    per step, not once per request) and attention runs sequence by sequence on its own cache. A row's products do
    not depend on the rows beside it (the packed float32 products sum each row in the same order whatever the row
    count; int8 products quantise each row alone), so a sequence gets what it would get alone."""
    c, weights = head.config, step_weights(head)
    counts = [int(ids.shape[0]) for ids in token_ids]
    total = sum(counts)
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    eps = c.rms_norm_eps

    features = _joined(features)
    embeds = head.embed_tokens(_joined(token_ids)).to(features.dtype)
    x = _rms_norm(torch.stack([embeds, features], dim=1), weights.input_norms, eps).flatten(1)  # [N, 2H]
    qkv = weights.linear(x, "qkv").view(total, heads + 2 * kv_heads, d)
    attended = _joined([_attend(rows, cache, weights, c) for rows, cache in zip(qkv.split(counts), caches)])
    residual = features + weights.linear(attended, "o")
    gate_up = weights.linear(_rms_norm(residual, weights.post_attention_norm, eps), "gate_up")
    gate, up = gate_up.split(c.intermediate_size, dim=-1)
    prenorm = residual + weights.linear(F.silu(gate) * up, "down")
    logits = weights.linear(_rms_norm(prenorm, weights.final_norm, eps), "lm_head")
    return list(logits.split(counts)), list(prenorm.split(counts))
