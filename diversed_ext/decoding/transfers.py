"""The loop's small host-device copies, made so that a CUDA round waits on the device only where the host must read a
result: once per draft pass (the drafted tokens feed the next pass) and once after the verify call.

``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the copy to finish, a host sync per
call; a round builds several such tensors (row counts, seeds, slots). Staged in pinned memory and copied with
``non_blocking=True`` they queue behind the device's work instead (torch keeps the pinned block alive until the copy
has run). Results are read back packed into one tensor, one copy and one wait, where a ``.tolist()`` each would
wait once per tensor. On the CPU both are plain tensor calls.
"""

from __future__ import annotations

import torch


def device_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, without waiting for the copy on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def read_back(*tensors: torch.Tensor) -> list:
    """Every tensor's ``.tolist()``, in one copy to the host (one wait) where they all live on one CUDA device.

    The tensors travel packed as float64, which holds every float32 value and every integer below 2**53 (token ids,
    counts) exactly, and are cast back to their own dtypes on the host."""
    devices = {tensor.device for tensor in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return [tensor.tolist() for tensor in tensors]
    packed = torch.cat([tensor.reshape(-1).to(torch.float64) for tensor in tensors]).cpu()
    pieces = packed.split([tensor.numel() for tensor in tensors])
    return [piece.to(tensor.dtype).reshape(tensor.shape).tolist() for piece, tensor in zip(pieces, tensors)]
