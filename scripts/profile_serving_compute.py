#!/usr/bin/env python
"""Profile the compute of served engine steps, per variant, for ``python -m netsim predict``.

    python scripts/profile_serving_compute.py --bench-serve serve.json --out runs/serve_profile.json

The code and what it measures: tools/profile/serving_compute.py (``python -m tools.profile.serving_compute``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.profile.serving_compute import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
