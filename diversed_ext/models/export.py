"""The default pair as two plain Hugging Face folders that serving engines (vLLM) load as they are.

The converted cache folder is not one: its config.json names no architecture (an engine then resolves the bare
``LlamaModel``, without the LM head), and it also holds the draft's int8 cache, which a loader would read as part of
the model. ``export_default_pair(DIR)`` writes ``DIR/target`` (the float32 target: config with its architecture,
model.safetensors, tokenizer) and ``DIR/draft``. An engine loads the draft in the target's dtype, so the draft goes in
as its int8 weights dequantised: the same weights as the loop's int8 draft, but products in float32 without the int8
layers' activation quantisation, so its distributions (and its acceptance) differ a little from the loop's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple, Optional, Union

import torch

from ..forward.int8 import Int8Linear
from .pairs import CACHE_STAMP, INT8_CACHE, convert_default_checkpoint, load_default_pair

ARCHITECTURE = "LlamaForCausalLM"
NOT_EXPORTED = {INT8_CACHE, CACHE_STAMP, "model.safetensors", "config.json"}  # written anew, or ours alone


class PairExport(NamedTuple):
    """The two folders :func:`export_default_pair` wrote."""

    target: Path
    draft: Path


def _write_config(source: Path, folder: Path, *, tied_embeddings: bool) -> None:
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    config["tie_word_embeddings"] = tied_embeddings
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer_and_generation_files(source: Path, folder: Path) -> None:
    for path in source.iterdir():
        if path.is_file() and path.name not in NOT_EXPORTED:
            shutil.copy2(path, folder / path.name)


def dequantized_draft_weights(target: torch.nn.Module, draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's weights as float32 tensors by the target's parameter names: every int8 product's weight (and bias)
    dequantised, the draft's norms (smoothed in a calibrated draft), the rest (embeddings) the target's own. The LM
    head, quantised in the draft, gets its own tensor, so the embeddings are no longer tied."""
    weights = {name: tensor.detach().clone().contiguous() for name, tensor in target.state_dict().items()}
    for name, parameter in draft.named_parameters():
        if parameter.dim() == 1 and name in weights:
            weights[name] = parameter.detach().float().clone().contiguous()
    for name, module in draft.named_modules():
        if isinstance(module, Int8Linear):
            weights[f"{name}.weight"] = module.dequantized_weight().contiguous()
            if module.bias is not None:
                weights[f"{name}.bias"] = module.bias.detach().float().contiguous()
    return weights


def export_default_pair(out_dir: Union[str, Path], *, cache_dir: Optional[Union[str, Path]] = None,
                        overwrite: bool = False, progress: bool = True) -> PairExport:
    """Write the default pair to ``out_dir/target`` and ``out_dir/draft`` (see the module docstring).

    Raises:
        FileExistsError when a destination folder exists and is not empty, unless ``overwrite``; OSError when
        ``out_dir`` cannot be made (both before the pair loads).
    """
    from safetensors.torch import save_file

    out = Path(out_dir).expanduser()
    folders = PairExport(out / "target", out / "draft")
    for folder in folders:
        if folder.exists() and any(folder.iterdir()) and not overwrite:
            raise FileExistsError(f"{folder} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    out.mkdir(parents=True, exist_ok=True)  # a destination that cannot be made fails here, before the pair loads
    source = convert_default_checkpoint(cache_dir, progress=progress)
    target, draft, _ = load_default_pair(cache_dir=cache_dir, progress=False)  # the int8 draft from its cache
    for folder in folders:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        _copy_tokenizer_and_generation_files(source, folder)
    shutil.copy2(source / "model.safetensors", folders.target / "model.safetensors")
    _write_config(source, folders.target, tied_embeddings=True)
    save_file(dequantized_draft_weights(target, draft), str(folders.draft / "model.safetensors"),
              metadata={"format": "pt"})
    _write_config(source, folders.draft, tied_embeddings=False)
    return folders
