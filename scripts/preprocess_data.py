#!/usr/bin/env python
"""Tokenize text into megatron-core indexed datasets (``.bin`` + ``.idx``), as Megatron-LM's
``tools/preprocess_data.py``.

    python scripts/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type GPT2BPETokenizer \\
        --vocab-file gpt2/encoder.json --merge-file gpt2/vocab.bpe --append-eod --workers 2

The code, its inputs and outputs: tools/data/preprocess_data.py (``python -m tools.data.preprocess_data``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.data.preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
