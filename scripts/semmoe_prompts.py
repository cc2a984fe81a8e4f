#!/usr/bin/env python
"""Turn the shared prompt sets into Sem-MoE PROMPTS.jsonl files with the paper's 20% / 80% split.

    python scripts/semmoe_prompts.py --data-dir ../shared/data/prompts --out-dir data/semmoe_prompts

The code and the files it writes: tools/semmoe/prompts.py (``python -m tools.semmoe.prompts``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.semmoe.prompts import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
