"""Model pairs for speculative decoding: the embedded default pair (no network), any pair by name or path, and the
int8 draft. ``pairs`` loads and converts; ``export`` writes the default pair as folders serving engines load. The int8
draft's quantisation and cache live in :mod:`diversed_ext.forward.int8_draft` (re-exported here)."""

from .export import PairExport, export_default_pair
from ..forward.int8_draft import Int8Packing, load_int8_draft, quantize_int8, save_int8_weights
from .pairs import (CACHE_STAMP, DEFAULT_CACHE_NAME, DEFAULT_GGUF, DEFAULT_PACKAGE, DEFAULT_PACKAGE_PIP, DEFAULT_PAIR,
                    INT8_CACHE, RUNTIME_PIP, ModelPair, cache_root, convert_default_checkpoint, default_gguf_path,
                    int8_draft_of, load_default_pair, load_model, load_pair)

__all__ = ["ModelPair", "PairExport", "export_default_pair", "load_default_pair", "load_pair", "load_model", "convert_default_checkpoint", "cache_root",
           "default_gguf_path", "int8_draft_of", "quantize_int8", "save_int8_weights",
           "load_int8_draft", "Int8Packing", "DEFAULT_PAIR", "DEFAULT_PACKAGE", "DEFAULT_PACKAGE_PIP", "DEFAULT_GGUF",
           "DEFAULT_CACHE_NAME", "CACHE_STAMP", "INT8_CACHE", "RUNTIME_PIP"]
