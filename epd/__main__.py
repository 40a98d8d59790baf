"""``python -m epd``: the same command line as ``epd``."""

import sys

from epd.cli import main

sys.exit(main())
