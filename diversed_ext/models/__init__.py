"""Model pairs for speculative decoding: the embedded default pair (no network), any pair by name or path, and the
int8 draft. ``pairs`` loads and converts; ``calibration`` holds the tokens an int8 draft is smoothed on; ``export``
writes the default pair as folders serving engines load. The int8 draft's quantisation and cache are
:mod:`diversed_ext.forward`'s (``quantize_int8``, ``load_int8_draft``)."""

from .calibration import CALIBRATION_EXCHANGES, calibration_batches
from .export import PairExport, export_default_pair
from .pairs import (DEFAULT_PAIR, ModelPair, cache_root, convert_default_checkpoint, default_gguf_path, int8_draft_of,
                    load_default_pair, load_model, load_pair)

__all__ = ["ModelPair", "PairExport", "export_default_pair", "load_default_pair", "load_pair", "load_model",
           "convert_default_checkpoint", "cache_root", "default_gguf_path", "int8_draft_of", "DEFAULT_PAIR",
           "CALIBRATION_EXCHANGES", "calibration_batches"]
