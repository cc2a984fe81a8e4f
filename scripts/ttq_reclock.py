#!/usr/bin/env python
"""Time to the baseline's final perplexity on a measured link clock, over seeds.

    python scripts/ttq_reclock.py --clock runs/bigmac_paper_clock/ttq.json \\
        --pattern 'runs/bigmac_paper_cf12/seed{seed}/{variant}/metrics.jsonl' \\
        --seeds 1234,1235,1236 --variants standard,bigmac --json bigmac_cf12.json

The code and its method: tools/bench/reclock.py (``python -m tools.bench.reclock``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.reclock import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
