#!/usr/bin/env python
"""DeepSpeed-MoE in its usual modes beside megatron-core's, over seeds.

    sudo .venv/bin/python scripts/deepspeed_modes.py --out runs/ds_modes --json docs/figures/deepspeed_modes.json

The code and what it reports: tools/bench/deepspeed_modes.py (``python -m tools.bench.deepspeed_modes``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.deepspeed_modes import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
