#!/usr/bin/env python
"""Train a small byte-level BPE (HF ``tokenizer.json``) from text files.

    python scripts/train_tokenizer.py --input a.txt b.txt --vocab-size 8192 --output tok.json

The code and the tokenizer it writes: tools/data/train_tokenizer.py (``python -m tools.data.train_tokenizer``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.data.train_tokenizer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
