"""``python -m scaletrain`` is the same CLI as ``scaletrain``."""

import sys

from scaletrain.cli import main

sys.exit(main())
