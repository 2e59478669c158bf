"""``python -m diversed_ext.cli``: the ``diversed`` command."""

import sys

from . import main

sys.exit(main())
