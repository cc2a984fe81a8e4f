#!/usr/bin/env python
"""Per-collective overlap of one step from an EP-benchmark Chrome trace (``bench_ep.py --trace DIR``).

    python scripts/trace_overlap.py DIR/trace_farskip_rank0.json [--json out.json]

The code and what it prints: tools/bench/trace_overlap.py (``python -m tools.bench.trace_overlap``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.trace_overlap import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
