#!/usr/bin/env python
"""Scale check for the Sem-MoE solver at DeepSeek-V3 table sizes.

    python scripts/semmoe_scale_check.py --out runs/semmoe_scale.json

The code and what it measures: tools/semmoe/scale_check.py (``python -m tools.semmoe.scale_check``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.semmoe.scale_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
