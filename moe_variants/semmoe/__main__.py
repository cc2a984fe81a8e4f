"""Entry point: ``python -m moe_variants.semmoe <command> ...`` (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
