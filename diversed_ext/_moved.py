"""Old module paths kept working after a module moved: the old path becomes the new module itself, with a
DeprecationWarning naming where it went. One rule for every moved module, so each old path is a two-line file."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias_moved_module(old_name: str, new_name: str) -> None:
    """Make ``old_name`` (the module being imported) an alias of ``new_name``: the same module object, so attributes
    set or patched through either path are seen through both."""
    warnings.warn(f"{old_name} has moved to {new_name}: import it from there (the old path will be removed)",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old_name] = importlib.import_module(new_name)
