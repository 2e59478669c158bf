"""What the tests share, imported as ``from helpers import ...`` from any folder of the suite (the suite's root is on
sys.path: pytest puts it there for the root conftest.py).

- ops.py: random verify problems, poisoned inputs, checks of verify results, the dispatch log and the CUDA skip.
- stats.py: the chi-square tests and the exact output laws of the decoding loop.
- models.py: tiny random Llama models and pairs (no downloads) and the decoding loop's shared checks.
- training.py: a trainer on a tiny pair, for the trainer tests and the DDP worker.
- fly.py: FLy problems, and a literal port of vLLM's FLy kernels to test the ops' FLy against.
- eagle.py: EAGLE-3 heads distilled on the tiny targets of models.py, and those targets' aux hidden states.
- documents.py: the documents' fenced blocks and command lines, and the arguments a reader would type.
- commands.py: the command line run in a test, its model load replaced by a tiny pair or by a failure.

process_tree.py (a command whose whole process tree dies at its timeout) and ddp_worker.py (one rank of the DDP test,
a script torchrun starts) are imported or run by path, not re-exported here.

Test files import only from here, never from one another, so a test file can move, or skip itself at import
(pytest.importorskip), without breaking or skipping another. Nothing here imports transformers at import time
(conftest.py imports this package in every run); the builders that need it import it when called.
"""

from pathlib import Path

from .ops import *  # noqa: F401,F403
from .stats import *  # noqa: F401,F403
from .models import *  # noqa: F401,F403
from .training import *  # noqa: F401,F403
from .fly import *  # noqa: F401,F403
from .eagle import *  # noqa: F401,F403
from .documents import *  # noqa: F401,F403
from .commands import *  # noqa: F401,F403

TESTS_ROOT = Path(__file__).resolve().parents[1]  # python_tests/
REPO_ROOT = TESTS_ROOT.parent
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]  # the user-facing documents
