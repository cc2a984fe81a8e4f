#!/usr/bin/env python
"""The FCSD paper's two short sweeps (FarSkip-Collective §5.1): batch size, then learning rate.

    python scripts/fcsd_sweep.py --load CKPT --root SWEEP_DIR --steps 2000 \\
        --batch-tokens 65536,131072,262144 --lrs 2e-5,4e-5,8e-5 [--nproc 8] -- [distill.fcsd flags ...]

The code and how it selects: distill/sweep.py (``python -m distill.sweep``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distill.sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
