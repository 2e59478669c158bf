"""Every benchmark command the documents show (``python bench/<script>.py ...`` in a bash block or inline, and the
arguments of ``diversed bench e2e|verify ...``) names a script of bench/ and parses with that script's own
``parse_args``: the commands behind the figures of RESULTS.md and benchmarks.md stay commands that run. The scripts
are imported, not run (each keeps its work under ``if __name__ == "__main__"`` and imports vLLM only when it runs).
"""

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from helpers import DOCUMENTS, REPO_ROOT, command_lines, parse_outcome, typed_arguments

BENCH = REPO_ROOT / "bench"
# `[VAR=value ...] [python] bench/<script>.py [arguments]`
SCRIPT_COMMAND = re.compile(r"^((?:\w+=\S*\s+)*)(?:\S*python3?\s+)?bench/(\w+)\.py(?:\s+(.*))?$")
CLI_BENCH = re.compile(r"^(?:\S*/)?diversed bench (e2e|verify)(?:\s+(.*))?$")
CLI_SCRIPTS = {"e2e": "bench_e2e", "verify": "bench_verify"}  # what `diversed bench WHICH` runs


def documented_benchmarks() -> list:
    """(document name, the command as written, script name, its argument text, its environment assignments) of every
    benchmark command."""
    found = []
    for document in DOCUMENTS:
        for line in command_lines(document, inline=True):
            script_command, cli_command = SCRIPT_COMMAND.match(line), CLI_BENCH.match(line)
            if script_command:
                environment, script, arguments = script_command.groups()
                found.append((document.name, line, script, arguments or "", environment.strip()))
            elif cli_command:
                found.append((document.name, line, CLI_SCRIPTS[cli_command.group(1)], cli_command.group(2) or "", ""))
    return sorted(set(found))


BENCHMARKS = documented_benchmarks()


def lay_out_inputs(arguments: list) -> None:
    """Creates, in the working folder, the inputs a reader running the command would have, which a parser may check
    exist: each data file (``*.jsonl``) and each ``--pair`` folder as ``diversed export-pair`` lays it out."""
    for word, following in zip(arguments, arguments[1:] + [""]):
        if word.endswith(".jsonl"):
            Path(word).parent.mkdir(parents=True, exist_ok=True)
            Path(word).touch()
        elif word == "--pair":
            for model in ("target", "draft"):
                (Path(following) / model).mkdir(parents=True, exist_ok=True)
                (Path(following) / model / "config.json").write_text("{}")


@pytest.fixture(scope="module")
def bench_module():
    """Imports a bench/ script by name, with bench/ on sys.path for its sibling modules (pass_costs, vllm_common)."""
    sys.path.insert(0, str(BENCH))
    loaded = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"documented_{name}", BENCH / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # its dataclasses look their module up while the script runs
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    yield load
    sys.path.remove(str(BENCH))
    for name in loaded:
        sys.modules.pop(f"documented_{name}", None)


def test_the_documents_show_benchmarks():
    assert len(BENCHMARKS) >= 10
    assert {script for _, _, script, _, _ in BENCHMARKS} >= {"bench_e2e", "bench_verify", "bench_drafters",
                                                              "bench_vllm"}


@pytest.mark.parametrize("document, command, script, arguments, environment", BENCHMARKS,
                         ids=[f"{name}:{command[:60]}" for name, command, *_ in BENCHMARKS])
def test_the_documented_benchmark_parses(document, command, script, arguments, environment, bench_module, tmp_path,
                                        monkeypatch):
    assert (BENCH / f"{script}.py").is_file(), f"{document}: `{command}` names no script of bench/"
    module = bench_module(script)
    if not hasattr(module, "parse_args"):  # a script without options: the documents must give it none
        assert not typed_arguments(arguments), f"{document}: `{command}` passes options to a script that takes none"
        return
    typed = typed_arguments(arguments)
    for assignment in environment.split():
        monkeypatch.setenv(*assignment.split("=", 1))
    monkeypatch.chdir(tmp_path)
    lay_out_inputs(typed)
    parsed, exit_code, errors = parse_outcome(module.parse_args, typed)
    assert exit_code is None, f"{document}: `{command}` does not parse (exit {exit_code}): {errors}"
    assert isinstance(parsed, argparse.Namespace)


def test_a_wrong_option_fails_the_check(bench_module):
    arguments = typed_arguments("--draft-length gain")  # the flag is --draft-lengths
    assert parse_outcome(bench_module("bench_e2e").parse_args, arguments)[1] == 2


def test_bench_vllm_reads_a_draft_schedule_and_rows(bench_module):
    parsed = bench_module("bench_vllm").parse_args(["--draft-schedule", "1:3, 2-64:1", "--rows", "vllm,head"])
    assert parsed.draft_schedule == [[1, 1, 3], [2, 64, 1]] and parsed.rows == ("vllm", "head")


@pytest.mark.parametrize("arguments, message", [
    (["--draft-schedule", "1:3,2-x:1"], "'2-x:1' is not FIRST[-LAST]:K"),
    (["--draft-schedule", "1-:3"], "'1-:3' is not FIRST[-LAST]:K"),
    (["--draft-schedule", "1"], "'1' is not FIRST[-LAST]:K"),
    (["--draft-schedule", "1:4"], "drafts more than --max-draft 3"),
    (["--rows", "heads"], "unknown row 'heads'"),
])
def test_bench_vllm_names_a_bad_schedule_or_row(bench_module, arguments, message):
    _, exit_code, errors = parse_outcome(bench_module("bench_vllm").parse_args, arguments)
    assert exit_code == 2 and message in errors, errors


@pytest.mark.parametrize("script, arguments, message", [
    ("bench_verify", ["--draft", "0"], "argument --draft: must be an int >= 1, got 0"),
    ("bench_verify", ["--vocab", "0"], "argument --vocab: must be an int >= 1, got 0"),
    ("bench_verify", ["--batch", "-1"], "argument --batch: must be an int >= 1, got -1"),
    ("bench_verify", ["--device", "tpu"], "argument --device: must be cpu or cuda[:N], got 'tpu'"),
    ("bench_verify", ["--fly-window", "-1"], "--fly-window must be >= 0"),
    ("bench_verify", ["--csv", "{folder}"], "a folder, not a file"),
    ("bench_e2e", ["--data", "{folder}/missing.jsonl"], "missing.jsonl: no such file"),
    ("bench_e2e", ["--fly", "--fly-window", "5", "--k", "2"], "--fly-window must lie in [0, 2)"),
    ("bench_e2e", ["--csv", "{blocker}/e2e.csv"], "its folder is not writable"),
])
def test_bench_scripts_refuse_bad_arguments_before_any_work(bench_module, tmp_path, script, arguments, message):
    """A mistake on a benchmark's command line is argparse's one line (exit 2) at parse time, not a traceback after
    a run; an output that cannot be written is found before the timing starts."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    arguments = [argument.format(folder=tmp_path, blocker=blocker) for argument in arguments]
    _, exit_code, errors = parse_outcome(bench_module(script).parse_args, arguments)
    assert exit_code == 2 and message in errors, errors
