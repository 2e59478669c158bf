"""Deprecated path of :mod:`diversed_ext.forward.float_linear` (the lean forward's floor), kept for old imports:
importing it warns. Nothing in the package imports it."""

from .._moved import alias_moved_module

alias_moved_module(__name__, "diversed_ext.forward.float_linear")
