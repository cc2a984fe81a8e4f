#!/usr/bin/env python
"""Time to quality over several seeds: scripts/time_to_quality.py once per seed, then intervals.

    sudo .venv/bin/python scripts/ttq_seeds.py --out runs/ttq_farskip --seeds 1234,1235,1236 \\
        --variants standard,farskip -- --config examples/corpus_moe_cpu.yaml --link-gbit 0.1824 \\
        --fixed-link --steps 300 --eval-interval 50

The code and what it reports: tools/bench/ttq_seeds.py (``python -m tools.bench.ttq_seeds``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.ttq_seeds import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
