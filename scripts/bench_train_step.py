#!/usr/bin/env python
"""Training step time of checkouts side by side, at several ``--log-interval``s.

    git worktree add /tmp/before <commit before the change>
    scripts/bench_train_step.py --checkout before=/tmp/before --checkout after=. \\
        --log-intervals 1,10 --runs 5 --json docs/figures/train_step_log_interval.json

The code and its method: tools/bench/train_step.py (``python -m tools.bench.train_step``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench.train_step import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
