"""When weights prepared once from a module's tensors (packed, concatenated) must be prepared again.

A tensor's ``_version`` counts its in-place changes, but an inference tensor (one made under
``torch.inference_mode()``, as a model loaded or quantised there is) keeps no counter and raises when asked. Its
in-place changes cannot be seen: such a tensor counts as never changed, and replacing it (a new tensor object) is
what makes the weights prepared again.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional, Sequence

import torch

UNVERSIONED = -1  # the version given to an inference tensor, and to a missing one (a bias of None)


def tensor_version(tensor: Optional[torch.Tensor]) -> int:
    """``tensor._version``, or :data:`UNVERSIONED` for None or an inference tensor."""
    if tensor is None or tensor.is_inference():
        return UNVERSIONED
    return tensor._version


def tensor_versions(tensors: Iterable[Optional[torch.Tensor]]) -> tuple:
    return tuple(tensor_version(tensor) for tensor in tensors)


class TensorStamp(NamedTuple):
    """The tensors something was prepared from, held (so a new tensor is never mistaken for a freed one at the same
    address), and their versions then."""

    tensors: tuple
    versions: tuple

    @classmethod
    def of(cls, tensors: Iterable[Optional[torch.Tensor]]) -> "TensorStamp":
        tensors = tuple(tensors)
        return cls(tensors, tensor_versions(tensors))

    def matches(self, tensors: Sequence[Optional[torch.Tensor]]) -> bool:
        """Whether ``tensors`` are the same objects, unchanged in place since."""
        return (len(tensors) == len(self.tensors) and all(a is b for a, b in zip(self.tensors, tensors))
                and tensor_versions(tensors) == self.versions)
