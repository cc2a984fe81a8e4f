#!/usr/bin/env python
"""Where each all-to-all of a served prefill step finds its window (megatron-core's engine, in process).

    python scripts/serve_overlap_windows.py --load CKPT [--variant farskip] [--ranks 2] \\
        [--prompt-len 256] [--prompts-per-rank 2] [--repeats 3] [--json out.json]

The code and what it prints: tools/profile/overlap_windows.py (``python -m tools.profile.overlap_windows``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.profile.overlap_windows import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
