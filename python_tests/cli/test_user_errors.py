"""A user's mistakes get one clear line, never a traceback or a silent wrong result: the command line (exit status 2,
checked before any model loads), data files and saved heads; training's damaged files are in
research/test_damaged_training_files.py."""

import json
import os

import pytest
import torch

pytest.importorskip("safetensors")
import diversed_ext as dx  # noqa: E402
from diversed_ext import cli  # noqa: E402
from diversed_ext.head import EnsembleHead, load_head  # noqa: E402
from diversed_ext.models import export  # noqa: E402
from helpers import run_cli  # noqa: E402


def write(path, content: bytes):
    path.write_bytes(content)
    return str(path)


GOOD_RECORD = json.dumps({"question": "1 + 1?", "answer": "#### 2"}).encode() + b"\n"


@pytest.mark.parametrize("name, content, expected", [
    ("malformed.jsonl", b"{not json\n", "not a JSON object"),
    ("list.jsonl", b"[1, 2]\n", "not a JSON object"),
    ("latin1.jsonl", b'{"question": "caf\xe9", "answer": "#### 2"}\n', "not UTF-8"),
    ("empty.jsonl", b"", "no records"),
    ("null.jsonl", b'{"question": null, "answer": "#### 2"}\n', "must be text"),
    ("missing.jsonl", b'{"question": "q"}\n', "lacks field"),
])
def test_bad_data_files_are_one_line_errors(tmp_path, capsys, no_models, name, content, expected):
    path = write(tmp_path / name, content)
    for command in (["eval", "--data", path], ["train", "--data", path, "--output-dir", str(tmp_path / "run")]):
        status, error = run_cli(command, capsys)
        assert status == 2 and expected in error and path in error and "\n" not in error


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--prompt", "hi", "--draft-cost", "0.2"], "--draft-cost applies to --draft-length gain"),
    (["eval", "--data", "x.jsonl", "--draft-length", "fixed", "heuristic", "--draft-cost", "0.2"],
     "--draft-cost applies to --draft-length gain"),
    (["demo", "--draft-length", "confidence", "--draft-cost", "0.2"], "--draft-cost applies to --draft-length gain"),
])
def test_draft_length_mistakes_are_one_line_errors(capsys, no_models, argv, expected):
    status, error = run_cli(argv, capsys)
    assert status == 2 and expected in error and "\n" not in error


def test_an_eagle_drafter_refuses_token_by_token_rollouts(tmp_path, capsys, no_models):
    path = write(tmp_path / "train.jsonl", GOOD_RECORD)
    for drafter in (["--drafter", "eagle3"], ["--drafter", "eagle3-int8"], ["--drafter-path", str(tmp_path)]):
        status, error = run_cli(["train", "--data", path, "--rollout", "mixture", *drafter], capsys)
        assert status == 2 and "--rollout mixture: an EAGLE-3 drafter" in error and "\n" not in error


@pytest.mark.parametrize("spec, expected", [
    ("synthetic", "expected TASK:DATA:N"),
    ("synthetic:train", "expected TASK:DATA:N"),
    ("riddles:train:5", "unknown task 'riddles'"),
    ("synthetic:train:0", "N must be an integer >= 1"),
    ("synthetic:train:many", "N must be an integer >= 1"),
    ("synthetic:validation:5", "names a split"),
])
def test_mix_in_mistakes_are_one_line_errors_before_any_model_loads(tmp_path, capsys, no_models, spec, expected):
    path = write(tmp_path / "train.jsonl", GOOD_RECORD)
    status, error = run_cli(["train", "--data", path, "--mix-in", spec], capsys)
    assert status == 2 and f"--mix-in {spec}" in error and expected in error and "\n" not in error


def test_the_kl_term_refuses_the_logistic_surrogate_before_any_model_loads(tmp_path, capsys, no_models):
    path = write(tmp_path / "train.jsonl", GOOD_RECORD)
    status, error = run_cli(["train", "--data", path, "--expected-kl-coef", "1", "--closed-form", "logistic"], capsys)
    assert status == 2 and "--expected-kl-coef 1 with --closed-form logistic" in error and "\n" not in error


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--draft-length", "longest"],
                                  ["eval", "--draft-length"], ["demo", "--draft-cost", "-1"],
                                  ["eval", "--fixed-k", "0"]])
def test_bad_draft_length_values_exit_before_any_model_loads(capsys, no_models, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2


def test_missing_data_file_and_model_folder(tmp_path, capsys, monkeypatch):
    status, error = run_cli(["eval", "--data", str(tmp_path / "nope.jsonl")], capsys)
    assert status == 2 and "no data file" in error
    status, error = run_cli(["generate", "--prompt", "hi", "--target", str(tmp_path / "nonexistent")], capsys)
    assert status == 2 and "no such model folder" in error


@pytest.mark.parametrize("argv", [
    ["train", "--data", "d.jsonl", "--lr", "-1"],
    ["train", "--data", "d.jsonl", "--lr", "nan"],
    ["train", "--data", "d.jsonl", "--init-weight", "2"],
    ["train", "--data", "d.jsonl", "--init-weight", "0"],
    ["train", "--data", "d.jsonl", "--expected-kl-coef", "-1"],
    ["validate", "--data", "d.jsonl", "--expected-kl-coef", "nan"],
    ["generate", "--prompt", "hi", "--temperature", "inf"],
    ["generate", "--prompt", "hi", "--max-new-tokens", "0"],
    ["generate", "--prompt", "", "--no-chat-template"],
    ["eval", "--data", "d.jsonl", "--weight", "nan"],
    ["compare-drafts", "--drafts", "probabilities"],
    ["compare-drafts", "--weight", "1.5"],
])
def test_bad_numbers_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


@pytest.mark.parametrize("device, expected", [("tpu", "must be cpu, cuda or cuda:N"),
                                              ("cuda:x", "must be cpu, cuda or cuda:N"),
                                              ("meta", "must be cpu, cuda or cuda:N"),
                                              ("cuda:64", "GPU(s) on this machine")])
def test_a_device_torch_cannot_run_on_is_refused_by_the_parser(device, expected, capsys):
    for argv in (["generate", "--prompt", "hi"], ["eval", "--data", "d.jsonl"], ["train", "--data", "d.jsonl"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.build_parser().parse_args([*argv, "--device", device])
        assert exit_info.value.code == 2
        assert "argument --device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--device", device])
    assert expected in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible, so --device cuda is valid here")
def test_device_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--device", "cuda"])
    assert "cuda: torch sees 0 GPU(s) on this machine" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["demo", "--device", "cpu"]).device == "cpu"


def test_unwritable_output_folder_is_refused_before_the_work(tmp_path, capsys, no_models):
    data = write(tmp_path / "data.jsonl", GOOD_RECORD)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    status, error = run_cli(["pareto", "--data", data, "--output-dir", str(blocker / "out")], capsys)
    assert status == 2 and "--output-dir" in error and "not writable" in error


@pytest.mark.parametrize("command, flag, under_file", [
    ("validate", "--tokens", "t.safetensors"), ("validate", "--tokens", None),
    ("train-drafter", "--out", "out"), ("train-drafter", "--data-dir", None)])
def test_unwritable_output_files_are_refused_before_the_work(tmp_path, capsys, no_models, monkeypatch, command, flag,
                                                            under_file):
    """An output path under a file, or a file's path that is a folder (None: the flag names the file or folder
    ``blocker`` itself, a file for --data-dir and a folder for --tokens): one line naming the flag, before any model
    loads (train-drafter loads the default pair itself)."""
    import diversed_ext.models

    monkeypatch.setattr(diversed_ext.models, "load_default_pair", lambda *args, **kwargs: pytest.fail("loaded"))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    path = blocker / under_file if under_file else (tmp_path if flag == "--tokens" else blocker)
    data = write(tmp_path / "train.jsonl", GOOD_RECORD)
    argv = [command, "--data", data, flag, str(path)]
    if command == "train-drafter" and flag != "--out":
        argv += ["--out", str(tmp_path / "drafter")]
    status, error = run_cli(argv, capsys)
    assert status == 2 and error.startswith(f"diversed: {flag} "), error


def test_method_diversed_without_head_names_the_default(capsys, no_models):
    status, error = run_cli(["generate", "--prompt", "hi", "--method", "diversed"], capsys)
    assert status == 2 and "--head default" in error


@pytest.mark.parametrize("argv, trained_for, used_with", [
    (["--head", "smollm2-135m-eagle3-lambda4"], "smollm2-135m-eagle3", "SmolLM2-135M-Instruct-int8"),
    (["--head", "smollm2-135m-lambda4", "--drafter", "eagle3"], "SmolLM2-135M-Instruct-int8", "smollm2-135m-eagle3"),
])
def test_a_head_of_another_drafter_is_refused_before_any_model_loads(capsys, no_models, argv, trained_for, used_with):
    """A head reads the states and distributions of the drafter it was trained on: another one's is refused."""
    status, error = run_cli(["generate", "--prompt", "hi", "--method", "diversed", *argv], capsys)
    assert status == 2 and f"was trained for draft {trained_for!r}, not {used_with!r}" in error, error


def test_a_head_of_its_own_drafter_passes_the_check(capsys, monkeypatch):
    """The default head of each drafter gets past the pair check (to the model load, refused here)."""
    def reached(*args, **kwargs):
        raise SystemExit(7)

    monkeypatch.setattr(cli.common, "load_models", reached)
    for drafter in ([], ["--drafter", "eagle3"]):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["generate", "--prompt", "hi", "--method", "diversed", "--head", "default", *drafter])
        assert stopped.value.code == 7


@pytest.mark.parametrize("argv, expected", [
    (["eval", "--method", "fly", "--fly-window", "5"], "5 must be below every K the run drafts at, got --max-draft 3"),
    (["eval", "--method", "fly", "--fly-window", "2", "--fixed-k", "1", "3"], "got --fixed-k 1"),
    (["pareto", "--fly", "--fly-window", "3", "--head", "default"], "got --max-draft 3"),
])
def test_a_fly_window_no_k_of_the_run_fits_is_refused_before_any_model_loads(tmp_path, capsys, no_models, argv,
                                                                              expected):
    data = write(tmp_path / "data.jsonl", GOOD_RECORD)
    status, error = run_cli([*argv, "--data", data, "--output-dir", str(tmp_path / "out")]
                            if argv[0] == "pareto" else [*argv, "--data", data], capsys)
    assert status == 2 and error.startswith("diversed: --fly-window: ") and expected in error, error


@pytest.mark.parametrize("damaged", ["--target", "--draft"])
def test_damaged_model_weights_are_named_with_their_flag(tmp_path, capsys, damaged):
    """A model folder whose safetensors file is not one: a one-line error naming the flag and the file, before
    transformers loads either model (the other folder here holds no weights at all)."""
    folders = {flag: tmp_path / flag.strip("-") for flag in ("--target", "--draft")}
    for folder in folders.values():
        folder.mkdir()
    (folders[damaged] / "model.safetensors").write_bytes(os.urandom(64))
    status, error = run_cli(["generate", "--prompt", "hi", "--target", str(folders["--target"]),
                             "--draft", str(folders["--draft"])], capsys)
    assert status == 2 and error.startswith(f"diversed: {damaged} {folders[damaged]}: model.safetensors is not a "
                                            "readable safetensors file"), error


@pytest.mark.parametrize("argv, expected", [
    (["eval", "--method", "sd", "--fly-threshold", "0.5"], "--fly-threshold would be ignored: no --method adds FLy"),
    (["eval", "--method", "sd", "static", "--gate-margin", "2"], "--gate-margin would be ignored"),
    (["eval", "--method", "sd", "--weight", "0.3"], "--weight would be ignored: no --method is a static ensemble"),
    (["pareto", "--fly-top-k=4"], "--fly-top-k would be ignored: FLy's points are added with --fly"),
    (["pareto", "--fly-threshold", "0.5"], "--fly-threshold would be ignored: FLy's points are added with --fly"),
])
def test_a_flag_no_method_reads_is_refused_before_any_model_loads(tmp_path, capsys, no_models, argv, expected):
    data = write(tmp_path / "data.jsonl", GOOD_RECORD)
    status, error = run_cli([*argv, "--data", data, "--output-dir", str(tmp_path / "out")]
                            if argv[0] == "pareto" else [*argv, "--data", data], capsys)
    assert status == 2 and error.startswith(f"diversed: {expected}"), error


def test_flags_a_method_reads_pass_the_check(tmp_path, capsys, no_models):
    """The same flags beside methods that read them get to the model load (refused by no_models)."""
    data = write(tmp_path / "data.jsonl", GOOD_RECORD)
    with pytest.raises(AssertionError, match="models were loaded"):
        cli.main(["eval", "--data", data, "--method", "static+fly", "gate", "--fly-threshold", "0.5",
                  "--gate-margin", "2", "--weight", "0.3"])


@pytest.mark.parametrize("argv, abbreviated", [
    (["eval", "--method", "sd", "--fly-thr", "0.5"], "--fly-thr"),
    (["demo", "--prom", "2"], "--prom"),
    (["generate", "--prompt", "hi", "--max-new", "4"], "--max-new"),
])
def test_abbreviated_flags_are_refused(capsys, argv, abbreviated):
    """A flag counts only written whole: an abbreviation would slip past the unread-flag check (``--fly-thr`` beside
    sd) and turn ambiguous once a flag sharing its prefix is added."""
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {abbreviated}" in capsys.readouterr().err


def test_version_names_the_package_torch_and_the_kernels_built(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    kernels = "CPU and CUDA kernels" if dx.cuda_kernels_registered() else "CPU kernels only"
    assert capsys.readouterr().out.strip() == f"diversed {dx.__version__} (torch {torch.__version__}; {kernels})"


@pytest.mark.parametrize("where", ["under a file", "a file", "in /proc"])
def test_export_pair_refuses_a_destination_it_cannot_make_before_loading(where, tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the pair was loaded before the destination was made")
    monkeypatch.setattr(export, "convert_default_checkpoint", refuse)
    (tmp_path / "file").write_text("")
    destination = {"under a file": str(tmp_path / "file" / "pair"), "a file": str(tmp_path / "file"),
                   "in /proc": "/proc/diversed-export"}[where]
    status, error = run_cli(["export-pair", destination], capsys)
    assert status == 2 and error.startswith(f"diversed: cannot write to {destination}: ") and "\n" not in error


def test_help_shows_the_defaults_each_command_uses():
    parser = cli.build_parser()
    demo = parser._subparsers._group_actions[0].choices["demo"]
    assert "default 48" in demo.format_help() and "default 64" not in demo.format_help()


# ---------------------------------------------------------------------------------------------------------- heads
@pytest.fixture
def saved_head(tmp_path):
    folder = tmp_path / "head"
    EnsembleHead(8, 12, init_weight=0.7).save(str(folder))
    return folder


@pytest.mark.parametrize("damage, expected", [
    (lambda folder: (folder / "head.safetensors").write_bytes((folder / "head.safetensors").read_bytes()[:40]),
     "not a readable safetensors"),
    (lambda folder: (folder / "head.safetensors").write_bytes(os.urandom(300)), "not a readable safetensors"),
    (lambda folder: (folder / "head.json").write_text("[1, 2]"), "JSON object"),
    (lambda folder: (folder / "head.json").write_text("{oops"), "not valid JSON"),
    (lambda folder: _edit_config(folder, lambda config: config.pop("draft_hidden")), "lacks draft_hidden"),
    (lambda folder: _edit_config(folder, lambda config: config.update(draft_hidden=9)), "has shape"),
    (lambda folder: _edit_config(folder, lambda config: config.update(draft_hidden="8")), "positive integer"),
])
def test_damaged_heads_are_refused_naming_the_file(saved_head, damage, expected):
    damage(saved_head)
    with pytest.raises(ValueError, match=expected) as error:
        load_head(str(saved_head))
    assert str(saved_head) in str(error.value)


def test_a_file_that_is_no_part_of_a_head_is_named(saved_head):
    """A head's head.json or head.safetensors stands for its folder; any other file is refused by its own name."""
    assert load_head(str(saved_head / "head.json")).config == load_head(str(saved_head)).config
    other = saved_head / "notes.txt"
    other.write_text("not a head")
    with pytest.raises(FileNotFoundError, match="notes.txt' is a file, not a head's folder"):
        load_head(str(other))


def test_nan_weights_are_refused(saved_head):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(saved_head / "head.safetensors"))
    tensors["output.bias"] = torch.tensor([float("nan")])
    save_file(tensors, str(saved_head / "head.safetensors"))
    with pytest.raises(ValueError, match="NaN"):
        load_head(str(saved_head))


@pytest.mark.parametrize("command", [["eval", "--method", "diversed"], ["pareto", "--weights", "1"],
                                     ["validate"], ["generate", "--prompt", "hi", "--method", "diversed"]])
def test_a_damaged_or_missing_head_is_refused_before_any_model_loads(saved_head, command, no_models, capsys):
    (saved_head / "head.json").write_text("[]")
    data = saved_head.parent / "data.jsonl"
    data.write_bytes(GOOD_RECORD)
    argv = command + ([] if command[0] == "generate" else ["--data", str(data)])
    status, error = run_cli(argv + ["--head", str(saved_head)], capsys)
    assert status == 2 and "cannot load --head" in error and "head.json" in error
    status, error = run_cli(argv + ["--head", str(saved_head.parent / "nowhere")], capsys)
    assert status == 2 and "no such head folder" in error and "default" in error


def _edit_config(folder, change):
    path = folder / "head.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
