"""``python -m benchmarks.fidelity``: see the package docstring and ``--help``."""

import sys

from benchmarks.fidelity.cli import main

sys.exit(main())
