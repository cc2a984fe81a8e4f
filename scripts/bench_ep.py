#!/usr/bin/env python
"""Measure MoE variants over a real, shaped network link on one machine (EP benchmark harness).

    python scripts/bench_ep.py --variants standard,bigmac --target-comm-fraction 0.6 --json out.json
    python scripts/bench_ep.py --variants synthetic --no-netns --steps 2 --json out.json
    python scripts/bench_ep.py --collectives --csv examples/calibration/gloo_netns.csv

Ranks live in their own network namespaces behind a bridge with ``tc`` shaping (needs root; falls
back to unshaped loopback with a warning). ``--help`` lists every option;
docs/design/measuring-communication.md explains the method and how to read the numbers.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
