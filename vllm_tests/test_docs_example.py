"""The vLLM example of README.md, which docs/vllm.md repeats, runs as written: saved as a script and run by this venv's
Python from a folder laid out as the checkout's root after ``diversed export-pair pair`` (the exported pair in
``pair/``, the shipped EAGLE-3 head at the path the example names). Its three engines start in one process, so it
also shows that the memory it asks of each fits beside the others."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_EXAMPLE = re.compile(r"^```python\n(from vllm import .*?)^```", re.MULTILINE | re.DOTALL)
SCRIPT_SECONDS = 780  # three engine start-ups and four short generations; about 3.5 minutes on a busy 2-core machine


def vllm_example(document: Path) -> str:
    examples = VLLM_EXAMPLE.findall(document.read_text(encoding="utf-8"))
    assert len(examples) == 1, f"{document.name} should hold one Python example starting 'from vllm import'"
    return examples[0]


def test_vllm_md_repeats_the_readme_example():
    assert vllm_example(ROOT / "docs" / "vllm.md") == vllm_example(ROOT / "README.md")


def test_the_readme_example_runs_as_a_script(pair, tmp_path):
    from diversed_ext.models.eagle3 import default_drafter_path

    # The script's folder lands on sys.path: it must not be the working folder, whose diversed_ext/ holds data only.
    script = tmp_path / "script" / "example.py"
    script.parent.mkdir()
    script.write_text(vllm_example(ROOT / "README.md"), encoding="utf-8")
    work = tmp_path / "work"
    drafters = work / "diversed_ext" / "drafters"
    drafters.mkdir(parents=True)
    (work / "pair").symlink_to(pair.target.parent, target_is_directory=True)
    (drafters / default_drafter_path().name).symlink_to(default_drafter_path(), target_is_directory=True)

    result = subprocess.run([sys.executable, str(script)], cwd=work, capture_output=True, text=True,
                            timeout=SCRIPT_SECONDS)
    assert result.returncode == 0, f"the README's vLLM example failed:\n{result.stderr[-6000:]}"
