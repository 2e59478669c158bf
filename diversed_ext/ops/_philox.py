"""Philox4x32-10 in plain PyTorch integer arithmetic: the counter-based generator of the native kernels.

The kernels draw the uniform for (row, position) as the first word of Philox4x32-10 with counter
(position, row_key, offset_lo, offset_hi) and key (seed_lo, seed_hi), keeping its top 24 bits: u = (word >> 8) / 2**24.
``row_key`` is the row index when one seed serves the whole batch and 0 with per-row seeds, so that a request's draw
depends only on its own seed. This module reproduces that bit for bit (it is tested against the kernels), which lets the
reference verifier and the native one be compared with seeds as well as with explicit uniforms.

On the CPU ``philox_uniforms`` calls ``diversed::philox_uniforms``, the kernels' own generator: the PyTorch version
(:func:`philox_uniforms_torch`, some 130 tensor ops) took about 1 ms a call, as much as a decoding round's verify
call. Elsewhere (CUDA tensors) the PyTorch version runs; the tests hold both to the same bits.
"""

from __future__ import annotations

from numbers import Integral

import torch

from .. import rules
from . import _fake  # noqa: F401  (loads the library and the fake kernels)

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
UNIFORM_BITS = 24
_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF


def _mul_hi_lo(constant: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """32x32 -> 64-bit product split in halves, without overflowing int64 (the constant is split in 16-bit halves)."""
    low_product = value * (constant & _MASK16)
    high_product = value * (constant >> 16) + (low_product >> 16)
    hi = high_product >> 16
    lo = ((high_product & _MASK16) << 16) | (low_product & _MASK16)
    return hi & _MASK32, lo & _MASK32


def normalize_offset(offset) -> int:
    """The step counter's rule: an int in [0, 2**63) (the counter's two words hold 64 bits; the top one stays 0)."""
    if type(offset) is int and 0 <= offset < rules.SEED_RANGE:  # the common case, without the abstract Integral
        return offset
    if isinstance(offset, bool) or not isinstance(offset, Integral):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if not 0 <= int(offset) < rules.SEED_RANGE:
        raise ValueError(f"offset must lie in [0, 2**63), got {offset}")
    return int(offset)


def _integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_philox_arguments(seeds, offset, num_positions) -> None:
    """Shapes and kinds, read on the host (no sync): seeds an integer tensor [B], offset an int (the rule above) or an
    integer tensor [B], num_positions an int >= 0."""
    if not (isinstance(seeds, torch.Tensor) and seeds.dim() == 1 and _integer_dtype(seeds.dtype)):
        raise TypeError("seeds must be an integer tensor [B]")
    if isinstance(offset, torch.Tensor):
        if not _integer_dtype(offset.dtype) or offset.shape not in ((), seeds.shape):
            raise TypeError(f"offset must be an int or an integer tensor [B] with B = {seeds.shape[0]}")
    else:
        normalize_offset(offset)
    if isinstance(num_positions, bool) or not isinstance(num_positions, Integral) or num_positions < 0:
        raise ValueError(f"num_positions must be an int >= 0, got {num_positions!r}")


def philox_uniforms(seeds: torch.Tensor, offset, num_positions: int, per_row_seed: bool) -> torch.Tensor:
    """Uniforms [B, num_positions] float64 in [0, 1), identical to the native kernels' draws.

    Args:
        seeds: int64 [B], one seed per row (a shared seed is simply repeated).
        offset: step counter; successive decoding steps pass successive offsets to draw fresh numbers. An int, or an
            int64 tensor [B] of per-row offsets in [0, 2**63): a batch whose requests are at different decoding steps
            (the batched decoding loop) then draws, for each row, what a call with that row alone would draw.
        num_positions: positions per row (K + 1 for a verify call).
        per_row_seed: True when each row has its own seed (the row index then stays out of the counter).
    TypeError or ValueError, naming the argument, for another kind or shape of argument.
    """
    _check_philox_arguments(seeds, offset, num_positions)
    if seeds.device.type == "cpu":
        seeds = seeds.to(torch.int64)
        offsets = torch.as_tensor(offset, dtype=torch.int64).expand(seeds.shape[0]).contiguous()
        return torch.ops.diversed.philox_uniforms(seeds, offsets, int(num_positions), bool(per_row_seed))
    return philox_uniforms_torch(seeds, offset, num_positions, per_row_seed)


def philox_uniforms_torch(seeds: torch.Tensor, offset, num_positions: int, per_row_seed: bool) -> torch.Tensor:
    """:func:`philox_uniforms` in PyTorch integer ops, on any device: the oracle of the native op."""
    device = seeds.device
    batch = seeds.shape[0]
    seeds = seeds.to(torch.int64)
    shape = (batch, num_positions)
    c0 = torch.arange(num_positions, device=device, dtype=torch.int64).expand(shape)
    rows = torch.zeros(batch, dtype=torch.int64, device=device) if per_row_seed else torch.arange(batch, device=device)
    c1 = (rows & _MASK32).unsqueeze(1).expand(shape)
    offsets = torch.as_tensor(offset, dtype=torch.int64, device=device).expand(batch)
    c2 = (offsets & _MASK32).unsqueeze(1).expand(shape)
    c3 = ((offsets >> 32) & _MASK32).unsqueeze(1).expand(shape)
    k0 = (seeds & _MASK32).unsqueeze(1).expand(shape)
    k1 = ((seeds >> 32) & _MASK32).unsqueeze(1).expand(shape)
    word = philox_first_word(c0, c1, c2, c3, k0, k1)
    return (word >> (32 - UNIFORM_BITS)).to(torch.float64) / float(1 << UNIFORM_BITS)


def philox_first_word(c0, c1, c2, c3, k0, k1):
    """The first 32-bit word of Philox4x32-10 for counter (c0, c1, c2, c3) and key (k0, k1), each a 32-bit value:
    int64 tensors (element-wise) or Python ints alike."""
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mul_hi_lo(PHILOX_M0, c0)
        hi1, lo1 = _mul_hi_lo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0


# Seedless CUDA calls draw their seed inside the kernel from torch's CUDA generator: 64 bits of Philox4x32-10 keyed by
# the generator's seed xor GENERATOR_DRAW_KEY (so no word of torch's own streams doubles as a seed), at the counter
# (offset, GENERATOR_DRAW_LANE, 0 or 1), each call moving the generator's offset by GENERATOR_INCREMENT (verify_math.h's
# seed_from_generator and ops_cuda.cu).
GENERATOR_DRAW_LANE = 0x5EED
GENERATOR_DRAW_KEY = 0xD1B54A32D192ED03
GENERATOR_INCREMENT = 4


def seed_from_generator(generator_seed: int, generator_offset: int) -> int:
    """The int64 seed a seedless CUDA call draws from a generator state (seed, offset), as the kernel computes it."""
    seed, offset = (generator_seed % 2**64) ^ GENERATOR_DRAW_KEY, generator_offset % 2**64
    words = [philox_first_word(offset & _MASK32, offset >> 32, GENERATOR_DRAW_LANE, lane, seed & _MASK32, seed >> 32)
             for lane in (0, 1)]
    value = (words[1] << 32) | words[0]
    return value - 2**64 if value >= 2**63 else value


def draw_cuda_generator_seed(device: torch.device) -> int:
    """Draws the seed a seedless verify call on this CUDA device would draw now, advancing the generator alike. Moves
    the generator's offset from the host, so not for use under CUDA graph capture (the reference never runs there)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    offset = generator.get_offset()
    generator.set_offset(offset + GENERATOR_INCREMENT)
    return seed_from_generator(generator.initial_seed(), offset)

