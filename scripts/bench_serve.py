#!/usr/bin/env python
"""Serve MoE variants over a real, shaped network link and measure them under load (serving benchmark).

    python scripts/bench_serve.py --config examples/bench_bigmac_top8_cpu.yaml --variants standard,bigmac \
        --mode prefill --input-len 64 --target-comm-fraction 0.6 --json prefill.json
    python scripts/bench_serve.py --variants standard,bigmac --config examples/bench_bigmac_top8_cpu.yaml \
        --prompts ../shared/data/prompts/sharegpt/ShareGPT_V3_filtered_500.json --request-rates 1,2,4 --json serve.json
    python scripts/bench_serve.py --load CKPT --variants standard,farskip --no-netns --input-len 32 --output-len 16

The server's ranks run in the EP benchmark's network namespaces behind a ``tc``-shaped link (needs
root; ``--no-netns`` runs over unshaped loopback). ``--help`` lists every option; docs/guides/bench-serve.md
explains the method and how to read the numbers.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.serve_bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
