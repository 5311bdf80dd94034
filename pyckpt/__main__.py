"""``python -m pyckpt``: the same command line as the ``pyckpt`` script."""

import sys

from pyckpt.cli import main

sys.exit(main())
