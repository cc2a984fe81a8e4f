#!/usr/bin/env python
"""Compare a served run's all-to-alls with netsim's replay, step by step.

    python scripts/replay_steps.py --spans WORK/serve-standard-run0/a2a_spans --profile serve.profile.json \\
        --variant standard --link-table TABLE/*.csv [--json OUT]

The code and what it compares: tools/profile/replay_steps.py (``python -m tools.profile.replay_steps``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.profile.replay_steps import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
