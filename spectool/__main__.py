"""``python -m spectool``: the same as the ``spectool`` command."""

import sys

from spectool.cli import main

sys.exit(main())
