"""Train a small byte-level BPE (HF ``tokenizer.json``) from text files.

    python -m tools.data.train_tokenizer --input a.txt b.txt --vocab-size 8192 --output tok.json

The result loads with ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok.json``. It is
GPT-2 style: byte-level (any UTF-8 text round-trips exactly, no unknown tokens), GPT-2's regex
pre-split, no prefix space, and ``<|endoftext|>`` (id 0) as the end-of-document token. Training
is deterministic: the same files and flags give a byte-identical file. The output is written to
a temporary file and renamed into place; an existing output is kept unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron.common.cli import UserError, run_cli
from megatron.common.files import write_text

PROG = "train_tokenizer.py"
EOD_TOKEN = "<|endoftext|>"  # same as megatron.components.tokenizer.EOD_TOKEN (kept import-free)


def train_bpe(files: list[str], vocab_size: int, min_frequency: int = 2):
    """Train and return a ``tokenizers.Tokenizer`` (byte-level BPE, ``<|endoftext|>`` = id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    return tok


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="UTF-8 text files to train on")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="total ids incl. the 256 byte tokens and <|endoftext|> (>= 258)")
    p.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    p.add_argument("--min-frequency", type=int, default=2, help="minimum pair count for a merge")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def body():
        for f in args.input:
            if not os.path.isfile(f):
                raise UserError(f"--input: no such file: {f}")
        if args.vocab_size < 258:
            raise UserError(f"--vocab-size must be at least 258 (256 bytes + EOD + 1), got {args.vocab_size}")
        if os.path.exists(args.output) and not args.overwrite:
            raise UserError(f"--output: {args.output} exists (pass --overwrite to replace it)")
        tok = train_bpe(args.input, args.vocab_size, args.min_frequency)
        write_text(args.output, tok.to_str(pretty=True))
        print(f"wrote {args.output}: vocab {tok.get_vocab_size()}, EOD {EOD_TOKEN} = {tok.token_to_id(EOD_TOKEN)}")

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
