"""The vLLM code the plugin depends on, and the check that the installed vLLM's is code the plugin was tested with.

The plugin wraps, overrides, calls or re-implements private vLLM functions (:data:`SEAMS`). Rather than trusting a
version string, start-up reads each one's source from the installed vLLM (without importing it) and compares its
fingerprint with those recorded in ``seams.json`` per vLLM release the plugin was tested against. The installed code
must be ONE tested release's in every seam; otherwise start-up is refused with the closest release and each function
that differs from it (changed, missing or unreadable), so neither a changed vLLM nor a mix of two releases' code
ever verifies some other way silently.

A fingerprint is the SHA-256 of the definition's tokens (:mod:`tokenize`), from its first decorator to its last
line, each token's kind and text, without comments, blank or continuation lines (NL), docstrings (its own and nested
ones) and indentation widths; INDENT, DEDENT and NEWLINE stay, without their text, as the block structure. So
reformatting, comments and docstrings do not count; a changed signature, default, body or decorator does. An f-string
is one string token of its source text (Python 3.12 splits it into parts, older Pythons do not); nothing else of the
interpreter enters, so every CPython from 3.10 on computes the same fingerprints (the tests compare 3.10-3.13 on the
recorded releases). ``ast`` only finds the definition (a function, class or module-level assignment by qualified
name, the last one winning as when Python runs the module) and its docstrings.

This file imports neither vLLM, torch nor the package: any Python runs it by path (:data:`USAGE`). ``record``
replaces a release's entry in ``seams.json`` with the fingerprints of a source tree (read the functions that changed
first); adding a seam is one line in :data:`SEAMS`, then ``record`` for each tested release.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import importlib.util
import io
import json
import os
import sys
import tokenize
from typing import NamedTuple

RECORD_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seams.json")
# What a fingerprint is (the module docstring); a record made with another definition is refused, not misread.
FINGERPRINT = "sha256 of source tokens, v1"


class Seam(NamedTuple):
    """One vLLM definition the plugin depends on: ``path`` under the folder holding ``vllm/``, its qualified
    ``name``, what the plugin does with it, and, for a definition vLLM moved, the other ``(path, name)`` places a
    release may hold it (the first place that defines it is fingerprinted)."""

    path: str
    name: str
    role: str
    elsewhere: tuple = ()

    @property
    def key(self) -> str:
        """The seam's name in ``seams.json``."""
        return f"{self.path}:{self.name}"


_V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
_V1_SAMPLER = "vllm/v1/sample/rejection_sampler.py"
_V1_PROPOSER = "vllm/v1/spec_decode/llm_base_proposer.py"
_V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
_V2_SAMPLER = "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py"
_V2_SAMPLING = "vllm/v1/worker/gpu/sample/sampler.py"
_V2_DRAFT = "vllm/v1/worker/gpu/spec_decode/speculator.py"
_V2_STANDALONE = "vllm/v1/worker/gpu/spec_decode/standalone_ar/speculator.py"
_V2_TARGET_AR = "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py"
_V2_STATES = "vllm/v1/worker/gpu/sample/states.py"
_PROCESSOR = "vllm/v1/engine/input_processor.py"
_V2_NGRAM = "vllm/v1/worker/gpu/spec_decode/ngram/speculator.py"
_V2_MULTI_MTP = "vllm/v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py"

SEAMS = (
    # V1 model runner
    Seam(_V1_RUNNER, "GPUModelRunner.__init__", "wrapped: builds the rejection sampler"),
    Seam(_V1_RUNNER, "GPUModelRunner._sample", "its call of the rejection sampler"),
    Seam(_V1_RUNNER, "GPUModelRunner.sample_tokens", "wrapped with heads: the target's hidden states"),
    Seam(_V1_RUNNER, "ExecuteModelState", "read with heads: sample_hidden_states, one row per logits row"),
    Seam(_V1_SAMPLER, "RejectionSampler.__init__", "subclassed: its sampler and logprobs mode"),
    Seam(_V1_SAMPLER, "RejectionSampler.forward", "overridden by a copy with our rule"),
    Seam(_V1_SAMPLER, "RejectionSampler._get_logprobs_tensors", "called"),
    Seam(_V1_SAMPLER, "RejectionSampler.apply_logits_processors", "called"),
    Seam(_V1_SAMPLER, "rejection_sample", "called by the exact 'vllm' verifier"),
    Seam(_V1_SAMPLER, "apply_sampling_constraints", "re-implemented (temperature, top-k, top-p on the target rows)"),
    Seam(_V1_SAMPLER, "expand_batch_to_tokens", "re-implemented (per-request values over their tokens)"),
    Seam(_V1_SAMPLER, "GREEDY_TEMPERATURE", "read: the temperature that marks a greedy request"),
    Seam("vllm/v1/sample/ops/topk_topp_sampler.py", "apply_top_k_top_p", "called on the target rows"),
    Seam("vllm/v1/sample/sampler.py", "Sampler.forward", "called for the bonus token"),
    Seam("vllm/v1/outputs.py", "SamplerOutput", "built as the sampler's output"),
    Seam("vllm/v1/spec_decode/metadata.py", "SpecDecodeMetadata", "read: the step's draft layout"),
    Seam(_V1_PROPOSER, "SpecDecodeBaseProposer.propose", "wrapped with heads: a proposal's start and end"),
    Seam(_V1_PROPOSER, "SpecDecodeBaseProposer._sample_draft_tokens", "wrapped with heads: the draft's hidden states"),
    Seam("vllm/v1/spec_decode/suffix_decoding.py", "SuffixDecodingProposer.propose",
         "relied on: nothing drafted where the suffix tree has no match (no filler)"),
    Seam("vllm/v1/spec_decode/step3p5.py", "Step3p5MTPProposer.propose",
         "refused with heads: it samples its drafts outside _sample_draft_tokens"),
    Seam("vllm/config/speculative.py", "SpeculativeConfig.use_step3p5_mtp", "read at start-up: which MTP proposer"),
    # V2 model runner
    Seam(_V2_RUNNER, "GPUModelRunner.load_model", "wrapped: builds the rejection sampler"),
    Seam(_V2_RUNNER, "GPUModelRunner.sample", "wrapped with heads: the target's hidden states"),
    Seam(_V2_RUNNER, "GPUModelRunner.add_requests", "its call of Sampler.add_request at admission"),
    Seam("vllm/v1/worker/gpu/spec_decode/__init__.py", "init_speculator", "which speculator a method gets"),
    Seam(_V2_SAMPLER, "RejectionSampler.__init__", "subclassed"),
    Seam(_V2_SAMPLER, "RejectionSampler.__call__", "wrapped"),
    Seam(_V2_SAMPLER, "RejectionSampler._verify_in_chunks", "calls _verify with row slices of the step's logits"),
    Seam(_V2_SAMPLER, "RejectionSampler._verify", "overridden"),
    Seam("vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py", "rejection_sample",
         "replaced in _verify; called by the exact 'vllm' verifier"),
    Seam(_V2_SAMPLING, "Sampler.__init__", "read: its sampling states and fp64 Gumbel flag"),
    Seam(_V2_SAMPLING, "Sampler.add_request", "wrapped: a request's choice at admission"),
    Seam(_V2_SAMPLING, "Sampler.apply_sampling_params", "called"),
    Seam("vllm/v1/worker/gpu/sample/gumbel.py", "gumbel_sample", "called for the bonus token"),
    Seam(_V2_STATES, "SamplingStates.__init__", "read: the requests' temperature and seed tables"),
    Seam(_V2_STATES, "SamplingStates.add_request", "what a request's temperature and seed become at admission"),
    Seam(_V2_DRAFT, "DraftModelSpeculator.__init__", "read: its draft logits"),
    Seam(_V2_DRAFT, "DraftModelSpeculator.compute_draft_logits", "called with heads: the draft's logits"),
    Seam(_V2_DRAFT, "DraftModelSpeculator.sample_draft", "wrapped with heads: the draft's hidden states"),
    Seam(_V2_STANDALONE, "StandaloneARSpeculator.propose", "wrapped with heads: a proposal's start"),
    Seam(_V2_STANDALONE, "StandaloneARSpeculator._prefill", "calls sample_draft for the first draft"),
    Seam(_V2_STANDALONE, "StandaloneARSpeculator._multi_step_decode", "calls sample_draft for the later drafts"),
    # V2's EAGLE and MTP speculators: the same capture, through their own steps
    Seam(_V2_TARGET_AR, "TargetDependentARSpeculator.propose", "wrapped with heads: a proposal's start"),
    Seam(_V2_TARGET_AR, "TargetDependentARSpeculator._prefill", "calls sample_draft for the first draft"),
    Seam(_V2_TARGET_AR, "TargetDependentARSpeculator._multi_step_decode", "reaches sample_draft for the later drafts"),
    Seam(_V2_TARGET_AR, "TargetDependentARSpeculator._fused_multi_step_decode", "the same, fused"),
    Seam(_V2_TARGET_AR, "TargetDependentARSpeculator._generate_fused_drafts", "the same, fused"),
    Seam(_V2_TARGET_AR, "TargetDependentARSpeculator._generate_draft", "calls sample_draft"),
    Seam("vllm/v1/worker/gpu/spec_decode/eagle/speculator.py", "EagleSpeculator",
         "relied on: drafts through TargetDependentARSpeculator's steps and DraftModelSpeculator.sample_draft"),
    Seam("vllm/v1/worker/gpu/spec_decode/mtp/speculator.py", "MTPSpeculator", "relied on: the same as EAGLE's"),
    Seam(_V2_MULTI_MTP, "MultiModuleMTPSpeculator.propose", "wrapped with heads: a proposal's start"),
    Seam(_V2_MULTI_MTP, "MultiModuleMTPSpeculator._generate_drafts", "calls sample_draft once a draft step"),
    Seam(_V2_MULTI_MTP, "MultiModuleMTPSpeculator.compute_draft_logits",
         "called with heads: each position's own module's logits"),
    # V2's n-gram speculator: its filler drafts are counted by the rule of its kernels
    Seam(_V2_NGRAM, "NgramGPUSpeculator.__init__", "read: its scratch scores, blocks and model length"),
    Seam(_V2_NGRAM, "NgramGPUSpeculator.propose", "wrapped: each request's real drafts counted after a proposal"),
    Seam(_V2_NGRAM, "_ngram_scan_kernel", "re-implemented: how a block's best match is packed into its score"),
    Seam(_V2_NGRAM, "_ngram_finalize_kernel", "re-implemented: which slots are real drafts and which are filler"),
    # Both
    Seam("vllm/config/vllm.py", "VllmConfig.use_v2_model_runner", "read at start-up: which runner drafts"),
    Seam("vllm/model_executor/models/llama_eagle3.py", "Eagle3LlamaForCausalLM.compute_logits",
         "relied on: a reduced draft vocabulary as target-vocabulary rows, -inf outside it"),
    Seam("vllm/sampling_params.py", "SamplingParams._validate_spec_decode",
         "relied on: logit_bias and min_p refused with speculation, so they never reach the sampler"),
    Seam("vllm/v1/sample/logits_processor/__init__.py", "build_logitsprocs",
         "relied on: V1 refuses custom logits processors with speculation"),
    Seam("vllm/v1/worker/gpu_worker.py", "Worker.load_model", "wrapped: the check that the runner was hooked"),
    Seam(_PROCESSOR, "InputProcessor.__init__", "wrapped: the engine's entry checked"),
    Seam(_PROCESSOR, "InputProcessor._validate_params", "wrapped: requests checked"),
    Seam("vllm/exceptions.py", "VLLMValidationError", "subclassed: a bad request's error, with parameter and value"),
)

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_STRUCTURE = {tokenize.NEWLINE: "NEWLINE", tokenize.INDENT: "INDENT", tokenize.DEDENT: "DEDENT"}
_LEFT_OUT = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
# Python 3.12 splits an f-string into these parts (3.14 adds t-strings); older Pythons give one STRING token.
_COMPOUND_START = {"FSTRING_START", "TSTRING_START"}
_COMPOUND_END = {"FSTRING_END", "TSTRING_END"}


def _binds(node: ast.AST, name: str) -> bool:
    if isinstance(node, _DEFINITIONS):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(target, ast.Name) and target.id == name for target in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _definition(tree: ast.AST, qualified_name: str):
    node = tree
    for part in qualified_name.split("."):
        bindings = [child for child in ast.iter_child_nodes(node) if _binds(child, part)]
        if not bindings:
            return None
        node = bindings[-1]
    return node


def _docstring_starts(node: ast.AST) -> set:
    """(line, column) of every docstring in ``node``: the first statement of a definition's body, a string."""
    starts = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None) if isinstance(inner, _DEFINITIONS) else None
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            starts.add((body[0].lineno, body[0].col_offset))
    return starts


class _SourceFile:
    """One Python file, parsed and tokenized once."""

    def __init__(self, path: str):
        with open(path, encoding="utf-8") as source:
            text = source.read()
        self.tree = ast.parse(text, filename=path)
        self.lines = text.splitlines(keepends=True)
        self.tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
        self.token_lines = [token.start[0] for token in self.tokens]  # ascending: a definition's tokens by bisection

    def text(self, start: tuple, end: tuple) -> str:
        """The source between two (line, column) token positions."""
        (first, start_col), (last, end_col) = start, end
        if first == last:
            return self.lines[first - 1][start_col:end_col]
        return "".join([self.lines[first - 1][start_col:], *self.lines[first:last - 1],
                        self.lines[last - 1][:end_col]])

    def fingerprint(self, qualified_name: str) -> str | None:
        """The fingerprint of ``qualified_name`` (see the module docstring), or None where it is not defined."""
        node = _definition(self.tree, qualified_name)
        if node is None:
            return None
        first = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
        return hashlib.sha256(json.dumps(self._canonical(first, node.end_lineno, _docstring_starts(node)),
                                         separators=(",", ":")).encode()).hexdigest()

    def _canonical(self, first: int, last: int, docstrings: set) -> list:
        kept, compound_start, depth, skipping = [], None, 0, False
        for token in self.tokens[bisect.bisect_left(self.token_lines, first):
                                 bisect.bisect_right(self.token_lines, last)]:
            kind = tokenize.tok_name[token.type]
            if depth:  # inside an f-string: it becomes one STRING of its source text
                depth += (kind in _COMPOUND_START) - (kind in _COMPOUND_END)
                if not depth:
                    kept.append(["STRING", self.text(compound_start, token.end)])
                continue
            if kind in _COMPOUND_START:
                compound_start, depth = token.start, 1
                continue
            if token.start in docstrings and token.type == tokenize.STRING:
                skipping = True
            if skipping:  # a docstring's statement, up to its NEWLINE
                skipping = token.type != tokenize.NEWLINE
                continue
            if token.type in _LEFT_OUT:
                continue
            if token.type in _STRUCTURE:
                if kept:  # the definition's own leading INDENT/DEDENT depends on what precedes it
                    kept.append([_STRUCTURE[token.type]])
                continue
            kept.append([kind, token.string])
        return kept


class _Scan:
    """Each seam's fingerprint in one vLLM source tree: ``found[key]`` a hex digest or None (missing or unreadable,
    ``why[key]`` says which)."""

    def __init__(self, root: str):
        self.found, self.why = {}, {}
        files = {}
        for seam in SEAMS:
            self.found[seam.key], self.why[seam.key] = None, "is missing"
            for path, name in ((seam.path, seam.name), *seam.elsewhere):
                full = os.path.join(root, path)
                if not os.path.isfile(full):
                    continue
                if full not in files:
                    try:
                        files[full] = _SourceFile(full)
                    except (SyntaxError, UnicodeDecodeError, tokenize.TokenError) as error:
                        files[full] = error
                source = files[full]
                if not isinstance(source, _SourceFile):
                    self.why[seam.key] = (f"cannot be read by Python {sys.version.split()[0]} "
                                          f"({type(source).__name__}: {source})")
                    break
                found = source.fingerprint(name)
                if found is not None:
                    self.found[seam.key] = found
                    break


def fingerprints(root: str) -> dict:
    """{seam key: fingerprint} of every seam in the vLLM source tree at ``root`` (None: missing or unreadable)."""
    return dict(_Scan(root).found)


def installed_root() -> str:
    """The folder holding the installed ``vllm`` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vllm is not installed")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def load_record(path: str = RECORD_PATH) -> dict:
    """{vLLM release: {seam key: fingerprint}} of the releases the plugin was tested against."""
    with open(path, encoding="utf-8") as record:
        content = json.load(record)
    if content.get("fingerprint") != FINGERPRINT:
        raise ValueError(f"{path} holds fingerprints of another kind ({content.get('fingerprint')!r}, this plugin "
                         f"computes {FINGERPRINT!r}): record every tested release again")
    return content["releases"]


def _release_order(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in version.split("."))


def compare(root: str | None = None, record: dict | None = None) -> tuple:
    """(release, differences): the tested release the vLLM source at ``root`` (the installed one by default) is
    closest to, the newest among equals, and one line per seam whose code is not that release's (empty: it is that
    release's code in every seam)."""
    record = load_record() if record is None else record
    if not record:
        raise ValueError("no vLLM release is recorded")
    scan = _Scan(root or installed_root())
    closest = None
    for release in sorted(record, key=_release_order, reverse=True):
        differences = []
        for seam in SEAMS:
            expected, found = record[release].get(seam.key), scan.found[seam.key]
            if expected is None:
                differences.append(f"{seam.key} is not recorded for vLLM {release} (record the release again)")
            elif found is None:
                differences.append(f"{seam.key} {scan.why[seam.key]}")
            elif found != expected:
                differences.append(f"{seam.key} differs")
        if closest is None or len(differences) < len(closest[1]):
            closest = (release, differences)
    return closest


def seam_problems(root: str | None = None, record: dict | None = None) -> list:
    """Empty where the vLLM at ``root`` (the installed one by default) is one tested release's code in every seam;
    otherwise the closest release, then one line per seam that differs from it."""
    release, differences = compare(root, record)
    if not differences:
        return []
    return [f"closest tested release vLLM {release} ({len(differences)} of {len(SEAMS)} functions differ)",
            *differences]


def record_release(version: str, root: str, path: str = RECORD_PATH) -> dict:
    """Replace release ``version``'s entry in the record file with the fingerprints of the source tree at ``root``."""
    try:
        releases = load_record(path) if os.path.isfile(path) else {}
    except ValueError:  # fingerprints of another kind are of no use: the releases are recorded again, one by one
        releases = {}
    scan = _Scan(root)
    missing = [f"{key} {scan.why[key]}" for key, found in scan.found.items() if found is None]
    if missing:
        raise ValueError(f"not recordable from {root}: " + "; ".join(missing))
    releases[version] = dict(sorted(scan.found.items()))
    with open(path, "w", encoding="utf-8") as out:
        json.dump({"fingerprint": FINGERPRINT, "releases": dict(sorted(releases.items()))}, out, indent=1)
        out.write("\n")
    return releases


USAGE = """usage: python diversed_ext/vllm_plugin/seams.py COMMAND   (ROOT: a folder holding vllm/)
  check [ROOT]               whether ROOT (default: the installed vLLM) is one tested release's code (exit 1: no)
  fingerprints ROOT          every seam's fingerprint in ROOT, as JSON
  record VERSION ROOT        replace VERSION's entry in seams.json with ROOT's fingerprints"""


def main(argv: list) -> int:
    """The command line (:data:`USAGE`); returns the exit status."""
    command, arguments = (argv[0], argv[1:]) if argv else ("", [])
    python = f"Python {sys.version.split()[0]}"
    if command == "check" and len(arguments) <= 1:
        root = arguments[0] if arguments else installed_root()
        release, differences = compare(root)
        if differences:
            print(f"{python}: the vLLM at {root} is no tested release's code; closest {release}:", *differences,
                  sep="\n  ")
            return 1
        print(f"{python}: the vLLM at {root} is vLLM {release}'s code in all {len(SEAMS)} seams")
        return 0
    if command == "fingerprints" and len(arguments) == 1:
        print(json.dumps(fingerprints(arguments[0]), indent=0, sort_keys=True))
        return 0
    if command == "record" and len(arguments) == 2:
        releases = record_release(*arguments)
        print(f"recorded vLLM {arguments[0]}'s {len(SEAMS)} seams in {RECORD_PATH} (releases: {', '.join(releases)})")
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
