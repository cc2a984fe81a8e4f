#!/usr/bin/env python
"""Validation perplexity against training wall-clock for standard, BigMac (and FarSkip) on the shaped link.

    sudo python scripts/time_to_quality.py --out runs/ttq --config examples/corpus_moe_cpu.yaml \\
        --variants standard,bigmac,farskip --target-comm-fraction 0.4
    python scripts/time_to_quality.py --out /tmp/ttq --no-netns --steps 20 --eval-interval 10   # smoke

Resumable: run the same command again after an interruption. Writes OUT/ttq.json and OUT/ttq.png;
``--report-only`` rebuilds them from the runs so far. See docs/guides/peers.md and tools/bench/ttq.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.ttq import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
