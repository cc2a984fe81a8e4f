#!/usr/bin/env python
"""Measure netsim's per-layer compute table on your GPU (the paper's Vidur-style single-GPU profiling).

    python scripts/profile_netsim_compute.py --out runs/h100_measured.json           # full grid
    python scripts/profile_netsim_compute.py --out runs/quick.json --quick           # coarser grid

The code and how it measures: tools/profile/netsim_compute.py (``python -m tools.profile.netsim_compute``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.profile.netsim_compute import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
