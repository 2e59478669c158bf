"""The vLLM code the plugin depends on, and the check that the installed vLLM's is code the plugin was tested with.

The plugin wraps, overrides or calls private vLLM functions (:data:`SEAMS`). Rather than trusting a version string,
start-up reads each function's source from the installed vLLM (without importing it) and compares its fingerprint
with the ones recorded in ``seams.json``, per vLLM release the plugin was tested against. A function that differs
from every record, or is missing, refuses start-up with its name, so a vLLM whose hooked code changed never verifies
some other way silently.

A fingerprint is the SHA-256 of the function's syntax tree (``ast.dump``): comments, blank lines and formatting do
not count, a changed signature, body or default does. ``python -m diversed_ext.vllm_plugin.seams record VERSION
ROOT`` records a release from its source tree (for example a wheel unpacked with ``pip download --no-deps``); read
the changed functions before recording them.

Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import sys

RECORD_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seams.json")

# (file under the vllm package's parent, qualified name, what the plugin does with it)
SEAMS = (
    # V1 model runner
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.__init__", "wrapped: builds the rejection sampler"),
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner._sample", "its call of the rejection sampler"),
    ("vllm/v1/sample/rejection_sampler.py", "RejectionSampler.forward", "overridden by a copy with our rule"),
    ("vllm/v1/sample/rejection_sampler.py", "RejectionSampler._get_logprobs_tensors", "called"),
    ("vllm/v1/sample/rejection_sampler.py", "RejectionSampler.apply_logits_processors", "called"),
    ("vllm/v1/sample/rejection_sampler.py", "rejection_sample", "called by the exact 'vllm' verifier"),
    ("vllm/v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer._sample_draft_tokens",
     "wrapped: the draft's hidden states for heads"),
    # V2 model runner
    ("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner.load_model", "wrapped: builds the rejection sampler"),
    ("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner.sample", "wrapped: the target's hidden states"),
    ("vllm/v1/worker/gpu/spec_decode/rejection_sampler.py", "RejectionSampler.__init__", "subclassed"),
    ("vllm/v1/worker/gpu/spec_decode/rejection_sampler.py", "RejectionSampler.__call__", "wrapped"),
    ("vllm/v1/worker/gpu/spec_decode/rejection_sampler.py", "RejectionSampler._verify_in_chunks",
     "calls _verify with row slices of the step's logits"),
    ("vllm/v1/worker/gpu/spec_decode/rejection_sampler.py", "RejectionSampler._verify", "overridden"),
    ("vllm/v1/worker/gpu/sample/sampler.py", "Sampler.add_request", "wrapped: a request's choice at admission"),
    ("vllm/v1/worker/gpu/sample/sampler.py", "Sampler.apply_sampling_params", "called"),
    ("vllm/v1/worker/gpu/spec_decode/speculator.py", "DraftModelSpeculator.sample_draft",
     "wrapped: the draft's hidden states for heads"),
    ("vllm/v1/worker/gpu/spec_decode/standalone_ar/speculator.py", "StandaloneARSpeculator.propose", "wrapped"),
    # Both
    ("vllm/v1/worker/gpu_worker.py", "Worker.load_model", "wrapped: the check that the runner was hooked"),
    ("vllm/v1/engine/input_processor.py", "InputProcessor.__init__", "wrapped: the engine's entry checked"),
    ("vllm/v1/engine/input_processor.py", "InputProcessor._validate_params", "wrapped: requests checked"),
)


def _definition(tree: ast.AST, qualified_name: str):
    node = tree
    for part in qualified_name.split("."):
        node = next((child for child in ast.iter_child_nodes(node)
                     if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and child.name == part), None)
        if node is None:
            return None
    return node


def fingerprint(path: str, qualified_name: str) -> str | None:
    """The fingerprint of ``qualified_name`` defined in the Python file ``path``, or None where it is not defined."""
    with open(path, encoding="utf-8") as source:
        node = _definition(ast.parse(source.read()), qualified_name)
    return None if node is None else hashlib.sha256(ast.dump(node).encode()).hexdigest()


def installed_root() -> str:
    """The folder holding the installed ``vllm`` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vllm is not installed")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def fingerprints(root: str) -> dict:
    """Every seam's fingerprint in the vLLM source tree at ``root`` (None for a missing file or function)."""
    found = {}
    for relative, name, _ in SEAMS:
        path = os.path.join(root, relative)
        found[f"{relative}:{name}"] = fingerprint(path, name) if os.path.isfile(path) else None
    return found


def load_record(path: str = RECORD_PATH) -> dict:
    """{seam: {vLLM version: fingerprint}} of the releases the plugin was tested against."""
    with open(path, encoding="utf-8") as record:
        return json.load(record)


def seam_problems(root: str | None = None, record: dict | None = None) -> list:
    """One line per seam of the vLLM at ``root`` (the installed one by default) whose code is none the plugin was
    tested with: missing, or changed."""
    record = load_record() if record is None else record
    problems = []
    for seam, found in fingerprints(root or installed_root()).items():
        known = record.get(seam, {})
        if found is None:
            problems.append(f"{seam} is missing")
        elif found not in known.values():
            releases = ", ".join(sorted(known)) or "none"
            problems.append(f"{seam} differs from the code of every tested release ({releases})")
    return problems


def record_release(version: str, root: str, path: str = RECORD_PATH) -> dict:
    """Add the fingerprints of release ``version`` (source tree at ``root``) to the record file."""
    record = load_record(path) if os.path.isfile(path) else {}
    for seam, found in fingerprints(root).items():
        if found is None:
            raise ValueError(f"{seam} is missing from {root}")
        record.setdefault(seam, {})[version] = found
    with open(path, "w", encoding="utf-8") as out:
        json.dump(record, out, indent=1, sort_keys=True)
        out.write("\n")
    return record


def main(argv: list) -> int:
    if len(argv) != 3 or argv[0] != "record":
        print("usage: python -m diversed_ext.vllm_plugin.seams record VERSION VLLM_SOURCE_ROOT", file=sys.stderr)
        return 2
    record_release(argv[1], argv[2])
    print(f"recorded vLLM {argv[1]}'s {len(SEAMS)} seams in {RECORD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
