"""Entry point: ``python -m netsim <command> ...`` (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
