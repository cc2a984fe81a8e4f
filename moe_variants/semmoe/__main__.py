"""``python -m moe_variants.semmoe``: the earlier name of ``python -m tools.semmoe``, kept so existing
scripts keep working (an entry point, not part of the model library's import graph)."""

import sys

from tools.semmoe.cli import main

sys.exit(main())
