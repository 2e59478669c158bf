"""Writing a file so that a reader, or a run killed at any moment, sees the old file or the new one, never a torn one.

Every file the package writes for later runs goes through :func:`atomic_path`: converted checkpoints' configs, the
int8 draft's weights, ensemble heads, training checkpoints and logs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Union


@contextlib.contextmanager
def atomic_path(path: Union[str, Path]) -> Iterator[str]:
    """Yields a staging path beside ``path`` to write in full; then flushes it to disk and renames it over ``path``.

    The staging name carries the process id, so processes writing the same file at once never share one. If the
    writer raises, the staging file is removed and ``path`` is left as it was."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield str(staging)
        descriptor = os.open(staging, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(staging, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
