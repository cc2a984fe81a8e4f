#!/usr/bin/env python
"""Write a benchmark JSON as docs/figures keeps it (raw per-request and per-rank lists left out).

The code: tools/figure_summary.py (``python -m tools.figure_summary``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.figure_summary import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
