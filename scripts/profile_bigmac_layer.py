#!/usr/bin/env python
"""Side-by-side compute of the standard fine-grained MoE model and its BigMac twin (one process, EP=1).

    python scripts/profile_bigmac_layer.py --with-upstream-scaling --json runs/bigmac_compute.json

The code and what it measures: tools/bigmac/profile_layer.py (``python -m tools.bigmac.profile_layer``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bigmac.profile_layer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
