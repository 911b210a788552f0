"""``python -m benchmarks.coverage``: see the package docstring and ``--help``."""

import sys

from benchmarks.coverage.cli import main

sys.exit(main())
