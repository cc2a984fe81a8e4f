"""Entry point: ``python -m tools.semmoe <command> ...`` (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
