"""What the vLLM benchmarks share: vLLM imported (or an exit that names the interpreter which has it), and the CSV
each writes beside its table."""

import csv
import sys
from pathlib import Path


def require_vllm(script: str):
    """The ``vllm`` module; without it, exit saying how to run ``script`` (vLLM has its own virtual environment)."""
    try:
        import vllm
    except ImportError:
        sys.exit(f"{script} needs vLLM: run it with .venv-vllm/bin/python (bash scripts/setup.sh vllm)")
    return vllm


def write_csv(rows: list, path: Path) -> None:
    """``rows`` (dicts with the same keys) as CSV at ``path``, its folder created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nCSV: {path}")
